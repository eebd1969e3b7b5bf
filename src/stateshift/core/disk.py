"""The disk tier: one scratch file per ModelState (and process) holding offloaded groups' values.

A ``DiskHome`` is scratch for this process, not a checkpoint. Its file is
``<dir>/stateshift-<host>-<pid>-<token>.disk`` (created exclusively), each group gets a
region laid out like its arena (a home, a snapshot), and values move through a bounded
pinned staging area (``StagedIO``): device slots are copied into one staging window
while the previous window is written to the file, and read back the same way, so host
memory used by a disk transfer is at most two windows, whatever the group's size.

Lifetime: the file is removed by ``close()``, when the state is collected, and at
interpreter exit. A file left by a killed process is never loaded -- a state only ever
opens the file it created -- and ``sweep_stale`` removes the ones whose process is gone.

I/O mode: the file is opened with ``O_DIRECT`` where the filesystem allows it (probed once
with an aligned write and read; tmpfs and some network filesystems refuse it) and plain
buffered I/O otherwise; ``DiskHome.io_mode`` says which (``"O_DIRECT"`` / ``"buffered"``) and
``describe()`` says why. With ``O_DIRECT`` only whole aligned blocks go through the direct
descriptor: each transfer is split into an unaligned head, an aligned middle (file offset,
length and buffer address all multiples of ``DiskHome.align``) and an unaligned tail, and the
head, the tail and any buffer whose address cannot meet an aligned offset go through a second,
buffered descriptor of the same file (Linux keeps the two coherent for one writer at a time).
Regions start at multiples of the alignment and the staging windows place each window so that
aligned file offsets meet aligned addresses, so nearly every byte of a large transfer goes
direct. Page cache: direct reads come from the disk and direct writes leave nothing cached; the
buffered bytes are pushed out by ``settle()`` (``fdatasync`` + ``POSIX_FADV_DONTNEED``).

Errors: a full disk or an I/O error while writing raises ``DiskError("tier")`` before any
slot changes residency (the values are still where they were), in either mode; a direct
transfer refused with ``EINVAL`` is redone through the buffered descriptor.
"""

from __future__ import annotations

import atexit
import ctypes
import errno as _errno
import logging
import os
import re
import secrets
import socket
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DiskError
from .pool import HostBlock, HostPool, pid_alive
from .transfer import MAX_GAP, CopyEngine, Plan, Run, Transfer

_log = logging.getLogger("stateshift")
ALIGN = 4096  #: the least alignment of regions and direct I/O (page and typical logical block size)
MAX_ALIGN = 64 << 10  #: the most: a filesystem block size (``statvfs().f_bsize``) above this is not used
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  #: 0 where the platform has none (then always buffered)
DISK_WINDOW = 64 << 20  #: default size of each of the two staging windows
_NAME = re.compile(r"^stateshift-(?P<host>[^-]+)-(?P<pid>\d+)-[0-9a-f]+\.disk$")
#: file names of this process's disk homes not yet removed: a file named with this pid and not here was
#: left by an earlier process with the same pid (a restarted container), and is stale
_LIVE: set[str] = set()


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor (no copy)."""
    n = t.numel()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def sweep_stale(directory: Path) -> list[Path]:
    """Remove disk homes of this host whose process is gone (and those named with this process's pid that
    none of its live disk homes owns: left by an earlier process with the same pid); returns what was removed."""
    removed = []
    host = socket.gethostname().replace("-", "_")
    for entry in directory.iterdir() if directory.is_dir() else ():
        m = _NAME.match(entry.name)
        pid = int(m["pid"]) if m else 0
        if m and m["host"] == host and (entry.name not in _LIVE if pid == os.getpid() else not pid_alive(pid)):
            try:
                entry.unlink()
                removed.append(entry)
            except OSError:
                pass
    if removed:
        _log.warning("removed %d stale stateshift disk homes in %s (their processes are gone)", len(removed), directory)
    return removed


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass
class _Region:
    offset: int
    nbytes: int


def _what(exc: OSError) -> str:
    """A write error in words: "the disk is full" for a full disk, a quota or a file-size limit."""
    full = exc.errno in (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG)
    return "the disk is full" if full else (exc.strerror or str(exc))


def alignment(fd: int) -> int:
    """The alignment direct I/O on ``fd``'s filesystem uses: its block size when that is a power of two
    between ``ALIGN`` and ``MAX_ALIGN``, else ``ALIGN`` (4096 suits every block device in practice)."""
    try:
        bsize = os.fstatvfs(fd).f_bsize
    except OSError:
        return ALIGN
    return bsize if ALIGN <= bsize <= MAX_ALIGN and bsize & (bsize - 1) == 0 else ALIGN


def _probe_direct(path: Path, fd: int, align: int) -> tuple[int | None, str]:
    """Open ``path`` a second time with ``O_DIRECT`` and write and read one aligned block through it
    (then truncate the file back to empty): the direct descriptor, or ``None`` and why not."""
    if not O_DIRECT:
        return None, "this platform has no O_DIRECT"
    try:
        dfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | O_DIRECT)
    except OSError as exc:
        return (
            None,
            f"the filesystem refused O_DIRECT ({_errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror})",
        )
    scratch = torch.zeros(2 * align, dtype=torch.uint8)
    start = -scratch.data_ptr() % align
    block = _byte_view(scratch[start : start + align])  # an aligned block, whatever the allocator gave
    try:
        try:
            if os.pwrite(dfd, block, 0) != align or os.preadv(dfd, [block], 0) != align:
                raise OSError(_errno.EIO, "short transfer")
        finally:
            os.ftruncate(fd, 0)
    except OSError as exc:
        os.close(dfd)
        return (
            None,
            f"an aligned O_DIRECT transfer failed ({_errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror})",
        )
    return dfd, f"O_DIRECT accepted with alignment {align}"


class DiskHome:
    """One scratch file and the region of each group in it (see the module docstring).

    ``io_mode``: ``"O_DIRECT"`` when the file is also open for direct I/O (aligned blocks go
    through it), ``"buffered"`` otherwise; ``direct=False`` (or the environment variable
    ``STATESHIFT_DISK_DIRECT=0`` when ``direct`` is not given) asks for buffered I/O only.
    ``bytes_direct`` / ``bytes_buffered`` count what each descriptor moved.
    """

    def __init__(self, directory: str | os.PathLike[str], *, direct: bool | None = None) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskError(
                "tier", f"cannot use {str(self.directory)!r} for disk homes: {exc.strerror or exc}"
            ) from None
        sweep_stale(self.directory)
        host = socket.gethostname().replace("-", "_")
        self.path = self.directory / f"stateshift-{host}-{os.getpid()}-{secrets.token_hex(6)}.disk"
        _LIVE.add(self.path.name)  # (before the file exists: a sweep in another thread must not take it)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            _LIVE.discard(self.path.name)
            raise DiskError(
                "tier", f"cannot create a disk home in {str(self.directory)!r}: {exc.strerror or exc}"
            ) from None
        self.align = alignment(self.fd)
        if direct is None:
            direct = os.environ.get("STATESHIFT_DISK_DIRECT", "1") != "0"
        if direct:
            self._dfd, self.why = _probe_direct(self.path, self.fd, self.align)
        else:
            self._dfd, self.why = None, "buffered I/O asked for (direct=False or STATESHIFT_DISK_DIRECT=0)"
        self.io_mode = "O_DIRECT" if self._dfd is not None else "buffered"
        self.bytes_direct = self.bytes_buffered = 0
        _log.debug("disk home %s: %s (%s)", self.path, self.io_mode, self.why)
        self._regions: dict[str, _Region] = {}
        self._free: dict[int, list[int]] = {}
        self._end = 0
        fds = (self.fd,) if self._dfd is None else (self.fd, self._dfd)
        self._finalizer = weakref.finalize(self, DiskHome._cleanup, fds, str(self.path))
        atexit.register(self._finalizer)

    @staticmethod
    def _cleanup(fds: tuple[int, ...], path: str) -> None:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        _remove(path)
        _LIVE.discard(os.path.basename(path))

    def describe(self) -> str:
        """The file, the I/O mode and why, and the bytes each descriptor moved so far."""
        return (
            f"{self.path}: {self.io_mode} ({self.why}); {self.bytes_direct / 1e6:.1f} MB direct, "
            f"{self.bytes_buffered / 1e6:.1f} MB buffered"
        )

    def close(self) -> None:
        self._finalizer()

    def region(self, group: str, nbytes: int) -> int:
        """The file offset of ``group``'s region (a new one when the group's size changed)."""
        r = self._regions.get(group)
        if r is None or r.nbytes != nbytes:
            if r is not None:
                self.free(r.offset, r.nbytes)
            r = self._regions[group] = _Region(self.allocate(nbytes), nbytes)
        return r.offset

    def adopt(self, group: str, offset: int, nbytes: int) -> None:
        """Make an allocated span ``group``'s region (the caller forgot its old one)."""
        self._regions[group] = _Region(offset, nbytes)

    def forget(self, group: str) -> None:
        r = self._regions.pop(group, None)
        if r is not None:
            self.free(r.offset, r.nbytes)

    def allocate(self, nbytes: int) -> int:
        """A free span of ``nbytes`` in the file (reused by exact size, else appended); it starts at a
        multiple of ``align`` and takes a whole number of aligned blocks (the direct path needs both)."""
        size = self._rounded(nbytes)
        spare = self._free.get(size)
        if spare:
            return spare.pop()
        offset, self._end = self._end, self._end + size
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        """Give a span back for reuse (its bytes stay until overwritten: scratch, never read again)."""
        self._free.setdefault(self._rounded(nbytes), []).append(offset)

    def _rounded(self, nbytes: int) -> int:
        return (nbytes + self.align - 1) // self.align * self.align

    # -- raw I/O ------------------------------------------------------------------------------
    def pieces(self, offset: int, address: int, nbytes: int) -> list[tuple[int, int, bool]]:
        """How a transfer of ``nbytes`` at file ``offset`` from/to memory at ``address`` splits:
        ``(start, end, direct)`` spans of it. Only whole aligned blocks whose memory is aligned too go
        direct; everything goes buffered when the address cannot meet the offset's alignment."""
        a = self.align
        if self._dfd is None or (address - offset) % a:
            return [(0, nbytes, False)]
        lo, hi = -offset % a, (offset + nbytes) // a * a - offset
        if hi <= lo:
            return [(0, nbytes, False)]
        return [p for p in ((0, lo, False), (lo, hi, True), (hi, nbytes, False)) if p[1] > p[0]]

    def write(self, offset: int, data: torch.Tensor) -> None:
        """Write a contiguous CPU uint8 tensor at ``offset`` (all of it, or ``DiskError("tier")``)."""
        mv = _byte_view(data)
        try:
            for a, b, direct in self.pieces(offset, data.data_ptr(), mv.nbytes):
                self._io(mv[a:b], offset + a, direct, write=True)
        except OSError as exc:
            raise DiskError(
                "tier", f"writing the disk home {str(self.path)!r} failed: {_what(exc)}; nothing was moved"
            ) from None

    def _io(self, mv: memoryview, offset: int, direct: bool, write: bool) -> None:
        """All of ``mv`` to (``write``) or from the file at ``offset``: through the ``O_DIRECT`` descriptor
        where ``direct`` and the length is aligned, else (or once the kernel refuses it: ``EINVAL``) the
        buffered one. A read that ends early raises ``DiskError("tier")``."""
        what = "write" if write else "read"
        while mv.nbytes:
            use_direct = direct and mv.nbytes % self.align == 0
            fd = self._dfd if use_direct else self.fd
            assert fd is not None
            try:
                n = os.pwrite(fd, mv, offset) if write else os.preadv(fd, [mv], offset)
            except OSError as exc:
                if not use_direct or exc.errno != _errno.EINVAL:
                    raise
                _log.debug("disk home %s: direct %s refused at %d (EINVAL); buffered instead", self.path, what, offset)
                direct = False
                continue
            if use_direct:
                self.bytes_direct += max(n, 0)
            else:
                self.bytes_buffered += max(n, 0)
            if n <= 0:
                raise DiskError("tier", f"the disk home {str(self.path)!r} ended early at byte {offset}")
            mv, offset = mv[n:], offset + n

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Fill a contiguous CPU uint8 tensor from ``offset`` (all of it, or ``DiskError("tier")``)."""
        mv = _byte_view(out)
        try:
            for a, b, direct in self.pieces(offset, out.data_ptr(), mv.nbytes):
                self._io(mv[a:b], offset + a, direct, write=False)
        except DiskError:
            raise
        except OSError as exc:
            raise DiskError("tier", f"reading the disk home {str(self.path)!r} failed: {exc.strerror or exc}") from None

    def settle(self, offset: int, nbytes: int) -> None:
        """Push written pages to the disk and out of the page cache (a disk tier saves host memory), and
        make the file cover the whole span (padding after the last slot may never have been written: a
        read of the whole span must not end early; the rest is a hole that reads as zeros)."""
        try:
            if os.fstat(self.fd).st_size < offset + nbytes:
                os.ftruncate(self.fd, offset + nbytes)
            os.fdatasync(self.fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise DiskError("tier", f"flushing the disk home {str(self.path)!r} failed: {_what(exc)}") from None


def windows(spans: list[tuple[int, int]], size: int) -> Iterator[tuple[int, int, list[int]]]:
    """Group consecutive ``(start, end)`` spans (sorted, non-overlapping) into windows of at most ``size``
    bytes (a span larger than ``size`` gets a window of its own): ``(lo, hi, span indices)``."""
    group: list[int] = []
    lo = hi = 0
    for k, (a, b) in enumerate(spans):
        if group and b - lo > size:
            yield lo, hi, group
            group = []
        if not group:
            lo = a
        group.append(k)
        hi = b
    if group:
        yield lo, hi, group


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class OffloadDecision:
    """Where one group goes (``host`` or ``disk``) and how many bytes of it move."""

    group: str
    to: str
    nbytes: int


@dataclass(frozen=True)
class OffloadPlan:
    """``ModelState.plan_offload``'s answer: a decision per group, the host memory held at the peak
    (pinned pool: homes, and the staging windows of a disk offload), and the bytes written to disk."""

    decisions: tuple[OffloadDecision, ...]
    host_peak_bytes: int
    disk_bytes: int

    def describe(self) -> str:
        parts = [f"{d.group} -> {d.to} ({d.nbytes / 1e6:.1f} MB)" for d in self.decisions]
        return f"{', '.join(parts) or 'nothing to move'}; host peak {self.host_peak_bytes / 1e6:.1f} MB, disk {self.disk_bytes / 1e6:.1f} MB"


# --------------------------------------------------------------------------- staged transfers


def extents(runs: tuple[Run, ...], ks: Iterable[int] | None = None) -> list[tuple[int, int]]:
    """The arena spans of runs ``ks`` (sorted; default all), neighbours merged into one span when only padding lies
    between them (a gap of at most ``MAX_GAP`` bytes: layouts align every slot to 64 bytes), so a large
    slot moved in chunks, or slots side by side, become one disk transfer."""
    out: list[tuple[int, int]] = []
    for r in runs if ks is None else (runs[k] for k in ks):
        if out and 0 <= r.start - out[-1][1] <= MAX_GAP:
            out[-1] = (out[-1][0], r.end)
        else:
            out.append((r.start, r.end))
    return out


def staged(buf: torch.Tensor, lo: int, hi: int, align: int) -> torch.Tensor:
    """The part of staging buffer ``buf`` that holds arena bytes ``[lo, hi)``: it starts where the
    address is congruent to ``lo`` modulo ``align``, so an aligned file offset of a region (regions
    start aligned) meets an aligned address and the direct path can take it; at the buffer's start
    when that does not fit (then those bytes go buffered)."""
    s = (lo - buf.data_ptr()) % align
    if s + hi - lo > buf.numel():
        s = 0
    return buf[s : s + hi - lo]


class StagedIO:
    """Moves a plan's runs between slots (or an arena) and a disk region through two pinned windows.

    Device-side copies of window k+1 are in flight while window k is written (or, reading,
    window k+1 is read while window k is copied to the device); a window buffer is reused only
    after the copy that used it completed. Host memory: the two windows, whatever the bytes moved.
    """

    def __init__(self, engine: CopyEngine, pool: HostPool, window: int) -> None:
        self.engine, self.pool, self.window = engine, pool, window
        #: the most arena bytes one window holds (plans through the windows use it as their chunk size):
        #: the window less room to shift its start to the disk's alignment (``staged``)
        self.chunk = window - min(MAX_ALIGN, window // 4)
        self._bufs: list[HostBlock] = []

    def buffers(self) -> list[torch.Tensor]:
        if not self._bufs:
            self.pool.check_room(2 * self.window)
            self._bufs = [self.pool.acquire(self.window) for _ in range(2)]
        return [b.data for b in self._bufs]

    def close(self) -> None:
        for b in self._bufs:
            b.sync()
            self.pool.release(b)
        self._bufs = []

    def out(self, p: Plan, disk: DiskHome, base: int, *, frees_sources: bool = False) -> int:
        """Slots of ``p`` -> disk at ``base`` + each run's arena offset. Returns bytes written.

        A writer thread writes window k (``pwrite`` releases the GIL) while window k+1 is copied in;
        a window is refilled only after its write finished.
        """
        bufs, moved = self.buffers(), 0
        writes: list[Future[int] | None] = [None, None]
        with ThreadPoolExecutor(1, thread_name_prefix="stateshift-disk") as writer:
            for k, (lo, hi, ks) in enumerate(windows([(r.start, r.end) for r in p.runs], self.chunk)):
                done = writes[k % 2]
                if done is not None:
                    moved += done.result()  # (an I/O error surfaces here, before anything changed residency)
                view = staged(bufs[k % 2], lo, hi, disk.align)
                t = self.engine.to_arena(p.window(ks, lo), view, frees_sources=frees_sources)
                nbytes = sum(p.runs[j].nbytes for j in ks)
                writes[k % 2] = writer.submit(self._flush, t, lo, extents(p.runs, ks), view, disk, base, nbytes)
            moved += sum(w.result() for w in writes if w is not None)
        return moved

    @staticmethod
    def _flush(
        t: Transfer, lo: int, spans: list[tuple[int, int]], view: torch.Tensor, disk: DiskHome, base: int, nbytes: int
    ) -> int:
        t.wait()
        for a, b in spans:
            disk.write(base + a, view[a - lo : b - lo])
        return nbytes

    def into(self, p: Plan, disk: DiskHome, base: int) -> Transfer:
        """Disk at ``base`` -> slots of ``p`` (their storage must be there). The last copies may still run.

        A reader thread fills window k+1 (``preadv`` releases the GIL) while window k is copied out.
        """
        bufs, pending, total = self.buffers(), [Transfer(), Transfer()], Transfer()
        spans = list(windows([(r.start, r.end) for r in p.runs], self.chunk))
        views = [staged(bufs[k % 2], lo, hi, disk.align) for k, (lo, hi, _) in enumerate(spans)]

        def read(k: int) -> None:
            lo, _, ks = spans[k]
            pending[k % 2].wait()  # the copy that read this window last is done
            for a, b in extents(p.runs, ks):
                disk.read(base + a, views[k][a - lo : b - lo])

        with ThreadPoolExecutor(1, thread_name_prefix="stateshift-disk") as reader:
            ahead = reader.submit(read, 0) if spans else None
            for k, (lo, _hi, ks) in enumerate(spans):
                assert ahead is not None
                ahead.result()
                ahead = reader.submit(read, k + 1) if k + 1 < len(spans) else None
                pending[k % 2] = self.engine.from_arena(p.window(ks, lo), views[k])
                total = total.merged(pending[k % 2])
        for b, t in zip(self._bufs, pending, strict=True):
            b.pending = t.merged(b.pending)
        return total

    def arena_to_disk(self, p: Plan, arena: torch.Tensor, disk: DiskHome, base: int) -> int:
        """The plan's run spans of an arena -> the disk region (a device arena through the windows)."""
        if arena.is_cpu:
            for a, b in extents(p.runs):
                disk.write(base + a, arena[a:b])
            return sum(r.nbytes for r in p.runs)
        bufs, moved = self.buffers(), 0
        for lo, hi, ks in windows([(r.start, r.end) for r in p.runs], self.chunk):
            view = staged(bufs[0], lo, hi, disk.align)
            self.engine.copy(
                [(view[p.runs[k].start - lo : p.runs[k].end - lo], arena[p.runs[k].start : p.runs[k].end]) for k in ks]
            ).wait()
            for a, b in extents(p.runs, ks):
                disk.write(base + a, view[a - lo : b - lo])
            moved += sum(p.runs[k].nbytes for k in ks)
        return moved

    def disk_to_arena(self, p: Plan, disk: DiskHome, base: int, arena: torch.Tensor) -> Transfer:
        """The disk region -> the plan's run spans of an arena (a device arena through the windows)."""
        if arena.is_cpu:
            for a, b in extents(p.runs):
                disk.read(base + a, arena[a:b])
            return Transfer(nbytes={"disk": sum(r.nbytes for r in p.runs)})
        bufs, t = self.buffers(), Transfer()
        for lo, hi, ks in windows([(r.start, r.end) for r in p.runs], self.chunk):
            t.wait()  # the single window is free again
            view = staged(bufs[0], lo, hi, disk.align)
            for a, b in extents(p.runs, ks):
                disk.read(base + a, view[a - lo : b - lo])
            t = self.engine.copy(
                [(arena[p.runs[k].start : p.runs[k].end], view[p.runs[k].start - lo : p.runs[k].end - lo]) for k in ks]
            )
        self._bufs[0].pending = t.merged(self._bufs[0].pending)
        return t

    def disk_to_disk(self, p: Plan, disk: DiskHome, src: int, dst: int) -> int:
        """The plan's run spans from one region of the file to another, through a window."""
        buf = self.buffers()[0]
        for lo, hi in extents(p.runs):
            for a in range(lo, hi, self.chunk):
                part = staged(buf, a, min(a + self.chunk, hi), disk.align)
                disk.read(src + a, part)
                disk.write(dst + a, part)
        return sum(r.nbytes for r in p.runs)

    def zero(self, p: Plan, disk: DiskHome, base: int) -> None:
        """Zeros into the plan's run spans (dropped slots read as zeros)."""
        buf = self.buffers()[0]
        buf.zero_()
        for lo, hi in extents(p.runs):
            for a in range(lo, hi, self.chunk):
                disk.write(base + a, staged(buf, a, min(a + self.chunk, hi), disk.align))
