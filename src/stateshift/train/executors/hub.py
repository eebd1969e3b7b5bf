"""The queue as a service: ``SampleQueue`` plus the prompts, the in-flight registry and bounded waits.

``QueueHub`` is what both executors put between rollouter and trainer: in
process it shares the run's condition variable (``RunControl.cond``); under
Ray it is the state of the queue actor, with a condition of its own. Every
method takes the condition, so it is safe from any thread.

It owns three things a rollouter must not own, so that a rollouter can die
without losing anything:

- the **prompts**: the prompt generator (seed ``run.seed + 2``) and the uid
  counter; a restarted rollouter continues the same prompt sequence;
- the **in-flight registry**: ``uid -> (item, owner)`` for every prompt that
  was admitted and has not come back as a group. ``owner`` numbers the
  rollouter incarnation it was given to;
- the **orphans**: when a rollouter is declared dead (``owner_died``) its
  in-flight prompts become orphans, handed first to whoever asks next
  (``start``), and generated again from scratch. They were admitted once and
  stay admitted (``running``), so the ledger counts each exactly once.

A put is accepted only for prompts registered to the putting owner: a group
a dead rollouter sent before it died but that arrives after its death was
handled is refused (counted in ``refused``), since it is already being
generated again. Together with the ledger's balance (``SampleQueue.check``)
this is why no group is lost or trained twice.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from typing import Any

from ..config import AsyncConfig, TrainConfig
from ..queue import Ledger, SampleQueue
from ..rollout import Group
from ..tasks.base import Task, training_item
from .base import SUMMED, RolloutCapture, RolloutStats, WorkerReport


def hub_args(cfg: TrainConfig, task: Task) -> dict[str, Any]:
    """``QueueHub``'s arguments for a run of ``cfg``, the same under every executor: the groups one trainer step
    takes (``required``), the groups the whole run trains (``total``), the prompts' seed."""
    required = cfg.trainer.batch_prompts * cfg.async_training.require_batches
    return {
        "cfg": cfg.async_training,
        "required": required,
        "task": task,
        "seed": cfg.run.seed + 2,
        "total": required * cfg.trainer.steps,
    }


class QueueHub:
    """Bounded queue, prompts, in-flight registry and orphans behind one condition variable."""

    def __init__(
        self,
        cfg: AsyncConfig,
        required: int,
        task: Task,
        *,
        seed: int,
        cond: threading.Condition | None = None,
        total: int | None = None,
    ) -> None:
        self.cond = cond if cond is not None else threading.Condition()
        self.queue = SampleQueue(cfg, required, total)
        self.task = task
        self.prompt_rng = random.Random(seed)
        self.next_uid = 0
        self.inflight: dict[int, tuple[Any, int | None]] = {}
        self.orphans: deque[int] = deque()
        self.dead: set[int] = set()
        self.refused = 0
        self.reports: dict[int, WorkerReport] = {}

    # -- rollout side ---------------------------------------------------------------------------
    def start(self, owner: int, version: int, want: int, wait_s: float = 0.0) -> list[tuple[int, Any]]:
        """Prompts for ``owner``: orphans first, else as many new ones as the admission rules allow.

        Waits up to ``wait_s`` for room when none may start; returns ``[]`` then (and always for a dead owner).
        """
        with self.cond:
            got = self._start(owner, version, want)
            if not got and wait_s > 0:
                self.cond.wait(wait_s)
                got = self._start(owner, version, want)
            return got

    def _start(self, owner: int, version: int, want: int) -> list[tuple[int, Any]]:
        if owner in self.dead:
            return []
        if self.orphans:
            out = []
            while self.orphans and len(out) < want:
                uid = self.orphans.popleft()
                item = self.inflight[uid][0]
                self.inflight[uid] = (item, owner)
                out.append((uid, item))
            self.queue.ledger.regenerated += len(out)
            return out
        count = self.queue.admissible(version, want)
        if count == 0:
            return []
        self.queue.admit(count)
        out = [
            (uid, training_item(self.task, self.prompt_rng, uid)) for uid in range(self.next_uid, self.next_uid + count)
        ]
        self.next_uid += count
        for uid, item in out:
            self.inflight[uid] = (item, owner)
        return out

    def put(self, owner: int, groups: list[Group], report: WorkerReport) -> None:
        """Finished groups; only those registered to ``owner`` are accepted (see the module docstring)."""
        with self.cond:
            self.reports[owner] = report
            ok = [g for g in groups if g.uid in self.inflight and self.inflight[g.uid][1] == owner]
            self.refused += len(groups) - len(ok)
            for g in ok:
                del self.inflight[g.uid]
            if ok:
                self.queue.put(ok)
            self.cond.notify_all()

    def on_sync(self, owner: int, report: WorkerReport, capture: bool = False) -> dict[str, Any] | None:
        """Rollouter ``owner`` took new weights; with ``capture``, the queue's part of a ``RolloutCapture``."""
        with self.cond:
            self.reports[owner] = report
            self.queue.on_sync()
            return self._capture_part() if capture else None

    def _capture_part(self) -> dict[str, Any]:
        q = self.queue
        return {
            "prompt_rng": self.prompt_rng.getstate(),
            "next_uid": self.next_uid,
            "queued": list(q.items),
            "running": q.running,
            "staleness_samples": q.staleness_samples,
            "ledger": q.ledger.as_dict(),
            "orphans": tuple((uid, self.inflight[uid][0]) for uid in self.orphans),
        }

    # -- trainer side -----------------------------------------------------------------------------
    def take(self, count: int, trainer_version: int, wait_s: float = 0.0) -> list[Group]:
        """Up to ``count`` groups once ``count`` are queued (waiting up to ``wait_s``); ``[]`` if not yet.

        Fewer than ``count`` only when some were discarded for lag (``max_lag``): the caller asks again.
        """
        with self.cond:
            if not self.queue.ready(count) and wait_s > 0:
                self.cond.wait_for(lambda: self.queue.ready(count), wait_s)
            if not self.queue.ready(count):
                return []
            out = self.queue.take(count, trainer_version)
            self.cond.notify_all()  # room in the queue: the rollouter may admit again
            return out

    def trained(self, count: int) -> int:
        """The trainer's step over ``count`` taken groups completed; returns the queue depth."""
        with self.cond:
            self.queue.trained(count)
            return self.queue.depth()

    def owner_died(self, owner: int) -> int:
        """Rollouter ``owner`` is gone: its in-flight prompts become orphans; returns how many."""
        with self.cond:
            self.dead.add(owner)
            lost = [uid for uid, (_, o) in self.inflight.items() if o == owner]
            for uid in lost:
                self.inflight[uid] = (self.inflight[uid][0], None)
            self.orphans.extend(lost)
            self.cond.notify_all()
            return len(lost)

    def stats(self) -> RolloutStats:
        with self.cond:
            reps = list(self.reports.values())
            current = self.reports[max(self.reports)] if self.reports else WorkerReport()
            return RolloutStats(
                **{k: sum(getattr(r, k) for r in reps) for k in SUMMED},
                version=current.version,
                generated=self.queue.ledger.generated,
                device_peak_bytes=max((r.device_peak_bytes for r in reps), default=0),
                depth=self.queue.depth(),
                running=self.queue.running,
                refused=self.refused,
            )

    def close(self) -> dict[str, Any]:
        """End of run: what is left is counted as discarded with a reason; the ledger must balance."""
        with self.cond:
            self.queue.close(
                "left in the queue at the end of the run",
                "in flight at the end of the run",
                "taken by a trainer step that did not complete",
            )
            self.inflight.clear()
            self.orphans.clear()
            self.queue.check()
            return self.queue.ledger.as_dict()

    # -- checkpoints ------------------------------------------------------------------------------
    def restore(self, cap: RolloutCapture, owner: int = 0) -> None:
        """Continue from ``cap`` (before anything runs): the prompts in ``cap.wave`` are in flight for ``owner``."""
        with self.cond:
            q = self.queue
            self.prompt_rng.setstate(cap.prompt_rng)
            self.next_uid = cap.next_uid
            q.items.extend(cap.queued)
            q.running = cap.running
            q.staleness_samples = cap.staleness_samples
            q.ledger = Ledger.from_dict(cap.ledger)
            if cap.wave is not None:
                self.inflight.update(
                    {uid: (item, owner) for uid, item in zip(cap.wave.uids, cap.wave.items, strict=True)}
                )
            for uid, item in cap.orphans:
                self.inflight[uid] = (item, None)
                self.orphans.append(uid)
            assert q.running == len(self.inflight), (q.running, len(self.inflight))
