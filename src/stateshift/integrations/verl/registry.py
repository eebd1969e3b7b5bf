"""One ``ModelState`` per model and per optimizer that verl passes in, and the snapshot handles.

verl's functions take the objects themselves (a list of Megatron chunks, an
FSDP2 module, an optimizer) and keep nothing between calls. The drop-ins find
the ``ModelState`` of those objects again here:

- **Lookup.** A ``WeakKeyDictionary`` keyed by the model (the first chunk of a
  Megatron list, whose other chunks are checked too) or by the optimizer.
  Neither the key nor the state is held by the table: the state lives as long
  as its model, because the guard hooks it installs on the model hold it (and
  a state built with ``guard=False`` keeps itself alive while it holds
  offloaded values). A rebuilt model (new objects) gets a new state; the old
  one goes with the old objects, and a handle taken from it is refused by a
  restore on the new model (``ObjectError("snapshot_handle")``). The same first chunk
  with other chunks behind it closes the old state (its values come back to
  the device) and builds a new one, with a warning.
- **Model and optimizer apart.** verl offloads the model and the optimizer in
  separate calls, so each gets its own state: the model's holds ``params``,
  ``frozen``, ``buffers`` and ``grads``; the optimizer's holds ``optim``
  (named after the model's parameters when the model is registered first).
- **Handles.** What a copy function returns is a ``SnapshotHandle``: opaque,
  it holds one stateshift ``Snapshot`` and the state it came from. When
  verl drops the handle (``del cpu_saved_models[n]``) its memory goes back to
  the pool at the next call of any drop-in (not from the garbage collector,
  which may run in the middle of a verb), or at once with ``release()``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ... import ModelState, Snapshot
from ...backends import detect_backends
from ...backends.fsdp2 import FSDP2OptimizerBackend
from ...backends.megatron import MegatronOptimizerBackend, is_megatron_optimizer
from ...backends.megatron.objects import optimizers_of, state_owners
from ...errors import ObjectError

_log = logging.getLogger("stateshift.integrations.verl")

Placement = Literal["host", "device"]


@dataclass
class Settings:
    """How the drop-ins build states and snapshots (``install()`` sets them)."""

    #: where ``copy_*`` / ``fsdp2_sharded_save_to_cpu`` keep a snapshot: pinned ``"host"`` memory (verl's
    #: choice, the default) or ``"device"`` memory (no PCIe crossing; costs the params' bytes per handle)
    placement: Placement = "host"
    #: install stateshift's guards (running the model on offloaded state raises ``StateError("offloaded")``)
    guard: bool = True
    #: verl's own functions by name while installed (``install()`` fills it, ``uninstall()`` empties it)
    verl: dict[str, Any] = field(default_factory=dict)


SETTINGS = Settings()


def original(name: str) -> Any | None:
    """verl's own function ``name`` while installed, else ``None``."""
    return SETTINGS.verl.get(name)


_VERSIONS = itertools.count()
_LOCK = threading.RLock()
#: snapshots whose handles were collected, released at the next call (see the module docstring)
_PENDING: collections.deque[tuple[ModelState, Snapshot]] = collections.deque()


@dataclass
class _Entry:
    state: weakref.ref[ModelState]
    chunks: tuple[weakref.ref[Any], ...]
    param_ids: frozenset[int]


_MODELS: weakref.WeakKeyDictionary[Any, _Entry] = weakref.WeakKeyDictionary()
_OPTIMIZERS: weakref.WeakKeyDictionary[Any, weakref.ref[ModelState]] = weakref.WeakKeyDictionary()


def _chunks(model: Any) -> tuple[Any, ...]:
    chunks = tuple(model) if isinstance(model, (list, tuple)) else (model,)
    if not chunks:
        raise ValueError("an empty list of model chunks was given")
    return chunks


def drain() -> None:
    """Release the snapshots of handles that were garbage-collected (called by every drop-in first)."""
    while _PENDING:
        state, snap = _PENDING.popleft()
        if not state.closed and not snap.released:
            state.release(snap)


def model_state(model: Any) -> ModelState:
    """The ``ModelState`` of ``model`` (a module or a list of Megatron chunks), built on first use."""
    chunks = _chunks(model)
    with _LOCK:
        drain()
        entry = _MODELS.get(chunks[0])
        state = entry.state() if entry is not None else None
        if state is not None and not state.closed:
            if tuple(r() for r in entry.chunks) == chunks:  # type: ignore[union-attr]
                return state
            warnings.warn(
                f"the model's chunks changed ({len(entry.chunks)} -> {len(chunks)} chunks, same first chunk): "  # type: ignore[union-attr]
                "its stateshift state is closed (values back on the device) and a new one is built",
                stacklevel=3,
            )
            state.close()
        state = ModelState(list(chunks) if isinstance(model, (list, tuple)) else model, guard=SETTINGS.guard)
        ids = frozenset(id(p) for c in chunks for p in c.parameters())
        _MODELS[chunks[0]] = _Entry(weakref.ref(state), tuple(weakref.ref(c) for c in chunks), ids)
        _log.debug("built a ModelState for %s: groups %s", type(chunks[0]).__name__, state.groups)
        return state


def _optimizer_params(optimizer: Any) -> list[Any]:
    if is_megatron_optimizer(optimizer):
        return [p for leaf in optimizers_of(optimizer) for p, _ in state_owners(leaf)]
    return [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"]]


def _model_of(optimizer: Any) -> Any | None:
    """A registered model whose parameters the optimizer steps (for names), or ``None``."""
    params = _optimizer_params(optimizer)
    for entry in list(_MODELS.values()):
        chunks = [r() for r in entry.chunks]
        if all(c is not None for c in chunks) and any(id(p) in entry.param_ids for p in params):
            return chunks if len(chunks) > 1 or is_megatron_optimizer(optimizer) else chunks[0]
    return None


def _optimizer_backends(optimizer: Any) -> list[Any]:
    model = _model_of(optimizer)
    if model is not None:
        return [b for b in detect_backends(model, optimizer) if tuple(b.groups) == ("optim",)]
    if is_megatron_optimizer(optimizer):
        return [MegatronOptimizerBackend(optimizer)]
    if isinstance(optimizer, torch.optim.Optimizer):
        return [FSDP2OptimizerBackend(optimizer)]  # plain tensors are their own local shards
    raise TypeError(
        f"not an optimizer stateshift knows: {type(optimizer).__name__} (a torch.optim.Optimizer or a Megatron optimizer)"
    )


def optimizer_state(optimizer: Any) -> ModelState:
    """The ``ModelState`` (group ``optim``) of ``optimizer``, built on first use."""
    with _LOCK:
        drain()
        ref = _OPTIMIZERS.get(optimizer)
        state = ref() if ref is not None else None
        if state is not None and not state.closed:
            return state
        state = ModelState(None, backends=_optimizer_backends(optimizer), guard=SETTINGS.guard)
        _OPTIMIZERS[optimizer] = weakref.ref(state)
        return state


@dataclass(eq=False, repr=False)
class SnapshotHandle:
    """An opaque snapshot of a model's weights, from a drop-in copy function; only its restore reads it.

    ``kind`` is ``"megatron"`` or ``"fsdp2"``. The values are safe to read on
    the host only after ``wait()``; a restore needs no wait (it orders itself
    after the copies). Dropping the handle gives its memory back (at the next
    drop-in call); ``release()`` does it now.
    """

    kind: str
    snapshot: Snapshot
    state: ModelState
    _finalizer: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _PENDING.append, (self.state, self.snapshot))

    @property
    def nbytes(self) -> int:
        return sum(p.layout.total for p in self.snapshot.parts)

    def wait(self) -> SnapshotHandle:
        self.snapshot.wait()
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the values by name, read after ``wait()`` (for tests and debugging)."""
        return self.snapshot.wait().tensors()

    def release(self) -> None:
        """Give the snapshot's memory back now; the handle cannot be restored afterwards."""
        self._finalizer.detach()
        if not self.state.closed and not self.snapshot.released:
            self.state.release(self.snapshot)

    def __repr__(self) -> str:
        gone = " released" if self.snapshot.released else ""
        return f"<stateshift SnapshotHandle {self.kind} v{self.snapshot.version} {self.snapshot.placement} {self.nbytes} bytes{gone}>"


def take(state: ModelState, kind: str, groups: Sequence[str]) -> SnapshotHandle:
    """A new handle: a snapshot of ``groups`` under a version no other handle has (handles never replace each other)."""
    snap = state.snapshot(list(groups), tag=f"verl-{kind}", version=next(_VERSIONS), placement=SETTINGS.placement)
    return SnapshotHandle(kind, snap, state)


def check_handle(handle: object, state: ModelState, kind: str, function: str) -> Snapshot:
    """The handle's snapshot, after checking it is a live handle of ``kind`` taken from ``state``."""
    got = type(handle).__name__
    if not isinstance(handle, SnapshotHandle):
        hint = (
            " (a dict is what verl's own copy function returns: take the snapshot with the stateshift one too)"
            if isinstance(handle, dict)
            else ""
        )
        raise ObjectError(
            "snapshot_handle",
            f"expected a stateshift SnapshotHandle from the matching copy function{hint}",
            function=function,
            got=got,
        )
    if handle.kind != kind:
        raise ObjectError(
            "snapshot_handle", f"a {handle.kind} handle given to a {kind} restore", function=function, got=got
        )
    if handle.state is not state:
        why = (
            "its model state was closed"
            if handle.state.closed
            else "it was taken from another model (rebuilt, or another worker's)"
        )
        raise ObjectError(
            "snapshot_handle", f"the handle does not belong to this model: {why}", function=function, got=got
        )
    if handle.snapshot.released:
        raise ObjectError("snapshot_handle", "the handle was released", function=function, got=got)
    return handle.snapshot
