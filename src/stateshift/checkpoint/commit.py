"""Committing a checkpoint: a fresh locked temporary directory, fsync, the manifest, rename, ``latest`` last.

A save never writes into an existing checkpoint; a crash or a full disk at any point leaves no ``<name>`` or
the complete one, and writers racing to one path are told apart by an ``flock`` on each temporary name
(docs/guide/checkpoints.md, "Atomic, never overwritten"). ``latest`` holds one plain name of a real
directory beside it.
"""

from __future__ import annotations

import errno as errno_mod
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, DiskError, LayoutError, show
from . import manifest as mf
from .collective import Collective
from .format import FileEntry, open_regular, write_all
from .manifest import MANIFEST_NAME

LATEST = "latest"
_HEX_TAIL = re.compile(r"[0-9a-f]+")
_MAX_TRIES = 100

_SPACE = {
    errno_mod.ENOSPC: "no space left on device (ENOSPC)",
    errno_mod.EDQUOT: "disk quota exceeded (EDQUOT)",
    errno_mod.EFBIG: "file too large (EFBIG: a file size limit such as RLIMIT_FSIZE, or the file system's maximum)",
}


def describe_os_error(e: OSError) -> str:
    code = e.errno or 0
    return _SPACE.get(code, f"{os.strerror(code) if code else e} ({errno_mod.errorcode.get(code, 'error')})")


def os_failure(kind: Any, e: OSError, doing: str, then: str, path: str | os.PathLike[str]) -> CheckpointError:
    """``CheckpointError(kind)`` for the OS error ``e`` while ``doing`` (e.g. "writing 'f'"): what failed, the tensor
    whose bytes failed where ``e`` knows it, and ``then``, what that left (e.g. "; the model is unchanged")."""
    tensor = DiskError.tensor_of(e)
    where = "" if tensor is None else f" (tensor {show(tensor)})"
    return CheckpointError(
        kind, f"{describe_os_error(e)} while {doing}{where}{then}", path=path, errno=e.errno, tensor=tensor
    )


def write_error(final: Path, e: OSError, doing: str, nbytes: int = 0) -> CheckpointError:
    """``os_failure`` of a write of the checkpoint ``final``: nothing was created, and how much room it needs."""
    then = (
        f". No checkpoint was created at '{final}' and its temporary directory was removed; the previous "
        "checkpoint (and the latest pointer) is intact."
    )
    if e.errno in _SPACE and nbytes:
        then += f" The checkpoint needs {nbytes} bytes of data; free space (or raise the limit) and retry."
    return os_failure("write", e, doing, then, final)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by its path."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool | None:
    """An exclusive ``flock`` on ``fd``, without waiting: True if taken, False if another open file holds it,
    None where the file system has no ``flock`` (then nobody can tell a live writer's file from a dead one's)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _is(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def create_locked(parent: Path, prefix: str, directory: bool) -> tuple[Path, int]:
    """A new ``<parent>/<prefix><random hex>`` (a directory, or an empty file; those dead writers left removed
    first) and an open descriptor holding its ``flock``: while it is open, ``clear_dead`` leaves it alone. (A
    clean-up may take the lock between the creation and ours; then the name is given up and another one made.)"""
    clear_dead(parent, prefix, directory)
    for _ in range(_MAX_TRIES):
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        if directory:
            os.mkdir(path, 0o755)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:  # removed by a clean-up before we could open it
                continue
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        if _try_lock(fd) is not False and _is(fd, path):
            return path, fd
        os.close(fd)
    raise OSError(
        errno_mod.EAGAIN,
        f"could not create a temporary {'directory' if directory else 'file'} "
        f"'{parent / prefix}*' that stays: {_MAX_TRIES} were removed as soon as they were made",
    )


def clear_dead(parent: Path, prefix: str, directory: bool) -> None:
    """Remove every ``<prefix><hex>`` in ``parent`` (directories, or regular files) that its writer left when it
    died: one whose ``flock`` this call can take. A live writer's (it holds the lock) is left, and so is
    everything where the file system has no ``flock``. Errors removing one are ignored (the next save retries)."""
    for entry in os.scandir(parent):
        if not (entry.name.startswith(prefix) and _HEX_TAIL.fullmatch(entry.name, len(prefix))):
            continue
        if not (entry.is_dir(follow_symlinks=False) if directory else entry.is_file(follow_symlinks=False)):
            continue
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_DIRECTORY if directory else 0)
        try:
            fd = os.open(entry.path, flags)
        except OSError:  # gone meanwhile (another writer's clean-up), or not ours to open
            continue
        try:
            if _try_lock(fd) and _is(fd, Path(entry.path)):  # dead: its lock died with its writer
                if directory:
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        except OSError:
            pass
        finally:
            os.close(fd)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Replace the file ``path`` atomically and durably: the body writes the yielded temporary sibling
    ``.<name>.tmp-<hex>`` (made empty, and locked by this writer until it is renamed: ``create_locked``); then it
    is fsynced, renamed over ``path`` and the directory fsynced. On any error it is removed."""
    tmp, fd = create_locked(path.parent, f".{path.name}.tmp-", directory=False)
    try:
        yield tmp
        os.fsync(fd)  # (the file's data, whichever descriptor wrote it)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)
    fsync_path(path.parent)


def write_durable(path: Path, data: bytes) -> None:
    """``data`` to ``path`` atomically and durably (``replacing``)."""
    with replacing(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
        try:
            write_all(fd, [memoryview(data)], 0, str(tmp))
        finally:
            os.close(fd)


def make_parents(directory: Path) -> None:
    """Create missing directories down to ``directory`` (like ``mkdir -p``), each made durable in its parent."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_path(d.parent)


# --------------------------------------------------------------------------- the latest pointer


def check_latest_name(final: Path) -> None:
    """``ValueError`` unless ``final``'s name reads back from ``latest`` as itself (``read_latest`` strips it)."""
    if final.name != final.name.strip() or not final.name.isprintable():  # (isprintable: no line break, no surrogate)
        raise ValueError(f"a checkpoint that becomes latest needs a printable name, unpadded, not {final.name!r}")


def set_latest(path: str | os.PathLike[str]) -> Path:
    """Point ``<parent>/latest`` at the complete checkpoint ``path``; returns the pointer file.

    On failure the pointer still names the previous checkpoint and ``CheckpointError("write")`` says so
    (``ValueError``, nothing written, for a name it cannot hold: ``check_latest_name``)."""
    final = Path(os.path.abspath(path))
    check_latest_name(final)
    if not (final / MANIFEST_NAME).is_file() or final.is_symlink():
        raise CheckpointError(
            "incomplete", f"no {MANIFEST_NAME}: only a complete checkpoint can become latest", path=final
        )
    pointer = final.parent / LATEST
    try:
        write_durable(pointer, (final.name + "\n").encode())
    except OSError as e:
        raise os_failure("write", e, "updating the pointer", "; it still names the previous checkpoint", pointer) from e
    return pointer


def read_latest(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``<root>/latest`` names (a real directory inside ``root``), or ``None`` if there is no pointer."""
    root_p = Path(os.path.abspath(root))
    try:
        with open_regular(root_p, LATEST) as (fd, size, path):
            name = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    if not name or "/" in name or "\0" in name or name in (".", "..") or size > 4096:
        raise CheckpointError(
            "corrupt", "latest does not hold the plain name of a checkpoint in this directory", path=path
        )
    if os.path.islink(root_p / name):
        raise CheckpointError(
            "corrupt", f"latest names a symbolic link ({name!r}); refusing to follow it", path=root_p / name
        )
    return root_p / name


# --------------------------------------------------------------------------- the commit protocol


def _begin(final: Path) -> tuple[str, int]:
    """Rank 0, step 1: check the path, clear dead writers' leftovers, create the temporary directory; returns it
    and the descriptor holding its lock (``create_locked``), to be closed once the directory is renamed or removed."""
    if not final.parent.is_dir():
        raise FileNotFoundError(f"parent directory of checkpoint '{final}' does not exist")
    if final.is_symlink() or (os.path.lexists(final) and (not final.is_dir() or any(os.scandir(final)))):
        raise FileExistsError(
            f"'{final}' exists; checkpoints are never overwritten: save to a new directory "
            "(e.g. step-N) and move latest (update_latest=True), or remove it first"
        )
    prefix = f".{final.name}.tmp-"

    def make() -> tuple[str, int]:
        clear_dead(final.parent, f".{LATEST}.tmp-", directory=False)
        tmp, fd = create_locked(final.parent, prefix, directory=True)
        return str(tmp), fd

    return step(final, "creating its temporary directory", 0, make)


def _check_space(final: Path, nbytes: int) -> None:
    """Fail before writing when the file system clearly cannot hold ``nbytes`` more bytes."""
    st = os.statvfs(final.parent)
    if st.f_bavail * st.f_frsize < nbytes:
        raise OSError(errno_mod.ENOSPC, f"{st.f_bavail * st.f_frsize} bytes available")


def _rename(tmp: Path, final: Path) -> None:
    """``tmp`` to ``final``, durably. Never over a checkpoint: a directory is renamed over an empty one only, so
    a writer that finds ``final`` completed by another (after its ``_begin`` found it free) fails here."""
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno not in (errno_mod.ENOTEMPTY, errno_mod.EEXIST, errno_mod.ENOTDIR, errno_mod.EISDIR):
            raise
        raise CheckpointError(
            "write",
            f"another writer created '{final.name}' while this one wrote it; checkpoints "
            "are never overwritten: this write was discarded (its temporary directory removed) and "
            "what the other wrote is untouched. Save each checkpoint from one process (rank 0, or "
            "distributed=True on every rank)",
            path=final,
            errno=e.errno,
        ) from e
    fsync_path(final.parent)


def step(final: Path, doing: str, nbytes: int, fn: Callable[[], Any]) -> Any:
    """``fn()``, an OS error it raises while ``doing`` part of the write of ``final`` made a ``write_error``."""
    try:
        return fn()
    except CheckpointError:
        raise
    except OSError as e:
        raise write_error(final, e, doing, nbytes) from e


def _manifest(reports: list[dict[str, Any]], layout: Mapping[str, Any], per_rank: bool, fields: Any) -> mf.Manifest:
    """Rank 0's manifest: every rank's files (no name written by two), ``layout`` (with ``world_size`` and every
    rank's own layout when ``per_rank``) and the manifest's other ``fields``."""
    files: dict[str, FileEntry] = {}
    for rank, report in enumerate(reports):
        for name, entry in report["files"].items():
            if name in files:
                raise LayoutError(
                    "checkpoint_mismatch", f"file written by two ranks (rank {rank} and another)", tensor=name
                )
            files[name] = entry
    full = dict(layout)
    if per_rank:
        full.update(world_size=len(reports), ranks=[r["layout"] for r in reports])
    return mf.make(layout=full, files=files, **fields)


def commit(
    final: Path,
    comm: Collective,
    write: Callable[[Path], dict[str, Any]],
    *,
    layout: Mapping[str, Any],
    per_rank: bool,
    nbytes: int = 0,
    update_latest: bool = False,
    **fields: Any,
) -> mf.Manifest:
    """Write a new checkpoint at ``final`` on every rank of ``comm`` (see the module doc); returns its manifest.

    ``write(tmp)`` writes this rank's files into the temporary directory and returns its picklable report,
    ``{"files": {name: FileEntry}, "layout": this rank's layout}``; rank 0 then writes the manifest (``_manifest``).
    ``nbytes``: what this rank writes (checked against the free space first). Any failure raises on every rank
    (``CheckpointError("write")`` naming the failing rank on the others), after the temporary directory was removed."""
    tmp: list[Path] = []
    lock: list[int] = []  # rank 0: the descriptor holding the temporary directory's lock
    built: list[mf.Manifest] = []

    def failed(rank: int, text: str) -> BaseException:
        return CheckpointError("write", f"rank {rank} failed ({text})", path=final)

    def cleanup() -> None:
        if comm.rank == 0 and tmp:
            shutil.rmtree(tmp[0], ignore_errors=True)

    def begin() -> str | None:
        if comm.rank != 0:
            return None
        path, fd = _begin(final)
        lock.append(fd)
        return path

    def write_mine() -> Any:
        step(final, "checking the free space", nbytes, lambda: _check_space(final, nbytes))
        return write(tmp[0])

    def install() -> bytes | None:
        if comm.rank != 0:
            return None
        built.append(_manifest(reports, layout, per_rank, fields))
        data = mf.dumps(built[0])
        # the manifest (which fsyncs tmp: every entry of it is durable), then the rename, each made durable
        step(final, f"writing '{MANIFEST_NAME}'", nbytes, lambda: write_durable(tmp[0] / MANIFEST_NAME, data))
        step(final, "renaming the checkpoint into place", nbytes, lambda: _rename(tmp[0], final))
        if update_latest:
            set_latest(final)
        return data

    try:
        tmp.append(Path(comm.run(begin, what="preparing", error=failed)[0]))
        reports = comm.run(write_mine, what="writing its files", error=failed, cleanup=cleanup)
        data = comm.run(install, what="installing the checkpoint", error=failed, cleanup=cleanup)[0]
    finally:
        for fd in lock:  # (after the rename or the removal: the temporary name is gone)
            os.close(fd)
    # rank 0 built it (and wrote exactly its bytes): not decoded again; the other ranks decode what it sent
    return built[0] if built else mf.loads(data, str(final / MANIFEST_NAME))
