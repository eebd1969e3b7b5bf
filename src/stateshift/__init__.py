"""stateshift: move a training model's state between GPU, pinned host memory and disk.

Public API::

    state = ModelState(model, optimizer)
    state.offload()                      # params, buffers, grads, optim -> pinned homes
    state.onload()
    pi_old = state.snapshot(tag="pi_old")
    with state.swapped(pi_old):          # compute under pi_old, then the current weights are back
        ...
    state.restore(pi_old)

``HostPool``: the pinned host pool a ``ModelState`` takes its homes and snapshots from (``HostPool(shared=True)``:
in ``/dev/shm``, mappable by other processes, for weight sync). ``watch_thread()``: check a thread that neither
calls verbs nor runs a guarded model for touches of offloaded state.

Checkpoints: ``stateshift.checkpoint``; RL building blocks: ``stateshift.rl``; the RL trainer: ``stateshift.train``.
Everything else (the engine in ``stateshift.core``, the backends in
``stateshift.backends``) is internal and may change.
"""

from . import backends as _backends  # noqa: F401 - registers backend detection with the engine
from .core.pool import HostPool, PoolStats
from .core.slot import Residency
from .core.snapshot import Snapshot
from .core.state import ModelState
from .core.touch import watch_thread
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
    "HostPool",
    "LayoutError",
    "ModelState",
    "ObjectError",
    "PoolStats",
    "Residency",
    "Snapshot",
    "StateError",
    "StateShiftError",
    "__version__",
    "watch_thread",
]
