"""Slots: tensors whose identity survives every move.

A slot is one *storage* (a flat buffer, a parameter, a local shard, an
optimizer state tensor). Moving a slot resizes that storage in place
(``resize_(0)`` to release, ``resize_(nbytes)`` to re-grow), so the Python
tensor objects that use it -- the parameter, views of a flat buffer,
``main_grad``, tied weights -- stay the same objects and see the new values
after an onload. Tensors that share one storage are *members* of one slot;
the slot moves the whole storage as bytes, so views and ties survive.

Backends describe tensors with ``Entry``; the engine groups entries by
storage into slots. ``SlotInfo`` is the slot's part of a layout fingerprint.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class Residency(str, enum.Enum):
    """Where a slot's truth lives."""

    DEVICE = "device"  #: device storage valid (for CPU tensors: their own storage)
    HOST = "host"  #: device storage released; the home holds the values
    DROPPED = "dropped"  #: device storage released; no values kept (onload zero-fills)
    DISK = "disk"  #: device storage released; the state's disk home holds the values

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class NativeHome:
    """Where a framework's own offload left a released tensor's values.

    ``values`` is a host tensor holding exactly the storage's bytes (e.g.
    Megatron's ``param_data_cpu``), or ``None`` when the framework released
    the storage without keeping values (e.g. Megatron's grad offload): the
    slot is then adopted as ``dropped`` and onload zero-fills it.

    ``on_onload`` is called once, when stateshift stops relying on the
    framework's copy: after an onload re-grew and refilled the storage, or
    when newer values replace it while the storage stays released
    (``restore`` into the slot, ``drop``). The framework can then drop its
    own bookkeeping (otherwise its own reload would later bring back older
    values).
    """

    values: torch.Tensor | None
    on_onload: Any = None
    #: called when stateshift releases the storage again after lending it device memory for a
    #: ``swapped()`` context: the framework's copy is the values' home again (the framework may have
    #: let go of it meanwhile, having seen the storage resident)
    on_released: Any = None

    def forget(self) -> None:
        """Tell the framework stateshift stops relying on its copy (``on_onload``, where it gave one)."""
        if self.on_onload is not None:
            self.on_onload()

    def reinstate(self) -> None:
        """Tell the framework its copy is the values' home again (``on_released``, where it gave one)."""
        if self.on_released is not None:
            self.on_released()


class Entry(NamedTuple):
    """One tensor a backend reports (a named tuple: listing runs at every verb and must be cheap).

    Args:
        name: a stable, unique name (e.g. ``"decoder.layers.0.mlp.weight"``).
        group: the group it moves with (``"params"``, ``"grads"``, ``"optim"``, ...).
        tensor: the live tensor; its storage becomes (part of) a slot.
        meta: extra fingerprint items that must match at restore (mesh, placements, ...).
        nbytes: the storage's full size; needed only when the storage is
            currently released by someone else (its ``nbytes()`` is 0 then).
        native_home: where a framework's own offload put the values, if it did.
    """

    name: str
    group: str
    tensor: torch.Tensor
    meta: tuple[Any, ...] = ()
    nbytes: int | None = None
    native_home: NativeHome | None = None


@dataclass(frozen=True)
class MemberInfo:
    """Fingerprint of one tensor inside a slot."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]
    offset: int
    meta: tuple[Any, ...] = ()


@dataclass(frozen=True)
class SlotInfo:
    """Fingerprint of one slot: what a snapshot or checkpoint must agree with."""

    name: str
    group: str
    nbytes: int
    members: tuple[MemberInfo, ...]

    def describe(self) -> str:
        m = self.members[0]
        return f"{m.name} {list(m.shape)} {m.dtype}"

    @functools.cached_property
    def covers_storage(self) -> bool:
        """One member, contiguous from byte 0, exactly as large as the storage: a plain tensor (worked out
        once per fingerprint: a checkpoint of many tensors asks several times per slot)."""
        if len(self.members) != 1:
            return False
        m = self.members[0]
        if m.offset != 0:
            return False
        expect, numel = 1, 1
        for size, stride in zip(reversed(m.shape), reversed(m.stride), strict=True):
            if size != 1 and stride != expect:
                return False
            expect *= size
            numel *= size
        itemsize = _ITEMSIZE.get(m.dtype)
        return itemsize is not None and numel * itemsize == self.nbytes


_ITEMSIZE = {str(d).removeprefix("torch."): d.itemsize for d in vars(torch).values() if isinstance(d, torch.dtype)}


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage; stable across moves (``resize_`` keeps the StorageImpl)."""
    return tensor.untyped_storage()._cdata


_UNTYPED_STORAGE, _CDATA = operator.methodcaller("untyped_storage"), operator.attrgetter("_cdata")


def _storage_id_agrees() -> bool:
    """Whether this torch's ``torch._C._storage_id`` gives ``storage_key`` (the StorageImpl's address)
    without making a storage object per call: about 40% less time for a verb's listing of keys."""
    probe = torch.empty(1, device="cpu")  # (not the default device: no CUDA start at import)
    fn = getattr(torch._C, "_storage_id", None)
    try:
        return fn is not None and fn(probe) == storage_key(probe) and fn(probe[:0]) == storage_key(probe)
    except Exception:  # noqa: BLE001 -- any failure: use the portable way
        return False


_STORAGE_ID = torch._C._storage_id if _storage_id_agrees() else None  # type: ignore[attr-defined]


def storage_keys(tensors: Iterable[torch.Tensor]) -> list[int]:
    """``storage_key`` of each tensor, without a Python loop (every verb lists every slot's)."""
    if _STORAGE_ID is not None:
        return list(map(_STORAGE_ID, tensors))
    return list(map(_CDATA, map(_UNTYPED_STORAGE, tensors)))


def member_info(entry: Entry) -> MemberInfo:
    t = entry.tensor
    return MemberInfo(
        name=entry.name,
        shape=tuple(t.shape),
        dtype=str(t.dtype).removeprefix("torch."),
        stride=tuple(t.stride()),
        offset=int(t.storage_offset()) * t.element_size(),
        meta=tuple(entry.meta),
    )


@dataclass(eq=False)
class Slot:
    """One storage and its residency. Only the verbs change residency (through the tiers).

    ``bytes()`` is a ``uint8`` view of the whole storage; it is valid only while
    the slot is ``DEVICE`` (a view of released storage points at nothing).
    """

    key: int
    info: SlotInfo
    storage: torch.UntypedStorage
    device: torch.device
    residency: Residency = Residency.DEVICE
    native_home: NativeHome | None = field(default=None, repr=False)
    #: the member tensors as last listed (identity fast path of ``SlotTable.refresh``)
    tensors: tuple[torch.Tensor, ...] = field(default=(), repr=False)
    _view: torch.Tensor | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    def bytes(self) -> torch.Tensor:
        """The byte view; created once (a view follows its storage through ``resize_``)."""
        view = self._view
        if view is None or view.numel() != self.nbytes:
            view = torch.empty(0, dtype=torch.uint8, device=self.device)
            view = self._view = view.set_(self.storage, 0, (self.nbytes,), (1,))
        return view

    @property
    def releasable(self) -> bool:
        """Whether the storage can be resized in place now (pinned storages of torch's host allocator cannot,
        and ``tensor.numpy()`` makes any storage it is asked of non-resizable from then on: asked afresh
        each time, never cached)."""
        return self.storage.resizable()


_SLOT_STORAGE, _SLOT_NBYTES = operator.attrgetter("storage"), operator.attrgetter("info.nbytes")
_STORAGE_NBYTES, _RELEASE = operator.methodcaller("nbytes"), operator.methodcaller("resize_", 0)
_RESIZABLE = operator.methodcaller("resizable")


def all_releasable(slots: Iterable[Slot]) -> bool:
    """``releasable`` of every slot, asked now, without a Python loop."""
    return all(map(_RESIZABLE, map(_SLOT_STORAGE, slots)))


def release_all(slots: Iterable[Slot]) -> None:
    """Free each slot's storage memory (``resize_(0)``; its tensors keep their identity and must not be
    read), without a Python loop (an offload of 20,000 small slots made 20,000 Python calls after its
    copies were enqueued)."""
    collections.deque(map(_RELEASE, map(_SLOT_STORAGE, slots)), maxlen=0)


def regrow_all(slots: Sequence[Slot]) -> None:
    """Give each slot's storage its memory back (uninitialised, allocated on the current stream), those
    whose storage is short of its size only (a same-size ``resize_`` would move it to new memory),
    without a Python loop: an onload runs this between its copies, so per-slot Python here delays them."""
    storages, sizes = list(map(_SLOT_STORAGE, slots)), list(map(_SLOT_NBYTES, slots))
    short = list(map(operator.ne, map(_STORAGE_NBYTES, storages), sizes))
    collections.deque(
        map(torch.UntypedStorage.resize_, itertools.compress(storages, short), itertools.compress(sizes, short)),
        maxlen=0,
    )
