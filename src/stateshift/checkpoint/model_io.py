"""Save and load a ``ModelState``'s groups: from any residency, atomic, verified, asynchronous.

Built on snapshots (see ``docs/checkpoints.md``):

* ``save`` takes a *host snapshot* of the groups -- zero bytes moved for a
  fully offloaded group (it shares the pinned home, copy-on-write), one
  device-to-host copy into a pooled pinned block otherwise -- waits for it,
  and streams the snapshot's slot regions straight from the pinned block into
  safetensors files (no second host copy, nothing brought back to the GPU).
* ``load`` checks the checkpoint's layout against the model's *before reading
  a byte*, reads every file straight into a pooled block laid out like a
  snapshot, verifies every checksum, and only then ``restore``s that block
  into the model (a pointer copy for a fully offloaded group). A corrupt or
  mismatching checkpoint therefore leaves the model unchanged.
* ``async_save`` returns once the snapshot is staged in host memory; a
  background thread writes it. Later training cannot leak in: a snapshot is
  never written after it is taken, and an offloaded group's home is copied
  before it is written while a snapshot shares it.

What is stored per slot: a slot with one member that exactly covers its
storage is a typed tensor under the member's name (``blocks.0.fc1.weight``,
``blocks.0.fc1.weight.exp_avg``); any other slot (tied weights, a flat buffer
with many views, a padded FSDP2 shard) is its raw storage bytes (``U8``) under
the slot's name, the members listed in the manifest's layout.

One file per group (``params.safetensors``, ``optim.safetensors`` ...), or per
group and rank (``params.rank0-of-2.safetensors``) when each rank of a
``torch.distributed`` run writes its own shard.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ReleasedSnapshotError, UnknownGroupError
from ..core.slot import SlotInfo
from ..core.layout import Layout, dtype_of
from ..core.snapshot import Snapshot, SnapshotPart
from .atomic import (
    CheckpointReader,
    Manifest,
    read_manifest,
    resolve_checkpoint,
    write_checkpoint,
    write_checkpoint_distributed,
)
from .format import (
    DEFAULT_CHECKSUM,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ProgressFn,
    TensorRecord,
    dtype_to_str,
)

if TYPE_CHECKING:
    from ..core.pool import HostBlock
    from ..core.state import ModelState

__all__ = [
    "LAYOUT_FORMAT",
    "SaveHandle",
    "async_save",
    "default_groups",
    "init_optimizer_state",
    "load",
    "save",
]

#: ``manifest.layout["format"]`` of a checkpoint written by ``save``.
LAYOUT_FORMAT = "stateshift-state/1"
#: Groups ``save`` leaves out unless asked: gradients are recomputed by the next backward.
TRANSIENT_GROUPS = ("grads",)


# --------------------------------------------------------------------------- layout fingerprint


def _jsonable(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def is_typed(info: SlotInfo) -> bool:
    """True when the slot is stored as a typed tensor: one member exactly covering its storage."""
    if len(info.members) != 1:
        return False
    m = info.members[0]
    try:
        dtype = dtype_of(m.dtype)
        dtype_to_str(dtype)
    except (KeyError, ValueError):
        return False
    if m.offset != 0 or math.prod(m.shape) * dtype.itemsize != info.nbytes:
        return False
    want = _contiguous_strides(m.shape)
    return all(size == 1 or s == w for size, s, w in zip(m.shape, m.stride, want, strict=True))


def slot_json(info: SlotInfo) -> dict[str, Any]:
    """A slot's part of the manifest layout (JSON)."""
    typed = is_typed(info)
    return {
        "slot": info.name,
        "nbytes": info.nbytes,
        "record": info.members[0].name if typed else info.name,
        "typed": typed,
        "members": [
            {
                "name": m.name,
                "shape": list(m.shape),
                "dtype": m.dtype,
                "stride": list(m.stride),
                "offset": m.offset,
                "meta": _jsonable(m.meta),
            }
            for m in info.members
        ],
    }


def default_groups(state: ModelState) -> tuple[str, ...]:
    """The groups ``save`` writes by default: every group but the transient ones (``grads``)."""
    return tuple(g for g in state.groups if g not in TRANSIENT_GROUPS)


def _group_names(state: ModelState, groups: str | Iterable[str] | None) -> tuple[str, ...]:
    if groups is None:
        return default_groups(state)
    names = (groups,) if isinstance(groups, str) else tuple(groups)
    for g in names:
        if g not in state.groups:
            raise UnknownGroupError(g, state.groups)
    if len(set(names)) != len(names):
        raise ValueError(f"groups listed twice: {list(names)}")
    return names


def _backend_name(state: ModelState) -> str:
    return "+".join(b.name for b in state.backends)


# --------------------------------------------------------------------------- distributed helpers


def _dist_world(group: Any) -> tuple[int, int] | None:
    """``(rank, world size)`` when torch.distributed is initialised, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(group), dist.get_world_size(group)


def _use_distributed(state: ModelState, distributed: bool | None, group: Any) -> bool:
    rw = _dist_world(group)
    if distributed is None:
        sharded = any(b.checkpoint_facts().sharded for b in state.backends)
        return bool(rw and rw[1] > 1 and sharded)
    if distributed and rw is None:
        raise RuntimeError("distributed=True needs an initialised torch.distributed process group")
    return bool(distributed)


def _file_name(group: str, rank: int, world: int) -> str:
    return f"{group}.safetensors" if world == 1 else f"{group}.rank{rank}-of-{world}.safetensors"


_WRITER_GROUPS: dict[Any, Any] = {}


def _writer_group(group: Any) -> Any:
    """A gloo group of the same ranks for a background writer's collectives (made once, collectively)."""
    import torch.distributed as dist

    key = id(group) if group is not None else None
    if key not in _WRITER_GROUPS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _WRITER_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _WRITER_GROUPS[key]


# --------------------------------------------------------------------------- staging


@dataclass(eq=False)
class _Staged:
    snapshot: Snapshot
    files: dict[str, list[TensorRecord]]
    layout: dict[str, Any]
    nbytes: int


def _stage(state: ModelState, names: tuple[str, ...], rank: int, world: int) -> _Staged:
    """Host snapshot of the groups, waited for; records are views of its pinned block."""
    snap = state.snapshot(names, tag=f"_checkpoint-{uuid.uuid4().hex[:12]}", placement="host")
    try:
        snap.wait()
        files: dict[str, list[TensorRecord]] = {}
        groups: dict[str, Any] = {}
        for part in snap.parts:
            fname = _file_name(part.group, rank, world)
            recs: list[TensorRecord] = []
            slots: list[dict[str, Any]] = []
            for i, info in enumerate(part.layout.slots):
                js = slot_json(info)
                region = part.region(i)
                if js["typed"]:
                    m = info.members[0]
                    recs.append(TensorRecord(js["record"], dtype_of(m.dtype), tuple(m.shape), region))
                else:
                    recs.append(TensorRecord(js["record"], torch.uint8, (info.nbytes,), region))
                slots.append(js)
            files[fname] = recs
            groups[part.group] = {"file": fname, "slots": slots}
        nbytes = sum(p.layout.nbytes for p in snap.parts)
        return _Staged(snap, files, {"rank": rank, "groups": groups}, nbytes)
    except BaseException:
        state.release(snap)
        raise


# --------------------------------------------------------------------------- save


#: The last writer of each checkpoint path in this process: a new one writes after it (in call order).
_LAST_WRITER: dict[str, SaveHandle] = {}
_LAST_WRITER_LOCK = threading.Lock()
#: Async saves whose staged snapshot is still to be released (on the thread that drives the state).
_PENDING: dict[int, list[SaveHandle]] = {}


@dataclass(eq=False)
class SaveHandle:
    """An asynchronous save: the values were staged at the call, a background thread writes them.

    ``wait()`` returns the manifest once the checkpoint is durable, or raises
    the writer's exception (e.g. :class:`CheckpointWriteError`); ``done()``
    says whether the writer has finished. Call them on the thread that drives
    the model state: they give the staged snapshot back to the pool (so does
    the next ``save``/``async_save``/``load`` on the same state).
    """

    path: Path
    nbytes: int
    #: seconds the caller was blocked (snapshot + wait for its copies + thread start)
    staged_seconds: float = 0.0
    _state: Any = field(default=None, repr=False)
    _staged: _Staged | None = field(default=None, repr=False)
    _finished: threading.Event = field(default_factory=threading.Event, repr=False)
    _manifest: Manifest | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def done(self) -> bool:
        if self._finished.is_set():
            self._release()
            return True
        return False

    def wait(self, timeout: float | None = None) -> Manifest:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint '{self.path}' is still being written after {timeout} s")
        self._release()
        if self._error is not None:
            raise self._error
        assert self._manifest is not None
        return self._manifest

    def exception(self) -> BaseException | None:
        """The writer's exception once finished (None while running or after success)."""
        return self._error if self._finished.is_set() else None

    @property
    def manifest(self) -> Manifest | None:
        return self._manifest

    def _release(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            self._state.release(staged.snapshot)
            pending = _PENDING.get(id(self._state), [])
            if self in pending:
                pending.remove(self)
            if not pending:
                _PENDING.pop(id(self._state), None)


def _reap(state: ModelState) -> None:
    for h in list(_PENDING.get(id(state), [])):
        h.done()


def _guarded(snapshot: Snapshot, progress: ProgressFn | None) -> ProgressFn:
    """A progress callback that aborts the write if the staged snapshot is released under it."""

    def check(n: int) -> None:
        if snapshot.released:
            raise ReleasedSnapshotError(
                "the staged snapshot of this checkpoint was released while it was written "
                "(ModelState.close() or snapshots.clear() during an async save?); the write was aborted"
            )
        if progress is not None:
            progress(n)

    return check


def _make_parents(directory: Path) -> None:
    """Create missing parent directories (like ``mkdir -p``), each made durable in its own parent."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fd = os.open(d.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _start(
    state: ModelState,
    path: str | os.PathLike[str],
    groups: str | Iterable[str] | None,
    *,
    tag: str | None,
    version: int | None,
    extra: Mapping[str, str] | None,
    checksum: str,
    update_latest: bool,
    distributed: bool | None,
    group: Any,
    progress: ProgressFn | None,
    background: bool,
) -> SaveHandle:
    t0 = time.perf_counter()
    _reap(state)
    final = Path(os.path.abspath(path))
    _make_parents(final.parent)
    names = _group_names(state, groups)
    dist_on = _use_distributed(state, distributed, group)
    rank, world = (_dist_world(group) or (0, 1)) if dist_on else (0, 1)
    coll_group = _writer_group(group) if dist_on and background else group
    staged = _stage(state, names, rank, world)
    handle = SaveHandle(path=final, nbytes=staged.nbytes, _state=state, _staged=staged)
    backend = _backend_name(state)
    common = {"format": LAYOUT_FORMAT, "groups": list(names)}

    with _LAST_WRITER_LOCK:
        before = _LAST_WRITER.get(str(final))
        _LAST_WRITER[str(final)] = handle

    def run() -> None:
        try:
            if before is not None:
                before._finished.wait()  # one writer per path, in call order
            guard = _guarded(staged.snapshot, progress)
            if dist_on:
                handle._manifest = write_checkpoint_distributed(
                    final, staged.files, backend=backend, layout=staged.layout, common_layout=common,
                    tag=tag, version=version, extra=extra, checksum=checksum, progress=guard,
                    update_latest=update_latest, group=coll_group,
                )
            else:
                handle._manifest = write_checkpoint(
                    final, staged.files, backend=backend,
                    layout={**common, "world_size": 1, "ranks": [staged.layout]},
                    tag=tag, version=version, extra=extra, checksum=checksum, progress=guard,
                    update_latest=update_latest,
                )
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            handle._error = e
        finally:
            handle._finished.set()
            with _LAST_WRITER_LOCK:
                if _LAST_WRITER.get(str(final)) is handle:
                    del _LAST_WRITER[str(final)]

    if background:
        _PENDING.setdefault(id(state), []).append(handle)
        handle._thread = threading.Thread(target=run, name=f"stateshift-save:{final.name}", daemon=True)
        handle._thread.start()
        handle.staged_seconds = time.perf_counter() - t0
    else:
        try:
            run()
        finally:
            handle._release()
        handle.staged_seconds = time.perf_counter() - t0
    return handle


def save(
    state: ModelState,
    path: str | os.PathLike[str],
    groups: str | Iterable[str] | None = None,
    *,
    tag: str | None = None,
    version: int | None = None,
    extra: Mapping[str, str] | None = None,
    checksum: str = DEFAULT_CHECKSUM,
    update_latest: bool = False,
    distributed: bool | None = None,
    group: Any = None,
    progress: ProgressFn | None = None,
) -> Manifest:
    """Write ``groups`` of ``state`` (default: all but ``grads``) to the checkpoint directory ``path``.

    Works in every residency and mix: device slots are copied once into a
    pooled pinned block, offloaded ones are written from their home without
    a copy; nothing is brought back to the device. The directory is replaced
    atomically (``write_checkpoint``); when this returns the checkpoint is
    durable. Each group is one file; ``tag``/``version``/``extra`` go to the
    manifest with the layout fingerprint, backend, checksums and versions.

    ``distributed``: each rank of ``group`` writes its own shard
    (``<group>.rank<r>-of-<w>.safetensors``) and rank 0 the manifest; must
    then be called on every rank. Default: on when torch.distributed is
    initialised with several ranks and the model is sharded (FSDP2, Megatron).
    For a replicated model (torch DDP) call ``save`` on one rank with
    ``distributed=False``.

    Raises :class:`CheckpointWriteError` (full disk, quota, ...) with the
    previous checkpoint at ``path`` intact. The model is never changed.
    """
    handle = _start(
        state, path, groups, tag=tag, version=version, extra=extra, checksum=checksum,
        update_latest=update_latest, distributed=distributed, group=group, progress=progress, background=False,
    )
    return handle.wait()


def async_save(
    state: ModelState,
    path: str | os.PathLike[str],
    groups: str | Iterable[str] | None = None,
    *,
    tag: str | None = None,
    version: int | None = None,
    extra: Mapping[str, str] | None = None,
    checksum: str = DEFAULT_CHECKSUM,
    update_latest: bool = False,
    distributed: bool | None = None,
    group: Any = None,
    progress: ProgressFn | None = None,
) -> SaveHandle:
    """Like :func:`save`, but returns once the values are staged; a background thread writes them.

    Staging is a host snapshot (zero-copy for offloaded groups, one pinned
    device-to-host copy otherwise) that this call waits for, so the model may
    be trained, offloaded or restored at once: the checkpoint holds the
    values of the moment of the call. Saves to the same path are written one
    at a time, in call order. The ``latest`` pointer (``update_latest``) moves
    only after the checkpoint is durable.

    Distributed: call on every rank; the writer threads talk over a
    dedicated gloo group (created collectively by the first call).

    Returns a :class:`SaveHandle`; its ``wait()`` re-raises a write error.
    Call ``wait()``/``done()`` on the training thread (they return the staged
    memory to the pool); the next save or load on this state does it too.
    """
    return _start(
        state, path, groups, tag=tag, version=version, extra=extra, checksum=checksum,
        update_latest=update_latest, distributed=distributed, group=group, progress=progress, background=True,
    )


# --------------------------------------------------------------------------- load


def _norm(x: Any) -> Any:
    return _jsonable(x)


def _match_group(group: str, stored: list[dict[str, Any]], layout: Layout, cast: bool) -> list[tuple[int, dict[str, Any], bool]]:
    """Pair every model slot with its stored slot; raise naming the first tensor that does not fit.

    Returns ``(model slot index, stored slot, needs cast)``.
    """
    have: dict[str, tuple[int, Any]] = {}
    for i, s in enumerate(layout.slots):
        for m in s.members:
            have[m.name] = (i, m)
    want: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for s in stored:
        for m in s["members"]:
            want[m["name"]] = (s, m)
    casting: set[int] = set()
    for name, (ws, wm) in want.items():
        if name not in have:
            hint = ""
            if group == "optim" and not layout.slots:
                hint = (
                    "; the optimizer has no state yet (it is created by its first step): call "
                    "stateshift.checkpoint.init_optimizer_state(optimizer) before loading"
                )
            raise CheckpointMismatchError(name, f"in the checkpoint (group {group!r}) but not in the model{hint}")
        i, hm = have[name]
        hs = layout.slots[i]
        if list(hm.shape) != list(wm["shape"]):
            raise CheckpointMismatchError(
                name, f"shape is {list(hm.shape)} in the model but {list(wm['shape'])} in the checkpoint"
            )
        if hm.dtype != wm["dtype"]:
            if not cast:
                raise CheckpointMismatchError(
                    name,
                    f"dtype is {hm.dtype} in the model but {wm['dtype']} in the checkpoint; "
                    "pass cast=True to convert on load",
                )
            if not (ws["typed"] and is_typed(hs)):
                raise CheckpointMismatchError(
                    name,
                    f"dtype is {hm.dtype} in the model but {wm['dtype']} in the checkpoint, and it lives in a shared "
                    "storage (tied or flat buffer) stored as raw bytes: cast=True converts only plain tensors",
                )
            casting.add(i)
        elif list(hm.stride) != list(wm["stride"]) or hm.offset != wm["offset"]:
            raise CheckpointMismatchError(
                name,
                f"stride/offset is {list(hm.stride)}/{hm.offset} in the model but "
                f"{list(wm['stride'])}/{wm['offset']} in the checkpoint",
            )
        if _norm(hm.meta) != _norm(wm["meta"]):
            raise CheckpointMismatchError(
                name,
                f"sharding differs: {_norm(hm.meta)} in the model, {_norm(wm['meta'])} in the checkpoint "
                "(another mesh, rank or placement: reshard with save_dcp/load_dcp)",
            )
    for name in have:
        if name not in want:
            raise CheckpointMismatchError(name, f"in the model (group {group!r}) but not in the checkpoint")
    out: list[tuple[int, dict[str, Any], bool]] = []
    for i, hs in enumerate(layout.slots):
        ws, _ = want[hs.members[0].name]
        if [m.name for m in hs.members] != [m["name"] for m in ws["members"]]:
            raise CheckpointMismatchError(
                hs.members[0].name,
                f"storage sharing differs: the model's storage holds {[m.name for m in hs.members]}, "
                f"the checkpoint's {[m['name'] for m in ws['members']]}",
            )
        if i not in casting and hs.nbytes != ws["nbytes"]:
            raise CheckpointMismatchError(
                hs.name, f"storage holds {hs.nbytes} bytes in the model, {ws['nbytes']} in the checkpoint"
            )
        out.append((i, ws, i in casting))
    return out


def _rank_layout(manifest: Manifest, path: Path, group: Any) -> tuple[dict[str, Any], int]:
    lay = manifest.layout
    if not isinstance(lay, dict) or lay.get("format") != LAYOUT_FORMAT:
        what = lay.get("format") if isinstance(lay, dict) else None
        hint = " (a torch.distributed.checkpoint directory: use load_dcp)" if what == "dcp" else ""
        raise CheckpointMismatchError(
            "(checkpoint)", f"'{path}' is not a stateshift model-state checkpoint (layout format {what!r}){hint}"
        )
    world = int(lay["world_size"])
    rw = _dist_world(group)
    if world == 1:
        return lay["ranks"][0], 0
    if rw is None or rw[1] != world:
        now = "one process" if rw is None else f"{rw[1]} ranks"
        raise CheckpointMismatchError(
            "(checkpoint)",
            f"'{path}' holds the shards of {world} ranks; it loads on {world} ranks only (now: {now}). "
            "To change the world size, save with save_dcp and load with load_dcp (torch.distributed.checkpoint)",
        )
    return lay["ranks"][rw[0]], rw[0]


def _read_staged(
    state: ModelState,
    root: Path,
    rank_layout: dict[str, Any],
    names: tuple[str, ...] | None,
    cast: bool,
    progress: ProgressFn | None,
    version: int | None,
) -> Snapshot:
    """Check, read and verify into pooled blocks; returns a host snapshot of the model's layout."""
    stored = rank_layout["groups"]
    if names is None:
        names = tuple(stored)
    for g in names:
        if g not in state.groups:
            raise UnknownGroupError(g, state.groups)
        if g not in stored:
            raise CheckpointMismatchError(
                f"(group {g})", f"group {g!r} is not in the checkpoint (it holds {', '.join(stored) or 'nothing'})"
            )
    plans = []
    for g in names:
        layout = state.layout(g)
        plans.append((g, layout, _match_group(g, stored[g]["slots"], layout, cast)))
    reader = CheckpointReader(root, files=[stored[g]["file"] for g in names])  # sizes and headers checked
    for g, _, matches in plans:
        for _, ws, _ in matches:
            info = reader.info(ws["record"])
            fpath = root / stored[g]["file"]
            if ws["typed"]:
                m = ws["members"][0]
                ok = info.dtype == dtype_of(m["dtype"]) and list(info.shape) == list(m["shape"])
            else:
                ok = info.dtype == torch.uint8 and list(info.shape) == [ws["nbytes"]]
            if not ok or info.file != stored[g]["file"]:
                raise CheckpointCorruptError(
                    fpath, f"tensor '{info.name}' is stored as {info.dtype} {list(info.shape)}, the manifest says otherwise"
                )
    blocks: list[HostBlock] = []
    parts: list[SnapshotPart] = []
    try:
        dsts: dict[str, torch.Tensor] = {}
        casts: list[tuple[torch.Tensor, torch.Tensor, torch.dtype, tuple[int, ...]]] = []
        for g, layout, matches in plans:
            block = state.pool.acquire(layout.total)
            blocks.append(block)
            parts.append(SnapshotPart(g, layout, host=block))
            regions = layout.regions(block.data)
            for i, ws, needs_cast in matches:
                if needs_cast:
                    info = reader.info(ws["record"])
                    tmp = torch.empty(info.shape, dtype=info.dtype)
                    dsts[ws["record"]] = tmp
                    m = layout.slots[i].members[0]
                    casts.append((regions[i], tmp, dtype_of(m.dtype), tuple(m.shape)))
                else:
                    dsts[ws["record"]] = regions[i]
        reader.read_into(dsts, progress=progress)
        for region, tmp, dtype, shape in casts:
            region.view(dtype).view(shape).copy_(tmp)
    except BaseException:
        for b in blocks:
            state.pool.release(b)
        raise
    return Snapshot.of(tag="_checkpoint-load", version=version, placement="host", parts=tuple(parts), pool=state.pool)


def load(
    state: ModelState,
    path: str | os.PathLike[str],
    groups: str | Iterable[str] | None = None,
    *,
    cast: bool = False,
    group: Any = None,
    progress: ProgressFn | None = None,
) -> Manifest:
    """Load ``groups`` (default: every group in the checkpoint) from ``path`` into ``state``.

    Every group's layout is checked against the model first: a tensor that
    is missing, extra, of another shape or dtype, or shared differently
    raises :class:`CheckpointMismatchError` naming it, before any byte is
    read. A dtype difference is an error unless ``cast=True`` (plain
    tensors only; shared storages are raw bytes and cannot be converted).
    Then every file is read straight into pooled host blocks and its
    checksum verified (:class:`CheckpointCorruptError` naming the file); only
    then are the values restored into the model, wherever each slot lives
    (in place on the device; into the home -- a pointer copy -- when a group
    is offloaded; dropped slots become offloaded with the values). On any
    error the model is unchanged.

    A per-rank checkpoint loads on the same number of ranks (each rank reads
    its own shard; all ranks agree before any changes its model). For
    another world size use ``save_dcp``/``load_dcp``.
    When this returns, compute enqueued afterwards sees the loaded values.
    """
    _reap(state)
    root = resolve_checkpoint(path)
    manifest = read_manifest(root)
    names = None if groups is None else ((groups,) if isinstance(groups, str) else tuple(groups))
    world = int(manifest.layout.get("world_size", 1)) if isinstance(manifest.layout, dict) else 1
    if world > 1:
        return _load_distributed(state, root, manifest, names, cast, group, progress)
    rank_layout, _ = _rank_layout(manifest, root, group)
    snap = _read_staged(state, root, rank_layout, names, cast, progress, manifest.version)
    try:
        state.restore(snap)
    finally:
        snap.release()
    return manifest


def _load_distributed(
    state: ModelState,
    root: Path,
    manifest: Manifest,
    names: tuple[str, ...] | None,
    cast: bool,
    group: Any,
    progress: ProgressFn | None,
) -> Manifest:
    import torch.distributed as dist

    rank_layout, _rank = _rank_layout(manifest, root, group)
    snap: Snapshot | None = None
    mine: BaseException | None = None
    try:
        snap = _read_staged(state, root, rank_layout, names, cast, progress, manifest.version)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the gather
        mine = e
    statuses: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(statuses, None if mine is None else f"{type(mine).__name__}: {mine}", group=group)
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        if snap is not None:
            snap.release()
        if mine is not None:
            raise mine
        r, text = failed[0]
        raise CheckpointError(f"loading '{root}' failed on rank {r} ({text}); no rank changed its model")
    assert snap is not None
    try:
        state.restore(snap)
    finally:
        snap.release()
    return manifest


# --------------------------------------------------------------------------- optimizer state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a torch optimizer's state tensors (as its first step would), so a checkpoint can be loaded into it.

    When the optimizer has no state yet and no parameter has a gradient: one
    ``step()`` with zero gradients and a learning rate of 0 (what
    ``torch.distributed.checkpoint`` does), then the gradients are set back to
    None. The parameters must be resident. ``load`` then overwrites the
    values. Does nothing if the optimizer already has state.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return
    with torch.no_grad():
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups if "lr" in g]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = lrs.pop(0)
        optimizer.zero_grad(set_to_none=True)
