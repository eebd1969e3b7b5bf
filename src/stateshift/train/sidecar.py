"""The RL checkpoint's sidecar, ``rl_state.bin``: step, version, the rollout side's capture, extras.

A typed, versioned, checksummed format; nothing in it is unpickled, so a sidecar from anywhere runs no
code. Layout (format version 1; integers little-endian)::

    b"SSRLSIDE" | u32 format version | u64 body length | SHA-256 of the 20 bytes before it and the body | body
    body = u64 header length | header (UTF-8 JSON) | tensor bytes

The header holds ``step``, ``version``, ``extra`` (a flat mapping of JSON scalars), ``tensors`` (one
``[dtype, shape, offset, nbytes]`` per tensor, offsets into the tensor bytes) and ``capture`` (``null``, or
the ``RolloutCapture`` field by field, a tensor written as its index into ``tensors``, the Python ``random``
state as ``[3, [625 ints], gauss_next]``, torch generator states as uint8 tensors, task items as plain ints
or strings or as a registered dataclass: ``{"type": name, "fields": {...}}``, see ``ITEM_TYPES``).

Reading (``read_sidecar``) checks, before anything is parsed: a regular file inside the checkpoint
directory (no symbolic link, no FIFO), at most ``MAX_SIDECAR_BYTES``, the magic, a format version this
code reads, the length, the SHA-256. A single flipped bit anywhere, a truncation, a pickle: each is a
``CheckpointError("corrupt")`` naming the file. Then the header (at most ``MAX_HEADER_BYTES``) is decoded against the schema above,
every check bounded before it computes (rank <= 8, each size bounded by the bytes present, offsets inside
the tensor bytes, each tensor used once and all of them within the bytes present, integers within 64 bits), so a re-sealed hostile header is refused too, in bounded time and
memory, with a message of bounded size. A later format version adds fields under a new version number;
this reader refuses versions it does not know (naming the version) rather than guessing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stateshift.checkpoint import format as fmt
from stateshift.checkpoint.commit import describe_os_error, write_durable
from stateshift.errors import CheckpointError

from ..errors import show
from .executors.base import RolloutCapture
from .rollout import Group, Wave
from .tasks.addition import Problem

SIDECAR = "rl_state.bin"
#: what stateshift before format version 1 wrote (a torch pickle): never loaded
LEGACY_SIDECAR = "rl_state.pt"
MAGIC = b"SSRLSIDE"
FORMAT_VERSION = 1
#: magic, version, body length, SHA-256
PREFIX = struct.Struct("<8sIQ32s")
MAX_SIDECAR_BYTES = 1 << 30
#: the largest JSON header parsed (a run's header is well under 1 MiB: ~200 bytes per queued group)
MAX_HEADER_BYTES = 64 << 20
MAX_RANK = 8
_I64 = 2**63
#: task items that are dataclasses, by the name written for them (register a new task's item type here)
ITEM_TYPES: dict[str, type] = {"addition.Problem": Problem}
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
}
_CAPTURE_KEYS = {
    "version",
    "prompt_rng",
    "sample_rng",
    "next_uid",
    "wave",
    "queued",
    "running",
    "staleness_samples",
    "ledger",
    "orphans",
}
_GROUP_TENSORS = ("tokens", "mask", "logprobs", "versions", "rewards", "exact", "finished")
_WAVE_TENSORS = ("prompt_ids", "prompt_mask", "tokens", "logprobs", "versions", "done")
_LEDGER_COUNTS = ("admitted", "generated", "trained", "regenerated")


def register_item_type(name: str, cls: type) -> None:
    """Let the sidecar write and read task items of the dataclass ``cls`` (fields of ints, floats, strings,
    booleans or None) under ``name``. Items that are plain ints or strings need no registration."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    ITEM_TYPES[name] = cls


@dataclass
class Sidecar:
    """What a sidecar holds."""

    step: int
    version: int
    capture: RolloutCapture | None
    extra: dict[str, Any]


# --------------------------------------------------------------------------- writing


class _Writer:
    """Collects tensors (as raw bytes) while the header is built."""

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []
        self.chunks: list[bytes] = []
        self.offset = 0

    def tensor(self, t: torch.Tensor) -> int:
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _DTYPES.values():
            raise TypeError(f"the sidecar does not store {t.dtype} tensors")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        self.entries.append([str(t.dtype).removeprefix("torch."), list(t.shape), self.offset, len(raw)])
        self.chunks.append(raw)
        self.offset += len(raw)
        return len(self.entries) - 1


def _item_out(item: Any) -> Any:
    if isinstance(item, (int, str)) and not isinstance(item, bool):
        return item
    for name, cls in ITEM_TYPES.items():
        if type(item) is cls:
            return {"type": name, "fields": {f.name: getattr(item, f.name) for f in dataclasses.fields(cls)}}
    raise TypeError(
        f"a task item of type {type(item).__name__} cannot go into the sidecar: register it "
        "(stateshift.train.sidecar.register_item_type)"
    )


def _group_out(g: Group, w: _Writer) -> dict[str, Any]:
    return {
        "uid": g.uid,
        "item": _item_out(g.item),
        "prompt": list(g.prompt),
        **{k: w.tensor(getattr(g, k)) for k in _GROUP_TENSORS},
    }


def _wave_out(wave: Wave | None, w: _Writer) -> dict[str, Any] | None:
    if wave is None:
        return None
    return {
        "uids": list(wave.uids),
        "items": [_item_out(i) for i in wave.items],
        "n": wave.n,
        "step": wave.step,
        **{k: w.tensor(getattr(wave, k)) for k in _WAVE_TENSORS},
    }


def _capture_out(cap: RolloutCapture | None, w: _Writer) -> dict[str, Any] | None:
    if cap is None:
        return None
    version, internal, gauss = cap.prompt_rng
    return {
        "version": cap.version,
        "prompt_rng": [version, list(internal), gauss],
        "sample_rng": w.tensor(cap.sample_rng),
        "next_uid": cap.next_uid,
        "wave": _wave_out(cap.wave, w),
        "queued": [_group_out(g, w) for g in cap.queued],
        "running": cap.running,
        "staleness_samples": cap.staleness_samples,
        "ledger": cap.ledger,
        "orphans": [[uid, _item_out(item)] for uid, item in cap.orphans],
    }


def encode(step: int, version: int, capture: RolloutCapture | None, extra: dict[str, Any]) -> bytes:
    """The bytes of a sidecar (see the module docstring). ``TypeError``/``ValueError`` for what it cannot hold."""
    w = _Writer()
    header = {
        "step": step,
        "version": version,
        "extra": dict(extra),
        "capture": _capture_out(capture, w),
        "tensors": w.entries,
    }
    raw = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    body = struct.pack("<Q", len(raw)) + raw + b"".join(w.chunks)
    head = PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), b"")[:20]
    return head + hashlib.sha256(head + body).digest() + body


def write_sidecar(
    directory: Path, *, step: int, version: int, capture: RolloutCapture | None, extra: dict[str, Any]
) -> Path:
    """Write ``directory/rl_state.bin`` atomically and durably (temporary name, fsync, rename); returns its path."""
    path = Path(directory) / SIDECAR
    write_durable(path, encode(step, version, capture, extra))
    return path


# --------------------------------------------------------------------------- reading: the envelope


def _read_all(fd: int, size: int) -> bytes:
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 26), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _open(directory: Path) -> tuple[bytes, str]:
    """The sidecar's bytes and path, read as a regular file of ``directory`` of at most ``MAX_SIDECAR_BYTES``."""
    try:
        with fmt.open_regular(directory, SIDECAR) as (fd, size, path):
            if size > MAX_SIDECAR_BYTES:
                raise CheckpointError(
                    "corrupt", f"{size} bytes, more than a sidecar may hold ({MAX_SIDECAR_BYTES})", path=path
                )
            return _read_all(fd, size), path
    except FileNotFoundError:
        if os.path.lexists(directory / LEGACY_SIDECAR):
            raise CheckpointError(
                "incomplete",
                f"no {SIDECAR}; its {LEGACY_SIDECAR} is a torch pickle written "
                "by an older stateshift, which is never loaded (unpickling can run code): "
                "start a new run, or resume from a checkpoint this version wrote",
                path=directory,
            ) from None
        raise CheckpointError(
            "incomplete", f"no {SIDECAR} (it is written last: the save did not finish)", path=directory
        ) from None
    except OSError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError("read", describe_os_error(e), path=directory / SIDECAR, errno=e.errno) from e


def _body(data: bytes, path: str) -> bytes:
    """The verified body of the sidecar ``data``: magic, version, length and SHA-256 checked, nothing parsed."""
    if len(data) < PREFIX.size:
        raise CheckpointError(
            "corrupt", f"truncated: {len(data)} bytes, shorter than the {PREFIX.size}-byte prefix", path=path
        )
    magic, version, length, digest = PREFIX.unpack_from(data)
    if magic != MAGIC:
        what = "a torch/pickle file" if data[:1] == b"\x80" or data[:4] == b"PK\x03\x04" else "not an RL sidecar"
        raise CheckpointError(
            "corrupt", f"{what} (bad magic); never unpickled: a sidecar is {SIDECAR} format", path=path
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            "corrupt", f"format version {version}; this stateshift reads version {FORMAT_VERSION}", path=path
        )
    if length != len(data) - PREFIX.size:
        raise CheckpointError(
            "corrupt", f"truncated or extended: {len(data)} bytes, the prefix says {PREFIX.size + length}", path=path
        )
    body = data[PREFIX.size :]
    if hashlib.sha256(data[:20] + body).digest() != digest:
        raise CheckpointError("corrupt", "SHA-256 mismatch: the file changed after it was written", path=path)
    return body


def read_sidecar(directory: str | os.PathLike[str]) -> Sidecar:
    """Read and verify ``directory/rl_state.bin``.

    Returns:
        The sidecar; its tensors are fresh CPU tensors (safe to use at once).
    Raises:
        CheckpointError("corrupt"): damaged, truncated, a pickle, another format version, a header outside the schema
            (``path`` names the file). CheckpointError("incomplete"): no sidecar (a save that did not finish, or an old
            pickle sidecar). CheckpointError("read"): an OS error reading it.
    """
    directory = Path(os.path.abspath(directory))
    data, path = _open(directory)
    body = _body(data, path)
    if len(body) < 8 or (hlen := struct.unpack_from("<Q", body)[0]) > len(body) - 8:
        raise CheckpointError("corrupt", "the header length runs past the end of the file", path=path)
    if hlen > MAX_HEADER_BYTES:
        raise CheckpointError(
            "corrupt", f"a header of {hlen} bytes, more than a sidecar's may be ({MAX_HEADER_BYTES})", path=path
        )
    header = fmt.load_json(body[8 : 8 + hlen], path, "the header")
    return _Reader(path, memoryview(body)[8 + hlen :]).sidecar(header)


# --------------------------------------------------------------------------- reading: the schema


class _Reader:
    """Decodes a verified header against the schema; every failure is ``CheckpointError("corrupt")`` naming the file."""

    def __init__(self, path: str, payload: memoryview) -> None:
        self.path = path
        self.payload = payload
        self.entries: list[Any] = []
        #: tensors decoded so far: each at most once (the writer never shares one), so that the bytes
        #: materialised stay within the payload's size whatever a header says
        self.used: set[int] = set()
        self.taken = 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError("corrupt", f"header: {what}", path=self.path)

    def obj(self, v: Any, keys: set[str], what: str) -> dict[str, Any]:
        if not isinstance(v, dict) or set(v) != keys:
            got = sorted(v)[:12] if isinstance(v, dict) else type(v).__name__
            raise self.fail(f"{what} must be an object with keys {sorted(keys)}, not {show(got)}")
        return v

    def int(self, v: Any, what: str, lo: int = -_I64, hi: int = _I64 - 1) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise self.fail(f"{what} must be an integer in [{lo}, {hi}], not {show(v)}")
        return v

    def list(self, v: Any, what: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(f"{what} must be a list, not {show(v)}")
        return v

    def scalar(self, v: Any, what: str) -> Any:
        if v is None or isinstance(v, (bool, str)) or (isinstance(v, int) and -_I64 <= v < _I64):
            return v
        if isinstance(v, float) and math.isfinite(v):
            return v
        raise self.fail(
            f"{what} must be a JSON scalar (a string, a 64-bit integer, a finite number, a boolean or "
            f"null), not {show(v)}"
        )

    def sidecar(self, h: Any) -> Sidecar:
        h = self.obj(h, {"step", "version", "extra", "capture", "tensors"}, "the header")
        self.entries = self.list(h["tensors"], "tensors")
        extra = h["extra"]
        if not isinstance(extra, dict):
            raise self.fail(f"extra must be an object, not {show(extra)}")
        extra = {k: self.scalar(v, f"extra[{show(k)}]") for k, v in extra.items()}
        capture = None if h["capture"] is None else self.capture(h["capture"])
        return Sidecar(
            step=self.int(h["step"], "step", 0),
            version=self.int(h["version"], "version", 0),
            capture=capture,
            extra=extra,
        )

    def tensor(self, ref: Any, what: str, rank: int | None = None) -> torch.Tensor:
        """The tensor ``ref`` (an index into ``tensors``) names, checked before any size is computed."""
        i = self.int(ref, f"{what} (a tensor index)", 0, len(self.entries) - 1)
        if i in self.used:
            raise self.fail(f"tensors[{i}] ({what}) is referenced twice")
        self.used.add(i)
        entry = self.list(self.entries[i], f"tensors[{i}]")
        if len(entry) != 4 or entry[0] not in _DTYPES:
            raise self.fail(f"tensors[{i}] must be [dtype, shape, offset, nbytes] with a dtype of {sorted(_DTYPES)}")
        dtype, shape = _DTYPES[entry[0]], self.list(entry[1], f"tensors[{i}] shape")
        offset = self.int(entry[2], f"tensors[{i}] offset", 0, len(self.payload))
        nbytes = self.int(entry[3], f"tensors[{i}] nbytes", 0, len(self.payload) - offset)
        if len(shape) > MAX_RANK or (rank is not None and len(shape) != rank):
            raise self.fail(
                f"tensors[{i}] ({what}) has {len(shape)} dims, expected {rank if rank is not None else '<= 8'}"
            )
        dims = [self.int(d, f"tensors[{i}] shape", 0, len(self.payload)) for d in shape]
        numel = 0 if 0 in dims else 1
        for d in dims if numel else ():
            numel *= d
            if numel * dtype.itemsize > nbytes:  # bounded: stop as soon as it cannot fit
                break
        if numel * dtype.itemsize != nbytes:
            raise self.fail(f"tensors[{i}] ({what}): shape {show(shape)} of {entry[0]} does not take {nbytes} bytes")
        self.taken += nbytes
        if self.taken > len(self.payload):
            raise self.fail(f"tensors[{i}] ({what}): the tensors overlap (more bytes than the file holds)")
        if nbytes == 0:
            return torch.empty(dims, dtype=dtype)
        raw = torch.frombuffer(bytearray(self.payload[offset : offset + nbytes]), dtype=torch.uint8)
        if dtype == torch.bool and bool((raw > 1).any()):
            raise self.fail(f"tensors[{i}] ({what}) is boolean but holds bytes other than 0 and 1")
        return raw.view(dtype).reshape(dims)

    def item(self, v: Any, what: str) -> Any:
        if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
            return self.scalar(v, what)
        v = self.obj(v, {"type", "fields"}, what)
        cls = ITEM_TYPES.get(v["type"]) if isinstance(v["type"], str) else None
        if cls is None:
            raise self.fail(f"{what}: item type {show(v['type'])} is not one of {sorted(ITEM_TYPES)}")
        fields = self.obj(v["fields"], {f.name for f in dataclasses.fields(cls)}, f"{what} fields")
        return cls(**{k: self.scalar(x, f"{what}.{k}") for k, x in fields.items()})

    def capture(self, c: Any) -> RolloutCapture:
        c = self.obj(c, _CAPTURE_KEYS, "capture")
        return RolloutCapture(
            version=self.int(c["version"], "capture.version", 0),
            prompt_rng=self.random_state(c["prompt_rng"]),
            sample_rng=self.tensor(c["sample_rng"], "capture.sample_rng", 1),
            next_uid=self.int(c["next_uid"], "next_uid", 0),
            wave=None if c["wave"] is None else self.wave(c["wave"]),
            queued=[self.group(g, f"queued[{i}]") for i, g in enumerate(self.list(c["queued"], "queued"))],
            running=self.int(c["running"], "running", 0),
            staleness_samples=self.int(c["staleness_samples"], "staleness", 0),
            ledger=self.ledger(c["ledger"]),
            orphans=tuple(self.orphan(o, i) for i, o in enumerate(self.list(c["orphans"], "orphans"))),
        )

    def orphan(self, o: Any, i: int) -> tuple[int, Any]:
        pair = self.list(o, f"orphans[{i}]")
        if len(pair) != 2:
            raise self.fail(f"orphans[{i}] must be [uid, item]")
        return self.int(pair[0], f"orphans[{i}] uid", 0), self.item(pair[1], f"orphans[{i}] item")

    def random_state(self, v: Any) -> tuple[int, tuple[int, ...], float | None]:
        """Python ``random.getstate()``: ``(3, 625 ints: 624 words and an index, gauss_next)``."""
        v = self.list(v, "capture.prompt_rng")
        if len(v) != 3 or v[0] != 3 or not isinstance(v[1], list) or len(v[1]) != 625:
            raise self.fail("capture.prompt_rng must be [3, [625 integers], gauss_next]")
        words = tuple(self.int(x, "capture.prompt_rng word", 0, 2**32 - 1) for x in v[1][:624])
        index = self.int(v[1][624], "capture.prompt_rng index", 0, 624)
        gauss = v[2] if v[2] is None else self.scalar(v[2], "capture.prompt_rng gauss_next")
        if gauss is not None and not isinstance(gauss, float):
            raise self.fail("capture.prompt_rng gauss_next must be a number or null")
        return 3, (*words, index), gauss

    def ledger(self, v: Any) -> dict[str, Any]:
        v = self.obj(v, {*_LEDGER_COUNTS, "discarded", "by_version"}, "capture.ledger")
        out: dict[str, Any] = {k: self.int(v[k], f"ledger.{k}", 0) for k in _LEDGER_COUNTS}
        for name in ("discarded", "by_version"):
            if not isinstance(v[name], dict):
                raise self.fail(f"ledger.{name} must be an object")
            out[name] = {k: self.int(n, f"ledger.{name} count", 0) for k, n in v[name].items()}
        if not all(k.lstrip("-").isdigit() and len(k) < 20 for k in out["by_version"]):
            raise self.fail("ledger.by_version keys must be version numbers")
        return {k: out[k] for k in ("admitted", "generated", "trained", "discarded", "by_version", "regenerated")}

    def group(self, v: Any, what: str) -> Group:
        v = self.obj(v, {"uid", "item", "prompt", *_GROUP_TENSORS}, what)
        t = {k: self.tensor(v[k], f"{what}.{k}", 2 if k in _GROUP_TENSORS[:4] else 1) for k in _GROUP_TENSORS}
        n = t["tokens"].shape[0]
        if any(t[k].shape != t["tokens"].shape for k in _GROUP_TENSORS[1:4]) or any(
            t[k].shape != (n,) for k in _GROUP_TENSORS[4:]
        ):
            raise self.fail(f"{what}: the shapes of its tensors disagree")
        prompt = tuple(self.int(x, f"{what}.prompt token", 0) for x in self.list(v["prompt"], f"{what}.prompt"))
        return Group(
            uid=self.int(v["uid"], f"{what}.uid", 0), item=self.item(v["item"], f"{what}.item"), prompt=prompt, **t
        )

    def wave(self, v: Any) -> Wave:
        v = self.obj(v, {"uids", "items", "n", "step", *_WAVE_TENSORS}, "capture.wave")
        uids = [self.int(u, "wave.uids", 0) for u in self.list(v["uids"], "wave.uids")]
        items = [self.item(x, "wave.items") for x in self.list(v["items"], "wave.items")]
        n = self.int(v["n"], "wave.n", 1, len(self.payload) + 1)
        t = {k: self.tensor(v[k], f"wave.{k}", 1 if k == "done" else 2) for k in _WAVE_TENSORS}
        rows = len(uids) * n
        if (
            len(items) != len(uids)
            or any(x.shape[0] != rows for x in t.values())
            or any(t[k].shape != t["tokens"].shape for k in ("logprobs", "versions"))
            or t["prompt_mask"].shape != t["prompt_ids"].shape
        ):
            raise self.fail("capture.wave: the lengths of uids, items and its tensors disagree")
        step = self.int(v["step"], "wave.step", 0, t["tokens"].shape[1])
        return Wave(uids=uids, items=items, n=n, step=step, **t)
