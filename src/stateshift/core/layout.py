"""Layouts: where each slot of a group sits in one flat byte arena, and the one compatibility check.

A ``Layout`` places a group's slots in one arena: slots of at least
``SMALL_BYTES`` first, then the small ones packed together (so the copy
engine can move them as one staged transfer), every slot aligned to
``ALIGN`` bytes. Homes and snapshots of a group share its layout, which is
what makes a snapshot of an offloaded group a pointer copy (copy-on-write).

``Layout.check_compatible`` is the only place that decides whether values
laid out one way fit a model laid out another: ``restore``, ``swapped`` and
checkpoint ``load`` all call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LayoutError
from .slot import MemberInfo, SlotInfo
from .transfer import SMALL_BYTES

ALIGN = 64

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named as in a fingerprint (``"bfloat16"``); ``KeyError`` if unknown."""
    return _DTYPES[name]


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

    def check_compatible(self, expected: Layout, *, source: str = "snapshot", cast: bool = False) -> frozenset[int]:
        """Raise ``LayoutError("mismatch")`` naming the first tensor where ``self`` (the model now) differs.

        ``expected`` is how the values were laid out when they were taken
        (a snapshot's layout, or one decoded from a checkpoint manifest);
        ``source`` names it in messages. With ``cast``, a dtype difference
        is allowed for slots holding one plain tensor (one member covering
        its storage, contiguous) in both layouts: their indices in ``self``
        are returned, and their byte counts may differ. Nothing else may
        differ: names, shapes, strides, offsets, sharding ``meta``, which
        tensors share a storage, storage sizes.
        """
        if self.slots == expected.slots:
            return frozenset()
        have = {m.name: (i, m) for i, s in enumerate(self.slots) for m in s.members}
        want = {m.name: (s, m) for s in expected.slots for m in s.members}
        casting: set[int] = set()
        for name, (ws, wm) in want.items():
            if name not in have:
                raise LayoutError(
                    "mismatch",
                    f"in the {source} (group {ws.group!r}) but not in the model",
                    tensor=name,
                    field="missing",
                )
            i, hm = have[name]
            if _member_differs(name, hm, wm, source, cast and self.slots[i].covers_storage and ws.covers_storage):
                casting.add(i)
        for name, (i, _) in have.items():
            if name not in want:
                raise LayoutError(
                    "mismatch",
                    f"in the model (group {self.slots[i].group!r}) but not in the {source}",
                    tensor=name,
                    field="extra",
                )
        self._check_sharing(expected, source, casting)
        return frozenset(casting)

    def _check_sharing(self, expected: Layout, source: str, casting: set[int]) -> None:
        """Same storages holding the same members, of the same sizes (cast slots excepted)."""
        if len(self.slots) != len(expected.slots):
            raise LayoutError(
                "mismatch",
                f"storage sharing differs: the model has {len(self.slots)} storages, the {source} {len(expected.slots)} "
                "(tied or shared tensors differ)",
                tensor=self.slots[0].name if self.slots else "(none)",
                field="sharing",
            )
        by_first = {s.members[0].name: s for s in expected.slots if s.members}
        for i, hs in enumerate(self.slots):
            ws = by_first.get(hs.members[0].name) if hs.members else None
            if ws is None or [m.name for m in hs.members] != [m.name for m in ws.members]:
                theirs = [m.name for m in ws.members] if ws is not None else "another grouping"
                raise LayoutError(
                    "mismatch",
                    f"storage sharing differs: the model's storage holds {[m.name for m in hs.members]}, the {source}'s {theirs}",
                    tensor=hs.name,
                    field="sharing",
                )
            if i not in casting and hs.nbytes != ws.nbytes:
                raise LayoutError(
                    "mismatch",
                    f"storage holds {hs.nbytes} bytes in the model, {ws.nbytes} in the {source}",
                    tensor=hs.name,
                    field="nbytes",
                )


def _member_differs(name: str, have: MemberInfo, want: MemberInfo, source: str, castable: bool) -> bool:
    """Raise on the first field that differs; ``True`` when only the dtype differs and a cast is allowed."""
    if have.shape != want.shape:
        raise LayoutError(
            "mismatch",
            f"shape is {list(have.shape)} in the model but {list(want.shape)} in the {source}",
            tensor=name,
            field="shape",
        )
    cast = False
    if have.dtype != want.dtype:
        if not castable:
            raise LayoutError(
                "mismatch",
                f"dtype is {have.dtype} in the model but {want.dtype} in the {source}",
                tensor=name,
                field="dtype",
            )
        cast = True
    elif have.stride != want.stride or have.offset != want.offset:
        field = "stride" if have.stride != want.stride else "offset"
        raise LayoutError(
            "mismatch",
            f"{field} is {getattr(have, field)} in the model but {getattr(want, field)} in the {source}",
            tensor=name,
            field=field,
        )
    if have.meta != want.meta:
        raise LayoutError(
            "mismatch", f"meta is {have.meta} in the model but {want.meta} in the {source}", tensor=name, field="meta"
        )
    return cast
