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

Errors: a full disk or an I/O error while writing raises ``DiskTierError`` before any
slot changes residency (the values are still where they were).
"""

from __future__ import annotations

import atexit
import errno as _errno
import logging
import os
import re
import secrets
import socket
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DiskTierError
from .pool import HostBlock, HostPool
from .transfer import CopyEngine, Plan, Transfer

_log = logging.getLogger("stateshift")
ALIGN = 4096  #: group regions start at multiples of this (page and typical block size)
DISK_WINDOW = 64 << 20  #: default size of each of the two staging windows
_NAME = re.compile(r"^stateshift-(?P<host>[^-]+)-(?P<pid>\d+)-[0-9a-f]+\.disk$")


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor (no copy)."""
    import ctypes

    n = t.numel()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: Path) -> list[Path]:
    """Remove disk homes of this host whose process is gone; returns what was removed."""
    removed = []
    host = socket.gethostname().replace("-", "_")
    for entry in directory.iterdir() if directory.is_dir() else ():
        m = _NAME.match(entry.name)
        if m and m["host"] == host and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
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


class DiskHome:
    """One scratch file and the region of each group in it (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskTierError(f"cannot use {str(self.directory)!r} for disk homes: {exc.strerror or exc}") from None
        sweep_stale(self.directory)
        host = socket.gethostname().replace("-", "_")
        self.path = self.directory / f"stateshift-{host}-{os.getpid()}-{secrets.token_hex(6)}.disk"
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DiskTierError(f"cannot create a disk home in {str(self.directory)!r}: {exc.strerror or exc}") from None
        self._regions: dict[str, _Region] = {}
        self._free: dict[int, list[int]] = {}
        self._end = 0
        self._finalizer = weakref.finalize(self, DiskHome._cleanup, self.fd, str(self.path))
        atexit.register(self._finalizer)

    @staticmethod
    def _cleanup(fd: int, path: str) -> None:
        try:
            os.close(fd)
        except OSError:
            pass
        _remove(path)

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

    def forget(self, group: str) -> None:
        r = self._regions.pop(group, None)
        if r is not None:
            self.free(r.offset, r.nbytes)

    def allocate(self, nbytes: int) -> int:
        """A free span of ``nbytes`` in the file (reused by exact size, else appended)."""
        size = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        spare = self._free.get(size)
        if spare:
            return spare.pop()
        offset, self._end = self._end, self._end + size
        return offset

    def free(self, offset: int, nbytes: int) -> None:
        """Give a span back for reuse (its bytes stay until overwritten: scratch, never read again)."""
        self._free.setdefault((nbytes + ALIGN - 1) // ALIGN * ALIGN, []).append(offset)

    # -- raw I/O ------------------------------------------------------------------------------
    def write(self, offset: int, data: torch.Tensor) -> None:
        """Write a contiguous CPU uint8 tensor at ``offset`` (all of it, or ``DiskTierError``)."""
        mv = _byte_view(data)
        try:
            while mv.nbytes:
                n = os.pwrite(self.fd, mv, offset)
                mv, offset = mv[n:], offset + n
        except OSError as exc:
            full = exc.errno in (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG)
            what = "the disk is full" if full else (exc.strerror or str(exc))
            raise DiskTierError(f"writing the disk home {str(self.path)!r} failed: {what}; nothing was moved") from None

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Fill a contiguous CPU uint8 tensor from ``offset``."""
        mv = _byte_view(out)
        while mv.nbytes:
            n = os.preadv(self.fd, [mv], offset)
            if n <= 0:
                raise DiskTierError(f"the disk home {str(self.path)!r} ended early at byte {offset}")
            mv, offset = mv[n:], offset + n

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
            full = exc.errno in (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG)
            what = "the disk is full" if full else (exc.strerror or str(exc))
            raise DiskTierError(f"flushing the disk home {str(self.path)!r} failed: {what}") from None


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


class StagedIO:
    """Moves a plan's runs between slots (or an arena) and a disk region through two pinned windows.

    Device-side copies of window k+1 are in flight while window k is written (or, reading,
    window k+1 is read while window k is copied to the device); a window buffer is reused only
    after the copy that used it completed. Host memory: the two windows, whatever the bytes moved.
    """

    def __init__(self, engine: CopyEngine, pool: HostPool, window: int) -> None:
        self.engine, self.pool, self.window = engine, pool, window
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
            for k, (lo, hi, ks) in enumerate(windows([(r.start, r.end) for r in p.runs], self.window)):
                done = writes[k % 2]
                if done is not None:
                    moved += done.result()  # (an I/O error surfaces here, before anything changed residency)
                t = self.engine.to_arena(p.window(ks, lo), bufs[k % 2][: hi - lo], frees_sources=frees_sources)
                writes[k % 2] = writer.submit(self._flush, t, lo, ks, bufs[k % 2], disk, base, p)
            moved += sum(w.result() for w in writes if w is not None)
        return moved

    @staticmethod
    def _flush(t: Transfer, lo: int, ks: list[int], buf: torch.Tensor, disk: DiskHome, base: int, p: Plan) -> int:
        t.wait()
        moved = 0
        for k in ks:
            run = p.runs[k]
            disk.write(base + run.start, buf[run.start - lo : run.end - lo])
            moved += run.nbytes
        return moved

    def into(self, p: Plan, disk: DiskHome, base: int) -> Transfer:
        """Disk at ``base`` -> slots of ``p`` (their storage must be there). The last copies may still run.

        A reader thread fills window k+1 (``preadv`` releases the GIL) while window k is copied out.
        """
        bufs, pending, total = self.buffers(), [Transfer(), Transfer()], Transfer()
        spans = list(windows([(r.start, r.end) for r in p.runs], self.window))

        def read(k: int) -> None:
            lo, _, ks = spans[k]
            pending[k % 2].wait()  # the copy that read this window last is done
            for j in ks:
                run = p.runs[j]
                disk.read(base + run.start, bufs[k % 2][run.start - lo : run.end - lo])

        with ThreadPoolExecutor(1, thread_name_prefix="stateshift-disk") as reader:
            ahead = reader.submit(read, 0) if spans else None
            for k, (lo, hi, ks) in enumerate(spans):
                assert ahead is not None
                ahead.result()
                ahead = reader.submit(read, k + 1) if k + 1 < len(spans) else None
                pending[k % 2] = self.engine.from_arena(p.window(ks, lo), bufs[k % 2][: hi - lo])
                total = total.merged(pending[k % 2])
        for b, t in zip(self._bufs, pending, strict=True):
            b.pending = t.merged(b.pending)
        return total

    def arena_to_disk(self, p: Plan, arena: torch.Tensor, disk: DiskHome, base: int) -> int:
        """The plan's run spans of an arena -> the disk region (a device arena through the windows)."""
        if arena.is_cpu:
            for run in p.runs:
                disk.write(base + run.start, arena[run.start : run.end])
            return sum(r.nbytes for r in p.runs)
        bufs, moved = self.buffers(), 0
        for lo, hi, ks in windows([(r.start, r.end) for r in p.runs], self.window):
            buf = bufs[0][: hi - lo]
            self.engine.copy([(buf[p.runs[k].start - lo : p.runs[k].end - lo], arena[p.runs[k].start : p.runs[k].end]) for k in ks]).wait()
            for k in ks:
                disk.write(base + p.runs[k].start, buf[p.runs[k].start - lo : p.runs[k].end - lo])
                moved += p.runs[k].nbytes
        return moved

    def disk_to_arena(self, p: Plan, disk: DiskHome, base: int, arena: torch.Tensor) -> Transfer:
        """The disk region -> the plan's run spans of an arena (a device arena through the windows)."""
        if arena.is_cpu:
            for run in p.runs:
                disk.read(base + run.start, arena[run.start : run.end])
            return Transfer(nbytes={"disk": sum(r.nbytes for r in p.runs)})
        bufs, t = self.buffers(), Transfer()
        for lo, hi, ks in windows([(r.start, r.end) for r in p.runs], self.window):
            t.wait()  # the single window is free again
            buf = bufs[0][: hi - lo]
            for k in ks:
                disk.read(base + p.runs[k].start, buf[p.runs[k].start - lo : p.runs[k].end - lo])
            t = self.engine.copy([(arena[p.runs[k].start : p.runs[k].end], buf[p.runs[k].start - lo : p.runs[k].end - lo]) for k in ks])
        self._bufs[0].pending = t.merged(self._bufs[0].pending)
        return t

    def disk_to_disk(self, p: Plan, disk: DiskHome, src: int, dst: int) -> int:
        """The plan's run spans from one region of the file to another, through a window."""
        buf, moved = self.buffers()[0], 0
        for run in p.runs:
            for a in range(run.start, run.end, self.window):
                part = buf[: min(self.window, run.end - a)]
                disk.read(src + a, part)
                disk.write(dst + a, part)
            moved += run.nbytes
        return moved

    def zero(self, p: Plan, disk: DiskHome, base: int) -> None:
        """Zeros into the plan's run spans (dropped slots read as zeros)."""
        buf = self.buffers()[0]
        buf.zero_()
        for run in p.runs:
            for a in range(run.start, run.end, self.window):
                disk.write(base + a, buf[: min(self.window, run.end - a)])
