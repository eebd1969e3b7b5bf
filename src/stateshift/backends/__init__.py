"""Backends: the only code that knows a framework's object layout.

A backend *lists* tensors (``Entry``: name, group, tensor) and installs
guards; it never moves, copies or pools anything -- the engine does.
A new framework is one new module here with a ``detect(model, optimizer)``
function returning its backends (or ``None`` when the objects are not its).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import BackendError
from ..slot import Entry

if TYPE_CHECKING:
    from ..state import ModelState


@runtime_checkable
class Backend(Protocol):
    """The contract every backend keeps."""

    #: short name, recorded in benchmark rows and checkpoint manifests
    name: str
    #: the groups this backend lists tensors for (disjoint from other backends')
    groups: tuple[str, ...]
    #: the groups the forward pass reads: the default of ``snapshot()``
    forward_groups: tuple[str, ...]

    def entries(self) -> Iterable[Entry]:
        """The tensors as they are now. Called at every verb; must be cheap and deterministic in order.

        A backend may instead define ``entries(self, groups)`` taking the set of
        groups wanted; the engine then asks only for the groups a verb touches.
        """
        ...

    def install_guards(self, state: ModelState) -> list[Any]:
        """Hooks that call ``state.check_resident`` before compute touches state; returns removable handles."""
        ...


#: detection order: the most specific framework first
DETECTORS: dict[str, str] = {
    "megatron": "stateshift.backends.megatron",
    "fsdp2": "stateshift.backends.fsdp2",
    "torch": "stateshift.backends.torch",
}


def detect_backends(model: Any, optimizer: Any = None) -> list[Backend]:
    """The backends for ``model`` (and ``optimizer``), by the first detector that recognises them."""
    for name, module_path in DETECTORS.items():
        try:
            module = importlib.import_module(module_path)
        except ModuleNotFoundError as exc:
            if exc.name == module_path:
                continue
            raise
        found = module.detect(model, optimizer)
        if found is not None:
            return list(found)
    raise BackendError(f"no backend knows a model of type {type(model).__name__}")


__all__ = ["Backend", "DETECTORS", "Entry", "detect_backends"]
