"""stateshift: move a training model's state between GPU, pinned host memory and disk.

Public API::

    state = ModelState(model, optimizer)
    state.offload()                      # params, buffers, grads, optim -> pinned homes
    state.onload()
    pi_old = state.snapshot(tag="pi_old")
    with state.swapped(pi_old):          # compute under pi_old, then the current weights are back
        ...
    state.restore(pi_old)

Checkpoints: ``stateshift.checkpoint``; RL building blocks: ``stateshift.rl``; the RL trainer: ``stateshift.train``.
Everything else (the engine in ``stateshift.core``, the backends in
``stateshift.backends``) is internal and may change.
"""

from . import backends as _backends  # noqa: F401 - registers backend detection with the engine
from .core.pool import PoolStats
from .core.slot import Residency
from .core.snapshot import Snapshot
from .core.state import ModelState
from .errors import (
    BudgetError,
    CheckpointError,
    DiskError,
    LayoutError,
    ObjectError,
    StateError,
    StateShiftError,
)

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "CheckpointError",
    "DiskError",
    "LayoutError",
    "ModelState",
    "ObjectError",
    "PoolStats",
    "Residency",
    "Snapshot",
    "StateError",
    "StateShiftError",
    "__version__",
]
