"""Tiers: where a slot's values live, and how slots move between them.

A residency is a tier. Each tier knows how to read the values of its slots
into a byte arena laid out as their group (``read``: a snapshot, a stash),
how to put them back into device storage (``load``: an onload), and how to
take slots from the other tiers (``take``: ``offload`` takes them into the
host tier, ``offload(to="disk")`` into the disk tier, ``drop`` into the
dropped tier, ``onload`` into the device tier). A verb is then "move these
slots from tier A to tier B", and a new tier (another disk, a remote host)
is one new class, not a branch in every verb.

- ``DeviceTier`` (``device``): the slots' own storage, released and re-grown
  in place or address-stable (``stable.py``);
- ``HostTier`` (``host``): each group's pooled pinned home, or a framework's
  own host copy (``NativeHome``);
- ``DroppedTier`` (``dropped``): no values; reads as zeros;
- ``DiskTier`` (``disk``, ``disk.py``): the state's scratch file.

Nothing here locks or validates: the verbs (``verbs.py``) check their
arguments and reserve memory first, so a tier's move does not fail half way
(the disk tier's writes can: it writes everything before anything changes).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

import torch

from ..errors import StateError
from .groups import GroupState, Only, disown, matches
from .pool import HostBlock, HostPool
from .slot import Residency, Slot
from .snapshot import SnapshotPart
from .stable import InPlace, StoragePolicy
from .transfer import CopyEngine, Transfer


class Tier(Protocol):
    """One residency's storage: what every verb dispatches through."""

    residency: Residency

    def read(self, gs: GroupState, idx: list[int], arena: torch.Tensor) -> Transfer:
        """The current values of slots ``idx`` (all in this tier) into their regions of ``arena``."""
        ...

    def load(self, gs: GroupState, idx: list[int], *, regrow: bool) -> Transfer:
        """The values of slots ``idx`` (in this tier) into their device storage, which holds storage again
        (``regrow``: the host tier may give it back run by run, overlapping its copies). Residency unchanged."""
        ...

    def take(self, groups: Sequence[GroupState], only: Only) -> Transfer:
        """Move the slots of ``groups`` that ``only`` selects (and this tier accepts) into this tier."""
        ...


class DeviceTier:
    """Device storage, released and re-grown through the storage policy (in place or address-stable).

    ``free_memory``: hand released memory back to the driver (``ModelState(free_device_memory=...)``)."""

    residency = Residency.DEVICE

    def __init__(self, engine: CopyEngine, storage: StoragePolicy, free_memory: bool) -> None:
        self.engine, self.storage, self.free_memory = engine, storage, free_memory
        #: storage keys of address-stable groups whose memory is unmapped (their size stays)
        self.paused_keys: set[int] = set()
        #: the tiers slots come back from (set by the core once every tier exists)
        self.sources: Mapping[Residency, Tier] = {}

    def read(self, gs: GroupState, idx: list[int], arena: torch.Tensor) -> Transfer:
        return gs.copy_out(self.engine, idx, arena)

    def load(self, gs: GroupState, idx: list[int], *, regrow: bool) -> Transfer:
        return Transfer()  # (already there)

    def take(self, groups: Sequence[GroupState], only: Only) -> Transfer:
        which = None if only is None else (lambda s: s.residency is not Residency.DEVICE and matches(s, only))
        return self.bring_back(groups, which)

    def bring_back(self, groups: Iterable[GroupState], which: Callable[[Slot], bool] | None) -> Transfer:
        """Re-grow and fill the slots ``which`` selects (``None``: every one not resident); they become ``device``.
        A failing source (a disk that cannot be read) gives the storage re-grown for it back and raises."""
        todo = [(gs, gs.offloaded() if which is None else gs.select(which)) for gs in groups]
        todo = [(gs, idx) for gs, idx in todo if idx]
        try:
            transfer = self.fill(todo)
        except BaseException:
            if self.engine.device is not None:
                torch.cuda.synchronize(self.engine.device)  # no copy still writes into it
            for gs, idx in todo:
                if not self.storage.paused(gs.name):
                    self.release(gs, [i for i in idx if gs.slots[i].storage.nbytes() > 0])
            raise
        for gs, idx in todo:
            native_too = gs.any_native()
            for i in idx:
                gs.slots[i].residency = Residency.DEVICE
                if native_too:
                    disown(gs.slots[i])
        return transfer

    def fill(self, todo: list[tuple[GroupState, list[int]]]) -> Transfer:
        """Re-grow slots and fill them from the tier each lives in (dropped: zeros). Residency unchanged.

        In place, the storage of slots refilled from their home is given back run by run, overlapping the copies."""
        transfer = Transfer()
        for gs, idx in todo:
            by = gs.by_residency(idx)
            host = by[Residency.HOST]
            late = [i for i in host if gs.slots[i].native_home is None] if isinstance(self.storage, InPlace) else []
            if len(late) < len(idx):  # (``late`` is part of ``idx``: all of it, in a whole onload of a host group)
                given_late = set(late)
                self.regrow(gs, [i for i in idx if i not in given_late])
            for r, tier in self.sources.items():
                if by[r]:
                    transfer = transfer.merged(tier.load(gs, by[r], regrow=bool(late)))
        return transfer

    def release(self, gs: GroupState, idx: list[int]) -> None:
        """Release the storage of resident slots ``idx`` (residency is the caller's to set)."""
        if not idx:
            return
        resident = gs.count(Residency.DEVICE)
        self.storage.release(gs.name, [gs.slots[i] for i in idx], whole=len(idx) >= resident)
        if self.storage.paused(gs.name):
            self.paused_keys.update(s.key for s in gs.slots)

    def regrow(self, gs: GroupState, idx: list[int]) -> None:
        """Give slots ``idx`` device storage back (uninitialised; residency is the caller's to set)."""
        if not idx:
            return
        offloaded = len(gs.slots) - gs.count(Residency.DEVICE)
        was_paused = self.storage.paused(gs.name)
        self.storage.regrow(gs.name, [gs.slots[i] for i in idx], whole=len(idx) >= offloaded)
        if was_paused:
            self.paused_keys.difference_update(s.key for s in gs.slots)

    def released(self, released: Mapping[GroupState, list[int]]) -> None:
        """Device memory was released: hand it back to the driver if asked (``free_memory``)."""
        if not released or not self.free_memory or self.engine.device is None:
            return
        if any(gs.slots[i].device.type != "cpu" for gs, idx in released.items() for i in idx[:1]):
            torch.cuda.empty_cache()

    @staticmethod
    def check_releasable(groups: Iterable[GroupState], only: Only) -> None:
        """Storage that cannot be resized cannot be released: fine on the host (it already is host
        memory, e.g. FSDP2's pinned shards under CPUOffloadPolicy: it stays where it is), an error
        on an accelerator -- raised before anything moves.

        Raises:
            StateError("not_releasable"): naming the first accelerator slot whose storage cannot be resized.
        """
        for gs in groups:
            if gs.all_releasable():
                continue
            for s in gs.slots:
                if s.residency is Residency.DEVICE and s.device.type != "cpu" and not s.releasable and matches(s, only):
                    raise StateError(
                        "not_releasable",
                        f"its {s.device.type} storage is not resizable (allocated outside torch's caching "
                        "allocator?), so it cannot be released in place",
                        tensor=s.name,
                    )

    def device_for(self, gs: GroupState) -> torch.device:
        """Where a device-placed snapshot or stash of a group goes: the accelerator if the group lives there."""
        dev = self.engine.device
        if dev is not None and any(s.device.type == dev.type for s in gs.slots):
            return dev
        return torch.device("cpu")

    def arena(self, gs: GroupState) -> torch.Tensor:
        """A new device arena of the group's layout (a device snapshot or stash)."""
        return torch.empty(gs.layout.total, dtype=torch.uint8, device=self.device_for(gs))


class HostTier:
    """Pooled pinned homes (one per group, laid out as its snapshots, kept for reuse) and framework copies.

    A home write has two phases: ``reserve`` (every block acquired, or ``BudgetError("pool")``, before
    anything changes) and ``install`` (the block becomes the home)."""

    residency = Residency.HOST

    def __init__(self, engine: CopyEngine, pool: HostPool, device: DeviceTier) -> None:
        self.engine, self.pool, self.device = engine, pool, device

    def read(self, gs: GroupState, idx: list[int], arena: torch.Tensor) -> Transfer:
        if idx and arena.is_cpu and gs.home is not None:
            gs.home.sync()  # host-to-host: the device copies still writing the home must be done
        return gs.copy_home(self.engine, idx, arena)

    def load(self, gs: GroupState, idx: list[int], *, regrow: bool) -> Transfer:
        own = [i for i in idx if gs.slots[i].native_home is None] if gs.any_native() else idx
        transfer = Transfer()
        if own:
            assert gs.home is not None
            if gs.any_on_host() and any(gs.slots[i].device.type == "cpu" for i in own):
                gs.home.sync()  # host-to-host copies read the home on this thread
            transfer = gs.copy_in(self.engine, own, gs.home.data, regrow=regrow)
            gs.home.pending = transfer.merged(gs.home.pending)
        if len(own) < len(idx):
            native = [(gs.slots[i].bytes(), gs.home_region(i)) for i in idx if gs.slots[i].native_home is not None]
            transfer = transfer.merged(self.engine.copy(native))
        return transfer

    def take(self, groups: Sequence[GroupState], only: Only) -> Transfer:
        """Copy the device-resident slots ``only`` selects into their homes and release their storage
        (``host``, ``disk`` and ``dropped`` slots stay as they are)."""
        moving = {gs: idx for gs in groups if (idx := gs.releasable(only, checked=True))}
        fresh = self.reserve(list(moving))
        transfer = Transfer()
        for gs, idx in moving.items():
            home = self.install(gs, fresh.get(gs.name), rewriting=list(map(gs.slots.__getitem__, idx)))
            moved = gs.copy_out(self.engine, idx, home.data, frees=True)
            home.pending = moved.merged(home.pending)
            transfer = transfer.merged(moved)
        for gs, idx in moving.items():
            self.device.release(gs, idx)
            for i in idx:
                gs.slots[i].residency = Residency.HOST
        self.device.released(moving)
        return transfer

    def write(self, gs: GroupState, part: SnapshotPart, fresh: HostBlock | None, rewriting: Sequence[Slot]) -> Transfer:
        """A host or device snapshot part's values into the home, for every slot neither resident nor on
        disk; those become ``host``."""
        home = self.install(gs, fresh, rewriting=rewriting)
        idx = gs.select(lambda s: s.residency is not Residency.DEVICE and s.residency is not Residency.DISK)
        written = gs.copy_home(self.engine, idx, part.arena, into_home=True)
        home.pending = written.merged(home.pending)
        for i in idx:
            gs.slots[i].residency = Residency.HOST
        return written

    def needs_home(self, groups: Collection[GroupState]) -> list[GroupState]:
        return [gs for gs in groups if gs.home is None or gs.home.shared]

    def home_bytes(self, groups: Collection[GroupState]) -> int:
        """Pooled bytes a home write of ``groups`` acquires (``reserve``)."""
        return sum(gs.layout.total for gs in self.needs_home(groups))

    def reserve(self, groups: Collection[GroupState]) -> dict[str, HostBlock]:
        """Phase one of a home write: a fresh block for every group whose home is missing or shared.

        Raises:
            BudgetError("pool"): the blocks do not fit the pool's budget (nothing was acquired).
        """
        self.pool.check_room(self.home_bytes(groups))
        return {gs.name: self.pool.acquire(gs.layout.total) for gs in self.needs_home(groups)}

    def install(self, gs: GroupState, fresh: HostBlock | None, rewriting: Sequence[Slot]) -> HostBlock:
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
                carry = [
                    i
                    for i, s in enumerate(gs.slots)
                    if s.residency is Residency.HOST and s.native_home is None and s.key not in keys
                ]
                if carry:
                    old.sync()
                    for i in carry:
                        gs.layout.region(fresh.data, i).copy_(gs.layout.region(old.data, i))
                self.pool.release(old)
        assert gs.home is not None
        gs.home.sync()
        return gs.home

    def adopt(self, gs: GroupState, part: SnapshotPart) -> None:
        """Restore into a fully offloaded group: the snapshot's block becomes its home (copy-on-write)."""
        assert part.host is not None
        old, gs.home = gs.home, self.pool.retain(part.host)
        if old is not None:
            self.pool.release(old)
        for s in gs.slots:
            s.residency = Residency.HOST

    def give_up(self, gs: GroupState) -> None:
        """A group with no value left on the host gives its home back to the pool."""
        if gs.home is not None and not any(s.residency is Residency.HOST for s in gs.slots):
            self.pool.release(gs.home)
            gs.home = None


class DroppedTier:
    """Released storage without values: reads as zeros, comes back zeroed."""

    residency = Residency.DROPPED

    def __init__(self, engine: CopyEngine, device: DeviceTier) -> None:
        self.engine, self.device = engine, device

    def read(self, gs: GroupState, idx: list[int], arena: torch.Tensor) -> Transfer:
        gs.zero_regions(self.engine, idx, arena)
        return Transfer()

    def load(self, gs: GroupState, idx: list[int], *, regrow: bool) -> Transfer:
        torch._foreach_zero_([gs.slots[i].bytes() for i in idx])
        return Transfer()

    def take(self, groups: Sequence[GroupState], only: Only) -> Transfer:
        """Release the storage of the slots ``only`` selects without keeping values (``host`` ones too)."""
        released: dict[GroupState, list[int]] = {}
        for gs in groups:
            idx = gs.select(lambda s: s.residency is not Residency.DROPPED and s.releasable and matches(s, only))
            released[gs] = [i for i in idx if gs.slots[i].residency is Residency.DEVICE]
            self.device.release(gs, released[gs])
            for i in idx:
                gs.slots[i].residency = Residency.DROPPED
                disown(gs.slots[i])
        self.device.released({gs: idx for gs, idx in released.items() if idx})
        return Transfer()
