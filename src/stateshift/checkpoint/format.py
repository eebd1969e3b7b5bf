"""Safetensors files with a crc32 per tensor, written from and read into caller memory, in parallel.

Every data file is plain safetensors (``safetensors.torch.load_file`` reads it), tensors largest element
size first; what a file cannot say about itself (its crc32s) is its ``FileEntry`` in the manifest. Bytes
move between the caller's memory and the file without a private copy (``pwritev``; reads out of a memory
map, copied ``SUB_BYTES`` at a time and hashed in the caller's memory while in the cache), in tasks of
about ``CHUNK_BYTES`` on a thread pool, a tensor's crc32 combined from its pieces' (``zlib_ng``: the
values of ``zlib.crc32``, about 7x faster). Untrusted input is bounded: ``MAX_HEADER_BYTES``, ``MAX_RANK``,
``MAX_DIM``, ``open_regular``, ``errors.show`` (docs/guide/checkpoints.md, "Untrusted checkpoints").
"""

from __future__ import annotations

import ctypes
import errno
import functools
import gc
import itertools
import json
import math
import os
import stat
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from zlib_ng.zlib_ng import (  # the values of zlib.crc32; crc32_combine(crc(a), crc(b), len(b)) = crc(a + b)
    crc32,
    crc32_combine,
)

from ..errors import CheckpointError, DiskError, LayoutError, show

CHUNK_BYTES = 16 << 20
"""Bytes per task: one positioned read or write and its crc32."""
WORKERS = max(2, min(16, os.cpu_count() or 1))
"""Threads moving and hashing bytes (one file at a time)."""
MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header accepted (the safetensors library's own limit)."""
MAX_RANK = 64
"""Most dimensions a stored tensor may have (what torch supports): a shape with more is refused unread."""
MAX_DIM = 1 << 48
"""Every dimension of a stored shape is below this (2**48 elements: 256 TiB of bytes)."""
_IOV_MAX = 1024

ProgressFn = Callable[[int], None]
"""Called on the calling thread with the number of bytes just written or read (an increment)."""

_SAFETENSORS_DTYPES = (  # safetensors name:torch attribute (those this torch lacks are left out)
    "BOOL:bool U8:uint8 I8:int8 I16:int16 U16:uint16 F16:float16 BF16:bfloat16 I32:int32 U32:uint32 F32:float32 "
    "I64:int64 U64:uint64 F64:float64 C64:complex64 F8_E4M3:float8_e4m3fn F8_E5M2:float8_e5m2 "
    "F8_E4M3FNUZ:float8_e4m3fnuz F8_E5M2FNUZ:float8_e5m2fnuz F8_E8M0:float8_e8m0fnu"
)
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, a) for n, _, a in (p.partition(":") for p in _SAFETENSORS_DTYPES.split()) if hasattr(torch, a)
}
"""Safetensors dtype name -> torch dtype (``"BF16"`` -> ``torch.bfloat16``); ``DTYPE_NAMES`` the other way."""
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


def crc_text(crc: int) -> str:
    """A crc32 as a manifest writes it: ``crc32:<8 hex digits>``."""
    return f"crc32:{crc:08x}"


def is_utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (a lone surrogate cannot): what names and other text in a
    checkpoint must be, on both sides (a writer refuses what a reader would)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def without_gc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with Python's cyclic garbage collector paused (and resumed after, if it was on).

    Decoding or building a checkpoint's metadata allocates containers per tensor and field, and with
    many tensors the collections this sets off -- each walking the young objects, some every live one,
    the model's included -- took about half of a save or load of 20,000 small tensors. What these
    functions allocate holds no reference cycles; a cycle made meanwhile elsewhere waits for the next
    collection.
    """

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        _gc_pause(+1)
        try:
            return fn(*args, **kwargs)
        finally:
            _gc_pause(-1)

    return paused


_GC_LOCK = threading.Lock()
_gc_paused = [0, False]  # [callers inside, whether the collector was on when the first came in]


def _gc_pause(step: int) -> None:
    """Count callers in and out under one lock: the first pauses the collector, the last resumes it if it was
    on (checking and switching without a lock let two threads leave it off for good)."""
    with _GC_LOCK:
        if step > 0 and _gc_paused[0] == 0:
            _gc_paused[1] = gc.isenabled()
            gc.disable()
        _gc_paused[0] += step
        if _gc_paused[0] == 0 and _gc_paused[1]:
            gc.enable()


# --------------------------------------------------------------------------- entries and records


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor as the manifest records it; ``start`` counts from the first data byte."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as the manifest records it.

    For a safetensors file ``header`` is ``(size of the length field and header, their crc32)`` and
    ``tensors`` lists every tensor in file order; for any other file (DCP's) both are empty.
    """

    bytes: int
    crc32: int
    header: tuple[int, int] | None = None
    tensors: tuple[TensorEntry, ...] = ()

    @property
    def checksum(self) -> str:
        return crc_text(self.crc32)


@dataclass(frozen=True)
class Record:
    """One tensor to write: ``data`` is a contiguous CPU tensor (pinned or not, any dtype) holding
    exactly ``prod(shape) * dtype.itemsize`` bytes, written as ``dtype``/``shape`` (a ``uint8``
    region of a pinned block is the usual input). Its bytes must not change until the write returns."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: torch.Tensor

    @classmethod
    def from_tensor(cls, name: str, t: torch.Tensor) -> Record:
        return cls(name, t.dtype, tuple(t.shape), t)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def validate(self) -> None:
        """Raise ``LayoutError("checkpoint_mismatch")`` naming the tensor if it cannot be written."""
        if not isinstance(self.name, str) or not self.name or self.name == "__metadata__":
            why = "invalid tensor name"
        elif not is_utf8(self.name):
            why = "tensor name is not valid UTF-8 text"
        elif self.dtype not in DTYPE_NAMES:
            why = f"dtype {self.dtype} cannot be stored in safetensors"
        elif not all(type(d) is int and d >= 0 for d in self.shape):
            why = f"invalid shape {self.shape!r}"
        else:
            return check_buffer(self.name, self.data, self.nbytes, "data")
        raise LayoutError("checkpoint_mismatch", why, tensor=str(self.name))


def check_buffer(name: str, t: Any, nbytes: int, what: str) -> None:
    """``t`` must be a dense contiguous CPU tensor with ``nbytes`` bytes of live storage."""
    have = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse or t.is_quantized:
        why = f"{what} must be a dense CPU tensor (pinned is fine), got {type(t).__name__}"
    elif not t.is_contiguous():
        why = f"{what} must be contiguous"
    elif have != nbytes:
        why = f"{what} holds {have} bytes, the tensor has {nbytes}"
    elif have and t.untyped_storage().nbytes() < t.storage_offset() * t.element_size() + have:
        why = f"{what} has released storage (size 0); it holds no values"
    else:
        return
    raise LayoutError("checkpoint_mismatch", why, tensor=name)


def byte_view(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor's memory (no copy; keep ``t`` alive)."""
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


# --------------------------------------------------------------------------- parallel positioned I/O


Span = tuple[int, int, "memoryview | None"]
"""``(file offset, length, caller memory)``; memory ``None`` for bytes that are only hashed."""
Piece = tuple[int, int, int, "memoryview | None"]
"""``(span index, file offset, length, memory)``: part of a span inside one task."""


def _tasks(spans: Sequence[Span]) -> list[list[Piece]]:
    """Cut spans into tasks of at most ``CHUNK_BYTES`` contiguous bytes, in file order."""
    chunk = CHUNK_BYTES
    tasks: list[list[Piece]] = []
    end, size = -1, chunk
    for idx, (offset, length, mem) in enumerate(spans):
        done = 0
        while done < length:
            if offset + done != end or size == chunk:
                tasks.append([])
                size = 0
            n = min(length - done, chunk - size)
            tasks[-1].append((idx, offset + done, n, None if mem is None else mem[done : done + n]))
            done += n
            size += n
            end = offset + done
    return tasks


def write_all(fd: int, bufs: list[memoryview], offset: int, path: str, names: Sequence[str] | None = None) -> None:
    """All of ``bufs`` through ``os.pwritev`` from ``offset``, resuming short writes; an OS error becomes
    ``DiskError("transfer")`` naming the tensor (``names[i]``: that of ``bufs[i]``)."""
    i = 0
    while i < len(bufs):
        try:
            n = os.pwritev(fd, bufs[i : i + _IOV_MAX], offset)
        except OSError as e:
            raise DiskError.from_os_error(e, path, None if names is None else names[i]) from e
        if n <= 0:
            raise DiskError("transfer", "the write made no progress", path=path)
        offset += n
        while n:
            if n >= len(bufs[i]):
                n -= len(bufs[i])
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


def _run_task(fd: int, task: list[Piece], path: str, names: Sequence[str] | None) -> list[tuple[int, int, int]]:
    """One task of a write: its bytes moved in one positioned call, then each piece's ``(span, crc32, length)``."""
    bufs = [mem for _, _, _, mem in task]
    write_all(fd, list(bufs), task[0][1], path, None if names is None else [names[p[0]] for p in task])
    return [(idx, crc32(b), n) for (idx, _, n, _), b in zip(task, bufs, strict=True)]


SUB_BYTES = 1 << 20
"""Bytes read into the caller's memory at a time and then hashed there, while still in the CPU's cache."""


def _run_read(fd: int, task: list[Piece], path: str, names: Sequence[str] | None) -> list[tuple[int, int, int]]:
    """One task of a read: per piece, ``SUB_BYTES`` at a time, the bytes read straight into the caller's memory
    (``os.preadv``: no private copy of the file; bytes only hashed go through a scratch buffer) and hashed there,
    from the cache: the crc32 is that of the bytes the caller got, even if the file changes meanwhile. A file
    that ends early (truncated under the read) is ``CheckpointError("corrupt")`` and an OS error (EIO) a
    ``DiskError("transfer")``, where touching a mapping of either would kill the process with SIGBUS."""
    out, scratch = [], memoryview(b"")
    for idx, offset, n, mem in task:
        crc, name = 0, None if names is None else names[idx]
        for k in range(0, n, SUB_BYTES):
            m = min(SUB_BYTES, n - k)
            if mem is None and len(scratch) < m:
                scratch = memoryview(bytearray(SUB_BYTES))
            buf = scratch[:m] if mem is None else mem[k : k + m]
            done = 0
            while done < m:
                try:
                    got = os.preadv(fd, [buf[done:]], offset + k + done)
                except OSError as e:
                    raise DiskError.from_os_error(e, path, name) from e
                if got == 0:
                    raise CheckpointError("corrupt", "file truncated while reading", path=path, tensor=name)
                done += got
            crc = crc32(buf, crc)
        out.append((idx, crc, n))
    return out


def transfer(
    fd: int,
    spans: Sequence[Span],
    path: str,
    progress: ProgressFn | None = None,
    names: Sequence[str] | None = None,
    read: bool = False,
) -> list[int]:
    """Move ``spans`` between memory and ``fd`` (written, or ``read``) on a thread pool; returns each span's
    crc32. ``names``: each span's tensor, named by a ``DiskError("transfer")``.
    ``progress`` runs on this thread, in file order, and at most ``2 * WORKERS`` tasks run ahead of
    it (an error it raises stops the transfer promptly).

    Never returns (nor raises) while a worker still touches caller memory.
    """
    tasks = iter(_tasks(spans))
    crcs: list[int | None] = [None] * len(spans)
    run = functools.partial(_run_read if read else _run_task, fd)
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="stateshift-io") as pool:
        running = deque(pool.submit(run, t, path, names) for t in itertools.islice(tasks, 2 * WORKERS))
        try:
            while running:
                moved = 0
                for idx, crc, n in running.popleft().result():
                    prev = crcs[idx]
                    crcs[idx] = crc if prev is None else crc32_combine(prev, crc, n)
                    moved += n
                if progress is not None:
                    progress(moved)
                running.extend(pool.submit(run, t, path, names) for t in itertools.islice(tasks, 1))
        except BaseException:
            for f in running:
                f.cancel()
            raise
    return [0 if c is None else c for c in crcs]


# --------------------------------------------------------------------------- opening and JSON


@contextmanager
def open_regular(root: os.PathLike[str], name: str) -> Iterator[tuple[int, int, str]]:
    """Open the file ``name`` inside the directory ``root`` for reading: ``(fd, size, path)``, closed on exit.

    Refuses (``CheckpointError("corrupt")``) a symbolic link and anything that is not a regular file
    (a FIFO is opened non-blocking, so it cannot hang us). ``FileNotFoundError`` if absent.
    """
    path = os.path.join(root, name)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a symbolic link
            raise CheckpointError(
                "corrupt", "is a symbolic link; a checkpoint holds only its own regular files", path=path
            ) from None
        raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                "corrupt", "not a regular file (a FIFO, device or directory); refusing to read it", path=path
            )
        os.set_blocking(fd, True)
        yield fd, st.st_size, path
    finally:
        os.close(fd)


def load_json(raw: bytes, path: str, what: str) -> Any:
    """Parse untrusted JSON: any failure, deep nesting included, is ``CheckpointError("corrupt")``."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise CheckpointError("corrupt", f"{what} is nested too deeply", path=path) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError("corrupt", f"{what} is not valid JSON ({e})", path=path) from None


# --------------------------------------------------------------------------- writing


@without_gc
def _header(records: Sequence[Record], starts: Sequence[int], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    for r, start in zip(records, starts, strict=False):
        entry = {"dtype": DTYPE_NAMES[r.dtype], "shape": list(r.shape), "data_offsets": [start, start + r.nbytes]}
        header[r.name] = entry
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    return struct.pack("<Q", len(blob)) + blob


def write_file(
    path: str,
    records: Sequence[Record],
    *,
    metadata: Mapping[str, str] | None = None,
    progress: ProgressFn | None = None,
    fsync: bool = True,
) -> FileEntry:
    """Write ``records`` to a safetensors file at ``path`` (new, or the empty one ``commit.replacing`` made) and
    fsync it (``fsync=False``: the caller does, e.g. while it writes the next file).

    Records must have been validated (``Record.validate``) with unique names. OS errors (ENOSPC,
    EFBIG, ...) propagate as ``OSError`` (``DiskError("transfer")`` naming the file and the tensor where the
    bytes failed); the partial file is left for the caller to remove.
    """
    ordered = sorted(records, key=lambda r: -r.dtype.itemsize)  # stable: each tensor aligned to its element size
    starts = list(itertools.accumulate((r.nbytes for r in ordered), initial=0))  # (and last, where the data ends)
    head = _header(ordered, starts, metadata or {})
    spans = [(len(head) + s, r.nbytes, byte_view(r.data, r.nbytes)) for r, s in zip(ordered, starts, strict=False)]
    size = len(head) + starts[-1]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, size)  # parallel writes inside the file's size do not serialise on extending it
        write_all(fd, [memoryview(head)], 0, path)
        crcs = transfer(fd, spans, path, progress, [r.name for r in ordered])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    whole = head_crc = crc32(head)
    for r, crc in zip(ordered, crcs, strict=True):
        whole = crc32_combine(whole, crc, r.nbytes)
    tensors = [
        TensorEntry(r.name, r.dtype, r.shape, s, r.nbytes, c) for r, s, c in zip(ordered, starts, crcs, strict=False)
    ]
    return FileEntry(size, whole, (len(head), head_crc), tuple(tensors))


# --------------------------------------------------------------------------- reading


def read_into(
    fd: int, entry: FileEntry, dsts: Mapping[str, torch.Tensor | None], path: str, progress: ProgressFn | None = None
) -> None:
    """Read the named tensors of a checked file (``manifest.check_file``) into ``dsts`` and verify each crc32.

    A destination is a contiguous CPU tensor of exactly the stored bytes (``uint8``, or the stored
    dtype and shape); ``None`` verifies the tensor without keeping it. All are checked before a
    byte is read (``LayoutError("checkpoint_mismatch")``). Destinations hold valid data only once this
    returns: on ``CheckpointError("corrupt")`` (naming the first bad tensor) their bytes are
    unspecified, so pass staging memory, never live state.
    """
    by_name = {t.name: t for t in entry.tensors}
    base = 0 if entry.header is None else entry.header[0]
    chosen: list[TensorEntry] = []
    spans: list[Span] = []
    for name, dst in dsts.items():
        t = by_name.get(name)
        if t is None:
            raise LayoutError("checkpoint_mismatch", f"not stored in '{path}'", tensor=name)
        if dst is not None:
            check_buffer(name, dst, t.nbytes, "destination")
            if dst.dtype not in (torch.uint8, t.dtype) or (dst.dtype == t.dtype and tuple(dst.shape) != t.shape):
                raise LayoutError(
                    "checkpoint_mismatch",
                    f"destination is {dst.dtype} {list(dst.shape)}; use uint8 or {t.dtype} {list(t.shape)}",
                    tensor=name,
                )
        chosen.append(t)
        spans.append((base + t.start, t.nbytes, None if dst is None else byte_view(dst, t.nbytes)))
    crcs = read_spans(fd, spans, path, progress, [t.name for t in chosen])
    for t, crc in zip(chosen, crcs, strict=True):
        if crc != t.crc32:
            raise CheckpointError(
                "corrupt",
                f"checksum mismatch in tensor {show(t.name)}: manifest says {crc_text(t.crc32)}, data hashes to "
                f"{crc_text(crc)}",
                path=path,
                tensor=t.name,
            )


def read_spans(
    fd: int, spans: Sequence[Span], path: str, progress: ProgressFn | None = None, names: Sequence[str] | None = None
) -> list[int]:
    """``transfer`` of ``spans`` out of the file ``fd``, each span's crc32 that of the bytes read (``_run_read``)."""
    return transfer(fd, spans, path, progress, names, read=True) if spans else []


def file_crc32(fd: int, size: int, path: str) -> int:
    """The crc32 of a whole file, hashed in parallel."""
    (crc,) = read_spans(fd, [(0, size, None)], path)
    return crc
