"""The engine behind ``ModelState``: its slot table, tiers, lock and snapshot store (internal).

``ModelState`` (``state.py``) is the user's facade: the verbs and a few
read-only facts. Everything else a library built on the engine needs lives on
the ``Core`` it composes, reached with ``core_of(state)``. This is the one
place that lists that internal API; it may change with the engine, and the
packages that use it (``checkpoint``, ``rl``, ``integrations``, the backends'
guards, the tests) change with it:

- ``slots(groups)``, ``layouts(groups)``, ``refresh(groups)``: the groups'
  slots and layouts as the backends list them now;
- ``snapshot_from(groups, fill, tag=...)``: a host snapshot filled by the
  caller (a checkpoint read straight into pooled memory);
- ``check_restore(snapshot)``: raise what ``restore`` would, changing nothing
  (a distributed load asks every rank first);
- ``stash_placement(groups, stash)``: where ``swapped()`` would stash;
- ``check_resident(tensors, where)``: the guard hooks' residency check;
- ``pool``, ``engine``, ``snapshots``: the pinned pool, the copy engine and
  the snapshot store; ``tiers``, ``groups``: the tiers (``tiers.py``) and each
  group's ``GroupState``; ``disk.disk``: the disk home once one exists.

The verbs themselves are in ``verbs.py`` (offload, onload, drop, snapshot,
restore, close) and ``swap.py`` (``swapped``), each a function of a ``Core``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from ..errors import LayoutError, StateError
from . import touch
from .disk import DiskHome, StagedIO
from .disk_tier import DiskTier
from .groups import GroupState, SlotTable
from .layout import Layout
from .locking import ReaderGate, locked
from .pool import HostPool
from .slot import Residency, Slot, storage_key
from .snapshot import Snapshot, SnapshotPart, SnapshotStore
from .source import Handle, Source
from .stable import make_policy
from .tiers import DeviceTier, DroppedTier, HostTier, Tier
from .transfer import CopyEngine

GroupArg = str | Iterable[str] | None


class Core:
    """The state of one ``ModelState`` and its internal API (see the module docstring).

    Args:
        sources: the backends listing the model's tensors.
        pool: the pinned host pool.
        device: the accelerator the copy engine drives.
        snapshot_budget_bytes: byte budget of ``snapshots``.
        guarded: the state installs guard hooks (they keep it alive).
        free_device_memory: hand released device memory back to the driver.
        address_stable: keep device addresses across offload and onload.
        disk_dir: where the disk tier keeps its file (``None``: no disk tier).
        disk_window_bytes: each of the disk tier's two staging windows.
        facade: the ``ModelState`` this is the core of (kept alive with it).
    """

    def __init__(
        self,
        sources: list[Source],
        pool: HostPool,
        device: torch.device | None,
        *,
        snapshot_budget_bytes: int | None,
        guarded: bool,
        free_device_memory: bool,
        address_stable: bool,
        disk_dir: str | None,
        disk_window_bytes: int,
        facade: Any,
    ) -> None:
        self.backends, self.pool, self.facade, self.guarded = sources, pool, facade, guarded
        self.table = SlotTable(sources, pool)
        self.names: tuple[str, ...] = self.table.names
        self.forward: tuple[str, ...] = self.table.forward
        self.groups: dict[str, GroupState] = self.table.groups
        self.engine = CopyEngine(device)
        self.snapshots = SnapshotStore(snapshot_budget_bytes)
        storage = make_policy(address_stable, self.engine.device, f"stateshift-{id(facade):x}")
        self.device = DeviceTier(self.engine, storage, free_device_memory)
        self.host = HostTier(self.engine, pool, self.device)
        self.dropped = DroppedTier(self.engine, self.device)
        self.disk_dir = disk_dir
        self.disk = DiskTier(
            self.table, StagedIO(self.engine, pool, disk_window_bytes), disk_dir, self.device, self.host
        )
        self.tiers: dict[Residency, Tier] = {
            Residency.DEVICE: self.device,
            Residency.HOST: self.host,
            Residency.DROPPED: self.dropped,
            Residency.DISK: self.disk,
        }
        self.device.sources = {r: t for r, t in self.tiers.items() if r is not Residency.DEVICE}
        self.swapping: set[str] = set()
        self.rebuild_reads: Counter[str] = Counter()
        #: the open ``swapped()`` contexts: (``swap.Swap`` record, snapshot), innermost last
        self.swaps: list[tuple[Any, Snapshot]] = []
        self.handles: list[Handle] = []
        self.lock = threading.RLock()
        self.gate = ReaderGate(self.lock)
        self.closed = False

    @property
    def disk_home(self) -> DiskHome | None:
        """The disk tier's file, once something went to disk."""
        return self.disk.disk

    # -- selection ------------------------------------------------------------------------------------
    def select(self, groups: GroupArg, *, check_swap: bool = True) -> tuple[str, ...]:
        """Group names from a verb's argument (``None``: all), checked.

        Raises:
            LayoutError("unknown_group"): a name is not a group of this state.
            ValueError: an empty list, or a group named twice.
            StateError("swap_active"): ``check_swap`` and a group is inside a ``swapped()`` context.
        """
        if groups is None:
            names: tuple[str, ...] = self.names
        elif isinstance(groups, str):
            names = (groups,)
        else:
            names = tuple(groups)
            if not names:
                raise ValueError(f"no groups given (an empty list); valid groups: {', '.join(self.names)}")
        for g in names:
            if g not in self.groups:
                raise LayoutError("unknown_group", group=g, valid=self.names)
        if len(set(names)) != len(names):
            raise ValueError(f"a group is named twice in {list(names)}")
        if check_swap:
            busy = [g for g in names if g in self.swapping]
            if busy:
                raise StateError("swap_active", f"group(s) {busy} are inside a swapped() context")
        return names

    def listed(self, groups: GroupArg, *, check_swap: bool = True) -> list[GroupState]:
        """``select`` and re-list those groups: their ``GroupState``, in order."""
        names = self.select(groups, check_swap=check_swap)
        self.table.refresh(names)
        return [self.groups[g] for g in names]

    def check_not_rebuild_read(self, names: Iterable[str]) -> None:
        """``drop`` and ``restore`` would change values an active context's rebuild reads on exit.

        Raises:
            StateError("swap_active"): naming the groups a rebuild reads.
        """
        busy = [g for g in names if self.rebuild_reads[g] > 0]
        if busy:
            raise StateError(
                "swap_active",
                f"group(s) {sorted(busy)} are read by the rebuild of an active swapped() context "
                "(its exit recomputes values from them)",
            )

    # -- the internal API ------------------------------------------------------------------------------
    @locked
    def slots(self, group: GroupArg = None) -> list[Slot]:
        """The slots of ``group`` -- a name, several (one listing for all), or ``None`` for every group --
        listed afresh, in group order; ``slot.info.group`` says whose."""
        return [s for gs in self.listed(group if group is not None else self.names, check_swap=False) for s in gs.slots]

    @locked
    def layouts(self, groups: GroupArg) -> dict[str, Layout]:
        """Each group's layout now, from one listing of them all (as ``slots(groups)``)."""
        return {gs.name: gs.layout for gs in self.listed(groups, check_swap=False)}

    @locked
    def refresh(self, groups: Iterable[str] | None = None) -> None:
        """Re-list the backends' tensors of ``groups`` (default all); every verb does this for the groups it touches."""
        self.table.refresh(groups)

    @locked
    def stash_placement(self, groups: GroupArg = None, stash: Literal["auto", "device", "host"] = "auto") -> str:
        """Where ``swapped(..., stash=stash)`` would keep the current values of ``groups`` now: ``"device"`` or ``"host"``."""
        return "device" if self.stash_on_device(stash, self.listed(groups, check_swap=False)) else "host"

    @locked
    def snapshot_from(
        self, groups: GroupArg, fill: Callable[[SnapshotPart], None], *, tag: str, version: int | None = None
    ) -> Snapshot:
        """A host snapshot of ``groups`` laid out as the model is now, its values written by ``fill(part)``.

        ``fill`` writes every region of each part (``part.regions()``) on this
        thread. If it raises, the blocks go back to the pool and nothing else
        changed. Replaces a snapshot stored under the same ``(tag, version)``,
        released only once the new one is filled (the pool holds both meanwhile).
        """
        gss = self.listed(groups, check_swap=False)
        old = self.make_room_for(tag, version, gss, [gs.layout.total for gs in gss], replaced_after=True)
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
        return self.store(Snapshot.of(tag=tag, version=version, placement="host", parts=tuple(parts), pool=self.pool))

    @locked
    def check_restore(self, snapshot: Snapshot) -> None:
        """Raise what ``restore(snapshot)`` would raise now for its arguments and budgets, changing nothing."""
        _, rewrite = self.restore_plan(snapshot)
        self.pool.check_room(self.host.home_bytes([self.groups[g] for g in rewrite]))

    def restore_plan(self, snapshot: Snapshot) -> tuple[list[tuple[GroupState, SnapshotPart]], dict[str, list[Slot]]]:
        """Check a restore's arguments; which groups adopt the snapshot's block as their home, and which
        offloaded slots get the values written into (private) homes."""
        Snapshot.given(snapshot, "restore")
        self.check_not_rebuild_read(self.select(snapshot.groups))
        self.listed(snapshot.groups)
        for part in snapshot.parts:
            self.groups[part.group].layout.check_compatible(part.layout)
        adopt: list[tuple[GroupState, SnapshotPart]] = []
        rewrite: dict[str, list[Slot]] = {}
        for part in snapshot.parts:
            gs = self.groups[part.group]
            if gs.all_resident():
                continue  # written in place
            offloaded = [s for s in gs.slots if s.residency is not Residency.DEVICE]
            on_disk = any(s.residency is Residency.DISK for s in offloaded)
            if (
                part.host is not None
                and offloaded
                and len(offloaded) == len(gs.slots)
                and not gs.has_native()
                and not on_disk
            ):
                adopt.append((gs, part))  # every slot offloaded: the snapshot's block becomes the home
            elif any(s.residency is not Residency.DISK for s in offloaded):
                rewrite[gs.name] = [s for s in offloaded if s.residency is not Residency.DISK]
        return adopt, rewrite

    def check_resident(self, tensors: Iterable[torch.Tensor], where: str, *, writes: bool = False) -> None:
        """Raise ``StateError("offloaded")`` if any tensor's storage is released (cheap: no refresh, no lock).

        A paused address-stable storage keeps its size but not its memory: it is looked up by key.
        ``writes``: an optimizer step; inside a ``swapped()`` context of its tensors' groups it raises
        ``StateError("swap_active")``."""
        touch.sync_thread()
        paused, swapping = self.device.paused_keys, self.swapping if writes else None
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            if swapping:
                self._check_not_swapped(t, where)
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or (paused and storage._cdata in paused):
                slot = self.table.slots.get(storage_key(t))
                if slot is None:
                    raise StateError("offloaded", where, group="(untracked)", tensor="(a tensor)", residency="released")
                raise StateError(
                    "offloaded", where, group=slot.info.group, tensor=slot.name, residency=slot.residency.value
                )

    def _check_not_swapped(self, t: torch.Tensor, where: str) -> None:
        slot = self.table.slots.get(storage_key(t))
        if slot is not None and slot.info.group in self.swapping:
            raise StateError(
                "swap_active",
                f"{where} inside a swapped() context of group {slot.info.group!r} ({slot.name}): it would update "
                "the optimizer from the snapshot's values, and the exit would discard what it wrote there; "
                "step after the context",
            )

    # -- memory and snapshots ---------------------------------------------------------------------------
    def make_room_for(
        self,
        tag: str,
        version: int | None,
        gss: list[GroupState],
        host_sizes: list[int],
        *,
        replaced_after: bool = False,
    ) -> Snapshot | None:
        """Check budgets for a new snapshot of ``gss`` under ``(tag, version)``; returns the snapshot it replaces.

        The store's budget counts every snapshot's bytes wherever they live (host, device, disk,
        shared with a home), as ``SnapshotStore.nbytes`` does; the pool's counts the new host blocks.
        ``replaced_after``: the old snapshot is released only after the new one is filled (its
        memory cannot be reused for it), so the pool must hold both at once."""
        self.snapshots.check_budget(sum(gs.layout.total for gs in gss), replacing=(tag, version))
        old = self.snapshots.find(tag, version)
        freeing = (
            0
            if old is None or replaced_after
            else sum(p.host.nbytes for p in old.parts if p.host is not None and not p.host.shared)
        )
        self.pool.check_room(sum(host_sizes), freeing=freeing)
        return old

    def store(self, snap: Snapshot) -> Snapshot:
        for p in snap.parts:
            if p.host is not None:
                p.host.pending = snap.transfer
        self.snapshots.put(snap)
        return snap

    def stash_on_device(self, stash: str, groups: list[GroupState]) -> bool:
        """``"auto"``: the device when its free memory holds twice the stash, or when the host pool's budget
        cannot hold it; else the host."""
        if stash != "auto":
            return stash == "device"
        need = sum(gs.layout.total for gs in groups)
        budget = self.pool.budget_bytes
        if budget is not None and self.pool.stats.in_use_bytes + need > budget:
            return True
        dev = self.engine.device
        if dev is None or not any(self.device.device_for(gs) == dev for gs in groups):
            return False
        free, _ = torch.cuda.mem_get_info(dev)
        return free >= 2 * need

    def holds_host_values(self) -> bool:
        """Whether a slot's values wait in a home (a state built with ``guard=False`` then keeps itself alive)."""
        return any(gs.count(Residency.HOST) for gs in self.groups.values())

    def publish_released(self) -> None:
        """Tell ``touch`` which storages of this state are released now (none once closed): any tensor
        operation on them raises ``StateError("offloaded")`` from then on."""
        released: dict[int, Slot] = {}
        paused = self.device.paused_keys  # address-stable storages keep their size, not their memory
        if not self.closed:
            for gs in self.groups.values():
                if gs.count(Residency.DEVICE) < len(gs.slots):
                    released.update((s.key, s) for s in gs.slots if s.residency is not Residency.DEVICE)
            if paused:
                released.update((s.key, s) for gs in self.groups.values() for s in gs.slots if s.key in paused)
        touch.publish(self, released, frozenset(paused) if released else frozenset())


def core_of(state: Any) -> Core:
    """The internal ``Core`` of a ``ModelState`` (the engine's internal API: see the module docstring)."""
    core = getattr(state, "_core", None)
    if not isinstance(core, Core):
        raise TypeError(f"expected a ModelState, got {type(state).__name__}")
    return core
