"""stateshift: move a training model's state between GPU, pinned host memory and disk.

Public API::

    state = ModelState(model, optimizer)
    state.offload()                      # params, buffers, grads, optim -> pinned homes
    state.onload()
    pi_old = state.snapshot(tag="pi_old")
    with state.swapped(pi_old):          # compute under pi_old, then the current weights are back
        ...
    state.restore(pi_old)
"""

from .errors import (
    BackendError,
    ForeignStateError,
    LayoutMismatchError,
    NotReleasableError,
    OffloadedStateError,
    PinningUnavailableError,
    PoolBudgetError,
    ReleasedSnapshotError,
    SnapshotBudgetError,
    StateShiftError,
    SwapActiveError,
    UnknownGroupError,
)
from .pool import HostPool, PoolStats
from .slot import Entry, NativeHome, Residency
from .snapshot import Layout, Snapshot, SnapshotStore
from .state import ModelState
from .transfer import CopyEngine, Transfer

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "CopyEngine",
    "Entry",
    "ForeignStateError",
    "HostPool",
    "Layout",
    "LayoutMismatchError",
    "ModelState",
    "NativeHome",
    "NotReleasableError",
    "OffloadedStateError",
    "PinningUnavailableError",
    "PoolBudgetError",
    "PoolStats",
    "ReleasedSnapshotError",
    "Residency",
    "Snapshot",
    "SnapshotBudgetError",
    "SnapshotStore",
    "StateShiftError",
    "SwapActiveError",
    "Transfer",
    "UnknownGroupError",
    "__version__",
]
