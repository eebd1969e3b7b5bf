"""The one "all ranks agree" step of every collective checkpoint operation.

Each operation is local steps separated by ``Collective.run``: if any rank failed, every rank raises,
so no rank installs a checkpoint or changes its model alone. A background writer talks over a gloo
group of the same ranks (``for_writer_thread``): an NCCL communicator must not be used from two threads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError

ErrorFn = Callable[[int, str], BaseException]
"""Makes the error a rank raises when another rank (first argument) failed with the given text."""

_WRITER_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class Collective:
    """The ranks of ``group`` (default: the world) taking part in one checkpoint operation."""

    def __init__(self, group: Any = None, *, enabled: bool = True) -> None:
        dist = _dist() if enabled else None
        self.on = dist is not None
        self.group = group
        self.rank = dist.get_rank(group) if dist is not None else 0
        self.world = dist.get_world_size(group) if dist is not None else 1

    @staticmethod
    def initialized_world(group: Any = None) -> int | None:
        """The size of ``group`` when ``torch.distributed`` is initialised, else ``None``."""
        dist = _dist()
        return None if dist is None else dist.get_world_size(group)

    def run(
        self,
        fn: Callable[[], Any],
        *,
        what: str,
        share: bool = True,
        error: ErrorFn | None = None,
        cleanup: Callable[[], None] | None = None,
    ) -> Any:
        """``fn()`` on this rank, then every rank learns every rank's outcome (``all_gather_object``).

        Once all succeeded, returns every rank's result in rank order (``share``: they must be picklable), or
        this rank's alone. Otherwise ``cleanup()``, then every rank raises: a rank that failed its own error, the
        others ``error(rank, text)`` for the first failing rank (default: ``CheckpointError("failed")`` saying it
        failed while ``what``).
        """
        try:
            result, mine = fn(), None
        except BaseException as e:  # noqa: BLE001 - every rank must reach the agreement
            result, mine = None, e
        report = (None, result if share else None) if mine is None else (f"{type(mine).__name__}: {mine}", None)
        reports: list[Any] = [report]
        if self.on:
            reports = [None] * self.world
            _dist().all_gather_object(reports, report, group=self.group)
        failed = [(rank, text) for rank, (text, _) in enumerate(reports) if text is not None]
        if not failed:
            return [r for _, r in reports] if share else result
        if cleanup is not None:
            cleanup()
        if mine is not None:
            raise mine
        rank, text = failed[0]
        raise (
            error(rank, text)
            if error is not None
            else CheckpointError("failed", f"rank {rank} failed while {what}: {text}")
        )

    def for_writer_thread(self) -> Collective:
        """The same ranks over a gloo group a background thread may use (collective on first use)."""
        if not self.on:
            return self
        dist = _dist()
        key = self.group if self.group is not None else dist.group.WORLD
        gloo = _WRITER_GROUPS.get(key)
        if gloo is None:
            ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
            gloo = _WRITER_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
        out = Collective.__new__(Collective)
        out.on, out.group, out.rank, out.world = True, gloo, self.rank, self.world
        return out
