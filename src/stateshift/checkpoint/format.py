"""Minimal safetensors writer and reader with streamed, verified checksums.

File layout (the safetensors format, readable by ``safetensors.torch.load_file``)::

    u64 little-endian N | N bytes of JSON header, space-padded to 8 | raw bytes

The JSON header maps each tensor name to ``{"dtype", "shape", "data_offsets"}``
(offsets relative to the first data byte) plus an optional ``"__metadata__"``
dict of str -> str.  Tensors are laid out in the caller's order, stably sorted
by element size (largest first), so every tensor starts at a multiple of its
element size, as safetensors itself does; there are no gaps.

Data paths, no hidden copies:

* writing streams each tensor's own bytes to ``os.write`` in chunks of
  ``CHUNK_BYTES`` (no staging copy, no full-size ``bytes`` object);
* reading ``readinto``\\ s straight into caller-provided destination tensors
  (e.g. pinned homes); only bytes the caller did not ask for go through a small
  reusable scratch buffer;
* the checksum of the *whole file* (header included) is computed on a helper
  thread while the main thread does I/O (``zlib.crc32`` and ``hashlib`` release
  the GIL), so hashing overlaps the write/read.

Checksum: ``crc32`` (``zlib``) by default: on the 2-core development machine it
streamed 1 GiB at 2.3-3.2 GB/s, tied with ``adler32`` and 4-5x faster than
``blake2b`` (0.56 GB/s) and ``sha256`` (1.35 GB/s); it is stronger than adler32
at detecting bit errors.  ``blake2b`` and ``sha256`` are accepted for callers
who want a cryptographic digest.  Checksums are written as ``"<alg>:<hex>"``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "CHUNK_BYTES",
    "DEFAULT_CHECKSUM",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "FileDigest",
    "SafetensorsHeader",
    "TensorInfo",
    "TensorRecord",
    "dtype_to_str",
    "hash_file",
    "read_header",
    "read_safetensors_into",
    "str_to_dtype",
    "write_safetensors",
]

CHUNK_BYTES = 64 << 20
"""Largest single ``os.write`` / ``readinto`` / checksum update, in bytes."""

MAX_HEADER_BYTES = 100_000_000
"""Same limit as the safetensors library; protects against a garbage length."""

ProgressFn = Callable[[int], None]
"""Called with the number of bytes just written or read (an increment)."""


from ..errors import (  # noqa: E402 - re-exported for the checkpoint package
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointWriteError,
)


# --------------------------------------------------------------------------- dtypes

_DTYPE_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
_STR_TO_DTYPE: dict[str, torch.dtype] = {s: getattr(torch, n) for s, n in _DTYPE_NAMES.items() if hasattr(torch, n)}
_DTYPE_TO_STR: dict[torch.dtype, str] = {d: s for s, d in _STR_TO_DTYPE.items()}


def dtype_to_str(dtype: torch.dtype) -> str:
    """safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _DTYPE_TO_STR[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors") from None


def str_to_dtype(name: str) -> torch.dtype:
    """torch dtype of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``)."""
    try:
        return _STR_TO_DTYPE[name]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {name!r}") from None


# --------------------------------------------------------------------------- checksums


class _Algo:
    """Uniform streaming interface over zlib.crc32 and hashlib."""

    def __init__(self, name: str) -> None:
        if name not in CHECKSUM_ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {name!r}; use one of {CHECKSUM_ALGORITHMS}")
        self.name = name

    def new(self) -> Any:
        return 0 if self.name == "crc32" else hashlib.new(self.name)

    def update(self, state: Any, data: memoryview | bytes) -> Any:
        if self.name == "crc32":
            return zlib.crc32(data, state)
        state.update(data)
        return state

    def finish(self, state: Any) -> str:
        hexd = f"{state:08x}" if self.name == "crc32" else state.hexdigest()
        return f"{self.name}:{hexd}"


CHECKSUM_ALGORITHMS: tuple[str, ...] = ("crc32", "blake2b", "sha256")
DEFAULT_CHECKSUM = "crc32"


def _split_checksum(path: str, checksum: str) -> str:
    algo, sep, _ = checksum.partition(":")
    if not sep or algo not in CHECKSUM_ALGORITHMS:
        raise CheckpointCorruptError(path, f"unrecognised checksum {checksum!r} in manifest")
    return algo


class _StreamHasher:
    """Hashes buffers in submission order on a helper thread.

    The buffers passed to :meth:`update` must stay unchanged until the hasher
    has consumed them: :meth:`finish`/:meth:`close` wait for all of them, and a
    ``release`` semaphore (if given) is released as soon as that buffer is done
    (used to recycle scratch buffers).
    """

    _SMALL = 1 << 16  # below this, hashing inline is cheaper than a queue hop

    def __init__(self, algorithm: str) -> None:
        self._algo = _Algo(algorithm)
        self._state = self._algo.new()
        self._err: BaseException | None = None
        self._q: queue.Queue[tuple[memoryview | bytes, threading.Semaphore | None] | None] = queue.Queue()
        self._discard = False
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            data, release = item
            try:
                if self._err is None and not self._discard:
                    self._state = self._algo.update(self._state, data)
            except BaseException as e:  # pragma: no cover - hashing a valid buffer does not fail
                self._err = e
            finally:
                if release is not None:
                    release.release()

    def update(self, data: memoryview | bytes, release: threading.Semaphore | None = None) -> None:
        if self._thread is None and len(data) < self._SMALL:
            self._state = self._algo.update(self._state, data)
            if release is not None:
                release.release()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stateshift-checksum", daemon=True)
            self._thread.start()
        self._q.put((data, release))

    def close(self) -> None:
        """Stop the helper thread, skipping unhashed buffers (after an error).

        Afterwards no submitted buffer is referenced any more.
        """
        if self._thread is not None:
            self._discard = True
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def finish(self) -> str:
        """Wait for every submitted buffer and return ``"<alg>:<hex>"``."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None
        if self._err is not None:
            raise self._err
        return self._algo.finish(self._state)


# --------------------------------------------------------------------------- records


def _nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def _byte_view(t: torch.Tensor, nbytes: int) -> memoryview:
    """Writable flat ``uint8`` memoryview over a contiguous CPU tensor's bytes.

    No copy; the caller must keep ``t`` alive while the view is used.
    """
    if nbytes == 0:
        return memoryview(bytearray(0))
    arr = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    return memoryview(arr).cast("B")


def _check_cpu_contiguous(name: str, t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise CheckpointMismatchError(name, f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise CheckpointMismatchError(name, f"{what} must be a CPU tensor (pinned is fine), got device {t.device}")
    if not t.is_contiguous():
        raise CheckpointMismatchError(name, f"{what} must be contiguous")
    if t.is_sparse or t.is_quantized:
        raise CheckpointMismatchError(name, f"{what} must be a dense tensor")
    if t.numel() and t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
        raise CheckpointMismatchError(name, f"{what} has released storage (size 0); it holds no values")


@dataclass(frozen=True)
class TensorRecord:
    """One tensor to write.

    ``data`` is a contiguous CPU tensor (pinned or not) of *any* dtype whose
    byte count equals ``prod(shape) * dtype.itemsize``; its raw bytes are
    written as ``dtype``/``shape``.  A ``uint8`` view of a pinned home is the
    intended input.  The bytes must not change until the write returns.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: torch.Tensor

    @classmethod
    def from_tensor(cls, name: str, t: torch.Tensor) -> TensorRecord:
        """Record for a contiguous CPU tensor, written with its own dtype and shape."""
        return cls(name, t.dtype, tuple(t.shape), t)

    @property
    def nbytes(self) -> int:
        return _nbytes_of(self.dtype, self.shape)

    def validate(self) -> None:
        """Raise :class:`CheckpointMismatchError` if the record cannot be written."""
        if not isinstance(self.name, str) or not self.name or self.name == "__metadata__":
            raise CheckpointMismatchError(str(self.name), "invalid tensor name")
        try:
            dtype_to_str(self.dtype)
        except ValueError as e:
            raise CheckpointMismatchError(self.name, str(e)) from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.shape):
            raise CheckpointMismatchError(self.name, f"invalid shape {self.shape!r}")
        _check_cpu_contiguous(self.name, self.data, "data")
        have = self.data.numel() * self.data.element_size()
        if have != self.nbytes:
            raise CheckpointMismatchError(
                self.name,
                f"data holds {have} bytes but dtype {self.dtype} and shape {list(self.shape)} need {self.nbytes}",
            )


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor as described by a file header (no data)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: str
    """File name inside the checkpoint directory (or the file path for a bare file)."""
    offset: int
    """Absolute byte offset of the first data byte inside the file."""


@dataclass(frozen=True)
class FileDigest:
    """What :func:`write_safetensors` wrote: file size in bytes and checksum."""

    size: int
    checksum: str
    tensors: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed and validated safetensors header."""

    tensors: tuple[TensorInfo, ...]  # in file (offset) order
    metadata: dict[str, str]
    data_start: int
    file_size: int
    raw: bytes  # the 8-byte length plus the header bytes, as stored


# --------------------------------------------------------------------------- writing


def _write_all(fd: int, mv: memoryview) -> None:
    while mv.nbytes:
        n = os.write(fd, mv)
        mv = mv[n:]


def _layout(records: Sequence[TensorRecord]) -> list[TensorRecord]:
    # Stable sort by element size, largest first: with an 8-aligned header every
    # tensor then starts at a multiple of its element size (as safetensors does).
    return sorted(records, key=lambda r: -r.dtype.itemsize)


def _build_header(ordered: Sequence[TensorRecord], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"__metadata__ must map str to str, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    pos = 0
    for r in ordered:
        n = r.nbytes
        header[r.name] = {"dtype": dtype_to_str(r.dtype), "shape": list(r.shape), "data_offsets": [pos, pos + n]}
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(8 + len(blob)) % 8)
    return struct.pack("<Q", len(blob)) + blob


def write_safetensors(
    path: str | os.PathLike[str],
    records: Iterable[TensorRecord],
    *,
    metadata: Mapping[str, str] | None = None,
    checksum: str = DEFAULT_CHECKSUM,
    progress: ProgressFn | None = None,
    fsync: bool = True,
) -> FileDigest:
    """Write ``records`` to a new safetensors file at ``path`` (must not exist).

    Streams each tensor's bytes from its own memory (no host copy) and hashes
    the whole file on the way.  With ``fsync=True`` the file's data is durable
    when this returns.  The records' bytes must not change until it returns.
    OS errors (ENOSPC, EFBIG, ...) propagate as :class:`OSError`; the partial
    file is left for the caller to remove.
    """
    recs = list(records)
    seen: set[str] = set()
    for r in recs:
        r.validate()
        if r.name in seen:
            raise CheckpointMismatchError(r.name, "duplicate tensor name")
        seen.add(r.name)
    _Algo(checksum)  # validate early
    ordered = _layout(recs)
    head = _build_header(ordered, metadata)
    data_start = len(head)
    infos: list[TensorInfo] = []
    fname = os.fspath(path)
    fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    hasher = _StreamHasher(checksum)
    try:
        hasher.update(head)
        _write_all(fd, memoryview(head))
        pos = data_start
        for r in ordered:
            n = r.nbytes
            infos.append(TensorInfo(r.name, r.dtype, tuple(r.shape), n, os.path.basename(fname), pos))
            mv = _byte_view(r.data, n)
            for i in range(0, n, CHUNK_BYTES):
                chunk = mv[i : i + CHUNK_BYTES]
                hasher.update(chunk)
                _write_all(fd, chunk)
                if progress is not None:
                    progress(chunk.nbytes)
            pos += n
        digest = hasher.finish()
        if fsync:
            os.fsync(fd)
    finally:
        hasher.close()  # never return while the helper thread still reads caller memory
        os.close(fd)
    return FileDigest(size=pos, checksum=digest, tensors=tuple(infos))


# --------------------------------------------------------------------------- reading


def _parse_header(path: str, raw_len: bytes, blob: bytes, file_size: int) -> SafetensorsHeader:
    n = len(blob)
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorruptError(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointCorruptError(path, "__metadata__ is not a str -> str object")
    data_start = 8 + n
    data_len = file_size - data_start
    base = os.path.basename(path)
    entries: list[tuple[int, int, TensorInfo]] = []
    for name, ent in header.items():
        try:
            dtype = str_to_dtype(ent["dtype"])
            shape = tuple(ent["shape"])
            b, end = ent["data_offsets"]
            ok = all(type(d) is int and d >= 0 for d in shape) and type(b) is int and type(end) is int
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or not 0 <= b <= end:
            raise CheckpointCorruptError(path, f"bad header entry for tensor '{name}': {ent!r}")
        if end - b != _nbytes_of(dtype, shape):
            raise CheckpointCorruptError(path, f"tensor '{name}': offsets {b}..{end} do not match dtype/shape")
        entries.append((b, end, TensorInfo(name, dtype, shape, end - b, base, data_start + b)))
    entries.sort(key=lambda x: (x[0], x[1]))
    pos = 0
    for b, end, info in entries:
        if b != pos:
            raise CheckpointCorruptError(path, f"tensor '{info.name}' starts at {b}, expected {pos} (gap or overlap)")
        pos = end
    if pos != data_len:
        what = "truncated" if pos > data_len else "has trailing bytes"
        raise CheckpointCorruptError(path, f"file {what}: header describes {pos} data bytes, file holds {data_len}")
    return SafetensorsHeader(tuple(i for _, _, i in entries), metadata, data_start, file_size, raw_len + blob)


def _read_header_fd(path: str, fd: int) -> SafetensorsHeader:
    size = os.fstat(fd).st_size
    raw_len = os.pread(fd, 8, 0)
    if len(raw_len) < 8:
        raise CheckpointCorruptError(path, f"file truncated: {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw_len)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CheckpointCorruptError(path, f"header length {n} impossible for a {size}-byte file (truncated?)")
    blob = os.pread(fd, n, 8)
    if len(blob) != n:
        raise CheckpointCorruptError(path, "file truncated inside the header")
    return _parse_header(path, raw_len, blob, size)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file (reads only the header).

    Raises :class:`CheckpointCorruptError` for a bad header or a file whose size
    does not match it (e.g. truncated).
    """
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_header_fd(p, fd)
    finally:
        os.close(fd)


def _readinto_exact(path: str, f: Any, mv: memoryview) -> None:
    while mv.nbytes:
        n = f.readinto(mv)
        if not n:
            raise CheckpointCorruptError(path, "unexpected end of file (truncated while reading)")
        mv = mv[n:]


def _check_destination(info: TensorInfo, dst: torch.Tensor) -> None:
    _check_cpu_contiguous(info.name, dst, "destination")
    if dst.dtype not in (torch.uint8, info.dtype):
        raise CheckpointMismatchError(
            info.name, f"destination dtype {dst.dtype}; use torch.uint8 or the stored dtype {info.dtype}"
        )
    have = dst.numel() * dst.element_size()
    if have != info.nbytes:
        raise CheckpointMismatchError(info.name, f"destination holds {have} bytes, stored tensor has {info.nbytes}")
    if dst.dtype == info.dtype and tuple(dst.shape) != info.shape:
        raise CheckpointMismatchError(
            info.name, f"destination shape {list(dst.shape)}, stored shape {list(info.shape)}"
        )


def read_safetensors_into(
    path: str | os.PathLike[str],
    dsts: Mapping[str, torch.Tensor],
    *,
    expected_checksum: str | None = None,
    expected_size: int | None = None,
    expected_header: SafetensorsHeader | None = None,
    progress: ProgressFn | None = None,
) -> SafetensorsHeader:
    """Read the tensors named in ``dsts`` from one file straight into ``dsts``.

    Each destination is a contiguous CPU tensor (``uint8`` or the stored dtype)
    with exactly the stored byte count; all are checked before any byte is read.
    The whole file is streamed once (bytes nobody asked for go through a small
    scratch buffer) and, if ``expected_checksum`` is given, its checksum is
    verified at the end.

    Safety: the destinations hold valid data only once this returns.  If it
    raises (:class:`CheckpointCorruptError` on mismatch / truncation) their
    contents are unspecified; pass staging buffers, not live state.
    """
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if expected_size is not None and size != expected_size:
            what = "truncated" if size < expected_size else "longer than recorded"
            raise CheckpointCorruptError(p, f"file {what}: {size} bytes, manifest says {expected_size}")
        hdr = _read_header_fd(p, fd)
        if expected_header is not None and hdr.raw != expected_header.raw:
            raise CheckpointCorruptError(p, "header changed since the checkpoint was opened")
        by_name = {t.name: t for t in hdr.tensors}
        for name, want in dsts.items():
            if name not in by_name:
                raise CheckpointMismatchError(name, f"not stored in '{p}'")
            _check_destination(by_name[name], want)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        algo = _split_checksum(p, expected_checksum) if expected_checksum is not None else None
        hasher = _StreamHasher(algo) if algo is not None else None
        scratch: list[memoryview] = []
        free = threading.Semaphore(2)
        slot = 0
        try:
            f.seek(len(hdr.raw))
            if hasher is not None:
                hasher.update(hdr.raw)
            for info in hdr.tensors:
                dst = dsts.get(info.name)
                if dst is None and hasher is None:
                    f.seek(info.nbytes, os.SEEK_CUR)
                    continue
                if dst is not None:
                    mv = _byte_view(dst, info.nbytes)
                    for i in range(0, info.nbytes, CHUNK_BYTES):
                        chunk = mv[i : i + CHUNK_BYTES]
                        _readinto_exact(p, f, chunk)
                        if hasher is not None:
                            hasher.update(chunk)
                        if progress is not None:
                            progress(chunk.nbytes)
                    continue
                # Bytes nobody asked for: still hashed, through two recycled scratch buffers.
                left = info.nbytes
                while left:
                    n = min(left, CHUNK_BYTES)
                    if not scratch:
                        m = min(CHUNK_BYTES, max(n, 1 << 20))
                        scratch = [memoryview(bytearray(m)), memoryview(bytearray(m))]
                    free.acquire()
                    buf = scratch[slot][:n]
                    slot ^= 1
                    _readinto_exact(p, f, buf)
                    assert hasher is not None
                    hasher.update(buf, release=free)
                    left -= n
            if f.read(1):
                raise CheckpointCorruptError(p, "file grew while reading")
            if hasher is not None:
                got = hasher.finish()
                if got != expected_checksum:
                    raise CheckpointCorruptError(
                        p, f"checksum mismatch: manifest says {expected_checksum}, file hashes to {got}"
                    )
        finally:
            if hasher is not None:
                hasher.close()
    return hdr


def hash_file(path: str | os.PathLike[str], algorithm: str = DEFAULT_CHECKSUM) -> tuple[int, str]:
    """Stream a whole file through ``algorithm``; returns ``(size, "<alg>:<hex>")``.

    Reading and hashing overlap (three recycled 64 MiB buffers at most).
    """
    p = os.fspath(path)
    hasher = _StreamHasher(algorithm)
    nbuf = 3
    free = threading.Semaphore(nbuf)
    bufs: list[memoryview] = []
    total = 0
    try:
        with open(p, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            size = os.fstat(f.fileno()).st_size
            i = 0
            while True:
                free.acquire()
                if len(bufs) < nbuf:
                    bufs.append(memoryview(bytearray(min(CHUNK_BYTES, max(size, 1 << 16)))))
                buf = bufs[i % nbuf]  # FIFO hashing: this buffer's previous use is done
                i += 1
                n = f.readinto(buf)
                if not n:
                    free.release()
                    break
                total += n
                hasher.update(buf[:n], release=free)
        return total, hasher.finish()
    finally:
        hasher.close()
