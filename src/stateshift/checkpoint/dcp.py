"""Resharding through ``torch.distributed.checkpoint`` (DCP), made atomic, verified and safe to inspect.

``save_dcp`` / ``load_dcp`` wrap DCP with the commit of ``commit.commit`` and a manifest of every file's
crc32 and every tensor's global shape and dtype: ``load_dcp`` compares the model with it (no silent cast,
no ignored key), verifies every file, and lets DCP unpickle its ``.metadata`` only when ``trusted=True``
(docs/guide/checkpoints.md, "Sharded models").
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, LayoutError
from . import manifest as mf
from .collective import Collective
from .commit import commit, make_parents, os_failure, write_error
from .directory import Checkpoint, check_args
from .format import FileEntry, file_crc32, open_regular


def _state_dicts(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        out["optim"] = get_optimizer_state_dict(model, optimizer)  # creates the optimizer's state if it has none
    return out


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors under nested dicts, keyed as DCP flattens them (keys joined by dots)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@contextmanager
def _calling_dcp(path: Path, reading: bool) -> Iterator[None]:
    """DCP called inside: its "torch.distributed is disabled" warning silenced (one process, as intended), and an
    error it raises, its ``CheckpointException`` included (a ``BaseException``), raised as ``_failure``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            yield
    except (Exception, CheckpointException) as e:
        raise _failure(e, path, reading) from e


def _failure(e: BaseException, path: Path, reading: bool) -> CheckpointError:
    """What ``load_dcp`` (``reading``: the values are put back) or ``save_dcp`` raises for what DCP raised. An OS
    error behind it (itself, or the first of the ranks' failures its ``CheckpointException`` gathers) is a
    ``"read"`` / ``"write"`` error naming the file; anything else ``"failed"`` / ``"write"``."""
    inner = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
    os_error = next((x for x in (e, *inner) if isinstance(x, OSError)), None)
    name = os.path.basename(os_error.filename) if os_error is not None and os_error.filename else ""
    unchanged = "; the model and optimizer are unchanged"
    if os_error is not None and reading:
        return os_failure("read", os_error, "torch.distributed.checkpoint read it", unchanged, path / name)
    if os_error is not None:
        return write_error(
            path, os_error, "writing with torch.distributed.checkpoint" + (f" ('{name}')" if name else "")
        )
    if reading:
        what = f"torch.distributed.checkpoint failed loading '{path}' ({type(e).__name__}: {e}){unchanged}"
        return CheckpointError("failed", what)
    what = f"torch.distributed.checkpoint failed ({type(e).__name__}: {e}); no checkpoint was created"
    return CheckpointError("write", what, path=path)


def _local_copies(state_dict: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor DCP would write into (this rank's shard of a DTensor), with a host copy of its values."""
    out, seen = [], set()
    for t in _tensors(state_dict).values():
        local = t.to_local() if hasattr(t, "to_local") else t
        if id(local) not in seen:
            seen.add(id(local))
            out.append((local, local.detach().to("cpu", copy=True)))
    return out


def _hash_share(tmp: Path, comm: Collective) -> dict[str, FileEntry]:
    """This rank's share of the files DCP wrote: crc32 and size of each."""
    out = {}
    for name in sorted(os.listdir(tmp))[comm.rank :: comm.world]:
        with open_regular(tmp, name) as (fd, size, path):
            out[mf.check_file_name(name)] = FileEntry(size, file_crc32(fd, size, path))
    return out


def save_dcp(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Any = None,
    *,
    tag: str | None = None,
    version: int | None = None,
    extra: Mapping[str, str] | None = None,
    update_latest: bool = False,
    group: Any = None,
) -> mf.Manifest:
    """Save ``model`` (and ``optimizer``) with ``torch.distributed.checkpoint`` to a new directory ``path``.

    Call on every rank (or in one process without a process group). Any model
    ``get_model_state_dict`` understands works: FSDP2, torch DDP, plain. The tensors must be
    resident. Returns the manifest on every rank; raises on every rank if any failed, and then no
    checkpoint is created (the previous one and ``latest`` are intact).
    """
    import torch.distributed.checkpoint as dcp

    final = Path(os.path.abspath(path))
    extra_d = check_args(tag, version, extra, final if update_latest else None)
    make_parents(final.parent)
    comm = Collective(group)
    state_dict = _state_dicts(model, optimizer)
    tensors = {k: mf.DcpTensor(tuple(t.shape), _dtype(t)) for k, t in _tensors(state_dict).items()}

    def write(tmp: Path) -> dict[str, Any]:
        with _calling_dcp(final, reading=False):
            writer = dcp.FileSystemWriter(tmp, sync_files=True)
            dcp.save(state_dict, storage_writer=writer, process_group=group, no_dist=not comm.on)
        return {"files": _hash_share(tmp, comm)}

    return commit(
        final,
        comm,
        write,
        layout={"format": mf.DCP_FORMAT, "world_size": comm.world},
        per_rank=False,
        update_latest=update_latest,
        backend="dcp",
        tag=tag,
        version=version,
        extra=extra_d,
        dcp_tensors=tensors,
    )


def _check(stored: Mapping[str, mf.DcpTensor], state_dict: dict[str, Any], cast: bool) -> None:
    """Every tensor of ``state_dict`` in the checkpoint with the same global shape and (unless ``cast``)
    dtype, and every checkpoint tensor under the same top-level keys in ``state_dict``."""
    want = _tensors(state_dict)
    for key, t in want.items():
        md = stored.get(key)
        if md is None:
            raise LayoutError(
                "checkpoint_mismatch", "in the model but not in the checkpoint", tensor=key, field="extra"
            )
        if md.shape != tuple(t.shape):
            raise LayoutError(
                "checkpoint_mismatch",
                f"shape is {list(t.shape)} in the model but {list(md.shape)} in the checkpoint",
                tensor=key,
                field="shape",
            )
        if md.dtype != _dtype(t) and not cast:
            raise LayoutError(
                "checkpoint_mismatch",
                f"dtype is {_dtype(t)} in the model but {md.dtype} in the checkpoint; "
                "pass cast=True to convert on load",
                tensor=key,
                field="dtype",
            )
    tops = {k.split(".", 1)[0] for k in state_dict}
    for key in stored:
        if key.split(".", 1)[0] in tops and key not in want:
            raise LayoutError(
                "checkpoint_mismatch", "in the checkpoint but not in the model", tensor=key, field="missing"
            )


def _check_all(ckpt: Checkpoint, state_dict: dict[str, Any], cast: bool, trusted: bool, comm: Collective) -> None:
    """``load_dcp``'s checks on one rank: the tensors (``_check``), the crc32 of ``.metadata`` and of this rank's share
    of the other files, then ``trusted``."""
    _check(ckpt.manifest.dcp_tensors, state_dict, cast)
    others = [n for n in ckpt.manifest.files if n != mf.DCP_METADATA]
    ckpt.verify([n for n in ckpt.manifest.files if n == mf.DCP_METADATA] + others[comm.rank :: comm.world])
    if not trusted:
        raise CheckpointError(
            "untrusted",
            f"'{ckpt.path}': torch.distributed.checkpoint keeps its metadata as a Python pickle, and loading it "
            "can run arbitrary code; pass trusted=True only for a directory you wrote or otherwise trust",
        )


def load_dcp(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Any = None,
    *,
    cast: bool = False,
    trusted: bool = False,
    group: Any = None,
) -> mf.Manifest:
    """Load a ``save_dcp`` checkpoint into ``model`` (and ``optimizer``), on any number of ranks.

    DCP keeps its metadata (``.metadata``) as a Python pickle, and unpickling a crafted file runs
    arbitrary code: pass ``trusted=True`` only for a directory you wrote or otherwise trust;
    without it this raises ``CheckpointError("untrusted")`` before DCP opens anything.

    Checks first, changing nothing on failure: every tensor's name, global shape and dtype against
    the manifest (``LayoutError("checkpoint_mismatch")``; a dtype difference is allowed with ``cast``), then
    the crc32 of every file, ``.metadata`` first (``CheckpointError("corrupt")``; each rank checks
    ``.metadata`` and its share of the rest), then ``trusted``. Then DCP reads and reshards the
    values and ``set_model_state_dict`` / ``set_optimizer_state_dict`` put them in place. The model
    must be resident.

    DCP reads into the live tensors, so each rank first takes a host copy of its local tensors (one
    device-to-host copy, and host memory for this rank's state); if DCP fails part-way (EIO:
    ``CheckpointError("read")`` naming the file; anything else: ``CheckpointError``) they are put back,
    and the model and optimizer are unchanged.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    comm = Collective(group)
    ckpt = Checkpoint.open(path, files=(), kind=mf.DCP_FORMAT)
    state_dict = _state_dicts(model, optimizer)
    comm.run(lambda: _check_all(ckpt, state_dict, cast, trusted, comm), share=False, what=f"checking '{ckpt.path}'")
    copies = _local_copies(state_dict)  # DCP reads into the live tensors: what to put back if it fails part-way
    try:
        with _calling_dcp(ckpt.path, reading=True):
            dcp.load(state_dict, checkpoint_id=os.fspath(ckpt.path), process_group=group, no_dist=not comm.on)
    except BaseException:
        with torch.no_grad():
            for live, saved in copies:
                live.copy_(saved)
        raise
    set_model_state_dict(model, state_dict["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state_dict["optim"])
    return ckpt.manifest
