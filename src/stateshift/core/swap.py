"""What a ``swapped()`` context holds between its entry and its exit.

``ModelState.swapped`` (``state.py``) fills a ``Swap`` on entry: which slots
it overwrote with the snapshot's values and what each was before, where
their current values wait (the stash), and the transfers that wrote them.
On exit the same object says what to put back. Nothing here touches a
``ModelState``: the record is plain data, so the entry and exit code can be
read as two halves of one verb.

A *rebuilder* (``rebuild={"params": fn}``) recomputes a group's current
values on the device instead of having them stashed: ``fn()`` must rewrite
every device-resident slot of its group on the current stream. If it reads
other state (Megatron's bf16 params are rebuilt from the optimizer's fp32
masters), it says which with ``reads()``; the exit puts those groups back
first and makes the tensors it names resident while it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .pool import HostBlock
from .slot import Residency
from .transfer import Transfer


@runtime_checkable
class Rebuilder(Protocol):
    """A rebuild function that also says what it reads (plain callables read nothing tracked)."""

    def __call__(self) -> None: ...

    def reads(self) -> Mapping[str, Collection[str]]:
        """Group -> member names whose device values the rebuild reads."""
        ...


def reads_of(fn: Callable[[], None]) -> Mapping[str, Collection[str]]:
    """What a rebuild function reads (nothing, for a plain callable)."""
    return fn.reads() if isinstance(fn, Rebuilder) else {}


@dataclass(eq=False)
class Swap:
    """The record of one ``swapped()`` context (see the module docstring).

    Per group: ``resident`` slots (device storage valid on entry: stashed,
    or rebuilt, and overwritten) and ``offloaded`` ones (slot index and the
    residency to return to: given device storage for the context only).
    """

    groups: tuple[str, ...]
    rebuild: dict[str, Callable[[], None]]
    resident: dict[str, list[int]] = field(default_factory=dict)
    offloaded: dict[str, list[tuple[int, Residency]]] = field(default_factory=dict)
    #: host blocks and device arenas holding the stash (host blocks go back to the pool on exit)
    stashes: list[HostBlock | torch.Tensor] = field(default_factory=list)
    #: group -> the byte arena its stash lives in (a host block's data or a device tensor)
    arenas: dict[str, torch.Tensor] = field(default_factory=dict)
    stashed: Transfer = field(default_factory=Transfer)
    written: Transfer = field(default_factory=Transfer)

    def rebuilt_groups(self) -> list[str]:
        """Groups whose rebuild must run on exit: those with a rebuilder and a slot that was resident."""
        return [g for g in self.groups if g in self.rebuild and self.resident.get(g)]
