"""The backend contract: everything a framework backend is, as ``typing.Protocol``s.

A backend is the only code that knows a framework's object layout. It
*lists* tensors and installs guards; it never moves, copies or pools
anything (the engine, ``stateshift.core``, does). A new framework is one new
module here plus one entry in ``REGISTRY`` (``backends/__init__.py``); the
engine is untouched.

The contract, in full:

- ``Source`` (defined in ``core/source.py``, the part the engine calls):
  ``name``, ``groups``, ``forward_groups``, ``prepare(groups)``,
  ``entries(groups)``, ``install_guards(check)``.
- ``Backend`` adds what the rest of the library asks: ``static_groups``
  (forward groups training never changes, left out of pi_old),
  ``coverage()`` (what is tracked and what deliberately is not),
  ``checkpoint_facts()`` (what checkpoints need to know), and
  ``rebuild_plugin()`` (an optional ``Rebuild``).
- ``Rebuild``: recomputes a group's current device values instead of a
  stash copy-back inside ``ModelState.swapped`` (Megatron: bf16 params from
  the fp32 masters).
- ``Detector``: a module's ``detect(model, optimizer)`` returns its backends,
  or ``None`` when the objects are not its framework's.

When data is safe to read: ``entries`` only reports tensors; whether their
storage holds values is the engine's business (a listed tensor may be
offloaded). ``prepare`` may change framework state (and is the only place a
backend does): the engine calls it before it lists or moves anything.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..core.source import Check, Handle, Source

__all__ = ["Backend", "Check", "CheckpointFacts", "Detector", "Handle", "Rebuild", "Source"]


@dataclass(frozen=True)
class CheckpointFacts:
    """What checkpoint code needs to know about a backend (instead of guessing from its name)."""

    #: each rank of a ``torch.distributed`` run holds a different part of the state (FSDP2 shards,
    #: Megatron's DistributedOptimizer): by default ``save`` writes one shard per rank
    sharded: bool = False
    #: the module whose ``state_dict`` names ``export_hf`` writes, or ``None`` if this backend has none
    module: torch.nn.Module | None = None
    #: why ``export_hf`` cannot write whole tensors from this backend (``None``: it can)
    export_refusal: str | None = None


@runtime_checkable
class Rebuild(Protocol):
    """Recomputes one group's current device values (instead of a stash copy-back)."""

    #: the group it rebuilds (e.g. ``"params"``)
    group: str

    def available(self) -> str | None:
        """``None`` when a rebuild now gives exactly the current values; otherwise why it would not."""
        ...

    def reads(self) -> Mapping[str, Collection[str]]:
        """Group -> member names whose device values the rebuild reads (made resident for it)."""
        ...

    def nbytes(self) -> tuple[int, int]:
        """(bytes read, bytes written) on the device by one rebuild."""
        ...

    def __call__(self) -> None:
        """Rewrite every device-resident slot of ``group`` on the current stream."""
        ...


@runtime_checkable
class Backend(Source, Protocol):
    """The whole contract (see the module docstring)."""

    #: forward groups that training does not change (the pi_old helper leaves them out)
    static_groups: tuple[str, ...]

    def coverage(self) -> dict[str, list[str]]:
        """Names per group, and what is deliberately not tracked (under keys of its own)."""
        ...

    def checkpoint_facts(self) -> CheckpointFacts:
        """What checkpoints need to know about this backend's state."""
        ...

    def rebuild_plugin(self) -> Rebuild | None:
        """A rebuild plug-in for ``swapped`` (``None`` if this backend offers none)."""
        ...


class Detector(Protocol):
    """``detect(model, optimizer)`` of a backend module."""

    def __call__(self, model: Any, optimizer: Any = None) -> list[Backend] | None: ...
