"""ModelState: a model's state as groups of slots, and the verbs that move it.

Verbs: ``offload``, ``onload``, ``drop``, ``snapshot``, ``restore``,
``swapped`` and ``release``. Each works in every residency and every mix of
residencies: a slot is ``device``, ``host`` or ``dropped``, and each verb
says what it does in each case -- there is no side attribute whose absence
could raise.

When results are safe to read: every verb returns without blocking the host
on device copies. Compute enqueued on the current stream after a verb is
ordered after that verb's copies, so the model may run (or be stepped) at
once. Host memory written by a verb (a snapshot's values, a home) is safe to
read on the host only after waiting: ``Snapshot.wait()`` or the returned
``Transfer.wait()``.

An error changes nothing: each verb validates and allocates everything it
needs (pooled host blocks, device arenas) before it changes a residency, a
home or a byte of the model.

Threads: verbs on one ``ModelState`` are serialised by a lock, so a
rollout thread and a training thread may both call them; ``swapped()``
holds it on entry and exit, not while its body runs (verbs on the swapped
groups raise ``SwapActiveError`` meanwhile). Guarded forwards, backwards and
optimizer steps are readers of the state's ``ReaderGate`` (``locking.py``): a verb
waits for those running in other threads, and they wait for a running verb;
``offload``/``drop`` from inside one on its own thread raise
``VerbInsideComputeError``.

Direct touches: while any storage is released, every tensor operation on
it (not only the hooked ones) raises ``OffloadedStateError`` (``touch.py``).

Homes: each group has one host arena (``home``) laid out like its
snapshots, taken from the pool the first time the group is offloaded and
kept for reuse. Homes and host snapshots share blocks copy-on-write: a
snapshot of a fully offloaded group, and a restore into one, move no bytes.

Lifetime: the guard hooks a ``ModelState`` installs on the model hold it,
so it lives as long as the model; one built with ``guard=False`` keeps
itself alive while it holds offloaded values, until ``close()``. ``close()``
brings offloaded values back to the device before it gives the homes up.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch

from ..errors import DiskTierError, NotReleasableError, PoolBudgetError, OffloadedStateError, SwapActiveError, UnknownGroupError
from .disk import DISK_WINDOW, DiskHome, OffloadDecision, OffloadPlan, StagedIO
from .groups import GroupState, Only, SlotTable, disown, matches
from .layout import Layout
from .pool import HostBlock, HostPool
from .slot import Residency, Slot, storage_key
from .snapshot import PLACEMENTS, Placement, Snapshot, SnapshotPart, SnapshotStore
from .source import Handle, Source, detect
from . import touch
from .locking import Guard, ReaderGate, verb_scope
from .locking import locked as _locked
from .stable import InPlace, StoragePolicy, make_policy
from .swap import Swap, SwapVerbs, reads_of
from .transfer import CopyEngine, Transfer

GroupArg = str | Iterable[str] | None
_log = logging.getLogger("stateshift")

#: states built with ``guard=False`` that hold offloaded values: kept alive until ``close()``
_KEEP_ALIVE: set[ModelState] = set()
#: every open state, for ``ModelState.owner``
_OPEN: weakref.WeakSet[ModelState] = weakref.WeakSet()


class ModelState(SwapVerbs):
    """The movable state of one model (and optionally its optimizer).

    Args:
        model: a ``torch.nn.Module`` (or anything a registered backend knows:
            Megatron-core DDP, FSDP2 modules, lists of model chunks).
        optimizer: its optimizer, whose state becomes the ``optim`` group.
        backends: explicit backends instead of detection.
        pool: the pinned host pool (shared between states if you like).
        pin: passed to a new ``HostPool`` when ``pool`` is not given.
        device: the accelerator the copy engine drives (default: current CUDA device, if any).
        snapshot_budget_bytes: byte budget of ``self.snapshots``.
        guard: install hooks that raise ``OffloadedStateError`` when compute
            touches released state (forward, backward into released grads,
            optimizer step, ``state_dict``) and order forwards and steps
            against verbs in other threads. (Direct tensor operations on
            released storage are checked either way: ``touch.py``.)
        free_device_memory: hand device memory that ``offload`` and ``drop``
            release back to the driver (``torch.cuda.empty_cache()``), so a
            rollout engine with its own allocator, or another process, can use
            it. PyTorch's caching allocator cannot return one tensor's memory
            alone: this also returns every other unused block it has cached
            for this process (they are allocated again on demand), and it waits
            for the copies that read the released memory, so such a verb
            returns when its copies are done. ``False`` keeps the memory cached
            for this process (the verb stays asynchronous). No effect on a
            machine without CUDA.
        address_stable: keep device addresses across offload and onload (CUDA
            graphs captured before an offload replay correctly after it), with
            the optional ``torch_memory_saver`` (``pip install 'stateshift[tms]'``;
            ``AddressStableError`` without it). A group becomes address-stable
            the first time it is onloaded, and then moves whole. Accepted with
            a warning, and a no-op, on a machine without CUDA. See ``stable.py``.
        disk_dir: where ``offload(..., to="disk")`` keeps values: one scratch file per state
            in this directory, removed on ``close()`` and at exit (``disk.py``); opened with
            ``O_DIRECT`` where the filesystem allows it, buffered otherwise (``describe_disk()``).
        disk_window_bytes: each of the two pinned staging windows disk transfers go through
            (host memory a disk offload uses: twice this, whatever it moves).
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        backends: Iterable[Source] | None = None,
        pool: HostPool | None = None,
        pin: bool | str = "auto",
        device: torch.device | None = None,
        snapshot_budget_bytes: int | None = None,
        guard: bool = True,
        free_device_memory: bool = True,
        address_stable: bool = False,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_window_bytes: int = DISK_WINDOW,
    ) -> None:
        if disk_window_bytes < 1:
            raise ValueError(f"disk_window_bytes must be at least 1 byte, not {disk_window_bytes}")
        self.backends: list[Source] = list(backends) if backends is not None else detect(model, optimizer)
        self.pool = pool if pool is not None else HostPool(pin=pin)  # type: ignore[arg-type]
        self._table = SlotTable(self.backends, self.pool)
        self.groups: tuple[str, ...] = self._table.names
        self.forward_groups: tuple[str, ...] = self._table.forward
        self.engine = CopyEngine(device)
        self._storage: StoragePolicy = make_policy(address_stable, self.engine.device, f"stateshift-{id(self):x}")
        self._paused_keys: set[int] = set()
        self.snapshots = SnapshotStore(snapshot_budget_bytes)
        self._groups: dict[str, GroupState] = self._table.groups
        self._swapping: set[str] = set()
        self._rebuild_reads: Counter[str] = Counter()
        self._swaps: list[tuple[Swap, Snapshot]] = []
        self._handles: list[Handle] = []
        self._lock = threading.RLock()
        self._gate = ReaderGate(self._lock)
        self._closed = False
        self._guarded = guard
        self.disk_dir = None if disk_dir is None else os.fspath(disk_dir)
        self._disk: DiskHome | None = None
        self._io = StagedIO(self.engine, self.pool, disk_window_bytes)
        #: the decisions of the last ``offload(..., to="auto")``
        self.last_offload_plan: OffloadPlan | None = None
        self.free_device_memory = free_device_memory
        try:
            self._table.refresh()
        except BaseException:
            self._table.close()
            raise
        if guard:
            for b in self.backends:
                self._handles.extend(b.install_guards(Guard(self.check_resident, self._gate)))
        _OPEN.add(self)
        self._publish_released()  # (a framework may have released storage before: Megatron's own offload)

    @classmethod
    def owner(cls, tensor: torch.Tensor) -> ModelState | None:
        """The open ``ModelState`` that tracks ``tensor``'s storage (e.g. one whose reference was lost
        while it held offloaded values: it is kept alive, and this gets it back), or ``None``."""
        t = getattr(tensor, "_local_tensor", tensor)  # a DTensor's storage is its local shard's
        key = storage_key(t)
        return next((s for s in list(_OPEN) if not s._closed and key in s._table.slots), None)

    # -- introspection --------------------------------------------------------------------
    @property
    def swapping(self) -> frozenset[str]:
        """The groups a ``swapped()`` context holds right now."""
        return frozenset(self._swapping)

    @property
    def closed(self) -> bool:
        return self._closed

    @_locked
    def residency(self) -> dict[str, dict[str, int]]:
        """Per group, how many slots are ``device`` / ``host`` / ``dropped``."""
        self._table.refresh()
        hide = () if self.disk_dir is not None else ("disk",)  # a state without a disk tier reports three
        return {g: {k: n for k, n in gs.counts().items() if k not in hide} for g, gs in self._groups.items()}

    @_locked
    def slots(self, group: GroupArg = None) -> list[Slot]:
        """The slots of ``group`` -- a name, several (one listing for all), or ``None`` for every group --
        listed afresh: those groups are re-listed (every group, when one of their storages is still a slot
        of another group: ``GroupTable.refresh``). In group order; ``slot.info.group`` says whose."""
        names = self._select(group, check_swap=False) if group is not None else self.groups
        self._table.refresh(names)
        return [s for g in names for s in self._groups[g].slots]

    @_locked
    def nbytes(self, groups: GroupArg = None) -> int:
        names = self._select(groups, check_swap=False)
        self._table.refresh(names)
        return sum(s.nbytes for g in names for s in self._groups[g].slots)

    def describe_disk(self) -> str | None:
        """The disk home in use: its file, its I/O mode (``O_DIRECT`` or ``buffered``) and why, and the
        bytes each mode moved; ``None`` while nothing went to disk (the file is made on first use)."""
        return None if self._disk is None else self._disk.describe()

    @_locked
    def layout(self, group: str) -> Layout:
        """The group's layout now (re-listed as ``slots(group)`` is)."""
        return self.layouts(group)[group]

    @_locked
    def layouts(self, groups: GroupArg) -> dict[str, Layout]:
        """Each group's layout now, from one listing of them all (as ``slots(groups)``)."""
        names = self._select(groups, check_swap=False)
        self._table.refresh(names)
        return {g: self._groups[g].layout for g in names}

    @_locked
    def stash_placement(self, groups: GroupArg = None, stash: Literal["auto", "device", "host"] = "auto") -> str:
        """Where ``swapped(..., stash=stash)`` would keep the current values of ``groups`` now: ``"device"`` or ``"host"``."""
        names = self._select(groups, check_swap=False)
        self._table.refresh(names)
        return "device" if self._stash_on_device(stash, [self._groups[g] for g in names]) else "host"

    @_locked
    def refresh(self, groups: Iterable[str] | None = None) -> None:
        """Re-list the backends' tensors of ``groups`` (default all); every verb does this for the groups it touches."""
        self._table.refresh(groups)

    # -- verbs ----------------------------------------------------------------------------
    @_locked
    def offload(self, groups: GroupArg = None, *, only: Only = None, to: Literal["host", "disk", "auto"] = "host") -> Transfer:
        """Copy device-resident slots to their homes and release their device storage.

        ``to="host"``: into pinned host homes; ``host`` and ``disk`` slots stay
        as they are. ``to="disk"``: into the state's disk home (``disk_dir``),
        host-resident slots too (their host memory goes back to the pool);
        done when this returns (the copies went through the staging windows),
        and a full disk raises ``DiskTierError`` with every value where it was.
        ``to="auto"``: as ``plan_offload`` decides (host while the pool's budget
        holds, disk beyond), the decision logged and kept in ``last_offload_plan``.
        ``dropped`` slots stay dropped. A host home is safe to read on the host
        after the returned transfer's ``wait()``. With ``free_device_memory``
        (the default) the released memory goes back to the driver before this
        returns (see ``__init__``).
        """
        if to not in ("host", "disk", "auto"):
            raise ValueError(f"to must be 'host', 'disk' or 'auto', not {to!r}")
        names = self._select(groups)
        self._table.refresh(names)
        self._check_releasable(names, only)
        if to == "auto":
            plan = self.last_offload_plan = self._plan_offload(names, only, None)
            _log.info("offload plan: %s", plan.describe())
            disk = tuple(d.group for d in plan.decisions if d.to == "disk")
            t = self._offload_to_disk(disk, only) if disk else Transfer()
            names = tuple(d.group for d in plan.decisions if d.to == "host")
            if not names:
                return t
        if to == "disk":
            return self._offload_to_disk(names, only)
        moving: dict[str, list[int]] = {}
        for g in names:
            idx = self._groups[g].releasable(only, checked=True)
            if idx:
                moving[g] = idx
        fresh = self._reserve_homes(moving)
        transfer = Transfer()
        for g, idx in moving.items():
            gs = self._groups[g]
            home = self._install_home(gs, fresh.get(g), rewriting=list(map(gs.slots.__getitem__, idx)))
            moved = gs.copy_out(self.engine, idx, home.data, frees=True)
            home.pending = moved.merged(home.pending)
            transfer = transfer.merged(moved)
        for g, idx in moving.items():
            self._release(self._groups[g], idx)
            for i in idx:
                self._groups[g].slots[i].residency = Residency.HOST
        if moving and not self._guarded:
            _KEEP_ALIVE.add(self)
        self._released(moving)
        _log.debug("offload %s: %d bytes", list(moving), transfer.total_bytes)
        return transfer

    @_locked
    def plan_offload(self, groups: GroupArg = None, *, only: Only = None, host_budget_bytes: int | None = None) -> OffloadPlan:
        """Where ``offload(groups, to="auto")`` would put each group, and the host memory it would hold at its
        peak, decided before anything is allocated: the host (pinned pool) while the budget holds
        (``host_budget_bytes``, default the pool's), the disk beyond (needs ``disk_dir``). Raises
        ``PoolBudgetError`` naming the group that fits nowhere."""
        names = self._select(groups)
        self._table.refresh(names)
        return self._plan_offload(names, only, host_budget_bytes)

    def _plan_offload(self, names: tuple[str, ...], only: Only, budget: int | None) -> OffloadPlan:
        budget = self.pool.budget_bytes if budget is None else budget
        if budget is not None and self.disk_dir is not None:
            budget -= 2 * self._io.window  # room for the staging windows of whatever goes to disk
        held = self.pool.stats.in_use_bytes
        disk_free = shutil.disk_usage(self.disk_dir).free if self.disk_dir is not None and os.path.isdir(self.disk_dir) else None
        decisions, peak, to_disk = [], held, 0
        for g in names:
            gs = self._groups[g]
            moving = sum(s.nbytes for s in gs.slots if s.residency is Residency.DEVICE and matches(s, only))
            need = gs.layout.total if moving and (gs.home is None or gs.home.shared) else 0
            if budget is None or held + need <= budget:
                decisions.append(OffloadDecision(g, "host", moving))
                held += need
            elif self.disk_dir is not None and (disk_free is None or to_disk + gs.layout.total <= disk_free):
                decisions.append(OffloadDecision(g, "disk", moving))
                to_disk += gs.layout.total
            else:
                where = "and no disk tier is set (disk_dir)" if self.disk_dir is None else "and the disk is too full"
                raise PoolBudgetError(f"group {g!r} ({need} bytes) fits in neither the host budget ({budget} bytes for homes, {held} held) {where}")
            peak = max(peak, held + (2 * self._io.window if to_disk else 0))
        return OffloadPlan(tuple(decisions), peak, to_disk)

    @_locked
    def drop(self, groups: GroupArg = None, *, only: Only = None) -> None:
        """Release device storage without keeping values (``onload`` zero-fills). ``host`` slots become ``dropped`` too."""
        names = self._select(groups)
        self._check_not_rebuild_read(names)
        self._table.refresh(names)
        self._check_releasable(names, only)
        released: dict[str, list[int]] = {}
        for g in names:
            gs = self._groups[g]
            idx = gs.select(lambda s: s.residency is not Residency.DROPPED and s.releasable and matches(s, only))
            released[g] = [i for i in idx if gs.slots[i].residency is Residency.DEVICE]
            self._release(gs, released[g])
            for i in idx:
                gs.slots[i].residency = Residency.DROPPED
                disown(gs.slots[i])
        self._released({g: idx for g, idx in released.items() if idx})

    @_locked
    def onload(self, groups: GroupArg = None, *, only: Only = None) -> Transfer:
        """Re-grow device storage and fill it: from the home (``host``) or with zeros (``dropped``).

        The same tensor objects hold the values afterwards; compute enqueued
        after the call sees them.
        """
        names = self._select(groups)
        self._table.refresh(names)
        transfer = self._bring_back(names, None if only is None else lambda s: s.residency is not Residency.DEVICE and matches(s, only))
        if groups is None and only is None:
            _KEEP_ALIVE.discard(self)
        _log.debug("onload %s: %d bytes", names, transfer.total_bytes)
        return transfer

    def _bring_back(self, names: Iterable[str], which: Callable[[Slot], bool] | None) -> Transfer:
        """Re-grow and fill the slots ``which`` selects (``None``: every one not resident) in groups ``names``;
        they become ``device``."""
        groups = list(map(self._groups.__getitem__, names))
        todo = [(gs, gs.offloaded() if which is None else gs.select(which)) for gs in groups]
        try:
            transfer = self._fill_from_homes([(gs, idx) for gs, idx in todo if idx])
        except BaseException:  # e.g. a disk that cannot be read: the storage re-grown for it goes again
            if self.engine.device is not None:
                torch.cuda.synchronize(self.engine.device)  # no copy still writes into it
            for gs, idx in todo:
                if idx and not self._storage.paused(gs.name):
                    self._release(gs, [i for i in idx if gs.slots[i].storage.nbytes() > 0])
            raise
        for gs, idx in todo:
            native_too = gs.any_native()
            for i in idx:
                gs.slots[i].residency = Residency.DEVICE
                if native_too:
                    disown(gs.slots[i])
        self._forget_disk_regions(names)
        return transfer

    @_locked
    def snapshot(
        self,
        groups: GroupArg = None,
        *,
        tag: str = "snapshot",
        version: int | None = None,
        placement: Placement = "host",
    ) -> Snapshot:
        """Copy the groups' current values, wherever they live, into a new snapshot.

        Default groups: those the forward pass reads (params, buffers, ...).
        ``placement``: ``"host"`` (pooled pinned memory), ``"device"``, or
        ``"disk"`` (a span of the state's disk home, written through the staging
        windows before this returns; needs ``disk_dir``).
        A snapshot under the same ``(tag, version)`` is replaced (released
        first, so its memory is reused). A host snapshot of a fully
        offloaded group shares the home's block instead of copying it.
        Values are safe to read on the host after ``snapshot.wait()``.
        """
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
        names = self._select(groups if groups is not None else self.forward_groups, check_swap=False)
        self._table.refresh(names)
        gss = [self._groups[g] for g in names]
        shared = {gs.name for gs in gss if placement == "host" and gs.home_is_whole()}
        old = self._make_room_for(tag, version, gss, [gs.layout.total for gs in gss if placement == "host" and gs.name not in shared])
        device_arenas = {gs.name: self._device_arena(gs) for gs in gss if placement == "device"}
        disk = self._disk_home() if placement == "disk" else None
        if disk is not None:  # writes can fail (a full disk): the old snapshot goes only once the new one is written
            return self._store(Snapshot.of(tag=tag, version=version, placement=placement, parts=self._disk_parts(disk, gss), pool=self.pool))
        if old is not None:
            self.snapshots.discard(old)
        parts: list[SnapshotPart] = []
        transfer = Transfer()
        for gs in gss:
            if gs.name in shared:
                assert gs.home is not None
                parts.append(SnapshotPart(gs.name, gs.layout, host=self.pool.retain(gs.home)))
                transfer = transfer.merged(gs.home.pending)
                continue
            arena = device_arenas.get(gs.name)
            part = SnapshotPart(gs.name, gs.layout, device=arena) if arena is not None else SnapshotPart(gs.name, gs.layout, host=self.pool.acquire(gs.layout.total))
            parts.append(part)
            transfer = transfer.merged(self._read_group(gs, part.arena))
        return self._store(Snapshot.of(tag=tag, version=version, placement=placement, parts=tuple(parts), pool=self.pool, transfer=transfer))

    @_locked
    def snapshot_from(
        self, groups: GroupArg, fill: Callable[[SnapshotPart], None], *, tag: str, version: int | None = None
    ) -> Snapshot:
        """A host snapshot of ``groups`` laid out as the model is now, its values written by ``fill(part)``.

        ``fill`` writes every region of each part (``part.regions()``) on this
        thread (e.g. a checkpoint read straight into pooled host memory). If
        it raises, the blocks go back to the pool and nothing else changed.
        Replaces a snapshot stored under the same ``(tag, version)``, released
        only once the new one is filled (so a failing fill keeps it; the pool
        holds both meanwhile: release the old one first to reuse its memory).
        """
        names = self._select(groups, check_swap=False)
        self._table.refresh(names)
        gss = [self._groups[g] for g in names]
        old = self._make_room_for(tag, version, gss, [gs.layout.total for gs in gss], replaced_after=True)
        parts = [SnapshotPart(gs.name, gs.layout, host=self.pool.acquire(gs.layout.total)) for gs in gss]
        try:
            for part in parts:
                fill(part)
        except BaseException:
            for part in parts:
                assert part.host is not None
                self.pool.release(part.host)
            raise
        if old is not None:
            self.snapshots.discard(old)
        return self._store(Snapshot.of(tag=tag, version=version, placement="host", parts=tuple(parts), pool=self.pool))

    @_locked
    def restore(self, snapshot: Snapshot) -> Transfer:
        """Write the snapshot's values into its groups, wherever each slot lives now.

        ``device`` slots are written in place (no temporary full-size device
        tensor); ``host`` slots get the values in their home (a pointer copy
        when the whole group is offloaded); ``dropped`` slots become ``host``
        with the values. Checks the layout of every group first and changes
        nothing if any differs (``LayoutMismatchError`` names the tensor).
        Slots on disk get the values in a new region, switched to only once
        every write succeeded (a full disk changes nothing); a disk snapshot
        that cannot be read (``DiskTierError`` part way) leaves its groups'
        device and host slots partly restored: restore again once it reads.
        """
        adopt, rewrite = self._restore_plan(snapshot)
        fresh = self._reserve_homes(rewrite)
        for gs, part in adopt:
            self._adopt_home(gs, part)
        return self._write_parts(snapshot, [p for p in snapshot.parts if p.group not in {gs.name for gs, _ in adopt}], fresh, rewrite)

    @_locked
    def check_restore(self, snapshot: Snapshot) -> None:
        """Raise what ``restore(snapshot)`` would raise now for its arguments and budgets, changing nothing
        (a distributed checkpoint load asks every rank before any rank restores)."""
        _, rewrite = self._restore_plan(snapshot)
        self.pool.check_room(self._home_bytes(rewrite))

    def _restore_plan(self, snapshot: Snapshot) -> tuple[list[tuple[GroupState, SnapshotPart]], dict[str, list[Slot]]]:
        """Check a restore's arguments; which groups adopt the snapshot's block as their home, and which
        offloaded slots get the values written into (private) homes."""
        Snapshot.given(snapshot, "restore")
        names = self._select(snapshot.groups)
        self._check_not_rebuild_read(names)
        self._table.refresh(names)
        for part in snapshot.parts:
            self._groups[part.group].layout.check_compatible(part.layout)
        adopt: list[tuple[GroupState, SnapshotPart]] = []
        rewrite: dict[str, list[Slot]] = {}
        for part in snapshot.parts:
            gs = self._groups[part.group]
            if gs.all_resident():
                continue  # written in place (``_write_parts``)
            offloaded = [s for s in gs.slots if s.residency is not Residency.DEVICE]
            on_disk = any(s.residency is Residency.DISK for s in offloaded)
            if part.host is not None and offloaded and len(offloaded) == len(gs.slots) and not gs.has_native() and not on_disk:
                adopt.append((gs, part))  # every slot offloaded: the snapshot's block becomes the home
            elif any(s.residency is not Residency.DISK for s in offloaded):
                rewrite[gs.name] = [s for s in offloaded if s.residency is not Residency.DISK]
        return adopt, rewrite

    @contextmanager
    def swapped(
        self,
        snapshot: Snapshot,
        *,
        rebuild: Mapping[str, Callable[[], None]] | None = None,
        stash: Literal["auto", "device", "host"] = "auto",
    ) -> Iterator[Snapshot]:
        """Inside, the model computes with the snapshot's values; after, it has exactly its own back.

        ``device`` slots are stashed and overwritten; ``host`` and ``dropped``
        slots get device storage filled from the snapshot and are released
        again on exit, their homes untouched. Changes made inside (e.g. an
        optimizer step) are discarded. Other verbs on these groups raise
        ``SwapActiveError`` inside.

        ``rebuild`` maps a group to a function that recomputes its current
        values on the device (e.g. bf16 params from the optimizer's fp32
        master weights): that group's device slots are then not stashed, and
        on exit the function runs instead of copying the stash back -- after
        every other group of the snapshot has its own values back, with the
        tensors it declares in ``reads()`` made resident (``swap.py``). It
        must rewrite every device-resident slot of the group, on the current
        stream. Groups it reads cannot be dropped or restored inside the context.

        ``stash``: where the current values wait. ``"device"`` costs device
        memory and moves them at device-copy speed; ``"host"`` uses a pooled
        pinned block and two PCIe crossings; ``"auto"`` takes the device when
        its free memory holds twice the stash, else the host.
        """
        if stash not in ("auto", "device", "host"):
            raise ValueError(f"stash must be 'auto', 'device' or 'host', not {stash!r}")
        swap = self._swap_in(snapshot, dict(rebuild or {}), stash)
        try:
            yield snapshot
        finally:
            self._swap_out(swap, snapshot)

    @_locked
    def release(self, snapshot: Snapshot) -> None:
        """Forget the snapshot and give its memory back (to the pool, for host snapshots)."""
        self.snapshots.discard(snapshot)

    def close(self) -> None:
        """Give the model back whole, then remove hooks, release snapshots and homes.

        Nothing is lost to a close and nothing is left released behind the
        removed guards: an active ``swapped()`` context is ended first (the
        model gets its own values back; the context's exit then does
        nothing), and every slot whose storage stateshift released is
        re-grown -- offloaded values come back to the device, dropped ones as
        zeros (``drop()`` before a close does not save device memory after
        it). Values kept in a framework's own host copy stay there.
        Idempotent; other verbs raise ``ClosedStateError`` afterwards.
        """
        with self._lock:
            if self._closed:
                return
            with verb_scope(self, "close"):
                self._close()

    def _close(self) -> None:
        for swap, snap in reversed(list(self._swaps)):
            self._swap_out(swap, snap)
        self._table.refresh()
        self._bring_back(self.groups, lambda s: s.residency is not Residency.DEVICE and s.native_home is None)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.snapshots.clear()
        for gs in self._groups.values():
            if gs.home is not None:
                self.pool.release(gs.home)
                gs.home = None
        self._closed = True
        self._io.close()
        if self._disk is not None:
            self._disk.close()
        self._table.close()
        _KEEP_ALIVE.discard(self)
        _OPEN.discard(self)

    def _publish_released(self) -> None:
        """Tell ``touch`` which storages of this state are released now (none once closed): any tensor
        operation on them raises ``OffloadedStateError`` from then on."""
        released: dict[int, Slot] = {}
        if not self._closed:
            for gs in self._groups.values():
                if gs.count(Residency.DEVICE) < len(gs.slots):
                    released.update((s.key, s) for s in gs.slots if s.residency is not Residency.DEVICE)
            paused = self._paused_keys  # address-stable storages keep their size, not their memory
            if paused:
                released.update((s.key, s) for gs in self._groups.values() for s in gs.slots if s.key in paused)
        touch.publish(self, released, frozenset(self._paused_keys) if released else frozenset())

    # -- guards ---------------------------------------------------------------------------
    def check_resident(self, tensors: Iterable[torch.Tensor], where: str, *, writes: bool = False) -> None:
        """Raise ``OffloadedStateError`` if any tensor's storage is released (cheap: no refresh, no lock).

        A paused address-stable storage keeps its size but not its memory: it is looked up by key.
        ``writes``: an optimizer step; inside a ``swapped()`` context of its tensors' groups it raises
        ``SwapActiveError`` (see ``Check``)."""
        touch.sync_thread()
        paused, swapping = self._paused_keys, self._swapping if writes else None
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            if swapping:
                self._check_not_swapped(t, where)
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or (paused and storage._cdata in paused):
                slot = self._table.slots.get(storage_key(t))
                if slot is None:
                    raise OffloadedStateError("(untracked)", "(a tensor)", "released", where)
                raise OffloadedStateError(slot.info.group, slot.name, slot.residency.value, where)

    def _check_not_swapped(self, t: torch.Tensor, where: str) -> None:
        slot = self._table.slots.get(storage_key(t))
        if slot is not None and slot.info.group in self._swapping:
            raise SwapActiveError(
                f"{where} inside a swapped() context of group {slot.info.group!r} ({slot.name}): it would update "
                "the optimizer from the snapshot's values, and the exit would discard what it wrote there; "
                "step after the context"
            )

    # -- internals: selection and memory ----------------------------------------------------
    def _select(self, groups: GroupArg, *, check_swap: bool = True) -> tuple[str, ...]:
        if groups is None:
            names: tuple[str, ...] = self.groups
        elif isinstance(groups, str):
            names = (groups,)
        else:
            names = tuple(groups)
            if not names:
                raise ValueError(f"no groups given (an empty list); valid groups: {', '.join(self.groups)}")
        for g in names:
            if g not in self._groups:
                raise UnknownGroupError(g, self.groups)
        if len(set(names)) != len(names):
            raise ValueError(f"a group is named twice in {list(names)}")
        if check_swap:
            busy = [g for g in names if g in self._swapping]
            if busy:
                raise SwapActiveError(f"group(s) {busy} are inside a swapped() context")
        return names

    def _check_not_rebuild_read(self, names: Iterable[str]) -> None:
        """``drop`` and ``restore`` would change values an active context's rebuild reads on exit."""
        busy = [g for g in names if self._rebuild_reads[g] > 0]
        if busy:
            raise SwapActiveError(f"group(s) {sorted(busy)} are read by the rebuild of an active swapped() context "
                                  "(its exit recomputes values from them)")

    def _make_room_for(
        self, tag: str, version: int | None, gss: list[GroupState], host_sizes: list[int], *, replaced_after: bool = False
    ) -> Snapshot | None:
        """Check budgets for a new snapshot of ``gss`` under ``(tag, version)``; returns the snapshot it replaces.

        The store's budget counts every snapshot's bytes wherever they live (host, device, disk,
        shared with a home), as ``SnapshotStore.nbytes`` does; the pool's counts the new host blocks.
        ``replaced_after``: the old snapshot is released only after the new one is filled (its
        memory cannot be reused for it), so the pool must hold both at once."""
        self.snapshots.check_budget(sum(gs.layout.total for gs in gss), replacing=(tag, version))
        old = self.snapshots.find(tag, version)
        freeing = 0 if old is None or replaced_after else sum(p.host.nbytes for p in old.parts if p.host is not None and not p.host.shared)
        self.pool.check_room(sum(host_sizes), freeing=freeing)
        return old

    def _store(self, snap: Snapshot) -> Snapshot:
        for p in snap.parts:
            if p.host is not None:
                p.host.pending = snap.transfer
        self.snapshots.put(snap)
        return snap

    def _device_arena(self, gs: GroupState) -> torch.Tensor:
        return torch.empty(gs.layout.total, dtype=torch.uint8, device=self._device_for(gs))

    def _reserve_homes(self, writing: Collection[str]) -> dict[str, HostBlock]:
        """Phase one of a home write: a fresh block for every group whose home is missing or shared.

        All blocks are acquired (or ``PoolBudgetError`` raised) before any home
        changes, so a budget error leaves every group as it was.
        """
        self.pool.check_room(self._home_bytes(writing))
        return {g: self.pool.acquire(self._groups[g].layout.total) for g in self._needs_home(writing)}

    def _needs_home(self, writing: Collection[str]) -> list[str]:
        return [g for g in writing if self._groups[g].home is None or self._groups[g].home.shared]  # type: ignore[union-attr]

    def _home_bytes(self, writing: Collection[str]) -> int:
        """Pooled bytes a home write of (groups) ``writing`` acquires (``_reserve_homes``)."""
        return sum(self._groups[g].layout.total for g in self._needs_home(writing))

    def _install_home(self, gs: GroupState, fresh: HostBlock | None, rewriting: Sequence[Slot]) -> HostBlock:
        """Phase two: make ``fresh`` the group's home (copying over host values not being rewritten).

        Native slots being rewritten leave their framework copy: their values
        will now live in our home. Returns the home, free of pending readers.
        """
        if gs.any_native():
            for s in rewriting:
                disown(s)
        if fresh is not None:
            old, gs.home = gs.home, fresh
            if old is not None:
                keys = {s.key for s in rewriting}
                carry = [i for i, s in enumerate(gs.slots) if s.residency is Residency.HOST and s.native_home is None and s.key not in keys]
                if carry:
                    old.sync()
                    for i in carry:
                        gs.layout.region(fresh.data, i).copy_(gs.layout.region(old.data, i))
                self.pool.release(old)
        assert gs.home is not None
        gs.home.sync()
        return gs.home

    def _adopt_home(self, gs: GroupState, part: SnapshotPart) -> None:
        """Restore into a fully offloaded group: the snapshot's block becomes its home (copy-on-write)."""
        assert part.host is not None
        old, gs.home = gs.home, self.pool.retain(part.host)
        if old is not None:
            self.pool.release(old)
        for s in gs.slots:
            s.residency = Residency.HOST

    # -- internals: copies ---------------------------------------------------------------------
    def _read_group(self, gs: GroupState, arena: torch.Tensor) -> Transfer:
        """Every slot's current values into ``arena``: device slots copied, offloaded ones from their homes,
        dropped ones as zeros."""
        by = gs.by_residency()
        if by[Residency.HOST] and arena.is_cpu and gs.home is not None:
            gs.home.sync()  # host-to-host: the device copies still writing the home must be done
        gs.zero_regions(self.engine, by[Residency.DROPPED], arena)
        t = gs.copy_out(self.engine, by[Residency.DEVICE], arena).merged(gs.copy_home(self.engine, by[Residency.HOST], arena))
        if by[Residency.DISK]:
            assert self._disk is not None
            t = t.merged(self._io.disk_to_arena(gs.plan(self.engine, by[Residency.DISK], self._io.chunk), self._disk, self._disk.region(gs.name, gs.layout.total), arena))
        return t

    def _write_parts(
        self, snapshot: Snapshot, parts: list[SnapshotPart], fresh: dict[str, HostBlock], rewrite: Mapping[str, list[Slot]]
    ) -> Transfer:
        """Copy ``parts`` into their groups: device slots in place, offloaded ones into (private) homes."""
        transfer = Transfer()
        self._write_disk_regions(snapshot, parts)  # values on disk stay on disk (first: only these writes can fail)
        for part in parts:
            gs = self._groups[part.group]
            offloaded = rewrite.get(gs.name, [])
            resident = gs.by_residency()[Residency.DEVICE]
            if part.host is not None and offloaded:
                snapshot.wait()  # host-to-host: its own copies must be done before this thread reads it
            if part.disk is not None:
                transfer = transfer.merged(self._write_from_disk_part(gs, part, offloaded, fresh))
                continue
            if offloaded:
                home = self._install_home(gs, fresh.get(gs.name), rewriting=offloaded)
                idx = gs.select(lambda s: s.residency is not Residency.DEVICE and s.residency is not Residency.DISK)
                written = gs.copy_home(self.engine, idx, part.arena, into_home=True)
                home.pending = written.merged(home.pending)
                transfer = transfer.merged(written)
                for i in idx:
                    gs.slots[i].residency = Residency.HOST
            transfer = transfer.merged(gs.copy_in(self.engine, resident, part.arena))
        for part in snapshot.parts:
            if part.host is not None:
                part.host.pending = transfer.merged(part.host.pending)
        if rewrite and not self._guarded:
            _KEEP_ALIVE.add(self)
        return transfer

    def _write_disk_regions(self, snapshot: Snapshot, parts: list[SnapshotPart]) -> None:
        """The parts' values of slots on disk, into new regions of the disk home that replace the groups'
        regions only once every write (and its flush) succeeded: a failing write changes nothing."""
        todo: list[tuple[GroupState, SnapshotPart, list[int]]] = []
        for part in parts:
            gs = self._groups[part.group]
            on_disk = gs.by_residency()[Residency.DISK]
            if on_disk:
                todo.append((gs, part, on_disk))
        if not todo:
            return
        disk = self._disk
        assert disk is not None
        if any(p.host is not None for _, p, _ in todo):
            snapshot.wait()  # host-to-host: its own copies must be done before this thread reads it
        fresh: list[tuple[GroupState, int]] = []
        try:
            for gs, part, idx in todo:
                fresh.append((gs, disk.allocate(gs.layout.total)))
                p, region = gs.plan(self.engine, idx, self._io.chunk), fresh[-1][1]
                if part.disk is not None:
                    self._io.disk_to_disk(p, disk, part.disk[1], region)
                else:
                    self._io.arena_to_disk(p, part.arena, disk, region)
                disk.settle(region, gs.layout.total)
        except BaseException:
            for gs, region in fresh:
                disk.free(region, gs.layout.total)
            raise
        for gs, region in fresh:
            disk.forget(gs.name)
            disk.adopt(gs.name, region, gs.layout.total)

    def _write_from_disk_part(self, gs: GroupState, part: SnapshotPart, offloaded: list[Slot], fresh: dict[str, HostBlock]) -> Transfer:
        """Restore from a disk part: device slots in place, offloaded (not on disk) ones into a private home."""
        home_idx: list[int] = []
        if offloaded:
            home = self._install_home(gs, fresh.get(gs.name), rewriting=offloaded)
            home_idx = gs.select(lambda s: s.residency is not Residency.DEVICE and s.residency is not Residency.DISK)
        t = self._read_disk_part(gs, part, gs.select(lambda s: s.residency is Residency.DEVICE), home_idx)
        for i in home_idx:
            gs.slots[i].residency = Residency.HOST
        if offloaded:
            home.pending = t.merged(home.pending)
        return t

    def _fill_from_homes(self, todo: list[tuple[GroupState, list[int]]]) -> Transfer:
        """Re-grow slots ``indices`` and fill them from their homes (dropped slots: zeros). Residency unchanged."""
        transfer = Transfer()
        for gs, idx in todo:
            by = gs.by_residency(idx)
            host, native_too = by[Residency.HOST], gs.any_native()
            own = [i for i in host if gs.slots[i].native_home is None] if native_too else host
            # in place, the storage of slots refilled from the home is given back run by run, overlapping the copies
            late = own if isinstance(self._storage, InPlace) else []
            if len(late) < len(idx):  # (``own`` is part of ``idx``: all of it, in a whole onload)
                given_late = set(late)
                self._regrow(gs, [i for i in idx if i not in given_late])
            zeros = [gs.slots[i].bytes() for i in by[Residency.DROPPED]]
            if zeros:
                torch._foreach_zero_(zeros)
            if own:
                assert gs.home is not None
                if gs.any_on_host() and any(gs.slots[i].device.type == "cpu" for i in own):
                    gs.home.sync()  # host-to-host copies read the home on this thread
                moved = gs.copy_in(self.engine, own, gs.home.data, regrow=bool(late))
                gs.home.pending = moved.merged(gs.home.pending)
                transfer = transfer.merged(moved)
            native = [(gs.slots[i].bytes(), gs.home_region(i)) for i in host if gs.slots[i].native_home is not None] if native_too else []
            transfer = transfer.merged(self.engine.copy(native))
            on_disk = by[Residency.DISK]
            if on_disk:
                assert self._disk is not None
                transfer = transfer.merged(self._io.into(gs.plan(self.engine, on_disk, self._io.chunk), self._disk, self._disk.region(gs.name, gs.layout.total)))
        return transfer

    # -- internals: the disk tier ---------------------------------------------------------------
    def _disk_home(self) -> DiskHome:
        if self._disk is None:
            if self.disk_dir is None:
                raise DiskTierError("offload(..., to='disk') needs ModelState(..., disk_dir=...): no disk directory is set")
            self._disk = self._table.disk = DiskHome(self.disk_dir)
        return self._disk

    def _offload_to_disk(self, names: tuple[str, ...], only: Only) -> Transfer:
        """Write every device- or host-resident slot to the disk home, then (only then) release them."""
        disk = self._disk_home()
        moving: dict[str, tuple[list[int], list[int]]] = {}
        for g in names:
            gs = self._groups[g]
            dev = gs.select(lambda s: s.residency is Residency.DEVICE and s.releasable and matches(s, only))
            host = gs.select(lambda s: s.residency is Residency.HOST and s.native_home is None and matches(s, only))
            if dev or host:
                moving[g] = (dev, host)
        moved, t0 = 0, time.perf_counter()
        for g, (dev, host) in moving.items():
            gs = self._groups[g]
            base = disk.region(g, gs.layout.total)
            if host:
                assert gs.home is not None
                gs.home.sync()
                moved += self._io.arena_to_disk(gs.plan(self.engine, host, self._io.chunk), gs.home.data, disk, base)
            if dev:
                moved += self._io.out(gs.plan(self.engine, dev, self._io.chunk), disk, base, frees_sources=True)
            disk.settle(base, gs.layout.total)
        for g, (dev, host) in moving.items():
            gs = self._groups[g]
            self._release(gs, dev)
            for i in dev + host:
                gs.slots[i].residency = Residency.DISK
            if gs.home is not None and not any(s.residency is Residency.HOST for s in gs.slots):
                self.pool.release(gs.home)  # the host memory those values used is free again
                gs.home = None
        self._released({g: dev for g, (dev, _) in moving.items() if dev})
        _log.debug("offload to disk %s: %d bytes", list(moving), moved)
        return Transfer(nbytes={"disk": moved}, host_seconds=time.perf_counter() - t0)

    def _disk_parts(self, disk: DiskHome, gss: list[GroupState]) -> tuple[SnapshotPart, ...]:
        """Disk snapshot parts of ``gss`` holding their current values; on an error their spans are freed."""
        parts: list[SnapshotPart] = []
        try:
            for gs in gss:
                parts.append(SnapshotPart(gs.name, gs.layout, disk=(disk, disk.allocate(gs.layout.total))))
                self._write_group_to_disk(gs, parts[-1])
        except BaseException:
            for p in parts:
                assert p.disk is not None
                disk.free(p.disk[1], p.layout.total)
            raise
        return tuple(parts)

    def _write_group_to_disk(self, gs: GroupState, part: SnapshotPart) -> None:
        """Every slot's current values into a disk snapshot part, whatever their residency."""
        assert part.disk is not None
        disk, base = part.disk
        w = self._io.chunk
        by = gs.by_residency()
        own = [i for i in by[Residency.HOST] if gs.slots[i].native_home is None]
        if own:
            assert gs.home is not None
            gs.home.sync()
            self._io.arena_to_disk(gs.plan(self.engine, own, w), gs.home.data, disk, base)
        for i in by[Residency.HOST]:
            if gs.slots[i].native_home is not None:
                disk.write(base + gs.layout.offsets[i], gs.home_region(i).contiguous())
        if by[Residency.DISK]:
            self._io.disk_to_disk(gs.plan(self.engine, by[Residency.DISK], w), disk, disk.region(gs.name, gs.layout.total), base)
        if by[Residency.DROPPED]:
            self._io.zero(gs.plan(self.engine, by[Residency.DROPPED], w), disk, base)
        if by[Residency.DEVICE]:
            self._io.out(gs.plan(self.engine, by[Residency.DEVICE], w), disk, base)
        disk.settle(base, gs.layout.total)

    def _read_disk_part(self, gs: GroupState, part: SnapshotPart, device: list[int], home: list[int]) -> Transfer:
        """A disk snapshot part -> slots ``device`` (holding storage) and into the home regions of ``home``."""
        assert part.disk is not None
        disk, base = part.disk
        w = self._io.chunk
        if home:
            assert gs.home is not None
            for run in gs.plan(self.engine, home, w).runs:
                disk.read(base + run.start, gs.home.data[run.start : run.end])
        return self._io.into(gs.plan(self.engine, device, w), disk, base) if device else Transfer()

    def _forget_disk_regions(self, names: Iterable[str]) -> None:
        """A group with nothing left on disk gives its region up (the next disk offload writes a new one)."""
        if self._disk is not None:
            for g in names:
                if not any(s.residency is Residency.DISK for s in self._groups[g].slots):
                    self._disk.forget(g)

    def _release(self, gs: GroupState, idx: list[int]) -> None:
        """Release the storage of resident slots ``idx`` (residency is the caller's to set)."""
        if not idx:
            return
        resident = gs.count(Residency.DEVICE)
        self._storage.release(gs.name, [gs.slots[i] for i in idx], whole=len(idx) >= resident)
        if self._storage.paused(gs.name):
            self._paused_keys.update(s.key for s in gs.slots)

    def _regrow(self, gs: GroupState, idx: list[int]) -> None:
        """Give slots ``idx`` device storage back (uninitialised; residency is the caller's to set)."""
        if not idx:
            return
        offloaded = len(gs.slots) - gs.count(Residency.DEVICE)
        was_paused = self._storage.paused(gs.name)
        self._storage.regrow(gs.name, [gs.slots[i] for i in idx], whole=len(idx) >= offloaded)
        if was_paused:
            self._paused_keys.difference_update(s.key for s in gs.slots)

    def _released(self, released: Mapping[str, list[int]]) -> None:
        """Device memory was released: hand it back to the driver if asked (``free_device_memory``)."""
        if not released or not self.free_device_memory or self.engine.device is None:
            return
        if any(not self._groups[g].slots[i].device.type == "cpu" for g, idx in released.items() for i in idx[:1]):
            torch.cuda.empty_cache()

    # -- internals: host ordering and placement ---------------------------------------------------
    def _check_releasable(self, names: tuple[str, ...], only: Only) -> None:
        """Storage that cannot be resized cannot be released: fine on the host (it already is host
        memory, e.g. FSDP2's pinned shards under CPUOffloadPolicy: it stays where it is), an error
        on an accelerator -- raised before anything moves."""
        for g in names:
            if self._groups[g].all_releasable():
                continue
            for s in self._groups[g].slots:
                if s.residency is Residency.DEVICE and s.device.type != "cpu" and not s.releasable and matches(s, only):
                    raise NotReleasableError(
                        s.name, f"its {s.device.type} storage is not resizable (allocated outside torch's caching "
                        "allocator?), so it cannot be released in place"
                    )

    def _stash_on_device(self, stash: str, groups: list[GroupState]) -> bool:
        """``"auto"``: the device when its free memory holds twice the stash, or when the host pool's budget
        cannot hold it; else the host."""
        if stash != "auto":
            return stash == "device"
        need = sum(gs.layout.total for gs in groups)
        budget = self.pool.budget_bytes
        if budget is not None and self.pool.stats.in_use_bytes + need > budget:
            return True
        dev = self.engine.device
        if dev is None or not any(self._device_for(gs) == dev for gs in groups):
            return False
        free, _ = torch.cuda.mem_get_info(dev)
        return free >= 2 * need

    def _device_for(self, gs: GroupState) -> torch.device:
        """Where a device-placed snapshot or stash of a group goes: the accelerator if the group lives there."""
        dev = self.engine.device
        if dev is not None and any(s.device.type == dev.type for s in gs.slots):
            return dev
        return torch.device("cpu")
