"""Layouts, snapshots and the snapshot store.

A ``Layout`` places a group's slots in one flat byte arena: slots of at least
``SMALL_BYTES`` first, then the small ones packed together (so the copy
engine can move them as one staged transfer), every slot aligned to
``ALIGN`` bytes. Homes and snapshots of a group share its layout, which is
what makes a snapshot of an offloaded group a pointer copy (copy-on-write).

A ``Snapshot`` is immutable: its memory is written once, when it is taken,
and never again -- a home that shares a snapshot's block (copy-on-write)
takes a block of its own before it is written. Restoring a snapshot twice
gives the same values twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from .errors import LayoutMismatchError, ReleasedSnapshotError, SnapshotBudgetError
from .slot import SlotInfo
from .transfer import SMALL_BYTES, Transfer

if TYPE_CHECKING:
    from .pool import HostBlock, HostPool

Placement = Literal["host", "device"]
PLACEMENTS: tuple[str, ...] = ("host", "device")
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Layout:
    """Slots of one group, in listing order, with their byte offsets in an arena."""

    slots: tuple[SlotInfo, ...]
    offsets: tuple[int, ...]
    total: int

    @staticmethod
    def build(slots: tuple[SlotInfo, ...]) -> Layout:
        offsets = [0] * len(slots)
        pos = 0
        large_first = sorted(range(len(slots)), key=lambda i: slots[i].nbytes < SMALL_BYTES)
        for i in large_first:
            offsets[i] = pos
            pos = _align(pos + slots[i].nbytes)
        return Layout(slots=slots, offsets=tuple(offsets), total=pos)

    @property
    def nbytes(self) -> int:
        """Bytes of values (without alignment padding)."""
        return sum(s.nbytes for s in self.slots)

    def region(self, arena: torch.Tensor, index: int) -> torch.Tensor:
        off = self.offsets[index]
        return arena[off : off + self.slots[index].nbytes]

    def regions(self, arena: torch.Tensor) -> list[torch.Tensor]:
        return [arena[off : off + s.nbytes] for off, s in zip(self.offsets, self.slots, strict=True)]

    def check_compatible(self, expected: Layout) -> None:
        """Raise ``LayoutMismatchError`` naming the first tensor where ``self`` (the model now) differs."""
        if self.slots == expected.slots:
            return
        have = {m.name: (s, m) for s in self.slots for m in s.members}
        want = {m.name: (s, m) for s in expected.slots for m in s.members}
        for name, (ws, wm) in want.items():
            if name not in have:
                raise LayoutMismatchError(name, f"in the snapshot (group {ws.group!r}) but missing from the model")
            hs, hm = have[name]
            for what in ("shape", "dtype", "stride", "offset", "meta"):
                if getattr(hm, what) != getattr(wm, what):
                    raise LayoutMismatchError(
                        name, f"{what} is {getattr(hm, what)} in the model but {getattr(wm, what)} in the snapshot"
                    )
            if hs.nbytes != ws.nbytes:
                raise LayoutMismatchError(name, f"storage holds {hs.nbytes} bytes in the model, {ws.nbytes} in the snapshot")
        for name in have:
            if name not in want:
                raise LayoutMismatchError(name, "in the model but not in the snapshot")
        if len(self.slots) != len(expected.slots):
            raise LayoutMismatchError(
                self.slots[0].name if self.slots else "(none)",
                f"the model has {len(self.slots)} storages, the snapshot {len(expected.slots)} (tied or shared tensors differ)",
            )
        for hs, ws in zip(self.slots, expected.slots, strict=True):
            if hs.name != ws.name or hs.members != ws.members:
                raise LayoutMismatchError(
                    hs.name,
                    f"storage sharing differs: the model's storage holds {[m.name for m in hs.members]}, "
                    f"the snapshot's {[m.name for m in ws.members]}",
                )


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(eq=False)
class SnapshotPart:
    """One group's values: a host block or a device tensor laid out by ``layout``."""

    group: str
    layout: Layout
    host: HostBlock | None = None
    device: torch.Tensor | None = None

    @property
    def arena(self) -> torch.Tensor:
        if self.host is not None:
            return self.host.data
        assert self.device is not None
        return self.device

    _device_regions: list[torch.Tensor] | None = field(default=None, repr=False)

    def regions(self) -> list[torch.Tensor]:
        if self.host is not None:
            return self.host.regions(self.layout)
        if self._device_regions is None:
            assert self.device is not None
            self._device_regions = self.layout.regions(self.device)
        return self._device_regions

    def region(self, index: int) -> torch.Tensor:
        return self.regions()[index]


@dataclass(eq=False)
class Snapshot:
    """An immutable, typed, named copy of some groups' values.

    The values are safe to read (``tensors()``, or by the host in any way)
    only after ``wait()``; ``ModelState.restore`` and ``swapped`` need no
    wait, since they order themselves after the snapshot's copies.
    """

    tag: str
    version: int | None
    placement: Placement
    parts: tuple[SnapshotPart, ...]
    _pool: HostPool = field(repr=False)
    _transfer: Transfer = field(default_factory=Transfer, repr=False)
    _released: bool = field(default=False, repr=False)

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.tag, self.version)

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(p.group for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.layout.total for p in self.parts)

    @property
    def fingerprint(self) -> tuple[tuple[str, tuple[SlotInfo, ...]], ...]:
        return tuple((p.group, p.layout.slots) for p in self.parts)

    @property
    def released(self) -> bool:
        return self._released

    def ready(self) -> bool:
        return self._transfer.done()

    def wait(self) -> Snapshot:
        self.check_alive()
        self._transfer.wait()
        return self

    def check_alive(self) -> None:
        if self._released:
            raise ReleasedSnapshotError(f"snapshot {self.tag!r} (version {self.version}) was released")

    def part(self, group: str) -> SnapshotPart:
        for p in self.parts:
            if p.group == group:
                return p
        raise KeyError(f"snapshot {self.tag!r} has no group {group!r} (it has {', '.join(self.groups)})")

    def views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every member, aliasing the snapshot's memory: read only, after ``wait()``."""
        self.check_alive()
        for part in self.parts:
            for i, slot in enumerate(part.layout.slots):
                region = part.region(i)
                for m in slot.members:
                    dtype = dtype_of(m.dtype)
                    typed = region.view(dtype) if region.numel() % dtype.itemsize == 0 else None
                    if typed is None:
                        raise RuntimeError(f"slot {slot.name!r} is not a whole number of {m.dtype} elements")
                    yield m.name, typed.as_strided(m.shape, m.stride, typed.storage_offset() + m.offset // dtype.itemsize)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Copies of every member's values (on the snapshot's placement), keyed by name. Waits first."""
        self.wait()
        out: dict[str, torch.Tensor] = {}
        for name, view in self.views():
            if name in out:
                raise RuntimeError(f"two tensors named {name!r} in snapshot {self.tag!r}")
            out[name] = view.clone()
        return out

    def release(self) -> None:
        """Give the memory back (host blocks to the pool). Idempotent."""
        if self._released:
            return
        self._released = True
        for p in self.parts:
            if p.host is not None:
                p.host.pending = self._transfer.merged(p.host.pending)
                self._pool.release(p.host)
                p.host = None
            p.device = None
            p._device_regions = None


class SnapshotStore:
    """Snapshots keyed by ``(tag, version)``, with an optional byte budget.

    Putting a snapshot under a key that is taken releases the old one.
    ``get(tag)`` without a version returns the highest version of that tag.
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._items: dict[tuple[str, int | None], Snapshot] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Snapshot]:
        return iter(list(self._items.values()))

    def __contains__(self, key: object) -> bool:
        return key in self._items

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._items.values())

    def check_budget(self, nbytes: int, replacing: tuple[str, int | None] | None = None) -> None:
        """Raise ``SnapshotBudgetError`` if adding ``nbytes`` (minus the snapshot replaced) would exceed the budget."""
        if self.budget_bytes is None:
            return
        freed = self._items[replacing].nbytes if replacing in self._items else 0
        total = self.nbytes - freed + nbytes
        if total > self.budget_bytes:
            raise SnapshotBudgetError(
                f"snapshot store budget {self.budget_bytes} bytes: holding {self.nbytes}, "
                f"a new snapshot of {nbytes} bytes would make {total}"
            )

    def put(self, snapshot: Snapshot) -> None:
        old = self._items.pop(snapshot.key, None)
        if old is not None and old is not snapshot:
            old.release()
        self._items[snapshot.key] = snapshot

    def get(self, tag: str, version: int | None = None) -> Snapshot:
        if version is not None or (tag, None) in self._items and not self._versions(tag):
            try:
                return self._items[(tag, version)]
            except KeyError:
                raise KeyError(f"no snapshot {tag!r} version {version}; have {self.keys()}") from None
        versions = self._versions(tag)
        if not versions:
            raise KeyError(f"no snapshot tagged {tag!r}; have {self.keys()}")
        return self._items[(tag, max(versions))]

    def keys(self) -> list[tuple[str, int | None]]:
        return list(self._items)

    def _versions(self, tag: str) -> list[int]:
        return [v for (t, v) in self._items if t == tag and v is not None]

    def discard(self, snapshot: Snapshot) -> None:
        """Forget and release ``snapshot`` (no error if it is not stored)."""
        if self._items.get(snapshot.key) is snapshot:
            del self._items[snapshot.key]
        snapshot.release()

    def clear(self) -> None:
        for snap in list(self._items.values()):
            snap.release()
        self._items.clear()
