"""The manifest of one published version: which tensors, where their bytes are, checked before use.

A manifest is plain JSON written by the publisher once, before the version
becomes visible, and never changed. A receiver trusts nothing in it: every
file name must be a bare name of the kind the transport uses (no path, no
``..``), every dtype one torch knows, every tensor's extent inside its part's
bytes; anything else is a ``SyncError("mailbox")`` raised before any byte is mapped
or read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...core.layout import dtype_of
from ...core.snapshot import SnapshotPart
from ...errors import SyncError

#: Bare names a shared_host part's file may have: a shared ``HostPool`` block.
POOL_FILE = re.compile(r"stateshift-pool-\d{1,10}-[0-9a-f]{1,32}-\d{1,12}")
#: Limits a receiver holds a manifest to before it believes it.
MAX_MANIFEST_BYTES = 64 << 20  # 100,000 tensors take about 15 MB; parsing 64 MB takes about a second
MAX_NAME_CHARS = 4096
MAX_DIMS = 64


@dataclass(frozen=True)
class TensorEntry:
    """One named tensor: its dtype, shape, stride (elements) and byte offset inside its part.

    ``aggregate``: a tensor whose bytes hold other listed tensors (a Megatron flat ``param_data`` beside
    the parameters inside it). Receivers skip aggregates: their bytes arrive through their members."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    aggregate: bool = False

    @property
    def extent(self) -> int:
        """Bytes from ``offset`` to one past the tensor's last element."""
        if any(s == 0 for s in self.shape):
            return 0
        last = sum((n - 1) * st for n, st in zip(self.shape, self.stride, strict=True))
        return (last + 1) * dtype_of(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize

    def view(self, arena: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of ``arena`` (the part's bytes, uint8)."""
        dtype = dtype_of(self.dtype)
        if arena.storage_offset() % dtype.itemsize:
            raise ValueError(f"tensor {self.name!r}: its part does not start at a multiple of {dtype.itemsize} bytes")
        typed = arena[: arena.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        return typed.as_strided(self.shape, self.stride, typed.storage_offset() + self.offset // dtype.itemsize)


@dataclass(frozen=True)
class PartEntry:
    """One group's bytes: a file (``shared_host``), an IPC handle (``cuda_ipc``) or a span of a broadcast."""

    group: str
    size: int
    tensors: tuple[TensorEntry, ...]
    file: str | None = None
    ipc: dict[str, Any] | None = None
    offset: int = 0
    #: with the manifest's ``base``: the indices (in ``tensors``) of the tensors whose bytes differ from it
    changed: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Manifest:
    """Everything a receiver needs to find version ``version``'s tensors.

    ``base``: a delta publisher's previous version (same names, shapes, dtypes and offsets); each part's
    ``changed`` then lists the tensors whose bytes differ from it, compared byte for byte."""

    version: int
    transport: str
    parts: tuple[PartEntry, ...]
    base: int | None = None

    @property
    def delta_bytes(self) -> int | None:
        """Bytes of the tensors that changed since ``base`` (``None`` without a base)."""
        if self.base is None:
            return None
        return sum(p.tensors[i].nbytes for p in self.parts for i in (p.changed or ()) if not p.tensors[i].aggregate)

    @property
    def nbytes(self) -> int:
        return sum(p.size for p in self.parts)

    def names(self) -> list[str]:
        """The tensors a receiver gets (aggregates left out)."""
        return [t.name for _, t in self.entries()]

    def entries(self) -> Iterator[tuple[PartEntry, TensorEntry]]:
        """``(part, tensor)`` for every tensor a receiver gets (aggregates left out)."""
        for p in self.parts:
            for t in p.tensors:
                if not t.aggregate:
                    yield p, t

    def to_json(self) -> bytes:
        parts = [
            {
                "group": p.group,
                "size": p.size,
                "file": p.file,
                "ipc": p.ipc,
                "offset": p.offset,
                "changed": None if p.changed is None else list(p.changed),
                "tensors": json.dumps(
                    [[t.name, t.dtype, list(t.shape), list(t.stride), t.offset, int(t.aggregate)] for t in p.tensors]
                ),
            }
            for p in self.parts
        ]
        return json.dumps(
            {"version": self.version, "transport": self.transport, "base": self.base, "parts": parts}
        ).encode()

    @staticmethod
    def parse(raw: bytes, where: str) -> Manifest:
        """A manifest from its JSON, every field checked (``SyncError("mailbox")`` naming ``where`` and the field).

        A part's ``tensors`` is JSON text inside the JSON: the same text as a part parsed before gives back
        the same entries without parsing or checking them again (``_checked_tensors``)."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise SyncError("mailbox", f"{len(raw)} bytes, more than {MAX_MANIFEST_BYTES}", path=where, field="size")
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise SyncError("mailbox", str(exc)[:200], path=where, field="json") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("parts"), list):
            raise SyncError("mailbox", "not a JSON object with a list of parts", path=where, field="parts")
        version, transport, base = obj.get("version"), obj.get("transport"), obj.get("base")
        if (
            not _is_int(version)
            or not isinstance(transport, str)
            or not (base is None or _is_int(base) and base < version)
        ):
            raise SyncError(
                "mailbox", f"version {version!r} / transport {transport!r} / base {base!r}", path=where, field="version"
            )
        parts = tuple(_parse_part(p, where, i) for i, p in enumerate(obj["parts"]))
        if (
            (base is None) != all(p.changed is None for p in parts)
            or base is not None
            and any(p.changed is None for p in parts)
        ):
            raise SyncError(
                "mailbox",
                "a base needs the changed tensors of every part, and they need a base",
                path=where,
                field="changed",
            )
        seen: set[str] = set()
        for p in parts:
            for t in p.tensors:
                if t.name in seen:
                    raise SyncError("mailbox", "named twice", path=where, field=f"tensor {t.name!r}")
                seen.add(t.name)
        return Manifest(version=version, transport=transport, parts=parts, base=base)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_part(p: object, where: str, i: int) -> PartEntry:
    if not isinstance(p, dict):
        raise SyncError("mailbox", "not an object", path=where, field=f"part {i}")
    size, file, ipc, offset, group = p.get("size"), p.get("file"), p.get("ipc"), p.get("offset", 0), p.get("group")
    if not _is_int(size) or size < 0 or not _is_int(offset) or offset < 0 or not isinstance(group, str):
        raise SyncError("mailbox", f"size {size!r}, offset {offset!r}, group {group!r}", path=where, field=f"part {i}")
    if file is not None and (not isinstance(file, str) or POOL_FILE.fullmatch(file) is None):
        raise SyncError(
            "mailbox", f"{file!r} is not the bare name of a shared pool block", path=where, field=f"part {i} file"
        )
    if ipc is not None and not isinstance(ipc, dict):
        raise SyncError("mailbox", "not an object", path=where, field=f"part {i} ipc")
    text = p.get("tensors")
    if not isinstance(text, str):
        raise SyncError("mailbox", "not JSON text", path=where, field=f"part {i} tensors")
    tensors = _checked_tensors(text, where, size, f"part {i} tensors")
    if offset and any(offset % dtype_of(t.dtype).itemsize for t in tensors):
        raise SyncError(
            "mailbox", f"{offset} is not a multiple of its tensors' item sizes", path=where, field=f"part {i} offset"
        )
    changed = p.get("changed")
    if changed is not None and (
        not isinstance(changed, list) or not all(_is_int(i) and 0 <= i < len(tensors) for i in changed)
    ):
        raise SyncError("mailbox", "not a list of tensor indices", path=where, field=f"part {i} changed")
    return PartEntry(
        group=group,
        size=size,
        tensors=tensors,
        file=file,
        ipc=ipc,
        offset=offset,
        changed=None if changed is None else tuple(changed),
    )


#: a part's entries by the exact text of its ``tensors`` and the part's size, the most recently used last.
#: Versions of one model repeat the same text (what changes from one to the next -- the version, a
#: ``cuda_ipc`` part's handles -- is outside it): the same entries come back, the same tuple object, which lets
#: a receiver's copy plan (``copyplan.py``) know the layout without comparing it entry by entry. Equal text is
#: equal JSON with the same checks passed, so nothing a full parse refuses comes back this way.
_TENSORS: dict[tuple[str, int], tuple[TensorEntry, ...]] = {}
_TENSORS_MAX = 16


def _checked_tensors(text: str, where: str, size: int, field: str) -> tuple[TensorEntry, ...]:
    """The entries of a part's ``tensors`` text (a JSON list of ``[name, dtype, shape, stride, offset,
    aggregate]``), each checked against the part's ``size``."""
    key = (text, size)
    entries = _TENSORS.pop(key, None)
    if entries is None:
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise SyncError("mailbox", str(exc)[:200], path=where, field=field) from None
        if not isinstance(raw, list):
            raise SyncError("mailbox", "not a list", path=where, field=field)
        entries = tuple(_checked_tensor(t, where, size) for t in raw)
        while _TENSORS and len(_TENSORS) >= _TENSORS_MAX:
            del _TENSORS[next(iter(_TENSORS))]
    _TENSORS[key] = entries  # (re)inserted last: the most recently used
    return entries


#: entries already checked, by their exact fields and their part's size (versions of one model repeat
#: the same entries: a receiver checks each once, not once per version)
_CHECKED: dict[tuple[Any, ...], TensorEntry] = {}
_CHECKED_MAX = 1 << 18


def _checked_tensor(t: object, where: str, size: int) -> TensorEntry:
    if isinstance(t, list) and len(t) == 6 and isinstance(t[2], list) and isinstance(t[3], list):
        try:
            key = (t[0], t[1], *t[2], -1, *t[3], -1, t[4], t[5], size)
            hit = _CHECKED.get(key)
        except TypeError:  # an unhashable field: the full check says what
            key, hit = None, None
        if (
            hit is not None
            and all(type(x) is int for x in (*t[2], *t[3], t[4], t[5]))
            and type(t[0]) is str
            and type(t[1]) is str
        ):
            return hit
    else:
        key = None
    entry = _parse_tensor(t, where, size)
    if key is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[key] = entry
    return entry


def _parse_tensor(t: object, where: str, size: int) -> TensorEntry:
    if not isinstance(t, list) or len(t) != 6 or t[5] not in (0, 1) or type(t[5]) is not int:
        raise SyncError(
            "mailbox",
            f"{str(t)[:80]!r} is not [name, dtype, shape, stride, offset, aggregate]",
            path=where,
            field="tensor",
        )
    name, dtype, shape, stride, offset, aggregate = t
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise SyncError("mailbox", f"{str(name)[:80]!r}", path=where, field="tensor name")
    try:
        itemsize = dtype_of(dtype).itemsize if isinstance(dtype, str) else 0
    except KeyError:
        itemsize = 0
    if itemsize == 0:
        raise SyncError(
            "mailbox", f"{str(dtype)[:40]!r} is not a torch dtype", path=where, field=f"tensor {name!r} dtype"
        )
    dims_ok = isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride) <= MAX_DIMS
    if (
        not dims_ok
        or not all(_is_int(n) and 0 <= n < 1 << 48 for n in [*shape, *stride])
        or math.prod(shape) * itemsize >= 1 << 62  # (repeated bytes, stride 0: more elements than torch counts)
    ):
        raise SyncError(
            "mailbox", f"shape {str(shape)[:80]} stride {str(stride)[:80]}", path=where, field=f"tensor {name!r} shape"
        )
    if not _is_int(offset) or offset < 0 or offset % itemsize:
        raise SyncError(
            "mailbox",
            f"{offset!r} is not a non-negative multiple of {itemsize}",
            path=where,
            field=f"tensor {name!r} offset",
        )
    entry = TensorEntry(
        name=name, dtype=dtype, shape=tuple(shape), stride=tuple(stride), offset=offset, aggregate=bool(aggregate)
    )
    if offset + entry.extent > size:
        raise SyncError(
            "mailbox",
            f"bytes [{offset}, {offset + entry.extent}) past its part's {size}",
            path=where,
            field=f"tensor {name!r}",
        )
    return entry


def part_entry(
    part: SnapshotPart, *, file: str | None = None, ipc: dict[str, Any] | None = None, offset: int = 0
) -> PartEntry:
    """The manifest entry of one snapshot part: every member of every slot at its byte offset in the part."""
    tensors: list[TensorEntry] = []
    for slot, base in zip(part.layout.slots, part.layout.offsets, strict=True):
        members = [
            TensorEntry(
                name=m.name, dtype=m.dtype, shape=tuple(m.shape), stride=tuple(m.stride), offset=base + m.offset
            )
            for m in slot.members
        ]
        spans = [(t.offset, t.offset + t.extent) for t in members]
        for t, (a, b) in zip(members, spans, strict=True):  # holds another member and is larger than it: an aggregate
            holds = any(a <= c < d <= b and (c, d) != (a, b) for c, d in spans)  # (an empty member is held by nothing)
            tensors.append(replace(t, aggregate=True) if holds else t)
    return PartEntry(
        group=part.group, size=part.layout.total, tensors=tuple(tensors), file=file, ipc=ipc, offset=offset
    )


def diff(
    old: Manifest, old_arenas: list[torch.Tensor], new: Manifest, new_arenas: list[torch.Tensor]
) -> Manifest | None:
    """``new`` with ``base`` = ``old.version`` and, per part, the tensors whose bytes differ (compared exactly);
    ``None`` if the two are not laid out alike (then receivers copy everything)."""
    same = len(old.parts) == len(new.parts) and all(
        (a.group, a.size, a.tensors) == (b.group, b.size, b.tensors) for a, b in zip(old.parts, new.parts, strict=True)
    )
    if not same:
        return None
    parts = []
    for part, a, b in zip(new.parts, old_arenas, new_arenas, strict=True):
        changed = tuple(
            i
            for i, t in enumerate(part.tensors)
            if not torch.equal(a[t.offset : t.offset + t.extent], b[t.offset : t.offset + t.extent])
        )
        parts.append(replace(part, changed=changed))
    return replace(new, parts=tuple(parts), base=old.version)
