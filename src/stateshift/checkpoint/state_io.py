"""Save and load a ``ModelState`` through snapshots: any residency, atomic, verified, in the background.

``save`` writes the regions of a host snapshot straight into one safetensors file per group (and rank),
each slot as ``manifest.stored_as`` says; ``load`` checks the layout with ``Layout.check_compatible`` (the
comparison restore and swapped use), reads straight into a snapshot laid out like the model
(``core_of(state).snapshot_from``), verifying every crc32, and only then restores it.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook first: ours (_finish_saves) runs before it
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.engine import core_of
from ..core.layout import Layout, dtype_of
from ..core.pool import HostBlock, HostPool
from ..core.snapshot import Snapshot, SnapshotPart
from ..errors import CheckpointError, LayoutError, StateError, show
from . import manifest as mf
from .collective import Collective
from .commit import make_parents
from .directory import Checkpoint, check_args, write_checkpoint
from .format import ProgressFn, Record, without_gc

if TYPE_CHECKING:
    from ..core.state import ModelState

#: Groups ``save`` leaves out unless asked: gradients are recomputed by the next backward.
TRANSIENT_GROUPS = ("grads",)


def _group_names(state: ModelState, groups: str | Iterable[str] | None, default: Iterable[str]) -> tuple[str, ...]:
    """``groups`` (a name or names; ``None``: ``default``), each a group of ``state`` named once."""
    names = tuple(default) if groups is None else (groups,) if isinstance(groups, str) else tuple(groups)
    for g in names:
        if g not in state.groups:
            raise LayoutError("unknown_group", group=g, valid=state.groups)
    if groups is not None and (not names or len(set(names)) != len(names)):
        raise ValueError(f"groups must name each group once, got {list(names)}")
    return names


def _collective(state: ModelState, distributed: bool | None, group: Any) -> Collective:
    """Who writes: every rank its own shard (sharded backends under torch.distributed), or this process alone."""
    world = Collective.initialized_world(group)
    if distributed is None:
        distributed = bool(world and world > 1 and any(b.checkpoint_facts().sharded for b in state.backends))
    elif distributed and world is None:
        raise RuntimeError("distributed=True needs an initialised torch.distributed process group")
    return Collective(group, enabled=bool(distributed))


# --------------------------------------------------------------------------- save


@dataclass(eq=False)
class _Staged:
    snapshot: Snapshot
    files: dict[str, list[Record]]
    layout: dict[str, Any]


_ORDER_LOCK = threading.Lock()
#: the completion of the last save started in this process: saves are written one at a time, in call order
_last_save: list[threading.Event] = []


def _after_last(finished: threading.Event) -> threading.Event | None:
    with _ORDER_LOCK:
        before = _last_save[0] if _last_save else None
        _last_save[:] = [finished]
    return before


def _finish_saves() -> None:
    """At the interpreter's exit: wait for the saves still being written (the last; they run in call order).
    It runs among threading's exit hooks, before ``concurrent.futures`` refuses new work to the writer's pools
    (registered after theirs, so called first): a program that ends right after ``async_save`` loses nothing."""
    with _ORDER_LOCK:
        last = _last_save[0] if _last_save else None
    if last is not None:
        last.wait()


threading._register_atexit(_finish_saves)  # type: ignore[attr-defined]


class SaveHandle:
    """A save under way: the values were staged at the call; ``wait()`` returns the manifest once the
    checkpoint is durable, or raises the writer's error (e.g. ``CheckpointError("write")``)."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        #: seconds the caller was blocked (snapshot, its copies, the thread's start)
        self.staged_seconds = 0.0
        self.manifest: mf.Manifest | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> mf.Manifest:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint '{self.path}' is still being written after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self.manifest is not None
        return self.manifest

    def exception(self) -> BaseException | None:
        """The writer's error once finished (``None`` while running or after success)."""
        return self._error if self._finished.is_set() else None


def _guarded(snapshot: Snapshot, progress: ProgressFn | None) -> ProgressFn:
    """A progress callback that aborts the write if the staged snapshot is released under it."""

    def check(n: int) -> None:
        if snapshot.released:
            raise StateError(
                "released",
                "the staged snapshot of this checkpoint was released while it was written "
                "(ModelState.close() or snapshots.clear() during an async save?); the write was aborted",
            )
        if progress is not None:
            progress(n)

    return check


def _give_back(state: ModelState, snap: Snapshot, pool: HostPool, held: list[HostBlock]) -> None:
    try:
        state.release(snap)
    except StateError as e:
        if e.kind != "closed":
            raise
        snap.release()  # close() released it already; idempotent
    finally:
        for block in held:  # (to the pool that retained them)
            pool.release(block)


@without_gc
def _stage_everywhere(
    state: ModelState, final: Path, groups: str | Iterable[str] | None, comm: Collective, fields: Mapping[str, Any]
) -> _Staged:
    """Check the arguments and stage the values on every rank, then agree (on the calling thread): a rank
    whose staging failed (a budget, a bad group) makes every rank raise now, none left waiting in the write.
    Staged is a host snapshot of the groups, waited for; the records are views of its pinned blocks."""
    snaps: list[Snapshot] = []

    def stage() -> _Staged:
        names = _group_names(state, groups, (g for g in state.groups if g not in TRANSIENT_GROUPS))
        check_args(fields["tag"], fields["version"], fields["extra"], final if fields["update_latest"] else None)
        make_parents(final.parent)
        snaps.append(state.snapshot(names, tag=f"_checkpoint-{uuid.uuid4().hex[:12]}", placement="host"))
        files, layouts = {}, {}
        shard = "" if comm.world == 1 else f".rank{comm.rank}-of-{comm.world}"
        for part in snaps[0].wait().parts:
            fname = f"{part.group}{shard}.safetensors"
            files[fname] = [
                Record(*mf.stored_as(info)[:3], region)
                for info, region in zip(part.layout.slots, part.regions(), strict=True)
            ]
            layouts[part.group] = (fname, part.layout)
        return _Staged(snaps[0], files, mf.rank_json(comm.rank, layouts))

    def failed(rank: int, text: str) -> BaseException:
        return CheckpointError(
            "write", f"rank {rank} failed while staging its values ({text}); nothing was written", path=final
        )

    return comm.run(
        stage, what="staging its values", share=False, error=failed, cleanup=lambda: [state.release(s) for s in snaps]
    )


def _start(
    state: ModelState,
    path: str | os.PathLike[str],
    groups: str | Iterable[str] | None,
    *,
    background: bool,
    distributed: bool | None,
    group: Any,
    progress: ProgressFn | None,
    **fields: Any,
) -> SaveHandle:
    t0 = time.perf_counter()
    final = Path(os.path.abspath(path))
    comm = _collective(state, distributed, group)
    staged = _stage_everywhere(state, final, groups, comm, fields)
    pool = core_of(state).pool  # the writer holds the staged blocks: a close (and a trim) under it frees none it reads
    held = [pool.retain(p.host) for p in staged.snapshot.parts if p.host is not None]
    comm = comm.for_writer_thread() if background else comm
    handle = SaveHandle(final, sum(p.layout.nbytes for p in staged.snapshot.parts))
    before = _after_last(handle._finished)

    def run() -> None:
        try:
            if before is not None:
                before.wait()
            handle.manifest = write_checkpoint(
                final,
                staged.files,
                backend="+".join(b.name for b in state.backends),
                rank_layout=staged.layout,
                layout={"format": mf.STATE_FORMAT, "groups": list(staged.snapshot.groups)},
                progress=_guarded(staged.snapshot, progress),
                comm=comm,
                **fields,
            )
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            handle._error = e
        finally:
            _give_back(state, staged.snapshot, pool, held)
            handle._finished.set()

    if background:
        threading.Thread(target=run, name=f"stateshift-save:{final.name}", daemon=True).start()  # (_finish_saves)
    else:
        run()
    handle.staged_seconds = time.perf_counter() - t0
    return handle


@without_gc
def save(
    state: ModelState,
    path: str | os.PathLike[str],
    groups: str | Iterable[str] | None = None,
    *,
    tag: str | None = None,
    version: int | None = None,
    extra: Mapping[str, str] | None = None,
    update_latest: bool = False,
    distributed: bool | None = None,
    group: Any = None,
    progress: ProgressFn | None = None,
) -> mf.Manifest:
    """Write ``groups`` of ``state`` (default: all but ``grads``) to a new checkpoint directory ``path``.

    Works in every residency and mix: device slots are copied once into a pooled pinned block,
    offloaded ones written from their home without a copy; nothing comes back to the device and
    the model is never changed. ``path`` must not exist (or be an empty directory): checkpoints
    are never overwritten; ``update_latest`` then points ``<parent>/latest`` at it. When this
    returns the checkpoint is durable. ``tag``/``version``/``extra`` go to the manifest.

    ``distributed``: each rank of ``group`` writes its own shard
    (``<group>.rank<r>-of-<w>.safetensors``) and rank 0 the manifest; call it on every rank.
    Default: on under ``torch.distributed`` with several ranks and a sharded backend (FSDP2,
    Megatron's distributed optimizer). A replicated model (torch DDP): one rank, ``distributed=False``.

    Raises ``CheckpointError("write")`` (full disk, quota, a failing rank, ...); no checkpoint is then
    created and the previous one (and ``latest``) is intact. ``FileExistsError`` if ``path`` exists.
    """
    return _start(background=False, **locals()).wait()  # (locals(): the parameters, as passed)


def async_save(
    state: ModelState,
    path: str | os.PathLike[str],
    groups: str | Iterable[str] | None = None,
    *,
    tag: str | None = None,
    version: int | None = None,
    extra: Mapping[str, str] | None = None,
    update_latest: bool = False,
    distributed: bool | None = None,
    group: Any = None,
    progress: ProgressFn | None = None,
) -> SaveHandle:
    """Like ``save``, but returns once the values are staged; a background thread writes them.

    Staging is a host snapshot (zero-copy for offloaded groups, one pinned device-to-host copy
    otherwise) that this call waits for, so the model may be trained, offloaded or restored at once:
    the checkpoint holds the values of the moment of the call. Saves in this process are written
    one at a time, in call order; ``latest`` (``update_latest``) moves only once the checkpoint is
    durable; the interpreter's exit waits for it. The writer returns the staged memory to the pool when
    it is done; releasing the state's snapshots under it (``state.close()``) aborts the write
    (``StateError("released")``), and frees none of the memory it still reads.

    Distributed: call on every rank; the writer threads talk over a gloo group of the same ranks
    (created collectively by the first call). ``progress`` runs on the writer thread.
    """
    return _start(background=True, **locals())  # (locals(): the parameters, as passed)


# --------------------------------------------------------------------------- load


def _mismatch(e: LayoutError, group: str, model: Layout, cast: bool) -> LayoutError:
    """The engine's layout error, with what to do about it in a checkpoint's terms."""
    hint = ""
    if e.field == "dtype" and cast:
        hint = "; it lives in a shared storage (tied, flat buffer) stored as raw bytes: cast=True casts plain tensors"
    elif e.field == "dtype":
        hint = "; pass cast=True to convert on load"
    elif e.field == "meta":
        hint = " (another mesh, rank or placement: reshard with save_dcp/load_dcp)"
    elif e.field == "missing" and group == "optim" and not model.slots:
        hint = "; the optimizer has no state yet (its first step makes it): call init_optimizer_state(optimizer) first"
    return LayoutError("checkpoint_mismatch", e.reason + hint, tensor=e.tensor, field=e.field)


Plan = list[tuple[mf.StoredSlot, bool]]
"""Per model slot (in layout order): the stored slot holding its values, and whether it is cast."""


def _plan(group: str, model: Layout, stored: mf.StoredGroup, cast: bool) -> Plan:
    model = mf.as_stored(model)
    try:
        casting = model.check_compatible(stored.layout(), source="checkpoint", cast=cast)
    except LayoutError as e:
        raise _mismatch(e, group, model, cast) from None
    by_first = {s.info.members[0].name: s for s in stored.slots}
    plan = [(by_first[s.members[0].name], i in casting) for i, s in enumerate(model.slots)]
    for slot, needs_cast in plan:
        if needs_cast and not slot.typed:
            raise LayoutError(
                "checkpoint_mismatch",
                "stored as raw bytes of a dtype safetensors lacks: it cannot be cast",
                tensor=slot.record,
                field="dtype",
            )
    return plan


def _read(
    state: ModelState,
    ckpt: Checkpoint,
    stored: Mapping[str, mf.StoredGroup],
    groups: str | Iterable[str] | None,
    cast: bool,
    progress: ProgressFn | None,
) -> Snapshot:
    """Check every group's layout, then read and verify into a host snapshot laid out like the model."""
    names = _group_names(state, groups, stored)
    for g in names:
        if g not in stored:
            raise LayoutError(
                "checkpoint_mismatch",
                f"group {g!r} is not in the checkpoint (it holds {show(list(stored))})",
                tensor=f"(group {g})",
                field="missing",
            )
    plans = {}
    for g in names:
        layout = state.layout(g)
        plans[g] = (layout, _plan(g, layout, stored[g], cast))
    ckpt.check(stored[g].file for g in names)  # every file opened and checked before the first byte of data is read

    def fill(part: SnapshotPart) -> None:  # one group's file read straight into the part's regions, verified
        checked, plan = plans[part.group]
        if part.layout.slots != checked.slots:  # the model changed since the check: check again
            plan = _plan(part.group, part.layout, stored[part.group], cast)
        dsts: dict[str, torch.Tensor | None] = {}
        casts = []
        for region, info, (slot, needs_cast) in zip(part.regions(), part.layout.slots, plan, strict=True):
            if needs_cast:
                m = slot.info.members[0]
                dsts[slot.record] = tmp = torch.empty(m.shape, dtype=dtype_of(m.dtype))
                casts.append((region.view(dtype_of(info.members[0].dtype)).view(info.members[0].shape), tmp))
            else:
                dsts[slot.record] = region
        ckpt.read_into(stored[part.group].file, dsts, progress)
        for dst, tmp in casts:
            dst.copy_(tmp)

    tag = f"_checkpoint-load-{uuid.uuid4().hex[:12]}"
    return core_of(state).snapshot_from(names, fill, tag=tag, version=ckpt.manifest.version)


def _my_rank(manifest: mf.Manifest, root: Path, group: Any) -> int:
    world, now = manifest.world_size, Collective.initialized_world(group)
    if world == 1:
        return 0
    if now != world:
        raise LayoutError(
            "checkpoint_mismatch",
            f"'{root}' holds the shards of {world} ranks; it loads on {world} ranks "
            f"only (now: {'one process' if now is None else f'{now} ranks'}). To change the "
            "world size, save with save_dcp and load with load_dcp (torch.distributed.checkpoint)",
            tensor="(checkpoint)",
        )
    return Collective(group).rank


@without_gc
def load(
    state: ModelState,
    path: str | os.PathLike[str],
    groups: str | Iterable[str] | None = None,
    *,
    cast: bool = False,
    group: Any = None,
    progress: ProgressFn | None = None,
) -> mf.Manifest:
    """Load ``groups`` (default: every group in the checkpoint) from ``path`` into ``state``.

    ``path`` is a checkpoint or a directory whose ``latest`` names one. Checked before a byte is
    read: the manifest (one schema), and every group's layout against the model's -- a tensor
    missing, extra, of another shape, dtype or sharding, or shared differently raises
    ``LayoutError("checkpoint_mismatch")`` naming it. A dtype difference is an error unless ``cast=True``
    (plain tensors only; shared storages are raw bytes). Then every file is read straight into
    pooled host memory and every tensor's crc32 verified (``CheckpointError("corrupt")`` naming the file
    and tensor); only then are the values restored, wherever each slot lives (in place on the
    device; into the home -- a pointer copy -- when a group is offloaded; dropped slots become
    offloaded with the values). On any error the model is unchanged.

    A per-rank checkpoint loads on the same number of ranks (each reads its own shard; all ranks
    agree before any restores). For another world size use ``save_dcp``/``load_dcp``. When this
    returns, compute enqueued afterwards sees the loaded values.
    """
    ckpt = Checkpoint.open(path, files=(), kind=mf.STATE_FORMAT)
    manifest = ckpt.manifest
    rank = _my_rank(manifest, ckpt.path, group)
    read: list[Snapshot] = []

    def read_mine() -> None:
        read.append(_read(state, ckpt, manifest.ranks[rank], groups, cast, progress))
        core_of(state).check_restore(read[0])  # (a budget) so that no rank restores unless every rank can

    Collective(group, enabled=manifest.world_size > 1).run(
        read_mine,
        what=f"loading '{ckpt.path}'",
        share=False,
        cleanup=lambda: [state.release(s) for s in read],
        error=lambda r, text: CheckpointError(
            "failed", f"loading '{ckpt.path}' failed on rank {r} ({text}); no rank changed its model"
        ),
    )
    snap = read[0]
    try:
        state.restore(snap)
    finally:
        state.release(snap)
    return manifest


# --------------------------------------------------------------------------- optimizer state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a torch optimizer's state tensors (as its first step would), so a checkpoint can be loaded into it.

    When the optimizer has no state yet and no parameter has a gradient: one ``step()`` with zero
    gradients and a learning rate of 0 (what ``torch.distributed.checkpoint`` does), then the
    gradients are set back to None. The parameters must be resident; ``load`` then overwrites the
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
    lrs = [(g, g["lr"]) for g in optimizer.param_groups if "lr" in g]
    for g, lr in lrs:
        g["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in lrs:
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
