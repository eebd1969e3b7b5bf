"""The manifest: ``manifest.json`` <-> frozen dataclasses, checked against one schema by one validator.

``manifest.json`` is written last and is the only description of the other files that is believed.
``loads`` is the one way in: it refuses a manifest over ``MAX_MANIFEST_BYTES`` unread, JSON nested too
deeply, a ``seal`` (the crc32 of the canonical JSON of everything else) that does not match, and any field
that is not the schema -- the ``Spec`` tables (``_MANIFEST``, ``_SIZED``, ``_TENSOR``, ``_LAYOUT``, ``_SLOT``,
``_MEMBER``), each field through ``_valid`` -- with ``CheckpointError("corrupt")`` naming the field. Consistency is
part of the schema: ``world_size`` ranks each holding every group, each group's file a safetensors file of the
checkpoint holding each slot's record typed or as raw ``U8`` bytes, tensors without gaps up to the file's size,
members inside their slot. A layout of another ``format`` (``dcp``: with ``dcp_tensors``) is kept as JSON.
Work is linear in the manifest's size whoever resealed it: shapes are bounded (``MAX_RANK``, ``MAX_DIM``)
before any product of them, and error messages are built from bounded values.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from zlib_ng.zlib_ng import crc32

from ..core.layout import Layout, dtype_of
from ..core.slot import MemberInfo, SlotInfo
from ..errors import CheckpointError, LayoutError, show
from .format import (
    DTYPE_NAMES,
    DTYPES,
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_RANK,
    FileEntry,
    TensorEntry,
    crc_text,
    is_utf8,
    load_json,
    open_regular,
    without_gc,
)

FORMAT_NAME = "stateshift-checkpoint"
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
STATE_FORMAT = "stateshift-state/1"
DCP_FORMAT = "dcp"
DCP_METADATA = ".metadata"
MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest read (about 150,000 tensors); a larger one is refused before it is read."""
MAX_META_DEPTH = 16
_MAX_INT = 1 << 62


class _Bad(ValueError):
    """A schema violation at a field (turned into ``CheckpointError("corrupt")`` once, in ``loads``)."""


class _TooLarge(_Bad):
    """A list over a cap (``MAX_RANK``): refused before the seal is computed, whose cost grows with the input."""


@dataclass(frozen=True)
class StoredSlot:
    """A slot as stored: its fingerprint, the tensor holding its bytes, and how (typed or raw ``U8``)."""

    info: SlotInfo
    record: str
    typed: bool


@dataclass(frozen=True)
class StoredGroup:
    """One group of one rank: the file holding it and its slots."""

    file: str
    slots: tuple[StoredSlot, ...]

    def layout(self) -> Layout:
        return Layout.build(tuple(s.info for s in self.slots))


@dataclass(frozen=True)
class DcpTensor:
    """A tensor of a ``save_dcp`` checkpoint as its manifest records it (global shape, torch dtype name)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Manifest:
    """A decoded manifest. ``layout`` is the layout as stored (JSON); ``ranks`` the same, typed,
    for a model-state checkpoint; ``dcp_tensors`` the tensors of a ``save_dcp`` checkpoint.

    ``ranks`` is derived from ``layout`` and ``files`` when first asked for: ``loads`` asks at once
    (a manifest read from disk is checked whole before it is used), while the manifest a save hands
    back, built from the values it wrote, is not decoded again unless someone looks."""

    backend: str
    layout: Mapping[str, Any]
    files: Mapping[str, FileEntry]
    tag: str | None = None
    version: int | None = None
    extra: Mapping[str, str] = field(default_factory=dict)
    total_bytes: int = 0
    library_version: str = ""
    torch_version: str = ""
    created: str = ""
    created_unix: float = 0.0
    dcp_tensors: Mapping[str, DcpTensor] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = "crc32"

    @functools.cached_property
    def ranks(self) -> tuple[Mapping[str, StoredGroup], ...]:
        try:
            return self._ranks()
        except _Bad as e:  # (only a manifest that was not read through ``loads``)
            raise CheckpointError("corrupt", f"malformed manifest: {e}", path=MANIFEST_NAME) from None

    def _ranks(self) -> tuple[Mapping[str, StoredGroup], ...]:
        """``ranks`` from ``layout`` and ``files``; ``_Bad`` where they disagree."""
        return _state(self.layout, self.files) if self.kind == STATE_FORMAT else ()

    @property
    def kind(self) -> Any:
        """``layout["format"]``: ``STATE_FORMAT``, ``DCP_FORMAT`` or whatever else the writer chose."""
        return self.layout.get("format")

    @property
    def world_size(self) -> int:
        return int(self.layout.get("world_size", 1))

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON (without its seal): the fields ``_MANIFEST`` lists, in its order."""
        out: dict[str, Any] = {"format": FORMAT_NAME, **{k: getattr(self, k) for k, _ in _MANIFEST[1:]}}
        out.update(extra=dict(self.extra), files={name: _file_json(e) for name, e in self.files.items()})
        if self.kind == DCP_FORMAT:
            out["dcp_tensors"] = {n: {"shape": list(t.shape), "dtype": t.dtype} for n, t in self.dcp_tensors.items()}
        return out


def _file_json(e: FileEntry) -> dict[str, Any]:
    d: dict[str, Any] = {"bytes": e.bytes, "checksum": e.checksum}
    if e.header is not None:
        d["header"] = {"bytes": e.header[0], "checksum": crc_text(e.header[1])}
        d["tensors"] = [
            {
                "name": t.name,
                "dtype": DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [t.start, t.start + t.nbytes],
                "checksum": crc_text(t.crc32),
            }
            for t in e.tensors
        ]
    return d


# --------------------------------------------------------------------------- writing


def make(
    *,
    backend: str,
    layout: Mapping[str, Any],
    files: Mapping[str, FileEntry],
    tag: str | None,
    version: int | None,
    extra: Mapping[str, str],
    dcp_tensors: Mapping[str, DcpTensor] | None = None,
) -> Manifest:
    """A new manifest, stamped with the library and torch versions and the time."""
    now = time.time()
    return Manifest(
        backend=backend,
        layout=dict(layout),
        files=dict(files),
        tag=tag,
        version=version,
        extra=dict(extra),
        total_bytes=sum(t.nbytes for e in files.values() for t in e.tensors) or sum(e.bytes for e in files.values()),
        library_version=str(getattr(sys.modules.get("stateshift"), "__version__", "unknown")),
        torch_version=str(torch.__version__),
        dcp_tensors=dict(dcp_tensors or {}),
        created=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z",
        created_unix=now,
    )


def _seal_of(d: Mapping[str, Any]) -> str:
    """The crc32 of the canonical JSON of every field but ``seal``."""
    rest = {k: v for k, v in d.items() if k != "seal"}
    return crc_text(zlib.crc32(json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()))


def seal(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with its ``seal`` (``_seal_of``)."""
    d["seal"] = _seal_of(d)
    return d


@without_gc
def dumps(manifest: Manifest) -> bytes:
    """The bytes of ``manifest.json`` (sealed; compact, which keeps to json's C encoder: ``stateshift inspect``
    or ``python -m json.tool`` print it for people)."""
    return json.dumps(seal(manifest.to_json()), separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def stored_as(info: SlotInfo) -> tuple[str, torch.dtype, tuple[int, ...], bool]:
    """The tensor a slot is stored as, ``(name, dtype, shape, typed)``: typed, its one member under its own name
    when it is one plain tensor of a safetensors dtype; else its storage's raw bytes (``U8``) under the slot's name."""
    if info.covers_storage and (dtype := dtype_of(info.members[0].dtype)) in DTYPE_NAMES:  # (one member, then)
        return info.members[0].name, dtype, info.members[0].shape, True
    return info.name, torch.uint8, (info.nbytes,), False


@without_gc
def rank_json(rank: int, groups: Mapping[str, tuple[str, Layout]]) -> dict[str, Any]:
    """One rank's part of a model-state layout: per group, its file and its slots."""
    out = {}
    for group, (fname, layout) in groups.items():
        slots = []
        for info in layout.slots:
            record, _, _, typed = stored_as(info)
            members = [
                {
                    "name": m.name,
                    "shape": list(m.shape),
                    "dtype": m.dtype,
                    "stride": list(m.stride),
                    "offset": m.offset,
                    "meta": _storable(m, info.name)[0],
                }
                for m in info.members
            ]
            slots.append(
                {"slot": info.name, "nbytes": info.nbytes, "record": record, "typed": typed, "members": members}
            )
        out[group] = {"file": fname, "slots": slots}
    return {"rank": rank, "groups": out}


def as_stored(layout: Layout) -> Layout:
    """The model's layout as a manifest would give it back (``meta`` through JSON), to compare with one."""
    if not any(m.meta for s in layout.slots for m in s.members):
        return layout
    return Layout.build(
        tuple(
            SlotInfo(
                s.name,
                s.group,
                s.nbytes,
                tuple(MemberInfo(m.name, m.shape, m.dtype, m.stride, m.offset, _storable(m)[1]) for m in s.members),
            )
            for s in layout.slots
        )
    )


def _storable(m: MemberInfo, slot: str = "") -> tuple[Any, Any]:
    """``m``'s meta as a manifest stores it (JSON) and as a load gives it back, its names and meta checked with the
    reader's own rules first (text that is not UTF-8, meta nested too deeply or holding NaN): a save must never
    commit a manifest that no load accepts. ``LayoutError("checkpoint_mismatch")`` if no checkpoint can hold it."""
    field = "layout"
    try:
        _valid(m.name, "str", "its name")
        _valid(slot, "str", "its slot's name")
        field = "meta"
        stored = _meta_json(m.meta or ())
        return stored, _meta(stored, "its meta")
    except _Bad as e:
        raise LayoutError(
            "checkpoint_mismatch", f"cannot be stored in a checkpoint: {e}", tensor=m.name, field=field
        ) from None


def _meta_json(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_meta_json(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _meta_json(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        raise _Bad(f"meta holds {x} (JSON has no such number)")
    return x if x is None or isinstance(x, (bool, int, float, str)) else str(x)


# --------------------------------------------------------------------------- reading: one validator

_INT_ONLY, _HEX, _ABSENT = {int}, frozenset("0123456789abcdef"), object()
_TOPS = {"shape": MAX_DIM, "stride": _MAX_INT, "ints": _MAX_INT}
_TYPES = {"bool": bool, "list": list, "dict": dict}
_LOWEST = {"int": 0, "signed": 1 - _MAX_INT, "number": 1 - _MAX_INT}  # (a huge int would overflow float())


def _all_ints(v: list[Any], top: int) -> bool:
    """Every value a non-negative int below ``top``, checked in C."""
    return not v or (set(map(type, v)) == _INT_ONLY and min(v) >= 0 and max(v) < top)


def _valid(v: Any, kind: str, where: str, key: str = "") -> Any:
    """The one validator of the schema: ``v`` as a value of ``kind``, normalised (shapes as tuples, a checksum as
    its int, a safetensors dtype name as its ``torch.dtype``, meta as tuples), or ``_Bad`` naming the field
    (``where.key``, built only then). A ``kind`` ending in ``?`` may also be null or absent."""
    if kind[-1] == "?":
        if v is None or v is _ABSENT:
            return None
        kind = kind[:-1]
    if kind == "str":
        ok = isinstance(v, str) and (v.isascii() or is_utf8(v))
    elif kind in _LOWEST:
        ok = (type(v) is int and _LOWEST[kind] <= v < _MAX_INT) or (kind == "number" and type(v) is float)
    elif kind in _TYPES:
        ok = type(v) is _TYPES[kind]
    elif kind in _TOPS:
        if type(v) is list and (len(v) <= MAX_RANK or kind == "ints") and _all_ints(v, _TOPS[kind]):
            return tuple(v)
        ok = False
    elif kind == "crc":
        if type(v) is str and len(v) == 14 and v.startswith("crc32:") and _HEX.issuperset(v[6:]):
            return int(v[6:], 16)
        ok = False
    elif kind == "dtype":
        if type(v) is str and v in DTYPES:
            return DTYPES[v]
        ok = False
    elif kind == "torch_dtype":  # (a member keeps its torch dtype's name)
        try:
            ok = type(v) is str and dtype_of(v) is not None
        except KeyError:
            ok = False
    else:  # meta
        if type(v) is list:
            return _meta(v, f"{where}.{key}" if key else where) if v else ()
        ok = False
    if ok:
        return v
    raise _refusal(v, kind, f"{where}.{key}" if key else where)


def _refusal(v: Any, kind: str, at: str) -> _Bad:
    """What is wrong with ``v``, which ``_valid`` refused as a ``kind`` at ``at``."""
    if v is _ABSENT:
        return _Bad(f"{at} is missing")
    if kind in _TOPS and type(v) is list:
        if len(v) > MAX_RANK and kind != "ints":
            return _TooLarge(f"{at} has {len(v)} dimensions (at most {MAX_RANK})")
        i, x = next((i, x) for i, x in enumerate(v) if type(x) is not int or not 0 <= x < _TOPS[kind])
        return _Bad(f"dimension {i} of {at} is {show(x)}, not an integer in [0, 2**{_TOPS[kind].bit_length() - 1})")
    what = {
        "str": "valid UTF-8 text" if isinstance(v, str) else "a str",
        "int": "a non-negative int",
        "crc": "crc32:<8 hex digits>",
        "dtype": "a safetensors dtype",
        "torch_dtype": "a torch dtype",
    }.get(kind, "a list" if kind in _TOPS or kind == "meta" else f"a {kind}")
    return _Bad(f"{at} is not {what}: {show(v)}")


Spec = tuple[tuple[str, str], ...]
"""The fields of one object of the schema: ``(key, kind)``; a kind ending in ``?`` may be null or absent."""


def _spec(fields: str) -> Spec:
    """A ``Spec`` written as ``"key:kind key:kind ..."``."""
    return tuple((key, kind) for key, _, kind in (f.partition(":") for f in fields.split()))


_TENSOR = _spec("name:str dtype:dtype shape:shape data_offsets:ints checksum:crc")
_MEMBER = _spec("name:str shape:shape dtype:torch_dtype stride:stride offset:int meta:meta")
_SLOT = _spec("slot:str nbytes:int typed:bool record:str members:list")
_SIZED = _spec("bytes:int checksum:crc")
_LAYOUT = _spec("groups:list world_size:int ranks:list")
_MANIFEST = _spec(  # (``Manifest``'s fields but ``dcp_tensors``, in the order ``to_json`` writes them)
    "format:str format_version:int backend:str tag:str? version:signed? extra:dict checksum_algorithm:str "
    "total_bytes:int library_version:str torch_version:str created:str created_unix:number files:dict layout:dict"
)


def _fields(d: Any, where: str, spec: Spec) -> list[Any]:
    """The values of the object ``d`` (``where`` names it) that ``spec`` lists, each through ``_valid``."""
    if type(d) is not dict:
        raise _Bad(f"{where} is not an object")
    return [_valid(d.get(key, _ABSENT), kind, where, key) for key, kind in spec]


def _meta(v: Any, where: str, depth: int = 0) -> Any:
    """JSON meta as tuples, at most ``MAX_META_DEPTH`` deep."""
    if depth > MAX_META_DEPTH:
        raise _Bad(f"{where} is nested deeper than {MAX_META_DEPTH} levels")
    if isinstance(v, list):
        return tuple(_meta(x, where, depth + 1) for x in v)
    if isinstance(v, dict):
        return tuple((_valid(k, "str", where), _meta(x, where, depth + 1)) for k, x in v.items())
    if isinstance(v, str):
        return _valid(v, "str", where)
    if v is None or type(v) in (bool, int, float):
        return v
    raise _Bad(f"{where} holds a {type(v).__name__}")


def check_file_name(name: Any, where: str = "file name") -> str:
    """A file of a checkpoint is a plain name inside it (``ValueError`` otherwise)."""
    _valid(name, "str", where)
    bad = (
        not name
        or name in (".", "..", MANIFEST_NAME)
        or len(name.encode()) > 255
        or (name.startswith(".") and name != DCP_METADATA)
        or any(c in name for c in "/\\\0")
    )
    if bad:
        raise _Bad(f"{where} {show(name)} is not a plain file name inside the checkpoint")
    return name


def _tensor(d: Any, where: str, size: int, name: str | None = None) -> TensorEntry:
    """A tensor entry of the manifest, or (``name`` given) of a safetensors header, which has no checksum."""
    if name is None:
        name, dtype, shape, offsets, crc = _fields(d, where, _TENSOR)
    else:
        (dtype, shape, offsets), crc = _fields(d, where, _TENSOR[1:4]), 0
    nbytes = math.prod(shape) * dtype.itemsize  # (bounded: at most MAX_RANK dimensions below MAX_DIM)
    if nbytes > size:
        raise _Bad(f"{where}: shape {show(list(shape))} holds more than the {size} bytes of its file")
    if len(offsets) != 2 or offsets[1] - offsets[0] != nbytes:
        raise _Bad(f"{where}.data_offsets do not hold {nbytes} bytes")
    return TensorEntry(name, dtype, shape, offsets[0], nbytes, crc)


def _file(name: str, d: Any, where: str) -> FileEntry:
    size, crc = _fields(d, where, _SIZED)
    if not name.endswith(".safetensors"):
        return FileEntry(size, crc)
    header, raw = _fields(d, where, (("header", "dict"), ("tensors", "list")))
    hsize, hcrc = _fields(header, f"{where}.header", _SIZED)
    tensors = tuple(_tensor(t, f"{where}.tensors[{i}]", size) for i, t in enumerate(raw))
    bad = _extent_error(tensors, hsize, size)
    if bad is not None:
        raise _Bad(f"{where}: {bad[0]}")
    if not 8 <= hsize <= MAX_HEADER_BYTES or len({t.name for t in tensors}) != len(tensors):
        raise _Bad(f"{where}: header size {hsize} impossible (or a tensor name repeats)")
    return FileEntry(size, crc, (hsize, hcrc), tensors)


def _member(d: Any, where: str) -> MemberInfo:
    name, shape, dtype, stride, offset, meta = _fields(d, where, _MEMBER)
    if len(stride) != len(shape):
        raise _Bad(f"{where}: stride and shape differ in length")
    return MemberInfo(name, shape, dtype, stride, offset, meta)


def _slot(group: str, d: Any, stored: Mapping[str, TensorEntry], where: str) -> StoredSlot:
    name, nbytes, typed, record, raw = _fields(d, where, _SLOT)
    members = tuple(_member(m, f"{where}.members[{k}]") for k, m in enumerate(raw))
    if not members:
        raise _Bad(f"{where}.members is empty")
    info = SlotInfo(name, group, nbytes, members)
    want = (dtype_of(members[0].dtype), members[0].shape) if typed else (torch.uint8, (info.nbytes,))
    t = stored.get(record)
    if t is None or (t.dtype, t.shape) != want or (typed and not info.covers_storage):
        raise _Bad(
            f"{where}: its record {show(record)} is not stored in the group's file as {want[0]} {show(list(want[1]))}"
        )
    if not typed:  # (a typed slot's one member covers it exactly)
        for k, m in enumerate(members):
            if (bad := _outside(m, info.nbytes)) is not None:
                raise _Bad(f"{where}.members[{k}] ({show(m.name)}): {bad}")
    return StoredSlot(info, record, typed)


def _outside(m: MemberInfo, nbytes: int) -> str | None:
    """Why member ``m`` (its values bounded by ``_member``) does not lie inside a slot of ``nbytes`` bytes, aligned
    to its element size; ``None`` if it does. (A load would refuse it against the model's layout anyway;
    ``verify`` and ``inspect`` have no model to compare with.)"""
    itemsize = dtype_of(m.dtype).itemsize
    if 0 in m.shape:  # (no bytes: nothing of the slot is read for it)
        return None
    if m.offset % itemsize:
        return f"offset {m.offset} is not a multiple of its element size ({itemsize})"
    end = m.offset + (sum((n - 1) * st for n, st in zip(m.shape, m.stride, strict=True)) + 1) * itemsize
    if end > nbytes:
        return f"its bytes [{m.offset}, {end}) lie outside its slot of {nbytes} bytes"
    return None


def _state(layout: Any, files: Mapping[str, FileEntry]) -> tuple[dict[str, StoredGroup], ...]:
    groups, world, ranks = _fields(layout, "layout", _LAYOUT)
    groups = [_valid(g, "str", "layout.groups[]") for g in groups]
    if world < 1 or len(ranks) != world:
        raise _Bad(f"layout.world_size is {world} but layout.ranks holds {len(ranks)} ranks")
    out = []
    for i, r in enumerate(ranks):
        where = f"layout.ranks[{i}]"
        rank, stored = _fields(r, where, (("rank", "int"), ("groups", "dict")))
        if rank != i or sorted(stored) != sorted(groups):
            raise _Bad(f"{where} is not rank {i} holding the groups {show(groups)}")
        decoded = {}
        for g in groups:
            gw = f"{where}.groups[{show(g)}]"
            fname, slots = _fields(stored[g], gw, (("file", "str"), ("slots", "list")))
            entry = files.get(fname)
            if entry is None or entry.header is None:
                raise _Bad(f"{gw}.file {show(fname)} is not a safetensors file of this checkpoint")
            by_name = {t.name: t for t in entry.tensors}
            decoded[g] = StoredGroup(
                fname, tuple(_slot(g, s, by_name, f"{gw}.slots[{j}]") for j, s in enumerate(slots))
            )
            names = [m.name for s in decoded[g].slots for m in s.info.members]
            records = [s.record for s in decoded[g].slots]
            if len(set(names)) != len(names) or len(set(records)) != len(records):
                raise _Bad(f"{gw}: a tensor name repeats, or two slots name one record")
        out.append(decoded)
    return tuple(out)


def _dcp(tensors: Any) -> dict[str, DcpTensor]:
    out = {}
    for name, t in _valid(tensors, "dict", "manifest.dcp_tensors").items():
        where = f"dcp_tensors[{show(name)}]"
        _valid(name, "str", where)
        shape, dtype = _fields(t, where, (("shape", "shape"), ("dtype", "torch_dtype")))
        if math.prod(shape) * dtype_of(dtype).itemsize >= _MAX_INT:
            raise _Bad(f"{where}: shape {show(list(shape))} holds more than 2**62 bytes")
        out[name] = DcpTensor(shape, dtype)
    return out


def _decode(d: Any) -> Manifest:
    v = dict(zip([k for k, _ in _MANIFEST], _fields(d, "manifest", _MANIFEST), strict=True))
    if v.pop("format") != FORMAT_NAME or v["checksum_algorithm"] != "crc32":
        raise _Bad(f"not a {FORMAT_NAME} manifest with crc32 checksums")
    if v["format_version"] != FORMAT_VERSION:
        raise _Bad(f"format_version {v['format_version']}: this stateshift reads format {FORMAT_VERSION} only")
    kind = v["layout"].get("format")
    if kind == DCP_FORMAT and _fields(v["layout"], "layout", (("world_size", "int"),))[0] < 1:
        raise _Bad("layout.world_size is 0")
    if kind not in (STATE_FORMAT, DCP_FORMAT):
        _meta(v["layout"], "layout")
    v["files"] = {check_file_name(n, "files"): _file(n, f, f"files[{show(n)}]") for n, f in v["files"].items()}
    v["extra"] = {_valid(k, "str", "extra"): _valid(x, "str", f"extra[{show(k)}]") for k, x in v["extra"].items()}
    v["created_unix"] = float(v["created_unix"])
    v["dcp_tensors"] = _dcp(d.get("dcp_tensors")) if kind == DCP_FORMAT else {}
    return Manifest(**v)


# --------------------------------------------------------------------------- a data file against its entry


@without_gc
def parse_header(raw: bytes, file_size: int, path: str) -> tuple[TensorEntry, ...]:
    """The tensors a safetensors header (the 8-byte length and the JSON) describes, in file order, each entry
    through the manifest's validator and checked against the file's size (``crc32`` 0: a header has none)."""
    if len(raw) < 8 or struct.unpack("<Q", raw[:8])[0] + 8 != len(raw) or len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(
            "corrupt", f"file truncated or header length impossible for a {file_size}-byte file", path=path
        )
    header = load_json(raw[8:], path, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError("corrupt", "safetensors header is not a JSON object", path=path)
    header.pop("__metadata__", None)
    found = []
    for name, ent in header.items():
        try:
            found.append(_tensor(ent, "the entry", file_size, name))
        except _Bad as e:
            raise CheckpointError(
                "corrupt", f"bad header entry for tensor {show(name)}: {e}", path=path, tensor=name
            ) from None
    found.sort(key=lambda t: (t.start, t.nbytes))
    bad = _extent_error(found, len(raw), file_size)
    if bad is not None:
        raise CheckpointError("corrupt", bad[0], path=path, tensor=bad[1])
    return tuple(found)


def _extent_error(tensors: Sequence[TensorEntry], header_bytes: int, file_size: int) -> tuple[str, str | None] | None:
    """Why ``tensors`` (in file order) after ``header_bytes`` do not fill a ``file_size``-byte file without gaps:
    ``(what, the tensor at fault or None)``, or ``None``."""
    pos = 0
    for t in tensors:
        if t.start != pos:
            return f"tensor {show(t.name)} starts at {t.start}, expected {pos} (gap or overlap)", t.name
        pos += t.nbytes
    if header_bytes + pos != file_size:
        what = "truncated" if header_bytes + pos > file_size else "trailing bytes"
        return f"header and tensors describe {header_bytes + pos} bytes, the file holds {file_size} ({what})", None
    return None


def check_file(fd: int, size: int, entry: FileEntry, path: str, checked: bytes | None = None) -> bytes | None:
    """Raise ``CheckpointError("corrupt")`` unless the open file's size and header are exactly what
    ``entry`` records (header crc32 first, so a damaged header is never interpreted). Returns the
    header's bytes; a header identical to ``checked`` (bytes this check passed before) is not parsed again."""
    if size != entry.bytes:
        what = "truncated" if size < entry.bytes else "longer than recorded"
        raise CheckpointError("corrupt", f"file {what}: {size} bytes, manifest says {entry.bytes}", path=path)
    if entry.header is None:
        return None
    raw = os.pread(fd, entry.header[0], 0)
    if raw == checked:
        return raw
    if len(raw) != entry.header[0] or crc32(raw) != entry.header[1]:
        raise CheckpointError(
            "corrupt", "header checksum mismatch: the header is not the one the manifest records", path=path
        )
    found = parse_header(raw, size, path)
    want = tuple((t.name, t.dtype, t.shape, t.start) for t in entry.tensors)
    if tuple((t.name, t.dtype, t.shape, t.start) for t in found) != want:
        raise CheckpointError("corrupt", "header describes other tensors than the manifest records", path=path)
    return raw


@without_gc
def loads(raw: bytes, path: str) -> Manifest:
    """Decode the bytes of ``manifest.json`` (``path`` names it in errors); see the module doc."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError("corrupt", f"manifest is larger than {MAX_MANIFEST_BYTES} bytes", path=path)
    d = load_json(raw, path, "manifest")
    if not isinstance(d, dict):
        raise CheckpointError("corrupt", "manifest is not a JSON object", path=path)
    bad: _Bad | None = None
    try:  # decoded first: a field over a cap is refused at once, without the seal's pass over everything
        manifest = _decode(d)
        manifest.__dict__["ranks"] = manifest._ranks()  # (the cached property's value, checked now)
    except _TooLarge as e:
        raise CheckpointError("corrupt", f"malformed manifest: {e}", path=path) from None
    except _Bad as e:
        bad = e
    try:
        expected = _seal_of(d)
    except (RecursionError, ValueError):
        raise CheckpointError("corrupt", "manifest is nested too deeply (or holds NaN)", path=path) from None
    if d.get("seal") != expected:  # (damage is said as damage, before what it broke)
        raise CheckpointError("corrupt", "manifest does not match its seal (damaged or edited)", path=path)
    if bad is not None:
        raise CheckpointError("corrupt", f"malformed manifest: {bad}", path=path) from None
    return manifest


def read(root: os.PathLike[str]) -> Manifest:
    """Read and decode ``manifest.json`` of the directory ``root``; ``FileNotFoundError`` if there is none."""
    with open_regular(root, MANIFEST_NAME) as (fd, size, path):
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError("corrupt", f"manifest is larger than {MAX_MANIFEST_BYTES} bytes ({size})", path=path)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return loads(f.read(MAX_MANIFEST_BYTES + 1), path)  # loads refuses one that grew past the limit
