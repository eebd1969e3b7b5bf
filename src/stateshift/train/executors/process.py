"""``executor=process``: the rollouter in a process of its own, the queue in the trainer's (the default on CUDA).

    trainer's process                               rollouter process (spawned; process_child.py)
      trainer thread: loop.py, ProcessRollouts        main thread: RolloutWorker.run (the in-process loop)
      server thread: answers the rollouter's   <-port->  PipeQueuePort: start / put / on_sync
        queue calls (QueueHub, under control.cond)
      trainer thread at a sync: "sync v"      <-ctl-->   ctl thread: WeightChannel handshake, "synced"
      weights: HostWeightPublisher            --shm-->   HostWeightReceiver (weights.py)

Why a process: the rollout thread and the trainer share the GIL; on the H200
every mode ran at the same samples per second. In a process of its own the
rollouter generates while the trainer's Python runs. It computes on the
trainer's device, or on ``rollout.device`` (``cuda:N``).

The queue, the prompts, the in-flight registry and the ledger stay in the
trainer's process (``QueueHub``, as in process), so a rollouter process can die
without losing anything. Groups and captures cross as messages with their
tensors in the wire format (``link.py``); the weights through shared memory
(``weights.py``), never through the pipe.

Liveness, as in the other executors:

- a rollouter that **raises** sends its exception; the run stops with it (the
  same type, the rollouter's traceback attached as a note);
- a rollouter process that **dies** (SIGKILL, OOM) closes its pipes: the server
  thread sees it within one wait slice, prints which (pid, signal), tells the
  queue (its prompts become orphans) and starts a new process with the newest
  weights, up to ``rollout.max_restarts`` times; past that the run stops with
  ``RunError("rollout_died")``. A sync waiting for a dead rollouter sends the weights
  again to its successor;
- **Ctrl-C**: the rollouter process ignores SIGINT (blocked from its start,
  ``_sigint_blocked``, then ignored); the trainer's process stops at its next
  step or wait (``control.StopSignals``), stops the rollouter (``stop``), joins
  it, and kills it if it does not end within 10 s;
- the **watchdog** reads what the rollouter process is doing from shared memory
  (``SharedStatus``) beside the trainer's own state;
- **resume**: a checkpoint's capture is taken in the rollouter process at a sync
  and sent back; a resumed run sends it to the new process before it starts.

Results equal ``executor=inprocess`` with fixed seeds where the schedule does not
depend on timing (``staleness_threshold=0``): the same loop, seeds and queue.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from stateshift import Snapshot

from ...errors import RunError
from ..config import TrainConfig
from ..control import SLICE_S, RunControl
from ..policies import Policy
from ..rollout import Group
from ..tasks.base import Task
from .base import RolloutCapture, RolloutStats, SyncOutcome, rollout_seed, take_in_slices
from .hub import QueueHub, hub_args
from .link import Link
from .process_child import ChildSpec, child_main
from .weights import LibraryPublisher, make_publisher, rollout_device

#: seconds a rollouter process may take to start (import torch, build its model, load the weights)
START_TIMEOUT_S = 300.0


class _StartDied(RunError):
    """A rollouter process ended before it was ready, without an error of its own (killed, crashed)."""

    def __init__(self, inc: Incarnation) -> None:
        super().__init__(
            "rollout_died", f"rollouter process {inc.pid} ended before it was ready: {exit_reason(inc.proc)}"
        )
        self.inc = inc


@dataclass(eq=False)
class Incarnation:
    """One rollouter process (``owner`` numbers them: 0, then +1 per restart)."""

    owner: int
    proc: Any
    port: Link
    ctl: Link
    pid: int | None = None
    ended: bool = False
    server: threading.Thread | None = field(default=None, repr=False)


def exit_reason(proc: Any) -> str:
    """How a process ended, in words (``killed by SIGKILL``, ``exit status 1``)."""
    code = proc.exitcode
    if code is None:
        return "it is still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked on this thread for the block (any thread can: the mask is per thread).

    A process started here inherits the mask through fork and exec: a Ctrl-C to the process group in its first
    seconds (importing torch) stays pending until ``child_main`` ignores SIGINT, instead of killing it with a
    traceback. This process loses nothing meanwhile: its SIGINT goes to another thread or waits for the unblock.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class ProcessRollouts:
    """The ``Rollouts`` protocol over a rollouter process, replaced when it dies (see the module docstring)."""

    #: the loop passes the trainer's ``ModelState`` (``state=``): the weight-sync library publishes from it
    takes_state = True

    def __init__(
        self,
        cfg: TrainConfig,
        task: Task,
        policy: Policy,
        control: RunControl,
        *,
        version: int,
        capture: RolloutCapture | None = None,
        state: Any = None,
        stream: TextIO | None = None,
    ) -> None:
        self.cfg, self.control, self.stream = cfg, control, stream or sys.stderr
        self.hub = QueueHub(**hub_args(cfg, task), cond=control.cond)
        if capture is not None:
            self.hub.restore(capture)
        self.device = rollout_device(cfg)
        self.publisher = make_publisher(
            cfg, policy.rollout_state_dict(), version, state=state, skip=getattr(policy.lm, "skip_weight", None)
        )
        self.ctx = mp.get_context("spawn")
        self.status = self.ctx.RawArray("c", 256)
        self.lock = threading.RLock()
        self.closing = False
        self.restarts: list[dict[str, Any]] = []
        try:
            self.current = self._spawn(0, capture)
        except BaseException:
            self.publisher.close()
            raise

    # -- rollouter processes ----------------------------------------------------------------------
    def _spawn(self, owner: int, capture: RolloutCapture | None) -> Incarnation:
        """Start rollouter ``owner`` with the newest weights and wait until it is ready (hold ``lock``)."""
        port_here, port_there = self.ctx.Pipe()
        ctl_here, ctl_there = self.ctx.Pipe()
        spec = ChildSpec(
            self.cfg,
            self.publisher.handle(),
            self.publisher.version,
            owner,
            rollout_seed(self.cfg, owner),
            os.getcwd(),
            self.device,
        )
        proc = self.ctx.Process(
            target=child_main,
            args=(spec, port_there, ctl_there, self.status),
            name=f"stateshift-rollouter-{owner}",
            daemon=True,
        )
        with (
            _sigint_blocked()
        ):  # inherited through exec: Ctrl-C in its first seconds (importing torch) does not kill it
            proc.start()
        port_there.close()
        ctl_there.close()
        inc = Incarnation(owner, proc, Link(port_here), Link(ctl_here))
        try:
            inc.ctl.send(("start", capture))
            inc.pid = self._await_ready(inc)
        except BaseException:
            proc.kill()
            proc.join(5)
            raise
        inc.server = threading.Thread(
            target=self._serve, args=(inc,), name=f"stateshift-rollout-server-{owner}", daemon=True
        )
        inc.server.start()
        return inc

    def _await_ready(self, inc: Incarnation) -> int:
        """The process's pid once it says ``ready``; its own error if it failed first; ``RunError("rollout_died")`` if it
        died or did not start within ``START_TIMEOUT_S``."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                got, msg = inc.ctl.recv(SLICE_S)
            except RunError as e:
                if e.kind != "link_closed":
                    raise
                got, msg = False, None
            if got:
                return int(msg[1])
            if not inc.proc.is_alive():
                inc.proc.join(1)
                try:
                    got, msg = inc.port.recv(0.5)
                except RunError as e:
                    if e.kind != "link_closed":
                        raise
                    got = False
                if got and msg[0] == "failed":
                    raise msg[1]
                inc.pid = inc.proc.pid
                raise _StartDied(inc)
            if self.closing or self.control.stopping:
                raise RunError("rollout_died", "the run stopped while a rollouter process was starting")
        raise RunError("rollout_died", f"rollouter process {inc.proc.pid} was not ready within {START_TIMEOUT_S:g} s")

    def _serve(self, inc: Incarnation) -> None:
        """Server thread of ``inc``: answer its queue calls until it ends; a death means a restart."""
        try:
            while True:
                try:
                    got, msg = inc.port.recv(SLICE_S)
                except RunError as e:
                    if e.kind != "link_closed":
                        raise
                    break
                if not got:
                    if not inc.proc.is_alive() and not inc.port.conn.poll(0):
                        break
                    continue
                try:
                    if not self._answer(inc, msg):
                        return
                except RunError as e:
                    if e.kind != "link_closed":
                        raise
                    break
            self._died(inc)
        except BaseException as exc:  # noqa: BLE001 - reaches the trainer thread at its next wait slice
            if not self.closing:
                self.control.fail("rollout", exc)

    def _answer(self, inc: Incarnation, msg: tuple[Any, ...]) -> bool:
        """Handle one message of ``inc``; ``False`` once it said it ended (its error stops the run)."""
        kind, args = msg[0], msg[1:]
        if kind == "start":
            inc.port.send(self.hub.start(*args))
        elif kind == "put":
            self.hub.put(*args)
            self.control.progress()
            inc.port.send(None)
        elif kind == "on_sync":
            inc.port.send(self.hub.on_sync(*args))
        else:
            inc.ended = True
            if not self.closing:
                stopped = f"rollouter process {inc.pid} stopped generating without being asked to"
                err = args[0] if kind == "failed" else RunError("rollout_died", stopped)
                self.control.fail("rollout", err)
            return False
        return True

    def _died(self, inc: Incarnation) -> None:
        """``inc`` died: report it at once; a successor with the newest weights generates its prompts first. A
        successor that dies before it is ready is one more death: reported, counted and replaced in turn.

        ``RunError("rollout_died")`` (the run stops) past ``rollout.max_restarts``."""
        inc.proc.join(2)
        if self.closing or self.control.stopping:  # (``stop`` reports it; SIGTERM to the group stops both)
            return
        t_detect, why, limit = time.time(), exit_reason(inc.proc), self.cfg.rollout.max_restarts
        print(f"[stateshift] rollouter process {inc.pid} died: {why}", file=self.stream, flush=True)
        while True:
            done = len(self.restarts)
            if done >= limit:
                self._record(inc, why, t_detect, None, 0)
                raise RunError(
                    "rollout_died",
                    f"rollouter process {inc.pid} died: {why} -- after {done} restarts "
                    f"(rollout.max_restarts={limit}) the run stops",
                )
            orphans = self.hub.owner_died(inc.owner)  # before the successor asks for prompts: it gets these first
            try:
                successor = self._restart_as(inc.owner + 1)
            except _StartDied as err:
                self._record(inc, why, t_detect, err.inc, orphans)
                inc, why, t_detect = err.inc, f"{exit_reason(err.inc.proc)} before it was ready", time.time()
                print(f"[stateshift] rollouter process {inc.pid} died: {why}", file=self.stream, flush=True)
                continue
            break
        self._record(inc, why, t_detect, successor, orphans)
        self.control.progress()
        print(
            f"[stateshift] restarted it as pid {successor.pid} with weights v{self.publisher.version}; {orphans} "
            f"prompts in flight are generated again ({len(self.restarts)}/{limit} restarts)",
            file=self.stream,
            flush=True,
        )

    def _restart_as(self, owner: int) -> Incarnation:
        with self.lock:
            successor = self._spawn(owner, None)
            self.current = successor
            successor.ctl.send(("run",))
        return successor

    def _record(self, inc: Incarnation, why: str, t_detect: float, successor: Incarnation | None, orphans: int) -> None:
        self.restarts.append(
            {
                "rollouter": f"process {inc.owner}",
                "pid": inc.pid,
                "why": why,
                "detected_at": t_detect,
                "restart_s": time.time() - t_detect if successor else None,
                "weights_version": self.publisher.version if successor else None,
                "regenerated": orphans,
                "successor": f"process {successor.owner}" if successor else None,
                "successor_pid": successor.pid if successor else None,
            }
        )

    # -- the Rollouts protocol -------------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            self.current.ctl.send(("run",))

    def take(self, count: int, trainer_version: int, on_wait: Callable[[], None] | None = None) -> list[Group]:
        return take_in_slices(
            self.control, count, lambda need, wait_s: self.hub.take(need, trainer_version, wait_s), on_wait
        )

    def trained(self, count: int) -> int:
        return self.hub.trained(count)

    @property
    def reads_snapshot(self) -> bool:
        """The weight-sync library (``LibraryPublisher``) publishes from the trainer's state: no snapshot to read."""
        return not isinstance(self.publisher, LibraryPublisher)

    def sync(self, snapshot: Snapshot | None, version: int, *, capture: bool, interrupt: bool) -> SyncOutcome:
        """Write the weights to shared memory, tell the rollouter; returns once it copied them in (``snapshot`` may
        be released then; ``None`` with the weight-sync library). A rollouter that dies meanwhile is replaced and
        told again."""
        assert snapshot is not None or not self.reads_snapshot
        with self.lock:  # not while a successor starts: it reads the weights
            self.publisher.publish(snapshot.wait().views() if snapshot is not None else (), version)
        while True:
            with self.lock:
                inc = self.current
            self.control.doing["trainer"] = f"waiting for the rollouter to take weights v{version}"
            outcome = self._wait_synced(inc, ("sync", version, capture, interrupt))
            if outcome is not None:
                self.control.doing["trainer"] = "working"
                return outcome
            while self.current is inc:  # the server thread replaces it (or stops the run: check raises)
                self.control.check()
                time.sleep(SLICE_S)

    def _wait_synced(self, inc: Incarnation, request: tuple[Any, ...]) -> SyncOutcome | None:
        """``inc``'s answer to ``request``; ``None`` if it died first (bounded slices; raises if the run stops)."""
        try:
            inc.ctl.send(request)
            while True:
                got, msg = inc.ctl.recv(SLICE_S)
                if got:
                    return msg[1]
                if not inc.proc.is_alive():
                    return None
                self.control.check()
        except RunError as e:
            if e.kind != "link_closed":
                raise
            return None

    def stats(self) -> RolloutStats:
        stats = self.hub.stats()
        stats.restarts = list(self.restarts)
        return stats

    def describe(self) -> dict[str, Any]:
        inc = self.current
        self.control.doing["rollout"] = f"{self.status.value.decode(errors='replace') or 'starting'} (pid {inc.pid})"
        q = self.hub.queue
        report = self.hub.reports.get(inc.owner)
        return {
            "queue": q.depth(),
            "in_flight": q.running,
            "rollout_version": report.version if report is not None else self.publisher.version,
        }

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the rollouter process and join it; killed (and ``False``) if it did not end within ``timeout``."""
        self.closing = True
        self.control.stop()
        with self.lock:  # a restart in progress finishes first: then its successor is the one stopped
            inc = self.current
        try:
            inc.ctl.send(("stop",))
        except RunError as e:
            if e.kind != "link_closed":
                raise
        inc.proc.join(timeout)
        stopped = not inc.proc.is_alive()
        if not stopped:
            inc.proc.kill()
            inc.proc.join(5)
        if inc.server is not None:
            inc.server.join(2)
        if not inc.ended and inc.proc.exitcode not in (0, None) and not any(r["pid"] == inc.pid for r in self.restarts):
            why = exit_reason(inc.proc)
            print(
                f"[stateshift] rollouter process {inc.pid} died: {why} (the run was stopping: not restarted)",
                file=self.stream,
                flush=True,
            )
            self._record(inc, why, time.time(), None, 0)
        return stopped

    def close(self) -> dict[str, Any]:
        """Close the ledger (it must balance); remove the shared memory."""
        try:
            return self.hub.close()
        finally:
            self.publisher.close()
            for link in (self.current.port, self.current.ctl):
                link.close()
