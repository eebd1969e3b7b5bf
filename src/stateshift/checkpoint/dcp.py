"""Resharding checkpoints through ``torch.distributed.checkpoint`` (DCP), made atomic and verified.

``save`` writes each rank's own shard and loads on the same world size
only; to load onto another number of ranks (2 -> 1, FSDP2 -> plain model)
use these thin wrappers over ``torch.distributed.checkpoint`` and its
``get_state_dict``/``set_state_dict`` helpers:

    save_dcp(path, model, optimizer)        # on every rank
    load_dcp(path, model, optimizer)        # on every rank of the new world (or one process)

What the wrappers add to DCP:

* atomic install: all ranks write into a temporary sibling directory; rank 0
  adds a ``manifest.json`` (whole-file checksums of every DCP file, hashed in
  parallel by the ranks) and renames it into place as ``save`` does, so a
  crash mid-write leaves the previous checkpoint;
* verification on load: the checksums are checked (files shared out over
  the ranks) before DCP reads anything;
* no silent changes: DCP casts a tensor to the model's dtype on load and
  ignores checkpoint keys the model does not have (FIELD.md). ``load_dcp``
  compares every tensor's name, global shape and dtype with the checkpoint's
  metadata first and raises :class:`CheckpointMismatchError` naming the
  first difference (a dtype difference only with ``cast=False``, the default).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from .atomic import (
    FileEntry,
    Manifest,
    _check_args,
    _check_target,
    _install_or_discard,
    _make_manifest,
    _new_tmp,
    _Stage,
    _write_error,
    read_manifest,
    resolve_checkpoint,
    verify,
)
from .format import (
    DEFAULT_CHECKSUM,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWriteError,
    hash_file,
)

__all__ = ["DCP_FORMAT", "load_dcp", "save_dcp"]

#: ``manifest.layout["format"]`` of a checkpoint written by ``save_dcp``.
DCP_FORMAT = "dcp"


class _Comm:
    """Collectives over ``group``, or trivial ones in a single process."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.on = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.on else 0
        self.world = dist.get_world_size(group) if self.on else 1

    def gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def check(self, mine: BaseException | None, what: str) -> None:
        """Raise on every rank when any rank failed (its own error, or one naming the failing rank)."""
        statuses = self.gather(None if mine is None else f"{type(mine).__name__}: {mine}")
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if not failed:
            return
        if mine is not None:
            raise mine
        r, text = failed[0]
        raise CheckpointError(f"rank {r} failed while {what}: {text}")


def _state_dicts(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    out: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        out["optim"] = get_optimizer_state_dict(model, optimizer)  # creates the optimizer's state if it has none
    return out


def _tensor_leaves(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors under nested dicts, keyed as DCP flattens them (dict keys joined by dots)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensor_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def save_dcp(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Any = None,
    *,
    tag: str | None = None,
    version: int | None = None,
    extra: dict[str, str] | None = None,
    update_latest: bool = False,
    group: Any = None,
    checksum: str = DEFAULT_CHECKSUM,
) -> Manifest:
    """Save ``model`` (and ``optimizer``) with ``torch.distributed.checkpoint``; atomic, checksummed.

    Call on every rank (or in one process without a process group). Any
    model ``get_model_state_dict`` understands works: FSDP2, torch DDP, plain.
    The tensors must be resident on their devices (``state.onload()`` first).
    Returns the manifest on every rank; raises on every rank if any failed,
    with the previous checkpoint at ``path`` intact.
    """
    import torch.distributed.checkpoint as dcp

    comm = _Comm(group)
    final = Path(os.path.abspath(path))
    mine: BaseException | None = None
    tmp: Path | None = None
    previous = False
    try:
        _check_args(final, "dcp", version)
        if comm.rank == 0:
            previous = _check_target(final)
            tmp = _new_tmp(final)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the gather
        mine = e
    boot = comm.gather((None if mine is None else repr(mine), str(tmp) if tmp else None, previous))
    if any(b[0] for b in boot) and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    comm.check(mine, "preparing the checkpoint")
    tmp, previous = Path(boot[0][1]), bool(boot[0][2])

    def cleanup() -> None:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    try:
        state_dict = _state_dicts(model, optimizer)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group,
                     no_dist=not comm.on)
    except BaseException as e:  # DCP raises on every rank when one fails
        cleanup()
        if isinstance(e, OSError):
            raise _write_error(final, previous, 0, e, "writing with torch.distributed.checkpoint", tmp) from e
        raise CheckpointWriteError(final, f"torch.distributed.checkpoint failed ({type(e).__name__}: {e})") from e

    # Checksums: rank 0 lists the files, every rank hashes its share.
    names = comm.gather(sorted(os.listdir(tmp)) if comm.rank == 0 else None)[0]
    sums: dict[str, tuple[int, str]] = {}
    mine = None
    try:
        for i, n in enumerate(names):
            if i % comm.world == comm.rank:
                sums[n] = hash_file(tmp / n, checksum)
    except BaseException as e:  # noqa: BLE001
        mine = e
    parts = comm.gather(sums if mine is None else None)
    if any(p is None for p in parts):
        cleanup()
    comm.check(mine, "hashing the checkpoint files")

    result: Any = None
    if comm.rank == 0:
        stage = _Stage()
        try:
            files = {n: FileEntry(size, digest, 0) for p in parts for n, (size, digest) in p.items()}
            manifest = _make_manifest(
                backend="dcp", layout={"format": DCP_FORMAT, "world_size": comm.world},
                files=dict(sorted(files.items())), tag=tag, version=version, extra=dict(extra or {}),
                checksum=checksum, total=sum(f.bytes for f in files.values()),
            )
            _install_or_discard(tmp, final, manifest, stage, previous, update_latest)
            result = manifest.to_json()
        except BaseException as e:  # noqa: BLE001
            mine = e
    comm.check(mine, "installing the checkpoint")
    result = comm.gather(result)[0]
    return Manifest.from_json(final / "manifest.json", json.loads(json.dumps(result)))


def check_dcp(path: str | os.PathLike[str], state_dict: dict[str, Any], *, cast: bool = False) -> None:
    """Compare a target state dict with a DCP checkpoint's metadata; raise naming the first difference.

    Every tensor of ``state_dict`` must be in the checkpoint with the same
    global shape and (unless ``cast``) dtype; every checkpoint tensor under
    the same top-level keys must be in ``state_dict``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    want = _tensor_leaves(state_dict)
    for key, t in want.items():
        md = meta.get(key)
        if md is None:
            raise CheckpointMismatchError(key, "in the model but not in the checkpoint")
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointMismatchError(key, f"a tensor in the model, a {type(md).__name__} in the checkpoint")
        if tuple(md.size) != tuple(t.shape):
            raise CheckpointMismatchError(
                key, f"shape is {list(t.shape)} in the model but {list(md.size)} in the checkpoint"
            )
        if md.properties.dtype != t.dtype and not cast:
            raise CheckpointMismatchError(
                key,
                f"dtype is {str(t.dtype).removeprefix('torch.')} in the model but "
                f"{str(md.properties.dtype).removeprefix('torch.')} in the checkpoint; pass cast=True to convert on load",
            )
    tops = {k.split(".", 1)[0] for k in state_dict}
    for key, md in meta.items():
        top = key.split(".", 1)[0]
        if top == "optim" and not key.startswith("optim.state."):
            continue  # param_groups: hyperparameters, taken from the checkpoint as they are
        if top in tops and isinstance(md, TensorStorageMetadata) and key not in want:
            raise CheckpointMismatchError(key, "in the checkpoint but not in the model")


def load_dcp(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Any = None,
    *,
    cast: bool = False,
    verify_checksums: bool = True,
    group: Any = None,
) -> Manifest:
    """Load a :func:`save_dcp` checkpoint into ``model`` (and ``optimizer``), on any number of ranks.

    Checks first, changing nothing on failure: the checksums of every file
    (``verify_checksums``; the files are shared out over the ranks), then
    names, global shapes and dtypes against the checkpoint's metadata
    (:func:`check_dcp`). Then DCP reads and reshards the values and
    ``set_model_state_dict``/``set_optimizer_state_dict`` put them in place.
    The model must be resident on its devices.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    comm = _Comm(group)
    root = resolve_checkpoint(path)
    manifest = read_manifest(root)
    fmt = manifest.layout.get("format") if isinstance(manifest.layout, dict) else None
    if fmt != DCP_FORMAT:
        raise CheckpointMismatchError("(checkpoint)", f"'{root}' was not written by save_dcp (layout format {fmt!r}); use load")
    mine: BaseException | None = None
    try:
        if verify_checksums:
            names = list(manifest.files)
            verify(root, files=[n for i, n in enumerate(names) if i % comm.world == comm.rank])
        state_dict = _state_dicts(model, optimizer)
        check_dcp(root, state_dict, cast=cast)
    except BaseException as e:  # noqa: BLE001
        mine = e
    comm.check(mine, f"checking '{root}'")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state_dict, checkpoint_id=os.fspath(root), process_group=group, no_dist=not comm.on)
    set_model_state_dict(model, state_dict["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state_dict["optim"])
    return manifest
