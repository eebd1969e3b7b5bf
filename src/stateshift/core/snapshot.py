"""Snapshots and the snapshot store.

A snapshot part holds one group's values in an arena laid out by the
group's ``Layout`` (``layout.py``), the same layout as the group's home,
which is what makes a snapshot of an offloaded group a pointer copy
(copy-on-write).

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

from ..errors import BudgetError, StateError
from .layout import Layout, dtype_of
from .slot import SlotInfo
from .transfer import Transfer

if TYPE_CHECKING:
    from .disk import DiskHome
    from .pool import HostBlock, HostPool

Placement = Literal["host", "device", "disk"]
PLACEMENTS: tuple[str, ...] = ("host", "device", "disk")


@dataclass(eq=False)
class SnapshotPart:
    """One group's values laid out by ``layout``: in a host block, a device tensor, or a span of the
    state's disk home (``disk``: the home and the span's file offset)."""

    group: str
    layout: Layout
    host: HostBlock | None = None
    device: torch.Tensor | None = None
    disk: tuple[DiskHome, int] | None = None

    @property
    def arena(self) -> torch.Tensor:
        """The part's memory (a disk part has none: ``regions()`` reads a copy of it)."""
        if self.host is not None:
            return self.host.data
        if self.device is None:
            raise ValueError(f"the snapshot part of group {self.group!r} is on disk: it has no memory arena")
        return self.device

    _device_regions: list[torch.Tensor] | None = field(default=None, repr=False)

    def regions(self) -> list[torch.Tensor]:
        """Views of each slot's bytes (for a disk part: of a copy read now into host memory)."""
        if self.host is not None:
            return self.host.regions(self.layout)
        if self.disk is not None:
            home, offset = self.disk
            copy = torch.empty(self.layout.total, dtype=torch.uint8)
            home.read(offset, copy)
            return self.layout.regions(copy)
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

    @classmethod
    def of(
        cls,
        *,
        tag: str,
        version: int | None,
        placement: Placement,
        parts: tuple[SnapshotPart, ...],
        pool: HostPool,
        transfer: Transfer | None = None,
    ) -> Snapshot:
        """A snapshot of ``parts`` (the engine's constructor): host parts go back to ``pool`` on release;
        ``transfer`` is what must complete before the values may be read."""
        return cls(
            tag=tag, version=version, placement=placement, parts=parts, _pool=pool, _transfer=transfer or Transfer()
        )

    @property
    def transfer(self) -> Transfer:
        """The copies that fill this snapshot (``wait()`` waits for them)."""
        return self._transfer

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
            raise StateError("released", f"snapshot {self.tag!r} (version {self.version}) was released")

    @staticmethod
    def given(snapshot: object, verb: str) -> Snapshot:
        """What a verb was handed, checked before anything reads it: a ``Snapshot`` (``TypeError``
        naming what came instead) that is not released (``StateError("released")``)."""
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"{verb} needs a Snapshot (from ModelState.snapshot), got {type(snapshot).__name__}")
        snapshot.check_alive()
        return snapshot

    def part(self, group: str) -> SnapshotPart:
        for p in self.parts:
            if p.group == group:
                return p
        raise KeyError(f"snapshot {self.tag!r} has no group {group!r} (it has {', '.join(self.groups)})")

    def views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every member, aliasing the snapshot's memory: read only, after ``wait()``
        (a disk part's are views of a copy read from the disk now)."""
        self.check_alive()
        for part in self.parts:
            regions = part.regions()
            for i, slot in enumerate(part.layout.slots):
                region = regions[i]
                for m in slot.members:
                    dtype = dtype_of(m.dtype)
                    typed = region.view(dtype) if region.numel() % dtype.itemsize == 0 else None
                    if typed is None:
                        raise RuntimeError(f"slot {slot.name!r} is not a whole number of {m.dtype} elements")
                    yield (
                        m.name,
                        typed.as_strided(m.shape, m.stride, typed.storage_offset() + m.offset // dtype.itemsize),
                    )

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
            if p.disk is not None:
                home, offset = p.disk
                home.free(offset, p.layout.total)
                p.disk = None
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
        """Raise ``BudgetError("snapshot")`` if adding ``nbytes`` (minus the snapshot replaced) would exceed the budget."""
        if self.budget_bytes is None:
            return
        freed = self._items[replacing].nbytes if replacing in self._items else 0
        total = self.nbytes - freed + nbytes
        if total > self.budget_bytes:
            raise BudgetError(
                "snapshot",
                f"snapshot store budget {self.budget_bytes} bytes: holding {self.nbytes}, "
                f"a new snapshot of {nbytes} bytes would make {total}",
            )

    def find(self, tag: str, version: int | None = None) -> Snapshot | None:
        """The snapshot stored under exactly ``(tag, version)``, or ``None``."""
        return self._items.get((tag, version))

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
