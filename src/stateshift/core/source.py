"""What the engine needs from a backend, and how it finds one.

The engine moves tensors; it never looks inside a framework's objects. It
asks its *sources* (the backends, ``stateshift/backends/``) three things:

- ``prepare(groups)``: bring the framework into a state in which its tensors
  can be listed and moved (FSDP2 reshards; Megatron forgets host copies it
  must never reload). Called once before every verb touches ``groups``;
  the only place a backend may change framework state.
- ``entries(group)``: the tensors of one group as they are now, without
  side effects, deterministic in order, cheap (called at every verb). The
  same sequence object may come back while nothing changed: the engine then
  re-checks only that each tensor still has its storage.
- ``install_guards(check)``: hooks that call ``check(tensors, where)`` before
  compute reads or writes state; ``check`` raises ``StateError("offloaded")``
  naming the group when a tensor's storage is released.

``backends/base.py`` states the whole contract (these three plus the
plug-ins a backend may offer); this module holds only the part the engine
calls, so that the engine imports nothing from ``backends/``. The backends
package registers its detector here when imported, which is how
``ModelState(model, optimizer)`` finds the backends without importing them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ObjectError
from .slot import Entry


class Check(Protocol):
    """``check(tensors, where)``: raises ``StateError("offloaded")`` if a tensor's storage is released.

    ``writes=True`` (an optimizer step): also raises ``StateError("swap_active")`` if a
    tensor belongs to a group a ``swapped()`` context holds -- the step would
    update the optimizer from the snapshot's values, and the exit would
    discard what it wrote to the swapped groups.
    """

    def __call__(self, tensors: Iterable[torch.Tensor], where: str, *, writes: bool = False) -> None: ...


class Handle(Protocol):
    """A removable hook (``torch.utils.hooks.RemovableHandle`` or a backend's own)."""

    def remove(self) -> None: ...


@runtime_checkable
class Source(Protocol):
    """The part of the backend contract the engine calls (see the module docstring)."""

    #: short name, recorded in benchmark rows and checkpoint manifests
    name: str
    #: the groups this source lists tensors for (disjoint from other sources')
    groups: tuple[str, ...]
    #: the groups the forward pass reads: the default of ``snapshot()``
    forward_groups: tuple[str, ...]

    def prepare(self, groups: Collection[str]) -> None:
        """Make the framework's tensors of ``groups`` listable and movable (see the module docstring)."""
        ...

    def entries(self, group: str) -> Sequence[Entry]:
        """The tensors of ``group`` as they are now; no side effects, deterministic order. Return the same
        sequence object only if the names and tensor objects are the same as last time."""
        ...

    def install_guards(self, check: Check) -> list[Handle]:
        """Hooks that call ``check`` before compute touches state; returns removable handles."""
        ...


Detector = Callable[[Any, Any], list[Source]]
_detector: Detector | None = None


def set_detector(detector: Detector) -> None:
    """Install the function ``ModelState(model, optimizer)`` uses to find backends (``stateshift.backends`` does)."""
    global _detector
    _detector = detector


def detect(model: Any, optimizer: Any) -> list[Source]:
    """The sources for ``model`` and ``optimizer``, by the registered detector."""
    if _detector is None:
        raise ObjectError(
            "backend", "no backend registry is loaded: import stateshift (or pass backends=[...] explicitly)"
        )
    return _detector(model, optimizer)
