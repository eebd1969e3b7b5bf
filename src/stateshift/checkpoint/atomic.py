"""Atomic, verified checkpoint directories.

A checkpoint is a directory::

    <path>/
      <file>.safetensors ...   one or more safetensors files (see ``format``)
      manifest.json            written last: its presence means "complete"

Write protocol (:func:`write_checkpoint`):

1. Write everything under a temporary sibling ``.<name>.tmp-<pid>-<rand>``;
   each data file is fsynced, then ``manifest.json`` is written to a temporary
   name, fsynced and renamed in, then the temporary directory is fsynced.
2. Install it: if ``<path>`` does not exist, ``rename(tmp, path)``.  If it does,
   swap the two with ``renameat2(RENAME_EXCHANGE)`` (one atomic step, Linux
   >= 3.15 on ext4/xfs/btrfs/tmpfs).  Where the exchange is not available:
   ``rename(path, .<name>.old-<pid>-<rand>)``, ``rename(tmp, path)``.
3. fsync the parent directory; only then delete the replaced checkpoint, and
   only then (optionally) move the ``latest`` pointer (tmp + fsync + rename +
   fsync), so the pointer never names something that is not durable.

Crash windows (a crash = SIGKILL, power loss, OOM kill):

* during step 1: ``<path>`` still holds the previous checkpoint, untouched; the
  temporary directory has no ``manifest.json`` (or a complete one, if the crash
  came after the manifest was renamed in).  It never looks like ``<path>``.
* exchange path, after the exchange: ``<path>`` is the new checkpoint and the
  temporary name holds the old one; both complete.  ``<path>`` wins.
* fallback path, between the two renames: ``<path>`` is missing, the old
  checkpoint sits at ``.<name>.old-*`` and the new, complete one at
  ``.<name>.tmp-*``.  Readers (:func:`resolve_checkpoint`) then pick the most
  recently created *complete* sibling (the new one); the next write (or
  :func:`recover_checkpoint`) renames it into place once the pid in its name
  is dead.
* after the renames, before the parent fsync: after power loss the directory
  entries may show either state above; both are handled the same way.
* while deleting the replaced checkpoint: a partial ``.old-*`` / ``.tmp-*``
  directory is left; it is ignored and removed by the next write.

Leftover siblings are removed by the next write to the same path only when the
process id in their name is no longer alive on this host, so one writer per
checkpoint path (and per host, for shared file systems) is assumed.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import json
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .format import (
    DEFAULT_CHECKSUM,
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointWriteError,
    ProgressFn,
    SafetensorsHeader,
    TensorInfo,
    TensorRecord,
    _check_destination,
    _split_checksum,
    hash_file,
    read_header,
    read_safetensors_into,
    write_safetensors,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointReader",
    "FileEntry",
    "Manifest",
    "list_tensors",
    "open_checkpoint",
    "read_latest",
    "read_manifest",
    "recover_checkpoint",
    "resolve_checkpoint",
    "set_latest",
    "verify",
    "write_checkpoint",
    "write_checkpoint_distributed",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
#: The one dot-file a checkpoint may list: ``torch.distributed.checkpoint``'s metadata (``save_dcp``).
DCP_METADATA = ".metadata"
FORMAT_NAME = "stateshift-checkpoint"

_SPACE_ERRORS = {
    _errno.ENOSPC: "no space left on device (ENOSPC)",
    _errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    _errno.EFBIG: "file too large (EFBIG: file size limit such as RLIMIT_FSIZE, or the file system's maximum)",
}

# Tests set this to False to exercise the two-rename fallback.
_USE_EXCHANGE = True


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint: size in bytes, whole-file checksum, tensor count."""

    bytes: int
    checksum: str
    tensors: int


@dataclass(frozen=True)
class Manifest:
    """Contents of ``manifest.json``: what was written, by whom, and how to check it."""

    backend: str
    layout: dict[str, Any]
    """Layout fingerprint given by the caller, as stored (JSON: tuples read back as lists)."""
    files: dict[str, FileEntry]
    tag: str | None = None
    version: int | None = None
    extra: dict[str, str] = field(default_factory=dict)
    checksum_algorithm: str = DEFAULT_CHECKSUM
    total_bytes: int = 0
    library_version: str = ""
    torch_version: str = ""
    created: str = ""
    """ISO-8601 UTC time at which the manifest was written."""
    created_unix: float = 0.0
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "backend": self.backend,
            "tag": self.tag,
            "version": self.version,
            "layout": self.layout,
            "checksum_algorithm": self.checksum_algorithm,
            "files": {
                k: {"bytes": v.bytes, "checksum": v.checksum, "tensors": v.tensors} for k, v in self.files.items()
            },
            "total_bytes": self.total_bytes,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "created": self.created,
            "created_unix": self.created_unix,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], d: Any) -> Manifest:
        """Parse a manifest; :class:`CheckpointCorruptError` naming ``path`` if malformed."""
        try:
            if d.get("format") != FORMAT_NAME:
                raise ValueError(f"not a {FORMAT_NAME} manifest")
            fv = int(d["format_version"])
            if fv > FORMAT_VERSION:
                raise ValueError(f"format_version {fv} is newer than this stateshift supports ({FORMAT_VERSION})")
            files = {
                str(k): FileEntry(int(v["bytes"]), str(v["checksum"]), int(v["tensors"])) for k, v in d["files"].items()
            }
            for k, v in files.items():
                _check_file_name(k)
                _split_checksum(os.fspath(path), v.checksum)
            return cls(
                backend=str(d["backend"]),
                layout=d["layout"],
                files=files,
                tag=d.get("tag"),
                version=d.get("version"),
                extra=dict(d.get("extra") or {}),
                checksum_algorithm=str(d["checksum_algorithm"]),
                total_bytes=int(d["total_bytes"]),
                library_version=str(d.get("library_version", "")),
                torch_version=str(d.get("torch_version", "")),
                created=str(d.get("created", "")),
                created_unix=float(d.get("created_unix", 0.0)),
                format_version=fv,
            )
        except CheckpointCorruptError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointCorruptError(path, f"malformed manifest ({type(e).__name__}: {e})") from None


def _library_version() -> str:
    v = getattr(sys.modules.get("stateshift"), "__version__", None)
    if v:
        return str(v)
    try:
        from importlib.metadata import version

        return version("stateshift")
    except Exception:
        return "unknown"


def _check_file_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..", MANIFEST_NAME)
        or (name.startswith(".") and name != DCP_METADATA)
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise ValueError(f"invalid checkpoint file name {name!r} (a plain name, not {MANIFEST_NAME!r})")


# --------------------------------------------------------------------------- fs helpers


def _fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: tmp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            mv = memoryview(data)
            while mv.nbytes:
                mv = mv[os.write(fd, mv) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


_libc: Any = None


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    global _libc
    if not _USE_EXCHANGE or not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    fn = getattr(_libc, "renameat2", None) if _libc else None
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (_errno.EINVAL, _errno.ENOSYS, _errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _siblings(path: Path) -> list[tuple[str, int, Path]]:
    """``(kind, pid, path)`` of ``.<name>.tmp-*`` / ``.<name>.old-*`` next to ``path``."""
    pat = re.compile(rf"^\.{re.escape(path.name)}\.(tmp|old)-(\d+)-[0-9a-f]+$")
    out = []
    try:
        entries = list(os.scandir(path.parent))
    except FileNotFoundError:
        return []
    for e in entries:
        m = pat.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            out.append((m.group(1), int(m.group(2)), Path(e.path)))
    return out


def _load_manifest_file(d: Path) -> Manifest:
    mpath = d / MANIFEST_NAME
    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            d, f"no {MANIFEST_NAME}: the write never finished (the manifest is written last)"
        ) from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorruptError(mpath, f"manifest is not valid JSON ({e})") from None
    return Manifest.from_json(mpath, data)


def _complete_candidates(path: Path) -> list[tuple[float, int, int, Path]]:
    """Complete siblings as ``(created_unix, is_tmp, pid, path)``, newest first."""
    found = []
    for kind, pid, p in _siblings(path):
        try:
            m = _load_manifest_file(p)
        except (CheckpointIncompleteError, CheckpointCorruptError, OSError):
            continue
        found.append((m.created_unix, 1 if kind == "tmp" else 0, pid, p))
    found.sort(reverse=True)
    return found


# --------------------------------------------------------------------------- resolve / recover


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The directory that holds the complete checkpoint for ``path`` (read-only).

    ``path`` itself if it has a manifest.  If ``path`` is missing (a crash
    between the two renames of the fallback install), the most recently created
    complete ``.<name>.tmp-*`` / ``.<name>.old-*`` sibling.  Raises
    :class:`CheckpointIncompleteError` for a directory without manifest and
    :class:`FileNotFoundError` when there is nothing.
    """
    p = Path(os.path.abspath(path))
    if p.is_dir():
        if (p / MANIFEST_NAME).is_file():
            return p
        raise CheckpointIncompleteError(
            p, f"no {MANIFEST_NAME}: the write never finished (the manifest is written last)"
        )
    if p.exists():
        raise NotADirectoryError(f"checkpoint path '{p}' is not a directory")
    cands = _complete_candidates(p)
    if cands:
        return cands[0][3]
    raise FileNotFoundError(f"no checkpoint at '{p}'")


def recover_checkpoint(path: str | os.PathLike[str]) -> Path | None:
    """Repair what a crashed write left next to ``path``; returns the checkpoint or None.

    If ``path`` is missing but a complete sibling exists, it is renamed into
    place (and the parent fsynced).  Then leftover siblings of dead processes
    are deleted.  Safe to call at any time while no other process writes ``path``.
    """
    p = Path(os.path.abspath(path))
    result: Path | None = None
    if not os.path.lexists(p):
        cands = _complete_candidates(p)
        if cands and not _pid_alive(cands[0][2]):  # a live writer is mid-install: leave it alone
            os.rename(cands[0][3], p)
            _fsync_dir(p.parent)
    if p.is_dir() and (p / MANIFEST_NAME).is_file():
        result = p
    for _kind, pid, sib in _siblings(p):
        if not _pid_alive(pid):
            shutil.rmtree(sib, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- writing


def _space_error_detail(e: OSError) -> str:
    return _SPACE_ERRORS.get(
        e.errno or 0, f"{os.strerror(e.errno) if e.errno else e} ({_errno.errorcode.get(e.errno or 0, 'error')})"
    )


def _plan_files(files: Mapping[str, Iterable[TensorRecord]]) -> tuple[dict[str, list[TensorRecord]], int]:
    """Validate file names and records (before anything is written); returns the plan and its data bytes."""
    plan: dict[str, list[TensorRecord]] = {}
    seen: dict[str, str] = {}
    for fname, recs in files.items():
        _check_file_name(fname)
        plan[fname] = list(recs)
        for r in plan[fname]:
            r.validate()
            if r.name in seen:
                raise CheckpointMismatchError(r.name, f"appears in both '{seen[r.name]}' and '{fname}'")
            seen[r.name] = fname
    return plan, sum(r.nbytes for recs in plan.values() for r in recs)


def _check_args(final: Path, backend: str, version: int | None) -> None:
    if not final.parent.is_dir():
        raise FileNotFoundError(f"parent directory of checkpoint '{final}' does not exist")
    if final.is_symlink():
        raise ValueError(f"checkpoint path '{final}' is a symbolic link; write to the real directory")
    if not isinstance(backend, str) or not backend:
        raise ValueError("backend must be a non-empty string")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise TypeError(f"version must be an int or None, got {version!r}")


def _check_target(final: Path) -> bool:
    """Repair crash leftovers; True when a previous complete checkpoint is at ``final``.

    Raises ``FileExistsError`` for anything at ``final`` that is not a checkpoint
    (an empty directory is fine).
    """
    recover_checkpoint(final)
    previous = final.is_dir() and (final / MANIFEST_NAME).is_file()
    if os.path.lexists(final) and not previous:
        if not final.is_dir() or final.is_symlink() or any(os.scandir(final)):
            raise FileExistsError(f"'{final}' exists and is not a stateshift checkpoint; refusing to replace it")
    return previous


def _write_error(final: Path, previous: bool, total: int, e: OSError, stage: str, tmp: Path | None) -> CheckpointWriteError:
    msg = f"{_space_error_detail(e)} while {stage}. "
    msg += (
        f"The previous checkpoint at '{final}' is intact. "
        if previous
        else "No checkpoint existed at that path; none was created. "
    )
    if tmp is not None:
        msg += f"The temporary directory '{tmp.name}' was removed."
    if e.errno in _SPACE_ERRORS:
        msg += f" The checkpoint needs {total} bytes of data; free space (or raise the limit) and retry."
    return CheckpointWriteError(final, msg, e.errno)


def _check_free_space(final: Path, previous: bool, total: int) -> None:
    """Fail fast when the file system clearly cannot hold ``total`` more bytes."""
    try:
        st = os.statvfs(final.parent)
    except (OSError, AttributeError):
        return
    if st.f_bavail * st.f_frsize < total:
        e = OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
        avail = st.f_bavail * st.f_frsize
        raise _write_error(final, previous, total, e, f"checking free space ({avail} bytes available in '{final.parent}')", None)


def _new_tmp(final: Path) -> Path:
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp, 0o755)
    return tmp


def _file_meta(backend: str, tag: str | None, version: int | None) -> dict[str, str]:
    meta = {"format": "pt", "stateshift_format": str(FORMAT_VERSION), "backend": backend}
    if tag is not None:
        meta["tag"] = str(tag)
    if version is not None:
        meta["version"] = str(version)
    return meta


class _Stage:
    """What a write is doing now (for error messages)."""

    def __init__(self) -> None:
        self.now = "creating the temporary directory"


def _write_files(
    tmp: Path,
    plan: Mapping[str, list[TensorRecord]],
    meta: Mapping[str, str],
    checksum: str,
    progress: ProgressFn | None,
    stage: _Stage,
) -> dict[str, FileEntry]:
    entries: dict[str, FileEntry] = {}
    for fname, recs in plan.items():
        stage.now = f"writing '{fname}'"
        d = write_safetensors(tmp / fname, recs, metadata=meta, checksum=checksum, progress=progress)
        entries[fname] = FileEntry(d.size, d.checksum, len(d.tensors))
    return entries


def _make_manifest(
    *,
    backend: str,
    layout: Any,
    files: dict[str, FileEntry],
    tag: str | None,
    version: int | None,
    extra: Mapping[str, str],
    checksum: str,
    total: int,
) -> Manifest:
    now = time.time()
    return Manifest(
        backend=backend,
        layout=layout,
        files=files,
        tag=tag,
        version=version,
        extra=dict(extra),
        checksum_algorithm=checksum,
        total_bytes=total,
        library_version=_library_version(),
        torch_version=str(torch.__version__),
        created=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z",
        created_unix=now,
    )


def _install_or_discard(
    tmp: Path, final: Path, manifest: Manifest, stage: _Stage, previous: Any, update_latest: bool
) -> None:
    """``_install`` a fully written ``tmp``; on failure remove it and raise the typed error
    (the previous checkpoint at ``final`` intact); on success move ``latest`` if asked."""
    try:
        _install(tmp, final, manifest, stage)
    except _Installed as e:
        raise _installed_error(final, e.error, stage) from e.error
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_error(final, previous, manifest.total_bytes, e, stage.now, tmp) from e
        raise
    if update_latest:
        set_latest(final)


def _install(tmp: Path, final: Path, manifest: Manifest, stage: _Stage) -> None:
    """Write the manifest into ``tmp`` and put ``tmp`` in place of ``final`` (see the module doc).

    Raises ``_Installed(e)`` for an error after the new checkpoint is in place.
    """
    parent = final.parent
    stage.now = f"writing '{MANIFEST_NAME}'"
    _write_durable(tmp / MANIFEST_NAME, json.dumps(manifest.to_json(), indent=1).encode())  # fsyncs tmp too
    stage.now = "installing the checkpoint"
    if not os.path.lexists(final):
        os.rename(tmp, final)
        old = None
    elif _rename_exchange(tmp, final):
        old = tmp  # now holds the previous checkpoint
    else:
        old = parent / f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)
            raise
    try:
        stage.now = "syncing the parent directory"
        _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        raise _Installed(e) from e


class _Installed(Exception):
    """An error after the new checkpoint was renamed into place (``__cause__`` is the error)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _installed_error(final: Path, e: BaseException, stage: _Stage) -> BaseException:
    if isinstance(e, OSError):
        return CheckpointWriteError(
            final,
            f"{_space_error_detail(e)} while {stage.now}: the new checkpoint is in place but may not be durable yet.",
            e.errno,
        )
    return e


def write_checkpoint(
    path: str | os.PathLike[str],
    files: Mapping[str, Iterable[TensorRecord]],
    *,
    backend: str,
    layout: Mapping[str, Any],
    tag: str | None = None,
    version: int | None = None,
    extra: Mapping[str, str] | None = None,
    checksum: str = DEFAULT_CHECKSUM,
    progress: ProgressFn | None = None,
    update_latest: bool = False,
) -> Manifest:
    """Write a checkpoint directory at ``path`` atomically; replaces an existing one.

    ``files`` maps file names (``"params.safetensors"``) to the records stored
    in them; tensor names must be unique across the checkpoint.  ``layout`` is
    the caller's JSON-able layout fingerprint, stored verbatim.  ``progress``
    is called with byte increments as data is written.

    Safety: the records' bytes must not change until this returns.  When it
    returns, the checkpoint is durable (files, manifest and directory entries
    fsynced) and, with ``update_latest``, ``<parent>/latest`` names it.
    Until then ``path`` keeps the previous checkpoint (see the module doc for
    crash windows).  OS errors are raised as :class:`CheckpointWriteError`
    (ENOSPC / EDQUOT / EFBIG with an explicit message), after the temporary
    directory was removed; the previous checkpoint is then intact.
    An existing non-empty directory at ``path`` that is not a checkpoint is
    never replaced (``FileExistsError``).
    """
    final = Path(os.path.abspath(path))
    _check_args(final, backend, version)
    layout_d = json.loads(json.dumps(layout))  # JSON-able, and detached from the caller's objects
    extra_d = _check_extra(extra)
    plan, total = _plan_files(files)
    previous = _check_target(final)
    _check_free_space(final, previous, total)

    stage = _Stage()
    tmp: Path | None = None
    try:
        tmp = _new_tmp(final)
        entries = _write_files(tmp, plan, _file_meta(backend, tag, version), checksum, progress, stage)
        manifest = _make_manifest(
            backend=backend, layout=layout_d, files=entries, tag=tag, version=version,
            extra=extra_d, checksum=checksum, total=total,
        )
        _install(tmp, final, manifest, stage)
    except _Installed as e:
        raise _installed_error(final, e.error, stage) from e.error
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_error(final, previous, total, e, stage.now, tmp) from e
        raise
    if update_latest:
        set_latest(final)
    return manifest


def _check_extra(extra: Mapping[str, str] | None) -> dict[str, str]:
    extra_d = dict(extra or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra_d.items()):
        raise TypeError("extra must map str to str")
    return extra_d


# --------------------------------------------------------------------------- writing, one file set per rank


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _raise_collective(
    final: Path, mine: BaseException | None, statuses: list[Any], what: str, previous: bool
) -> None:
    """After a gather of ``(rank, error text or None, ...)``: raise on every rank if any rank failed."""
    failed = [(s[0], s[1]) for s in statuses if s[1] is not None]
    if not failed:
        return
    if mine is not None:
        raise mine
    rank, text = failed[0]
    kept = f"The previous checkpoint at '{final}' is intact." if previous else "No checkpoint was created."
    raise CheckpointWriteError(final, f"rank {rank} failed while {what} ({text}). {kept}")


def write_checkpoint_distributed(
    path: str | os.PathLike[str],
    files: Mapping[str, Iterable[TensorRecord]],
    *,
    backend: str,
    layout: Any,
    common_layout: Mapping[str, Any] | None = None,
    tag: str | None = None,
    version: int | None = None,
    extra: Mapping[str, str] | None = None,
    checksum: str = DEFAULT_CHECKSUM,
    progress: ProgressFn | None = None,
    update_latest: bool = False,
    group: Any = None,
) -> Manifest:
    """Collective :func:`write_checkpoint`: every rank of ``group`` writes its own files into one checkpoint.

    Call on every rank of ``group`` (a ``torch.distributed`` process group,
    default the world) with the same ``path``; each rank passes the files it
    writes (names must differ between ranks, e.g. ``params.rank0-of-2.safetensors``)
    and its own ``layout``.  Rank 0 prepares the temporary directory; every
    rank writes and fsyncs its files into it; after all have reported, rank 0
    writes the manifest (``layout`` = ``{**common_layout, "world_size": w,
    "ranks": [layout of rank 0, ...]}``) and installs the directory exactly as
    :func:`write_checkpoint` does.  Returns the manifest on every rank.

    Failure on any rank (bad input, ENOSPC, ...) raises on *every* rank: the
    failing rank its own error, the others :class:`CheckpointWriteError`
    naming the failing rank.  The temporary directory is removed and the
    previous checkpoint is intact.  The ranks must share the file system.
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    final = Path(os.path.abspath(path))

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj, group=group)
        return out

    # 1. validate everywhere; rank 0 prepares the temporary directory.
    mine: BaseException | None = None
    previous = False
    tmp: Path | None = None
    plan: dict[str, list[TensorRecord]] = {}
    total = 0
    stage = _Stage()
    try:
        _check_args(final, backend, version)
        layout_d = json.loads(json.dumps(layout))
        common_d = json.loads(json.dumps(dict(common_layout or {})))
        extra_d = _check_extra(extra)
        plan, total = _plan_files(files)
        if rank == 0:
            previous = _check_target(final)
            tmp = _new_tmp(final)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the gather
        mine = e
    statuses = gather((rank, None if mine is None else _describe(mine), str(tmp) if tmp else None, previous, total))
    previous = bool(statuses[0][3])
    if any(s[1] is not None for s in statuses) and rank == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_collective(final, mine, statuses, "checking the checkpoint", previous)
    tmp = Path(statuses[0][2])
    all_total = sum(int(s[4]) for s in statuses)

    # 2. every rank writes its files.
    entries: dict[str, FileEntry] = {}
    try:
        if rank == 0:
            _check_free_space(final, previous, all_total)
        entries = _write_files(tmp, plan, _file_meta(backend, tag, version), checksum, progress, stage)
    except BaseException as e:  # noqa: BLE001
        mine = _write_error(final, previous, total, e, f"{stage.now} on rank {rank}", tmp) if isinstance(e, OSError) else e
    statuses = gather(
        (rank, None if mine is None else _describe(mine), {k: (v.bytes, v.checksum, v.tensors) for k, v in entries.items()}, layout_d if mine is None else None)
    )
    if any(s[1] is not None for s in statuses) and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_collective(final, mine, statuses, "writing its files", previous)

    # 3. rank 0 writes the manifest and installs; everyone learns the outcome.
    result: list[Any] = [None]
    if rank == 0:
        try:
            files_all: dict[str, FileEntry] = {}
            for s in statuses:
                for k, (b, c, n) in s[2].items():
                    if k in files_all:
                        raise CheckpointMismatchError(k, f"file written by two ranks (rank {s[0]} and another)")
                    files_all[k] = FileEntry(b, c, n)
            full_layout = {**common_d, "world_size": world, "ranks": [s[3] for s in statuses]}
            manifest = _make_manifest(
                backend=backend, layout=full_layout, files=files_all, tag=tag, version=version,
                extra=extra_d, checksum=checksum, total=all_total,
            )
            _install_or_discard(tmp, final, manifest, stage, previous, update_latest)
            result = [(None, manifest.to_json())]
        except BaseException as e:  # noqa: BLE001
            mine = e
            result = [(_describe(e), None)]
    dist.broadcast_object_list(result, src=_global_rank(group, 0), group=group)
    err, mjson = result[0]
    if err is not None:
        if mine is not None:
            raise mine
        raise CheckpointWriteError(final, f"rank 0 failed while installing the checkpoint ({err})")
    return Manifest.from_json(final / MANIFEST_NAME, mjson)


def _global_rank(group: Any, rank: int) -> int:
    import torch.distributed as dist

    if group is None:
        return rank
    return dist.get_global_rank(group, rank)


# --------------------------------------------------------------------------- latest pointer


def set_latest(path: str | os.PathLike[str], *, pointer: str = "latest") -> Path:
    """Point ``<parent>/<pointer>`` at the complete checkpoint ``path``; returns the pointer file.

    The pointer is written atomically (tmp + fsync + rename + fsync of the
    parent).  On failure it still names the previous checkpoint and
    :class:`CheckpointWriteError` says so.
    """
    p = Path(os.path.abspath(path))
    _load_manifest_file(p)  # only ever point at a complete checkpoint
    ptr = p.parent / pointer
    try:
        if ptr.is_file() and ptr.read_text().strip() == p.name:
            return ptr
        _write_durable(ptr, (p.name + "\n").encode())
    except OSError as e:
        raise CheckpointWriteError(
            ptr, f"{_space_error_detail(e)} while updating the pointer; it still names the previous checkpoint", e.errno
        ) from e
    return ptr


def read_latest(root: str | os.PathLike[str], *, pointer: str = "latest") -> Path | None:
    """The checkpoint named by ``<root>/<pointer>``, or None if there is no pointer."""
    ptr = Path(root) / pointer
    try:
        name = ptr.read_text().strip()
    except FileNotFoundError:
        return None
    if not name or "/" in name or name in (".", ".."):
        raise CheckpointCorruptError(ptr, f"pointer holds {name!r}, not a checkpoint name")
    return Path(os.path.abspath(root)) / name


# --------------------------------------------------------------------------- reading


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the complete checkpoint at ``path`` (see :func:`resolve_checkpoint`)."""
    return _load_manifest_file(resolve_checkpoint(path))


class CheckpointReader:
    """Read access to one complete checkpoint; opening parses and size-checks every header.

    Holds no open file descriptors between calls.
    """

    def __init__(self, path: str | os.PathLike[str], *, files: Iterable[str] | None = None) -> None:
        """``files``: only these files are opened and indexed (e.g. one rank's files of a
        per-rank checkpoint, whose files hold tensors of the same names); default all.
        Files that are not ``.safetensors`` (a ``torch.distributed.checkpoint``
        directory's) are size-checked and verified by :func:`verify`, not indexed.
        """
        self.path: Path = resolve_checkpoint(path)
        self.manifest: Manifest = _load_manifest_file(self.path)
        self._headers: dict[str, SafetensorsHeader] = {}
        self._index: dict[str, tuple[str, TensorInfo]] = {}
        wanted = None if files is None else set(files)
        if wanted is not None:
            unknown = sorted(wanted - set(self.manifest.files))
            if unknown:
                raise CheckpointMismatchError(unknown[0], f"no such file in checkpoint '{self.path}'")
        for fname, entry in self.manifest.files.items():
            if wanted is not None and fname not in wanted:
                continue
            fpath = self.path / fname
            try:
                size = os.stat(fpath).st_size
            except FileNotFoundError:
                raise CheckpointCorruptError(fpath, "listed in the manifest but missing") from None
            if size != entry.bytes:
                what = "truncated" if size < entry.bytes else "longer than recorded"
                raise CheckpointCorruptError(fpath, f"file {what}: {size} bytes, manifest says {entry.bytes}")
            if not fname.endswith(".safetensors"):
                continue
            hdr = read_header(fpath)
            if len(hdr.tensors) != entry.tensors:
                raise CheckpointCorruptError(
                    fpath, f"header lists {len(hdr.tensors)} tensors, manifest says {entry.tensors}"
                )
            self._headers[fname] = hdr
            for info in hdr.tensors:
                if info.name in self._index:
                    raise CheckpointCorruptError(
                        fpath, f"tensor '{info.name}' also stored in '{self._index[info.name][0]}'"
                    )
                self._index[info.name] = (fname, info)

    def records(self) -> list[TensorInfo]:
        """Every stored tensor (name, dtype, shape, nbytes, file, offset), file by file."""
        return [info for hdr in self._headers.values() for info in hdr.tensors]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def info(self, name: str) -> TensorInfo:
        try:
            return self._index[name][1]
        except KeyError:
            raise CheckpointMismatchError(name, f"not stored in checkpoint '{self.path}'") from None

    def read_into(self, dsts: Mapping[str, torch.Tensor], *, progress: ProgressFn | None = None) -> None:
        """Read the named tensors straight into caller buffers and verify them.

        ``dsts`` maps tensor names to contiguous CPU tensors (``uint8`` or the
        stored dtype, e.g. pinned homes) of exactly the stored size; all are
        checked before anything is read (:class:`CheckpointMismatchError`).
        Every file that holds a requested tensor is streamed once in full and
        its checksum verified.

        Safety: the destinations are safe to use only after this returns.  If
        any file is corrupt it raises :class:`CheckpointCorruptError` naming
        the file and the destinations hold unspecified bytes, so read into
        staging buffers, never into live state you cannot lose.
        """
        by_file: dict[str, dict[str, torch.Tensor]] = {}
        for name, dst in dsts.items():
            info = self.info(name)
            _check_destination(info, dst)
            by_file.setdefault(info.file, {})[name] = dst
        for fname, entry in self.manifest.files.items():
            if fname in by_file:
                read_safetensors_into(
                    self.path / fname,
                    by_file[fname],
                    expected_checksum=entry.checksum,
                    expected_size=entry.bytes,
                    expected_header=self._headers[fname],
                    progress=progress,
                )

    def read_tensors(
        self, names: Iterable[str] | None = None, *, progress: ProgressFn | None = None
    ) -> dict[str, torch.Tensor]:
        """Allocate fresh CPU tensors and :meth:`read_into` them (all tensors by default)."""
        wanted = list(self._index) if names is None else list(names)
        out = {}
        for n in wanted:
            info = self.info(n)
            out[n] = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(out, progress=progress)
        return out


def open_checkpoint(path: str | os.PathLike[str]) -> CheckpointReader:
    """Open the complete checkpoint at ``path``; see :class:`CheckpointReader`."""
    return CheckpointReader(path)


def list_tensors(path: str | os.PathLike[str]) -> list[TensorInfo]:
    """Tensors of a checkpoint (name, dtype, shape, nbytes, file) for ``stateshift inspect``.

    File by file; a per-rank checkpoint lists each rank's tensors under the same names.
    """
    manifest = read_manifest(path)
    out: list[TensorInfo] = []
    for fname in manifest.files:
        if fname.endswith(".safetensors"):
            out.extend(CheckpointReader(path, files=[fname]).records())
    return out


def verify(path: str | os.PathLike[str], *, files: Iterable[str] | None = None) -> Manifest:
    """Re-hash every file of the checkpoint (or only ``files``); raises
    :class:`CheckpointCorruptError` naming the first bad file."""
    manifest = read_manifest(path)
    names = list(manifest.files) if files is None else list(files)
    root = resolve_checkpoint(path)
    for fname in names:
        reader = CheckpointReader(root, files=[fname])  # size and header checks first
        entry = reader.manifest.files[fname]
        fpath = reader.path / fname
        size, got = hash_file(fpath, _split_checksum(os.fspath(fpath), entry.checksum))
        if size != entry.bytes:
            raise CheckpointCorruptError(
                fpath, f"file changed size while verifying: {size} bytes, manifest says {entry.bytes}"
            )
        if got != entry.checksum:
            raise CheckpointCorruptError(
                fpath, f"checksum mismatch: manifest says {entry.checksum}, file hashes to {got}"
            )
    return manifest
