"""The body of a rollouter process (``executor=process``): started by ``process.ProcessRollouts`` with ``spawn``.

The same ``RolloutWorker`` loop as the rollout thread of ``executor=inprocess``
(a ``ContinuousWorker`` with ``rollout.batching=continuous``) runs on the process's main thread; it reaches the queue (which stays in the
trainer's process) through ``PipeQueuePort``: a request and its answer per
call, on the ``port`` link. A second thread reads the ``ctl`` link: a weight
update is handed to the generating thread by the same ``WeightChannel``
handshake as in process (it reads the newest weights from shared memory,
``weights.py``) and answered with its ``SyncOutcome``; ``stop`` stops the loop.

Liveness: Ctrl-C is ignored here (the trainer's process gets it too and stops
this one in order); the trainer's process gone shows as ``RunError("link_closed")`` on
either link, which stops the loop. An exception that ends the loop is sent to
the trainer (``failed``) before the process exits with status 1; the trainer
re-raises it as the run's error. ``status`` (shared memory) mirrors what the
loop is doing, for the trainer's watchdog.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import RunError
from ..build import build_task
from ..config import TrainConfig
from ..control import SLICE_S, RunControl
from ..handshake import WeightUpdate
from ..policies import build_rollout_lm
from ..rollout import Group
from .base import WorkerReport
from .inprocess import RolloutWorker
from .link import Link, portable_error
from .weights import HostWeightReceiver, LibraryReceiver, open_receiver

#: tests only: ``module:function`` called first thing in a rollouter process (to patch it as a test needs)
HOOK_ENV = "STATESHIFT_TEST_ROLLOUT_PROCESS_HOOK"


@dataclass(frozen=True)
class ChildSpec:
    """What a rollouter process is started with (no tensors: those come over the link or from shared memory)."""

    cfg: TrainConfig
    weights: dict[str, Any]
    version: int
    owner: int
    seed: int
    cwd: str
    device: str | None


class SharedStatus(dict):
    """``RunControl.doing`` whose ``rollout`` entry is mirrored into a shared byte array (the trainer reads it)."""

    def __init__(self, array: Any) -> None:
        super().__init__()
        self.array = array

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        if key == "rollout":
            raw = value.encode()[: len(self.array) - 1]
            self.array[: len(raw) + 1] = raw + b"\0"


class PipeQueuePort:
    """``QueuePort`` over the ``port`` link: one request, one answer; waits in slices while the run goes on."""

    def __init__(self, link: Link, control: RunControl) -> None:
        self.link = link
        self.control = control

    def _call(self, *request: Any) -> Any:
        self.link.send(request)
        while True:
            got, answer = self.link.recv(SLICE_S)
            if got:
                return answer
            self.control.check()

    def start(self, owner: int, version: int, want: int, wait_s: float) -> list[tuple[int, Any]]:
        return self._call("start", owner, version, want, wait_s)

    def put(self, owner: int, groups: list[Group], report: WorkerReport) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            report.device_peak_bytes = torch.cuda.max_memory_allocated()
        self._call("put", owner, groups, report)

    def on_sync(self, owner: int, report: WorkerReport, capture: bool) -> dict[str, Any] | None:
        return self._call("on_sync", owner, report, capture)


def child_main(spec: ChildSpec, port_conn: Any, ctl_conn: Any, status: Any) -> None:
    """The process's life: build, load the newest weights, say ``ready``, generate until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the trainer's process stops us
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked since the start (``_sigint_blocked``)
    _prepare(spec)
    port, ctl = Link(port_conn), Link(ctl_conn)
    control = RunControl()
    control.doing = SharedStatus(status)
    receiver: HostWeightReceiver | LibraryReceiver | None = None
    try:
        worker, receiver, started = _build(spec, port, ctl, control)
        threading.Thread(
            target=_serve_ctl,
            args=(worker, receiver, ctl, control, started),
            daemon=True,
            name="stateshift-rollout-ctl",
        ).start()
        while not started.is_set() and not control.stopping:
            started.wait(SLICE_S)
        if not control.stopping:
            worker.run()
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer below
        control.fail("rollout", exc)
    if receiver is not None:  # the generating thread is done: nothing reads the weights now
        try:
            receiver.close()  # leave in order: the publisher is not told of a receiver that died
        except Exception:  # noqa: BLE001 - the publisher reclaims a receiver whose process is gone anyway
            pass
    err = control.error
    if err is not None and not (isinstance(err, RunError) and err.kind in ("stopped", "link_closed")):
        try:
            port.send(("failed", portable_error(err)))
        except RunError as e:
            if e.kind != "link_closed":
                raise
        sys.exit(1)
    try:
        port.send(("stopped",))
    except RunError as e:
        if e.kind != "link_closed":
            raise


def _prepare(spec: ChildSpec) -> None:
    if os.path.isdir(spec.cwd):
        os.chdir(spec.cwd)
    hook = os.environ.get(HOOK_ENV)
    if hook:
        module, _, fn = hook.partition(":")
        getattr(importlib.import_module(module), fn)()
    if spec.cfg.run.torch_threads:
        torch.set_num_threads(spec.cfg.run.torch_threads)
    if spec.device is not None and spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))


def _build(
    spec: ChildSpec, port: Link, ctl: Link, control: RunControl
) -> tuple[RolloutWorker, HostWeightReceiver | LibraryReceiver, threading.Event]:
    """The worker with the newest weights and the capture the trainer sends first; ``ready`` sent back."""
    cfg = spec.cfg
    task = build_task(cfg)
    worker = RolloutWorker.build(
        cfg,
        task,
        build_rollout_lm(cfg, task),
        PipeQueuePort(port, control),
        control,
        version=spec.version,
        owner=spec.owner,
        seed=spec.seed,
    )
    if cfg.rollout.batching == "continuous":  # the same port and handshake, slots instead of waves
        from ..continuous import ContinuousWorker

        worker = ContinuousWorker(worker, cfg.rollout.max_concurrent_prompts * cfg.rollout.n)
    receiver = open_receiver(spec.weights, f"rollout-{spec.owner}")
    worker.rollouter.update_weights(receiver.pairs(spec.version), spec.version)
    worker.rollouter.copy_bytes, worker.rollouter.copy_seconds = 0, 0.0  # count syncs only, as in process
    control.on_stop.append(worker.rollouter.pause)
    while True:
        got, first = ctl.recv(SLICE_S)
        if got:
            break
    capture = first[1]
    if capture is not None:
        worker.restore(capture)
    ctl.send(("ready", os.getpid()))
    return worker, receiver, threading.Event()


def _serve_ctl(
    worker: RolloutWorker,
    receiver: HostWeightReceiver | LibraryReceiver,
    ctl: Link,
    control: RunControl,
    started: threading.Event,
) -> None:
    """The ``ctl`` thread: ``run``, ``sync`` (handed to the generating thread, answered) and ``stop``."""
    try:
        while not control.stopping:
            got, msg = ctl.recv(SLICE_S)
            if not got:
                continue
            if msg[0] == "run":
                started.set()
            elif msg[0] == "sync":
                _, version, capture, interrupt = msg
                update = WeightUpdate(lambda v=version: receiver.pairs(v), version, capture=capture)
                ctl.send(("synced", worker.hand_over(update, interrupt=interrupt)))
            elif msg[0] == "stop":
                control.stop()
    except BaseException as exc:  # noqa: BLE001 - ends the run with it
        if isinstance(exc, RunError) and exc.kind == "link_closed":
            control.stop()  # the trainer's process is gone: nobody to generate for
        else:
            control.fail("rollout", exc)
