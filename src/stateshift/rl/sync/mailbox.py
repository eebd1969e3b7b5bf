"""The control plane of one publisher on one machine: a small JSON mailbox in ``/dev/shm`` and flocks.

Files, all named ``<prefix>...`` in the handle's directory (``<prefix>`` is
``stateshift-sync-<publisher pid>-<token>``):

- ``<prefix>.json``: the mailbox -- the versions visible now (the highest is
  the latest), and one entry per receiver: the version it holds, since when,
  and the version the publisher reclaimed from it (if any). Replaced whole by
  an atomic ``rename``, so a reader never sees half of it.
- ``<prefix>-v<version>.json``: a version's manifest (``manifest.py``), written
  once before the version is listed, removed after it is unlisted.
- ``<prefix>.lock``: ``flock``ed around every read-modify-write of the mailbox
  (short critical sections; a lock dies with its process, so a crash never
  leaves it held).
- ``<prefix>.alive`` and ``<prefix>.r.<receiver>.alive``: each held under an
  exclusive ``flock`` by its process for its whole life; whoever can take
  the lock knows the holder is dead (immune to process-id reuse).

Why a version is never torn: a version's bytes are written before it is
listed and are not written again until it is unlisted; the publisher unlists
a version only under the lock, only if no live receiver's entry holds it, and
a receiver marks the version it reads in its entry under the same lock.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from ...core.pool import remove_stale_files
from ...errors import SyncError
from .handle import NAME
from .manifest import Manifest

#: the mailbox format (2: a ``cuda_ipc`` part carries no reference counter); a receiver refuses any other
MAGIC = "stateshift-sync/2"
MAX_MAILBOX_BYTES = 4 << 20
STALE = re.compile(r"stateshift-sync-(\d+)-[0-9a-f]+(\.json|\.lock|\.alive|\.r\..+\.alive|-v\d+\.json|.*\.tmp)")
#: a mailbox's prefix at the start of each of its files' names
PREFIX = re.compile(r"stateshift-sync-\d+-[0-9a-f]+")
#: a receiver's alive file: (the mailbox's prefix, the receiver's name)
RECEIVER_ALIVE = re.compile(rf"({PREFIX.pattern})\.r\.(.+)\.alive")


class Mailbox:
    """One publisher's mailbox files (see the module doc); used by the publisher and its receivers.

    ``owner``: the publisher, which makes the lock file; a receiver finds it, or learns that the publisher
    closed (its files are gone), and so never leaves a file of the publisher's behind."""

    def __init__(self, directory: str, prefix: str, owner: bool = False) -> None:
        self.directory = directory
        self.prefix = prefix
        self.owner = owner
        self.path = os.path.join(directory, prefix + ".json")
        self._lock_fd: int | None = None
        self._threads = threading.Lock()  # a flock excludes other processes only, not this one's threads

    # -- files ---------------------------------------------------------------------------------
    def manifest_path(self, version: int) -> str:
        return os.path.join(self.directory, f"{self.prefix}-v{version}.json")

    def alive_path(self, receiver: str | None) -> str:
        return os.path.join(
            self.directory, f"{self.prefix}.alive" if receiver is None else f"{self.prefix}.r.{receiver}.alive"
        )

    @staticmethod
    def remove_stale(directory: str, dry_run: bool = False) -> list[str]:
        """Remove the mailbox files of publishers whose process is gone, but not those of one that a live
        receiver still reads: its receivers stay on its last whole version (and time out typed) until they
        close, and the next call removes them. Returns the names removed (``dry_run``: that it would remove)."""
        try:
            names = os.listdir(directory)
        except OSError:
            return []
        read = set()
        for name in names:
            m = RECEIVER_ALIVE.fullmatch(name)
            if m is not None and Mailbox(directory, m.group(1)).is_alive(m.group(2)):
                read.add(m.group(1))

        def keep(name: str) -> bool:
            m = PREFIX.match(name)
            return m is not None and m[0] in read

        return remove_stale_files(directory, STALE, keep=keep, dry_run=dry_run)

    def _write_atomic(self, path: str, data: bytes, keep: bool = False) -> int | None:
        """Write ``data`` to a new file that then replaces ``path`` whole; ``keep``: return a descriptor
        still open on that file (else ``None``)."""
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            unlink_quietly(tmp)
            raise
        if keep:
            return fd
        os.close(fd)
        return None

    def _read_file(self, path: str, limit: int) -> bytes:
        """The bytes of the regular file ``path`` (at most ``limit``). Opened without following a link and
        without blocking, so a FIFO or a device in its place is refused, not waited on."""
        fd = _open_regular(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise SyncError("mailbox", f"{size} bytes, more than {limit}", path=path, field="size")
            return os.read(fd, size + 1)[: limit + 1]
        except OSError as exc:
            raise SyncError("mailbox", f"cannot read: {exc.strerror}", path=path, field="file") from None
        finally:
            os.close(fd)

    # -- the mailbox ------------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the mailbox lock (exclusive ``flock``, and a thread lock; keep the section short)."""
        with self._threads:
            if self._lock_fd is None:
                path = os.path.join(self.directory, self.prefix + ".lock")
                if self.owner:
                    self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
                else:
                    try:
                        self._lock_fd = _open_regular(path, os.O_RDWR)
                    except SyncError:
                        if os.path.lexists(path):
                            raise
                        raise SyncError("closed", "the publisher's files are gone: it closed") from None
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def read(self) -> dict[str, Any]:
        """The mailbox, checked field by field (``SyncError("mailbox")``)."""
        raw = self._read_file(self.path, MAX_MAILBOX_BYTES)
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise SyncError("mailbox", str(exc)[:200], path=self.path, field="json") from None
        return _checked(obj, self.path)

    def write(self, state: dict[str, Any], keep: bool = False) -> int | None:
        """Replace the mailbox with ``state`` (under ``locked``). ``keep``: returns a descriptor open on the
        file written, for ``unchanged`` (the caller closes it); else ``None``."""
        return self._write_atomic(self.path, json.dumps(state).encode(), keep)

    def unchanged(self, fd: int) -> bool:
        """Whether the mailbox is still the file ``fd`` (from ``write(keep=True)``) is open on, so that it
        says exactly what that write said. Why that follows: every write replaces the mailbox with a new
        file, none writes into the current one, and a file kept open cannot have its inode number given to
        another."""
        try:
            now = os.stat(self.path)
        except OSError:
            return False
        was = os.fstat(fd)
        return (now.st_ino, now.st_dev) == (was.st_ino, was.st_dev)

    def remove_left_writes(self) -> list[str]:
        """Remove the temporary files of mailbox writes that never reached their ``rename`` (a writer killed
        inside one); returns their names. Call it under ``locked``: every mailbox write happens under the
        lock, so while it is held no live writer has a temporary file of the mailbox open."""
        start, gone = os.path.basename(self.path) + ".", []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        for name in names:
            if name.startswith(start) and name.endswith(".tmp") and unlink_quietly(os.path.join(self.directory, name)):
                gone.append(name)
        return gone

    def write_manifest(self, manifest: Manifest) -> None:
        self._write_atomic(self.manifest_path(manifest.version), manifest.to_json())

    def read_manifest(self, version: int) -> Manifest:
        from .manifest import MAX_MANIFEST_BYTES

        path = self.manifest_path(version)
        m = Manifest.parse(self._read_file(path, MAX_MANIFEST_BYTES), path)
        if m.version != version:
            raise SyncError("mailbox", f"says {m.version}, listed as {version}", path=path, field="version")
        return m

    # -- liveness -------------------------------------------------------------------------------
    def hold_alive(self, receiver: str | None) -> int:
        """Take the exclusive lock that says this process (the publisher, or ``receiver``) lives; returns
        its descriptor (closing it, or dying, lets go). ``SyncError("mailbox")`` if a live process holds it."""
        fd = os.open(self.alive_path(receiver), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SyncError(
                "mailbox",
                f"{receiver or 'the publisher'} is already running",
                path=self.alive_path(receiver),
                field="name",
            ) from None
        return fd

    def is_alive(self, receiver: str | None) -> bool:
        """Whether the process that holds ``receiver``'s (or the publisher's) alive lock still runs."""
        try:
            fd = os.open(self.alive_path(receiver), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def remove(self, versions: list[int], receivers: list[str]) -> None:
        """Remove the mailbox's files (the publisher's close)."""
        paths = {self.path, self.alive_path(None), os.path.join(self.directory, self.prefix + ".lock")}
        paths |= {self.manifest_path(v) for v in versions} | {self.alive_path(r) for r in receivers}
        try:  # and whatever else carries the prefix: a receiver killed mid-write leaves its temporary file
            ours = (self.prefix + ".", self.prefix + "-v")
            paths |= {os.path.join(self.directory, n) for n in os.listdir(self.directory) if n.startswith(ours)}
        except OSError:
            pass
        for p in sorted(paths):
            try:
                unlink_quietly(p)
            except IsADirectoryError:  # put in a file's place by someone else: removed if it is empty
                with suppress(OSError):
                    os.rmdir(p)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def unlink_quietly(path: str) -> bool:
    """Remove ``path``; whether it was there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def new_state() -> dict[str, Any]:
    return {"magic": MAGIC, "versions": [], "receivers": {}, "closed": False}


def _open_regular(path: str, flags: int) -> int:
    """A descriptor on ``path`` if it is a regular file (``SyncError("mailbox")``, field ``file``, if it cannot be
    opened or is anything else): never follows a link, never blocks on a FIFO."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise SyncError("mailbox", f"cannot open: {exc.strerror}", path=path, field="file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SyncError("mailbox", "not a regular file", path=path, field="file")
    return fd


#: the fields of a receiver's entry, as receivers write them
ENTRY = frozenset({"holding", "since", "reclaimed"})


def _entry_ok(entry: object) -> bool:
    """Whether ``entry`` is a receiver's entry as receivers and the publisher write it: exactly ``ENTRY``, the
    versions held and reclaimed non-negative integers or null, since when a finite number or null."""
    if not isinstance(entry, dict) or entry.keys() != ENTRY:
        return False
    versions_ok = all(v is None or type(v) is int and v >= 0 for v in (entry["holding"], entry["reclaimed"]))
    since = entry["since"]
    return versions_ok and (since is None or type(since) in (int, float) and math.isfinite(since))


def _checked(obj: object, path: str) -> dict[str, Any]:
    if not isinstance(obj, dict) or obj.get("magic") != MAGIC:
        raise SyncError(
            "mailbox",
            f"not a stateshift sync mailbox of format {MAGIC!r} (another stateshift?)",
            path=path,
            field="magic",
        )
    versions, receivers = obj.get("versions"), obj.get("receivers")
    if not isinstance(versions, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in versions):
        raise SyncError("mailbox", f"{str(versions)[:80]!r} is not a list of integers", path=path, field="versions")
    if not isinstance(receivers, dict) or not isinstance(obj.get("closed"), bool):
        raise SyncError("mailbox", "not an object", path=path, field="receivers")
    for name, entry in receivers.items():
        if NAME.fullmatch(name) is None or not _entry_ok(entry):
            raise SyncError("mailbox", "malformed entry", path=path, field=f"receiver {name[:64]!r}")
    return obj
