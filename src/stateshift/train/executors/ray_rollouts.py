"""``RayRollouts``: the rollout side as Ray actors, seen from the trainer thread (inside the trainer actor).

It owns two kinds of actor, both placed in the run's placement group:

- the **queue actor** (``hub.QueueHub``, bundle 0 beside the trainer, no CPU
  of its own): queue, prompts, in-flight registry, ledger. It outlives every
  rollouter, which is why a rollouter can die without losing a group;
- one **rollouter actor** at a time (``ray_actors.RolloutActor``, bundle 1),
  numbered by ``owner``: 0 for the first, +1 for each replacement.

Three threads of the trainer actor use it: the trainer thread (every
``Rollouts`` method), the supervisor thread (replaces a dead rollouter) and
the watchdog (``describe``). ``lock`` guards the current incarnation
(``actor``, ``owner``, ``run_ref``, ``name``, ``pid``) so that a thread reads
the three of them as one.

Why a replacement gets the right weights: ``sync`` sets ``weights`` (the
reference and its version) *before* sending them, and the supervisor builds
the replacement from ``weights`` under ``lock``. Either the replacement is
built after that assignment (it starts with the new version, and the trainer
sends it again), or before it -- then the trainer, which reads the actor under
the same lock, finds the old actor dead, waits until ``owner`` changes and
sends the new weights to the replacement. Either way the sync returns only
once the live rollouter holds them. The price of sending twice: the queue
restarts that version's staleness budget a second time (``on_sync``), so a
death during a sync may let that version admit up to one more budget of
groups -- still within the queue's capacity, and each counted once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from stateshift import Snapshot

from ...errors import RunError
from ..config import TrainConfig
from ..control import SLICE_S, RunControl
from ..policies import Policy
from ..rollout import Group
from ..tasks.base import Task
from .base import RolloutCapture, RolloutStats, SyncOutcome, take_in_slices
from .hub import hub_args
from .placement import ROLLOUTER, TRAINER
from .ray_actors import HubActor, RolloutActor
from .ray_common import actor_class, cause_of, death_reason, wait_ready
from .wire import use_wire_format

#: seconds a call to the queue actor may take before the run stops (its longest call waits ``SLICE_S``)
HUB_TIMEOUT_S = 60.0


class RayRollouts:
    """The ``Rollouts`` protocol over a queue actor and a rollouter actor that is replaced when it dies."""

    def __init__(
        self,
        cfg: TrainConfig,
        task: Task,
        policy: Policy,
        control: RunControl,
        *,
        version: int,
        capture: RolloutCapture | None,
        pg: Any,
        specs: list[dict[str, float]],
        stream: TextIO,
    ) -> None:
        import ray

        use_wire_format()
        self.ray, self.cfg, self.control, self.stream, self.pg, self.specs = ray, cfg, control, stream, pg, specs
        hub_cls = actor_class(
            ray, HubActor, {"CPU": 0}, pg, TRAINER, max_concurrency=16, name=f"stateshift-queue-{os.getpid()}"
        )
        self.hub = hub_cls.remote(**hub_args(cfg, task))
        if capture is not None:
            self._hub("restore", capture)
        #: the newest weights sent (an object reference) and their version: what a replacement is built with
        # host copies (device tensors would travel through torch's pickling); ray.put copies host ones once more
        self.weights = (ray.put({n: t.detach().cpu() for n, t in policy.rollout_state_dict().items()}), version)
        self.lock = threading.Lock()
        self.closing = False
        self.owner = 0
        self.restarts: list[dict[str, Any]] = []
        self.run_ref: Any = None
        self._spawn(capture)
        self.supervisor = threading.Thread(target=self._supervise, name="stateshift-rollout-supervisor", daemon=True)

    # -- rollouter incarnations ------------------------------------------------------------------
    def _spawn(self, capture: RolloutCapture | None) -> int:
        """Start rollouter ``self.owner`` with the newest weights sent, wait until it is up (hold ``lock``);
        returns the version of the weights it was built with."""
        ref, version = self.weights
        self.name = f"stateshift-rollouter-{os.getpid()}-{self.owner}"  # unique in the cluster while it lives
        self.pid = None  # (known once it is up)
        cls = actor_class(
            self.ray, RolloutActor, self.specs[ROLLOUTER], self.pg, ROLLOUTER, max_concurrency=4, name=self.name
        )
        self.actor = cls.remote(self.cfg, ref, version, self.owner, self.hub, capture, os.getcwd())
        self.pid = wait_ready(self.ray, self.actor.pid.remote(), self.cfg.ray.ready_timeout_s, f"rollouter {self.name}")
        return version

    def start(self) -> None:
        with self.lock:
            self.run_ref = self.actor.run.remote()
        self.supervisor.start()

    def _supervise(self) -> None:
        """Supervisor thread: wait on the current rollouter's ``run`` call until the run closes."""
        while not self.closing:
            with self.lock:
                ref, owner = self.run_ref, self.owner
            if not self.ray.wait([ref], timeout=0.2)[0] or self.closing:
                continue
            try:
                self._run_ended(ref, owner)
            except BaseException as exc:  # noqa: BLE001 - reaches the trainer thread at its next wait slice
                if not self.closing:
                    self.control.fail("rollout", exc)
                return

    def _run_ended(self, ref: Any, owner: int) -> None:
        """Rollouter ``owner``'s ``run`` call ended: a death means a restart; an error, or an end nobody asked
        for, is raised (the run stops with it: a bug does not go away by restarting)."""
        ray = self.ray
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as err:
            if not self.closing:
                self._restart(owner, err)
            return
        except ray.exceptions.RayTaskError as err:
            raise cause_of(err) from None
        if not self.closing:
            raise RunError("rollout_died", f"rollouter {self.name} stopped generating without being asked to")

    def _restart(self, owner: int, err: BaseException) -> None:
        """Report the death at once; hand its prompts to a new rollouter built with the newest weights sent.

        ``RunError("rollout_died")`` past ``ray.max_rollout_restarts``.
        """
        t_detect, why, name, pid = time.time(), death_reason(err), self.name, self.pid
        limit = self.cfg.ray.max_rollout_restarts
        print(f"[stateshift] rollouter {name} (pid {pid}) died: {why}", file=self.stream, flush=True)
        if len(self.restarts) >= limit:
            raise RunError(
                "rollout_died",
                f"rollouter {name} (pid {pid}) died: {why} -- after {len(self.restarts)} restarts "
                f"(ray.max_rollout_restarts={limit}) the run stops",
            )
        orphans = self._hub("owner_died", owner)  # before the successor asks for prompts: it gets these first
        again: BaseException | None = None
        with self.lock:
            self.owner += 1
            try:
                version = self._spawn(None)
            except self.ray.exceptions.RayActorError as err:  # the successor died before it was up: one more death
                version, again = self.weights[1], err
            else:
                self.run_ref = self.actor.run.remote()
        self.restarts.append(
            {
                "rollouter": name,
                "pid": pid,
                "why": why,
                "detected_at": t_detect,
                "restart_s": time.time() - t_detect,
                "weights_version": version,
                "regenerated": orphans,
                "successor": self.name,
                "successor_pid": self.pid,
            }
        )
        if again is not None:
            if not self.closing:  # (stopping: ``stop`` reports it)
                self._restart(self.owner, again)  # reported, counted against the limit, and replaced in turn
            return
        self.control.progress()
        print(
            f"[stateshift] restarted it as {self.name} (pid {self.pid}) with weights v{version}; {orphans} prompts "
            f"in flight are generated again ({len(self.restarts)}/{limit} restarts)",
            file=self.stream,
            flush=True,
        )

    # -- the Rollouts protocol -------------------------------------------------------------------
    def take(self, count: int, trainer_version: int, on_wait: Callable[[], None] | None = None) -> list[Group]:
        return take_in_slices(
            self.control, count, lambda need, wait_s: self._hub("take", need, trainer_version, wait_s), on_wait
        )

    def trained(self, count: int) -> int:
        return self._hub("trained", count)

    reads_snapshot = True

    def sync(self, snapshot: Snapshot | None, version: int, *, capture: bool, interrupt: bool) -> SyncOutcome:
        """Weights by reference (copied out of ``snapshot``, which may be released on return); a rollouter that
        dies meanwhile is replaced and the weights sent again (see the module docstring)."""
        assert snapshot is not None
        self.weights = (self.ray.put(dict(snapshot.wait().views())), version)
        while True:
            with self.lock:
                actor, owner = self.actor, self.owner
            ack = actor.update_weights.remote(self.weights[0], version, capture, interrupt)
            outcome = self._wait_ack(ack, owner, version)
            if outcome is not None:
                return outcome

    def _wait_ack(self, ack: Any, owner: int, version: int) -> SyncOutcome | None:
        """The rollouter's answer, or ``None`` once a dead one was replaced (bounded slices; raises if stopping)."""
        ray = self.ray
        self.control.doing["trainer"] = f"waiting for the rollouter to take weights v{version}"
        while not ray.wait([ack], timeout=SLICE_S)[0]:
            self.control.check()
        try:
            outcome = ray.get(ack)
        except ray.exceptions.RayActorError:
            while self.owner == owner:  # the supervisor replaces it (or stops the run: check raises)
                self.control.check()
                time.sleep(SLICE_S)
            return None
        except ray.exceptions.RayTaskError as err:
            raise cause_of(err) from None
        self.control.doing["trainer"] = "working"
        return outcome

    def stats(self) -> RolloutStats:
        stats: RolloutStats = self._hub("stats")
        stats.restarts = list(self.restarts)
        return stats

    def describe(self) -> dict[str, Any]:
        try:
            s = self.ray.get(self.hub.stats.remote(), timeout=5)
            return {"queue": s.depth, "in_flight": s.running, "rollout_version": f"{s.version} ({self.name})"}
        except Exception as exc:  # noqa: BLE001 - the watchdog reports whatever it can
            return {"queue": f"? ({type(exc).__name__})", "in_flight": "?", "rollout_version": "?"}

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the rollouter and wait for its ``run`` call; ``False`` if it did not end within ``timeout``."""
        ray = self.ray
        self.closing = True
        with self.lock:  # a restart in progress finishes first: then its successor is the one stopped
            actor, ref = self.actor, self.run_ref
        try:
            ray.get(actor.stop.remote(), timeout=5)
            if ref is not None:
                ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return False
        except ray.exceptions.RayActorError as err:
            self._died_while_stopping(err)
        except Exception:  # noqa: BLE001 - it raised: stopped either way (the supervisor reported it)
            pass
        if self.supervisor.ident is not None:
            self.supervisor.join(2)
        return True

    def _died_while_stopping(self, err: BaseException) -> None:
        """The rollouter was dead when the run stopped, and the supervisor (which stops restarting once the
        run is closing) did not see it: report which and why all the same, as a death without a successor."""
        with self.lock:
            name, pid = self.name, self.pid
        if any(r["rollouter"] == name for r in self.restarts):
            return
        why = death_reason(err)
        print(
            f"[stateshift] rollouter {name} (pid {pid}) died: {why} (the run was stopping: not restarted)",
            file=self.stream,
            flush=True,
        )
        self.restarts.append(
            {
                "rollouter": name,
                "pid": pid,
                "why": why,
                "detected_at": time.time(),
                "restart_s": None,
                "weights_version": None,
                "regenerated": 0,
                "successor": None,
                "successor_pid": None,
            }
        )

    def close(self) -> dict[str, Any]:
        """Close the ledger in the queue actor, then end both actors."""
        try:
            return self._hub("close")
        finally:
            self.ray.kill(self.actor)
            self.ray.kill(self.hub)

    def _hub(self, method: str, *args: Any) -> Any:
        """A call to the queue actor; ``RunError("rollout_died")`` if it is gone or does not answer in ``HUB_TIMEOUT_S``."""
        ray = self.ray
        try:
            return ray.get(getattr(self.hub, method).remote(*args), timeout=HUB_TIMEOUT_S)
        except ray.exceptions.RayActorError as err:
            raise RunError(
                "rollout_died",
                f"the queue actor died: {death_reason(err)}; the groups it held are gone "
                "(resume from the last checkpoint)",
            ) from None
        except ray.exceptions.GetTimeoutError:
            raise RunError(
                "rollout_died", f"the queue actor did not answer {method}() within {HUB_TIMEOUT_S:g} s"
            ) from None
        except ray.exceptions.RayTaskError as err:
            raise cause_of(err) from None
