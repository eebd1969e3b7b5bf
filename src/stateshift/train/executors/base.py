"""What the trainer's loop needs from the rollout side, whichever executor runs it.

The loop (``loop.py``, the trainer thread) sees one ``Rollouts`` object: it takes
finished groups, reports what it trained, sends weights, reads statistics and
finally stops it and closes the ledger. Two implementations:

- ``inprocess.InProcessRollouts``: the rollouter on a thread of the trainer's
  process, the queue (``hub.QueueHub``) shared under one condition variable;
- ``ray.RayRollouts``: the rollouter and the queue as Ray actors; weights go
  by object reference; a rollouter actor that dies is restarted.

On the rollout side the ``RolloutWorker`` (``inprocess.py``) drives the
sampler in both; it reaches the queue through a ``QueuePort``: the
``QueueHub`` itself in process, a proxy of the queue actor under Ray.

Every method of ``Rollouts`` is called from the trainer thread only; ``describe``
also from the watchdog thread (it only reads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from stateshift import Snapshot

from ..control import SLICE_S
from ..rollout import Group, Wave

if TYPE_CHECKING:
    from ..control import RunControl


@dataclass
class RolloutCapture:
    """The rollout side's state at a sync, enough to continue exactly where it was (checkpoints).

    ``version``, ``sample_rng`` and ``wave`` come from the rollouter; the rest from the queue.
    """

    version: int
    prompt_rng: Any
    sample_rng: torch.Tensor
    next_uid: int
    wave: Wave | None
    queued: list[Group]
    running: int
    staleness_samples: int
    ledger: dict[str, Any]
    #: (uid, item) admitted for a rollouter that died, not yet handed to its successor (a class attribute
    #: default, so sidecars written before the field existed load with none)
    orphans: tuple[tuple[int, Any], ...] = ()


@dataclass
class WorkerReport:
    """What one rollouter tells the queue with each put: cumulative over its own life."""

    busy_s: float = 0.0
    copy_s: float = 0.0
    copy_bytes: int = 0
    tokens: int = 0
    version: int = 0
    #: seconds spent scoring finished groups (the reward, on the rollout side), and rewards zeroed after an error
    reward_s: float = 0.0
    reward_zeroed: int = 0
    #: peak device memory allocated by PyTorch in the rollouter's own process (0: it shares the trainer's process)
    device_peak_bytes: int = 0


#: the ``WorkerReport`` fields that add up over rollouters
SUMMED = ("busy_s", "copy_s", "copy_bytes", "tokens", "reward_s", "reward_zeroed")


@dataclass
class RolloutStats(WorkerReport):
    """The rollout side as the trainer's metrics see it: every rollouter's reports summed (``SUMMED``;
    ``version`` is the one the current rollouter generates with), and the queue."""

    generated: int = 0
    depth: int = 0
    running: int = 0
    #: late puts refused: groups a rollouter that was declared dead delivered after its death was handled
    refused: int = 0
    restarts: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SyncOutcome:
    """The rollouter's answer to a weight update: the capture (if asked for) and its copy time."""

    captured: RolloutCapture | None
    copy_s: float


class QueuePort(Protocol):
    """How a ``RolloutWorker`` reaches the queue (rollout side). Waits are bounded by ``wait_s``."""

    def start(self, owner: int, version: int, want: int, wait_s: float) -> list[tuple[int, Any]]:
        """Prompts ``(uid, item)`` for ``owner`` to generate now (empty: none may start yet)."""
        ...

    def put(self, owner: int, groups: list[Group], report: WorkerReport) -> None:
        """Finished groups of prompts ``owner`` was given."""
        ...

    def on_sync(self, owner: int, report: WorkerReport, capture: bool) -> dict[str, Any] | None:
        """``owner`` took new weights (``report.version``); with ``capture`` the queue's part of a ``RolloutCapture``."""
        ...


class Rollouts(Protocol):
    """The rollout side as the trainer thread sees it."""

    def start(self) -> None:
        """Start generating."""
        ...

    def take(self, count: int, trainer_version: int, on_wait: Callable[[], None] | None = None) -> list[Group]:
        """``count`` groups (bounded waits; raises the run's error if it stops meanwhile)."""
        ...

    def trained(self, count: int) -> int:
        """A step over ``count`` taken groups completed; returns the queue depth."""
        ...

    #: whether ``sync`` reads the trainer's snapshot; ``False``: it publishes from the trainer's state itself
    #: (the weight-sync library), so the loop takes none -- a host snapshot of resident params is a full copy
    reads_snapshot: bool

    def sync(self, snapshot: Snapshot | None, version: int, *, capture: bool, interrupt: bool) -> SyncOutcome:
        """Send ``snapshot`` as weights ``version`` (``None`` where ``reads_snapshot`` is ``False``); returns once
        the rollouter took them (release it then)."""
        ...

    def stats(self) -> RolloutStats: ...

    def describe(self) -> dict[str, Any]:
        """Queue depth, groups in flight and the rollout version, for the watchdog."""
        ...

    def stop(self) -> bool:
        """Stop generating and wait for the rollouter; ``False`` if it did not stop within its time."""
        ...

    def close(self) -> dict[str, Any]:
        """Count what is left as discarded (with reasons), check the ledger balances, return it."""
        ...


def rollout_seed(cfg: Any, owner: int) -> int:
    """The sampling seed of rollouter ``owner`` (``cfg``: a ``TrainConfig``): the first's is ``run.seed + 1``, as in
    process; a replacement gets its own, or it would repeat the draws its first predecessor made from the start."""
    return cfg.run.seed + 1 + 1000 * owner


def take_in_slices(
    control: RunControl,
    count: int,
    fetch: Callable[[int, float], list[Group]],
    on_wait: Callable[[], None] | None = None,
) -> list[Group]:
    """``count`` groups for the trainer thread, gathered by ``fetch(need, wait_s)`` (one bounded wait each, ``[]``
    if none yet).

    Between two fetches the run's stop flag is checked (``control.check`` re-raises the other side's error), so
    the trainer never waits for a rollout side that is gone. Groups arriving count as progress for the watchdog
    (under Ray the trainer sees the rollouter's progress only this way). ``on_wait`` (the trainer parking its
    state) is called once, and only when the groups are not all there already: the first fetch does not wait.
    """
    got: list[Group] = []
    first = on_wait is not None
    while len(got) < count:
        need = count - len(got)
        control.doing["trainer"] = f"waiting for {need} groups from the queue"
        control.check()
        more = fetch(need, 0.0 if first else SLICE_S)
        if more:
            control.progress()
        got += more
        if first and len(got) < count:
            assert on_wait is not None
            on_wait()
        first = False
    control.doing["trainer"] = "working"
    return got
