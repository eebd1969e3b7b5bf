"""The bounded queue between rollouter and trainer, its version ledger and the admission rules.

Units are **groups** (one prompt and its ``n`` responses), as verl counts
"samples" in fully-async mode. ``required`` is what one trainer step takes:
``trainer.batch_prompts * async_training.require_batches``.

Admission (before a prompt starts generating; the rollout thread asks):

- verl: ``staleness_samples < max_required`` where
  ``max_required = int(required * (1 + staleness_threshold) * trigger_parameter_sync_step)``;
  ``staleness_samples`` counts groups admitted since the last sync and is
  reset at each sync to the groups in flight plus those still queued (they
  will be trained on stale). With ``staleness_threshold = 0`` each version
  generates exactly what the trainer consumes before the next sync.
- capacity: queued + in flight ``<= max_queue_size`` (default
  ``max_required``), so ``put`` never has to block or drop.
- AReaL (``max_head_offpolicyness = eta``, optional, on top):
  ``accepted + running <= (eta + v + 1) * required * trigger`` with ``v`` the
  rollouter's version (with ``trigger_parameter_sync_step = 1`` this is
  AReaL's rule; a version lasts ``trigger`` steps here, hence the factor).

Nothing is dropped silently. The ledger counts every group: admitted ->
running -> generated -> queued -> taken -> trained, or discarded[reason] (for
lag, or left over when the run ends: queued, in flight, or taken by a step
that did not complete);
``check()`` asserts the balance and the run's summary reports it. A group
discarded for lag (``max_lag``) gives its staleness budget back, so discards
cannot starve the trainer. A group whose rollouter died while generating it
stays admitted and running and is generated again by its successor
(``executors/hub.py``); ``regenerated`` counts those restarts, outside the
balance.

Thread safety: none of its own; ``executors/hub.py`` (``QueueHub``) calls
every method with its condition held (the rollouter admits and puts, the
trainer takes); groups are immutable once put.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from .config import AsyncConfig
from .rollout import Group


@dataclass
class Ledger:
    """Counts of groups by fate; ``by_version`` counts generated groups by their oldest token's version.

    ``regenerated``: generations started again because their rollouter died (not a fate: such a group is
    still running, and counted once when it is generated).
    """

    admitted: int = 0
    generated: int = 0
    trained: int = 0
    discarded: Counter[str] = field(default_factory=Counter)
    by_version: Counter[int] = field(default_factory=Counter)
    regenerated: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "admitted": self.admitted,
            "generated": self.generated,
            "trained": self.trained,
            "discarded": dict(self.discarded),
            "by_version": {str(k): v for k, v in sorted(self.by_version.items())},
            "regenerated": self.regenerated,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Ledger:
        return Ledger(
            admitted=d["admitted"],
            generated=d["generated"],
            trained=d["trained"],
            discarded=Counter(d["discarded"]),
            by_version=Counter({int(k): v for k, v in d["by_version"].items()}),
            regenerated=d.get("regenerated", 0),
        )


class SampleQueue:
    """Bounded FIFO of finished groups with admission control and a ledger."""

    def __init__(self, cfg: AsyncConfig, required: int, total: int | None = None) -> None:
        self.cfg = cfg
        self.required = required
        #: groups the run trains in all (``required`` x its steps; ``None``: no end): none is admitted past what
        #: that still needs, so the last version generates nothing no step will train, whatever the timing
        self.total = total
        staleness = (
            0.0 if cfg.mode == "sync" else cfg.staleness_threshold
        )  # sync: each version generates its steps' worth
        self.max_required = int(required * (1 + staleness) * cfg.trigger_parameter_sync_step)
        self.capacity = cfg.max_queue_size if cfg.max_queue_size is not None else self.max_required
        if self.capacity < required:
            raise ValueError(
                f"async_training.max_queue_size ({self.capacity}) must hold one trainer step ({required} groups)"
            )
        self.items: deque[Group] = deque()
        self.running = 0
        #: groups the trainer took whose step has not completed yet
        self.taken = 0
        self.staleness_samples = 0
        self.ledger = Ledger()

    # -- rollout side --------------------------------------------------------------------
    def admissible(self, version: int, want: int) -> int:
        """How many of ``want`` prompts may start generating now under every rule (0: wait)."""
        n = min(want, self.max_required - self.staleness_samples, self.capacity - len(self.items) - self.running)
        eta = self.cfg.max_head_offpolicyness
        if eta is not None:
            accepted = self.ledger.generated - sum(self.ledger.discarded.values())
            per_version = self.required * self.cfg.trigger_parameter_sync_step
            n = min(n, (eta + version + 1) * per_version - (accepted + self.running))
        if self.total is not None:  # trained, taken, queued or in flight: each will be trained or is being
            n = min(n, self.total - (self.ledger.trained + self.taken + len(self.items) + self.running))
        return max(n, 0)

    def admit(self, count: int) -> None:
        self.running += count
        self.staleness_samples += count
        self.ledger.admitted += count

    def put(self, groups: list[Group]) -> None:
        """Finished groups of admitted prompts (never blocks: their room was reserved at admission)."""
        assert len(groups) <= self.running, "put of groups that were never admitted"
        self.running -= len(groups)
        self.items.extend(groups)
        self.ledger.generated += len(groups)
        self.ledger.by_version.update(g.min_version for g in groups)
        assert len(self.items) + self.running <= self.capacity

    def on_sync(self) -> None:
        """The rollouter took new weights: what is in flight or queued counts against the new version's budget."""
        self.staleness_samples = self.running + len(self.items)

    # -- trainer side --------------------------------------------------------------------
    def ready(self, count: int) -> bool:
        return len(self.items) >= count

    def take(self, count: int, trainer_version: int) -> list[Group]:
        """The oldest ``count`` groups (call when ``ready(count)``); groups past ``max_lag`` are discarded first.

        Returns fewer than ``count`` only when some were discarded (the caller waits again).
        """
        lag = self.cfg.max_lag
        if lag is not None:
            keep = deque(g for g in self.items if trainer_version - g.min_version <= lag)
            dropped = len(self.items) - len(keep)
            if dropped:
                self.ledger.discarded[f"stale: oldest token more than {lag} versions behind"] += dropped
                self.staleness_samples = max(0, self.staleness_samples - dropped)
                self.items = keep
        out = [self.items.popleft() for _ in range(min(count, len(self.items)))]
        self.taken += len(out)
        return out

    def trained(self, count: int) -> None:
        """The trainer's step over ``count`` taken groups completed."""
        assert count <= self.taken
        self.taken -= count
        self.ledger.trained += count

    def close(self, reason_queued: str, reason_running: str, reason_taken: str) -> None:
        """End of run: what is left is counted as discarded with a reason, never forgotten."""
        if self.taken:
            self.ledger.discarded[reason_taken] += self.taken
            self.taken = 0
        if self.items:
            self.ledger.discarded[reason_queued] += len(self.items)
            self.items.clear()
        if self.running:
            self.ledger.discarded[reason_running] += self.running
            self.running = 0

    def check(self) -> None:
        """The ledger balances: every admitted group is in flight, queued, taken, trained or discarded (with a reason)."""
        led = self.ledger
        accounted = led.trained + sum(led.discarded.values()) + len(self.items) + self.running + self.taken
        assert led.admitted == accounted, led.as_dict()

    def depth(self) -> int:
        return len(self.items)
