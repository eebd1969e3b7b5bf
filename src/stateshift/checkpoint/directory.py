"""A checkpoint directory: found, opened safely, read and verified -- and written.

``Checkpoint.open`` resolves a checkpoint (or what ``latest`` names), says what anything else is, decodes
the manifest once and checks each file it will use (regular file, size, header crc32, header) before a
byte of data is read. ``write_checkpoint`` checks the records, then ``commit.commit`` writes them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, DiskError, LayoutError
from . import format as fmt, manifest as mf
from .collective import Collective
from .commit import check_latest_name, commit, fsync_path, os_failure, read_latest, step
from .format import FileEntry, ProgressFn, Record

_HF_FILES = re.compile(
    r"^(config\.json|model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors|pytorch_model.*\.bin)$"
)


def _not_a_checkpoint(p: Path) -> Exception:
    """Why the directory ``p`` (no manifest, no ``latest``) is not a checkpoint."""
    names = sorted(os.listdir(p))
    if re.match(r"^\..+\.tmp-[0-9a-f]+$", p.name):
        return CheckpointError(
            "incomplete",
            "the temporary directory of a write that never finished, or is still "
            "under way (the manifest is written last); the next write to the same "
            "path removes it once its writer is gone",
            path=p,
        )
    if not names:
        return CheckpointError("not_found", "an empty directory", path=p)
    if any(_HF_FILES.match(n) for n in names):
        return CheckpointError(
            "not_found",
            "a Hugging Face export (model.safetensors / config.json), not a stateshift "
            "checkpoint; load it with safetensors or transformers' from_pretrained",
            path=p,
        )
    if mf.DCP_METADATA in names:
        return CheckpointError(
            "not_found", "a torch.distributed.checkpoint directory without a stateshift manifest", path=p
        )
    if any(n.endswith(".safetensors") for n in names):
        return CheckpointError(
            "incomplete", f"no {mf.MANIFEST_NAME}: not a complete checkpoint (it is written last)", path=p
        )
    return CheckpointError(
        "not_found", f"no {mf.MANIFEST_NAME} and no latest pointer among its {len(names)} entries", path=p
    )


def resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``path`` stands for: itself, or what its ``latest`` names."""
    p = Path(os.path.abspath(path))
    if not p.is_dir():
        raise CheckpointError("not_found", "nothing there" if not os.path.lexists(p) else "not a directory", path=p)
    if os.path.lexists(p / mf.MANIFEST_NAME):
        return p
    latest = read_latest(p)
    if latest is None:
        raise _not_a_checkpoint(p)
    if not os.path.lexists(latest / mf.MANIFEST_NAME):
        raise (
            _not_a_checkpoint(latest)
            if latest.is_dir()
            else CheckpointError("not_found", "latest names nothing", path=latest)
        )
    return latest


@contextmanager
def _reading(
    path: str | os.PathLike[str], errors: type[OSError] | tuple[type[OSError], ...] = OSError
) -> Iterator[None]:
    """Our own reads inside: an OS error (of ``errors``) is ``CheckpointError("read")`` naming ``path``; a
    ``CheckpointError`` or a missing file passes as it is. Wraps no caller code: an OS error raised by a
    caller's callback is the caller's, not a read's."""
    try:
        yield
    except errors as e:
        if isinstance(e, (CheckpointError, FileNotFoundError)):
            raise
        raise os_failure("read", e, "reading it", "; a load stops here and leaves the model unchanged", path) from e


class Checkpoint:
    """One complete checkpoint, opened: its decoded manifest, and the files checked so far."""

    def __init__(self, path: Path, manifest: mf.Manifest) -> None:
        self.path = path
        self.manifest = manifest
        #: each checked file's header bytes: the same bytes found again are not parsed again
        self._headers: dict[str, bytes | None] = {}

    @classmethod
    @fmt.without_gc
    def open(cls, path: str | os.PathLike[str], *, files: Iterable[str] | None = None, kind: str = "") -> Checkpoint:
        """Resolve, decode the manifest and check ``files`` (default: all) -- see the module doc. An OS error
        while any of it is read (``latest``, the manifest, a header: EIO, ...) is ``CheckpointError("read")``;
        a layout format other than ``kind`` (if given) is ``LayoutError("checkpoint_mismatch")``."""
        with _reading(os.path.abspath(path)):
            root = resolve(path)
        with _reading(root / mf.MANIFEST_NAME):
            ckpt = cls(root, mf.read(root))
        if kind and ckpt.manifest.kind != kind:
            use = {mf.STATE_FORMAT: "; use load", mf.DCP_FORMAT: "; use load_dcp"}.get(ckpt.manifest.kind, "")
            what = f"'{root}' holds layout format {ckpt.manifest.kind!r}, not {kind!r}{use}"
            raise LayoutError("checkpoint_mismatch", what, tensor="(checkpoint)")
        ckpt.check(ckpt.manifest.files if files is None else files)
        return ckpt

    def check(self, files: Iterable[str]) -> None:
        """Open each of ``files`` and check its size and header against the manifest (``file``)."""
        for name in files:
            with self.file(name):
                pass

    @contextmanager
    def file(self, name: str) -> Iterator[tuple[int, FileEntry, str]]:
        """``(fd, entry, path)`` of one file, its size and header checked against the manifest."""
        entry = self.manifest.files.get(name)
        if entry is None:
            raise LayoutError("checkpoint_mismatch", f"no such file in checkpoint '{self.path}'", tensor=name)
        with ExitStack() as opened:
            try:
                with _reading(self.path / name):
                    fd, size, path = opened.enter_context(fmt.open_regular(self.path, name))
                    self._headers[name] = mf.check_file(fd, size, entry, path, self._headers.get(name))
            except FileNotFoundError:
                raise CheckpointError("corrupt", "listed in the manifest but missing", path=self.path / name) from None
            yield fd, entry, path

    def read_into(self, file: str, dsts: Mapping[str, torch.Tensor | None], progress: ProgressFn | None = None) -> None:
        """Read tensors of ``file`` straight into caller buffers and verify them (``format.read_into``:
        pass staging memory, since a corrupt file leaves them unspecified). A failing read (EIO, ...) is
        ``CheckpointError("read")`` naming the file and the tensor; what ``progress`` raises passes as it is."""
        with self.file(file) as (fd, entry, path), _reading(path, DiskError):
            fmt.read_into(fd, entry, dsts, path, progress)

    def verify(self, files: Iterable[str] | None = None) -> mf.Manifest:
        """Hash every file (or ``files``) against the manifest; ``CheckpointError("corrupt")`` naming the first bad one."""
        for name in self.manifest.files if files is None else files:
            with self.file(name) as (fd, entry, path), _reading(path, DiskError):
                if entry.header is not None:
                    fmt.read_into(fd, entry, {t.name: None for t in entry.tensors}, path)
                elif fmt.file_crc32(fd, entry.bytes, path) != entry.crc32:
                    raise CheckpointError("corrupt", f"checksum mismatch: manifest says {entry.checksum}", path=path)
        return self.manifest


@fmt.without_gc
def verify(path: str | os.PathLike[str]) -> mf.Manifest:
    """Check a checkpoint against its manifest, reading every byte: every file's size, header and
    checksums (a crc32 per tensor). Returns the manifest; raises ``CheckpointError("corrupt")`` naming
    the first bad file (and tensor), and what ``Checkpoint.open`` raises for what is not a checkpoint.
    Never unpickles anything (a DCP checkpoint's files are only hashed)."""
    return Checkpoint.open(path).verify()


# --------------------------------------------------------------------------- writing


def _plan(files: Mapping[str, Iterable[Record]]) -> tuple[dict[str, list[Record]], int]:
    """Check names and records before anything is written; returns the plan and its data bytes."""
    plan: dict[str, list[Record]] = {}
    seen: dict[str, str] = {}
    for fname, recs in files.items():
        mf.check_file_name(fname)
        if not fname.endswith(".safetensors"):
            raise ValueError(f"data file {fname!r} must end with .safetensors")
        plan[fname] = list(recs)
        for r in plan[fname]:
            r.validate()
            if r.name in seen:
                raise LayoutError(
                    "checkpoint_mismatch", f"appears in both '{seen[r.name]}' and '{fname}'", tensor=r.name
                )
            seen[r.name] = fname
    return plan, sum(r.nbytes for recs in plan.values() for r in recs)


def check_args(tag: Any, version: Any, extra: Mapping[str, str] | None, latest: Path | None = None) -> dict[str, str]:
    """``tag`` a str or None, ``version`` an int or None, ``extra`` str -> str; returns ``extra`` as a dict.
    Text must be valid UTF-8, ``version`` within what a manifest holds and ``latest`` (the path that is to
    become latest) a name the pointer holds: what a load would refuse is refused before anything is written."""
    if latest is not None:
        check_latest_name(latest)
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"tag must be a str or None, got {tag!r}")
    if version is not None and (type(version) is not int):
        raise TypeError(f"version must be an int or None, got {version!r}")
    if version is not None and not -(1 << 62) < version < 1 << 62:
        raise ValueError(f"version must be within +-2**62, got {version}")
    out = dict(extra or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in out.items()):
        raise TypeError("extra must map str to str")
    bad = next((t for t in (tag, *out.keys(), *out.values()) if t is not None and not fmt.is_utf8(t)), None)
    if bad is not None:
        raise ValueError(f"tag and extra must be valid UTF-8 text, got {bad!r}")
    return out


def write_checkpoint(
    path: str | os.PathLike[str],
    files: Mapping[str, Iterable[Record]],
    *,
    backend: str,
    layout: Mapping[str, Any],
    rank_layout: Mapping[str, Any] | None = None,
    tag: str | None = None,
    version: int | None = None,
    extra: Mapping[str, str] | None = None,
    progress: ProgressFn | None = None,
    update_latest: bool = False,
    comm: Collective | None = None,
) -> mf.Manifest:
    """Write a new checkpoint directory of safetensors files at ``path`` (``commit`` says how).

    ``files`` maps file names to the records stored there (names unique per rank). ``layout`` is
    stored in the manifest; with ``rank_layout`` every rank of ``comm`` passes its own and
    the manifest's layout gets ``world_size`` and ``ranks``. The records' bytes must not change
    until this returns; then the checkpoint is durable (and ``latest`` names it if asked).
    """
    final = Path(os.path.abspath(path))
    comm = comm or Collective(enabled=False)
    extra_d = check_args(tag, version, extra, final if update_latest else None)
    plan, nbytes = _plan(files)
    meta = {"format": "pt", "stateshift_format": str(mf.FORMAT_VERSION), "backend": backend}
    meta.update({k: str(v) for k, v in (("tag", tag), ("version", version)) if v is not None})

    write_file = partial(fmt.write_file, metadata=meta, progress=progress, fsync=False)

    def write(tmp: Path) -> dict[str, Any]:
        entries, synced = {}, []
        with ThreadPoolExecutor(1, thread_name_prefix="stateshift-fsync") as syncer:  # k syncs while k+1 is written
            for fname, recs in plan.items():
                entries[fname] = step(final, f"writing '{fname}'", nbytes, partial(write_file, str(tmp / fname), recs))
                synced.append((fname, syncer.submit(fsync_path, tmp / fname)))
            for fname, done in synced:
                step(final, f"syncing '{fname}'", nbytes, done.result)
        return {"files": entries, "layout": rank_layout}

    return commit(
        final,
        comm,
        write,
        layout=layout,
        per_rank=rank_layout is not None,
        nbytes=nbytes,
        update_latest=update_latest,
        backend=backend,
        tag=tag,
        version=version,
        extra=extra_d,
    )
