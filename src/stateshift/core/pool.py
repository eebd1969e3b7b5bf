"""Pinned host pool: exact sizes, reuse, a byte budget, statistics.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned caching
allocator rounds every request up to a power of two (5 GiB asked -> 8 GiB
pinned) and pins at about 2 GB/s. Here each block is an anonymous ``mmap`` of
exactly the bytes asked for, registered with ``cudaHostRegister``; a released
block goes back to a free list keyed by its exact size, so the second
snapshot of the same state allocates nothing.

A new block is what makes a state's first offload or snapshot slow: the kernel
must fault in (and zero) every page before it can be pinned. ``cudaHostRegister``
faults them in on one thread. The pool first writes a new block of two
``TOUCH_MIN_BYTES`` or more on several threads of its own (``_touch``: ``memset``
through ctypes, which runs without the GIL), whatever torch's thread count
(the RL loop runs torch on one thread). Measured on H200 hosts (16 cores,
2026-12-04, a one-off probe of each way to make a pinned block): a fresh 2 GiB block
took 617 ms registered alone and 458-467 ms through ``HostPool.acquire``, with
torch on 1 or on 16 threads; 8 GiB took 2.7-3.1 s registered alone, 1.9 s
touched by ``zero_`` on 16 threads, 3.4-4.3 s through torch's own pinned
allocator. A touch through torch on one thread was slower than none (2 GiB:
904 against 617 ms); ``MADV_HUGEPAGE`` and ``MADV_POPULATE_WRITE`` did about
as well as a plain write.

Safety: a block carries the transfer that last touched it (``pending``).
``acquire`` waits for that transfer before handing a reused block out, so a
block is never rewritten while a copy still reads or writes it.

On a machine without an accelerator (or with ``pin=False``) blocks are plain
host memory; everything else behaves the same.

Shared blocks (``HostPool(shared=True)``): each block is a file in ``shm_dir``
(``/dev/shm``: memory, not disk) of exactly its size, mapped ``MAP_SHARED``
and registered like any other block, so another process can map the same
pages (``HostBlock.file``) and read a snapshot or a home without a copy
(``stateshift.rl.sync``). The file is named after this process's id; it is
removed when the block is freed, when the pool goes, at exit, and -- for a
process that was killed -- by the next shared pool that starts on the machine.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import re
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from ..errors import BudgetError, StateError

if TYPE_CHECKING:
    from .layout import Layout
    from .transfer import Transfer

_log = logging.getLogger("stateshift")

#: Requests at least this large get their own ``mmap`` (page aligned, returned
#: to the OS on ``trim``); smaller ones come from torch's CPU allocator.
MMAP_MIN_BYTES = 1 << 20
#: A new block to be pinned is touched first on one thread per this many bytes (up to ``TOUCH_THREADS``), from
#: two such parts up (module doc).
TOUCH_MIN_BYTES = 64 << 20
TOUCH_THREADS = 16
#: Name of a shared block's file: ``stateshift-pool-<pid>-<pool>-<n>``.
SHARED_PREFIX = "stateshift-pool-"
#: the whole name of one, group 1 the pid of the process that made it (``remove_stale_files``)
SHARED_FILE = re.compile(r"stateshift-pool-(\d+)-[0-9a-f]+-\d+")


@dataclass(eq=False)
class HostBlock:
    """One host buffer of exactly ``nbytes`` bytes, owned through a reference count.

    Owners are homes and snapshots. A block with more than one owner is
    shared copy-on-write: nobody writes it; a writer first takes a block of
    its own. ``data`` is safe to read on the host only after ``sync()``.
    """

    data: torch.Tensor
    nbytes: int
    pinned: bool
    refs: int = 0
    pending: Transfer | None = None
    _mm: mmap.mmap | None = field(default=None, repr=False)
    #: the file behind a shared block (``HostPool(shared=True)``), ``None`` otherwise
    path: str | None = None
    _regions_layout: object = field(default=None, repr=False)
    _regions: list[torch.Tensor] = field(default_factory=list, repr=False)

    def regions(self, layout: Layout) -> list[torch.Tensor]:
        """Views of this block's regions under ``layout``, cached for the last layout asked."""
        if self._regions_layout is not layout:
            self._regions = layout.regions(self.data)
            self._regions_layout = layout
        return self._regions

    @property
    def shared(self) -> bool:
        return self.refs > 1

    @property
    def file(self) -> tuple[str, int, int] | None:
        """``(path, offset, nbytes)`` of this block's bytes in a file another process can map
        (a block of a shared pool), or ``None``. Safe to read there only after ``sync()`` here."""
        return None if self.path is None else (self.path, 0, self.nbytes)

    def sync(self) -> None:
        """Block the host until the last transfer touching this block has completed."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


@dataclass(frozen=True)
class PoolStats:
    """A point-in-time view of the pool. ``held`` = ``in_use`` + ``idle``."""

    pinned: bool
    held_bytes: int
    in_use_bytes: int
    idle_bytes: int
    peak_held_bytes: int
    requested_bytes: int
    allocations: int
    reuses: int
    frees: int
    budget_bytes: int | None

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def _cuda_register(ptr: int, nbytes: int) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    code = int(getattr(rc, "value", rc))
    if code != 0:
        raise StateError("no_pinning", f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")


def _touch(ptr: int, nbytes: int) -> None:
    """Fault in the pages of ``[ptr, ptr + nbytes)`` (fresh anonymous memory: writing zeros changes no
    value) on up to ``TOUCH_THREADS`` threads, one per ``TOUCH_MIN_BYTES``; nothing below two."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(TOUCH_THREADS, cores, nbytes // TOUCH_MIN_BYTES)
    if workers < 2:
        return
    step = -(-nbytes // workers // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="stateshift-touch") as ex:
            list(ex.map(lambda a: ctypes.memset(ptr + a, 0, min(step, nbytes - a)), range(0, nbytes, step)))
    except RuntimeError:  # no new thread (interpreter shutdown): the register faults the pages in itself
        pass


def _cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostPool:
    """Exact-size host buffers, allocated once and reused.

    Args:
        pin: ``"auto"`` pins when CUDA is available; ``True`` requires pinning
            (``StateError("no_pinning")`` on a machine without CUDA); ``False``
            never pins.
        budget_bytes: the most bytes the pool may hold (in use plus idle).
            Idle blocks are freed to make room; past that ``acquire`` raises
            ``BudgetError("pool")`` and changes nothing.
        shared: back every block by a file in ``shm_dir`` that other processes
            can map (``HostBlock.file``; module doc).
        shm_dir: where shared blocks' files live.
    """

    def __init__(
        self,
        *,
        pin: bool | Literal["auto"] = "auto",
        budget_bytes: int | None = None,
        shared: bool = False,
        shm_dir: str = "/dev/shm",
    ) -> None:
        if pin not in (True, False, "auto"):
            raise ValueError(f"pin must be True, False or 'auto', not {pin!r}")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, not {budget_bytes}")
        cuda = torch.cuda.is_available()
        if pin is True and not cuda:
            raise StateError(
                "no_pinning",
                "pin=True but no CUDA device is available; use pin='auto' to fall back to plain host memory",
            )
        self.pinned: bool = cuda if pin == "auto" else bool(pin)
        self.budget_bytes = budget_bytes
        self.shared = bool(shared)
        self.shm_dir = shm_dir
        if self.shared:
            if not os.path.isdir(shm_dir):
                raise ValueError(f"shm_dir {shm_dir!r} is not a directory")
            remove_stale_files(shm_dir, SHARED_FILE)
        self._serial = 0
        self._lock = threading.Lock()
        self._idle: dict[int, list[HostBlock]] = {}
        self._in_use: set[int] = set()
        self._blocks: dict[int, HostBlock] = {}
        self._held = 0
        self._in_use_bytes = 0
        self._peak = 0
        self._requested = 0
        self._allocations = 0
        self._reuses = 0
        self._frees = 0
        weakref.finalize(self, HostPool._free_all, self._blocks, os.getpid())

    # -- public ---------------------------------------------------------------------------
    def acquire(self, nbytes: int) -> HostBlock:
        """A block of exactly ``nbytes`` bytes with one owner, safe to write on the host now."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, not {nbytes}")
        with self._lock:
            self._requested += nbytes
            bucket = self._idle.get(nbytes)
            if bucket:
                block = bucket.pop()
                self._reuses += 1
            else:
                self._make_room(nbytes)
                block = self._allocate(nbytes)
                self._allocations += 1
            block.refs = 1
            self._in_use.add(id(block))
            self._in_use_bytes += nbytes
        block.sync()
        return block

    def check_room(self, nbytes: int, *, freeing: int = 0) -> None:
        """Raise ``BudgetError("pool")`` now if blocks of ``nbytes`` bytes in all could not be acquired.

        ``freeing``: bytes of blocks the caller will release before acquiring.
        Verbs call this before they change anything, so a budget error leaves
        the state as it was (idle blocks are freed by ``acquire`` as needed).
        """
        if self.budget_bytes is None:
            return
        with self._lock:
            if self._in_use_bytes - freeing + nbytes > self.budget_bytes:
                raise BudgetError(
                    "pool",
                    f"host pool budget {self.budget_bytes} bytes: {self._in_use_bytes} in use, "
                    f"{nbytes} more needed{f' ({freeing} to be freed first)' if freeing else ''}",
                )

    def retain(self, block: HostBlock) -> HostBlock:
        """Add an owner (copy-on-write sharing)."""
        with self._lock:
            if block.refs <= 0:
                raise RuntimeError("retain of a block that is not in use")
            block.refs += 1
        return block

    def release(self, block: HostBlock) -> None:
        """Drop an owner; the last owner returns the block to the free list (its memory stays held)."""
        with self._lock:
            if block.refs <= 0:
                raise RuntimeError("release of a block that is not in use")
            block.refs -= 1
            if block.refs == 0:
                self._in_use.discard(id(block))
                self._in_use_bytes -= block.nbytes
                self._idle.setdefault(block.nbytes, []).append(block)

    def trim(self, keep_bytes: int = 0) -> int:
        """Free idle blocks (largest first) until at most ``keep_bytes`` idle bytes are held; returns bytes freed."""
        with self._lock:
            return self._trim_locked(keep_bytes)

    @property
    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                pinned=self.pinned,
                held_bytes=self._held,
                in_use_bytes=self._in_use_bytes,
                idle_bytes=self._held - self._in_use_bytes,
                peak_held_bytes=self._peak,
                requested_bytes=self._requested,
                allocations=self._allocations,
                reuses=self._reuses,
                frees=self._frees,
                budget_bytes=self.budget_bytes,
            )

    # -- internals ------------------------------------------------------------------------
    def _make_room(self, nbytes: int) -> None:
        if self.budget_bytes is None or self._held + nbytes <= self.budget_bytes:
            return
        idle = self._held - self._in_use_bytes
        if self._in_use_bytes + nbytes > self.budget_bytes:
            raise BudgetError(
                "pool",
                f"host pool budget {self.budget_bytes} bytes: {self._in_use_bytes} in use, "
                f"{nbytes} more asked ({idle} idle bytes could be freed, not enough)",
            )
        freed = self._trim_locked(max(0, self.budget_bytes - self._in_use_bytes - nbytes))
        _log.info("host pool: freed %d idle bytes to stay within its budget of %d bytes", freed, self.budget_bytes)

    def _trim_locked(self, keep_bytes: int) -> int:
        freed = 0
        sizes = sorted(self._idle, reverse=True)
        for size in sizes:
            bucket = self._idle[size]
            while bucket and self._held - self._in_use_bytes > keep_bytes:
                block = bucket.pop()
                self._free(block)
                freed += block.nbytes
            if not bucket:
                del self._idle[size]
        return freed

    def _shared_map(self, nbytes: int) -> tuple[mmap.mmap, str]:
        """A new file of exactly ``nbytes`` bytes in ``shm_dir``, mapped shared (private to this user)."""
        vfs = os.statvfs(self.shm_dir)
        if vfs.f_bavail * vfs.f_frsize < nbytes:  # a mapped page past a full tmpfs is a SIGBUS, not an error: ask first
            raise BudgetError(
                "pool",
                f"shared host block of {nbytes} bytes: {self.shm_dir} has {vfs.f_bavail * vfs.f_frsize} bytes free",
            )
        self._serial += 1
        path = os.path.join(self.shm_dir, f"{SHARED_PREFIX}{os.getpid()}-{id(self):x}-{self._serial}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), path
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    def _allocate(self, nbytes: int) -> HostBlock:
        mm, path = None, None
        if self.shared and nbytes > 0:
            mm, path = self._shared_map(nbytes)
            data = torch.frombuffer(mm, dtype=torch.uint8)
        elif nbytes >= MMAP_MIN_BYTES:
            mm = mmap.mmap(-1, nbytes)
            data = torch.frombuffer(mm, dtype=torch.uint8)
        else:
            data = torch.empty(nbytes, dtype=torch.uint8)
        pinned = False
        if self.pinned and nbytes > 0:
            if mm is not None:
                _touch(data.data_ptr(), nbytes)
            try:
                _cuda_register(data.data_ptr(), nbytes)
                pinned = True
            except StateError as exc:  # (of kind "no_pinning": all that _cuda_register raises)
                warnings.warn(f"{exc}; this block stays pageable (copies to and from it are slower)", stacklevel=3)
        block = HostBlock(data=data, nbytes=nbytes, pinned=pinned, _mm=mm, path=path)
        self._blocks[id(block)] = block
        self._held += nbytes
        _log.debug(
            "host pool: new %s block of %d bytes (%d held)", "pinned" if pinned else "pageable", nbytes, self._held
        )
        self._peak = max(self._peak, self._held)
        return block

    def _free(self, block: HostBlock) -> None:
        block.sync()
        if block.pinned:
            _cuda_unregister(block.data.data_ptr())
        del self._blocks[id(block)]
        self._held -= block.nbytes
        self._frees += 1
        block.data = torch.empty(0, dtype=torch.uint8)
        block._regions, block._regions_layout = [], None
        if block._mm is not None:
            block._mm.close()
            block._mm = None
        _unlink(block)

    @staticmethod
    def _free_all(blocks: dict[int, HostBlock], pid: int) -> None:
        if os.getpid() != pid:  # a forked child exiting: the files and registrations are its parent's
            return
        for block in list(blocks.values()):
            _unlink(block)
            if block.pinned and torch.cuda.is_available():
                try:
                    block.sync()
                    _cuda_unregister(block.data.data_ptr())
                except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
                    pass


def _unlink(block: HostBlock) -> None:
    """Remove a shared block's file (processes that mapped it keep their mapping)."""
    if block.path is not None:
        try:
            os.unlink(block.path)
        except FileNotFoundError:
            pass
        block.path = None


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (a zombie counts as alive until reaped). An id no
    process can have (past a C ``pid_t``, as a file name may say) is not alive."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def remove_stale_files(
    directory: str,
    pattern: re.Pattern[str],
    keep: Callable[[str], bool] = lambda name: False,
    dry_run: bool = False,
) -> list[str]:
    """Remove the files in ``directory`` whose whole name matches ``pattern`` (its group 1 a process id)
    and whose process is gone: what a killed process left behind, but for those ``keep`` names and those
    a live process holds a ``flock`` on (``hold_in_use``: a receiver reading a dead publisher's last
    version). Returns the names removed (``dry_run``: those it would remove, removing none). A process of
    another user counts as alive; a name that vanishes meanwhile (another sweep) is not counted."""
    removed = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))) or keep(name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            fd = None  # (a link, or a file of another user: removed by name all the same)
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while it goes: nobody takes it meanwhile
            if not dry_run:
                os.unlink(path)
            removed.append(name)
        except OSError:  # (BlockingIOError: in use)
            pass
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def hold_in_use(fd: int) -> None:
    """Mark the file ``fd`` is open on as in use for as long as ``fd`` stays open (a shared ``flock``), so that
    ``remove_stale_files`` leaves it even after the process that made it died. Best effort: a sweep that holds
    the file at this moment wins (the file's memory stays readable through a mapping made from ``fd``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pass
