"""The disk tier (``tiers.Tier``): slots whose values wait in the state's scratch file.

The file, its I/O modes and the staging windows are ``disk.py``'s; this module is what the
verbs ask of the tier: read a group's disk-resident values into an arena or back onto the
device, take slots from the device and host tiers, write and read disk snapshot parts, and
restore values into slots that stay on disk (new regions, switched to only once every write
succeeded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch

from ..errors import DiskError
from .disk import DiskHome, StagedIO
from .groups import GroupState, Only, SlotTable, matches
from .pool import HostBlock
from .slot import Residency, Slot
from .snapshot import SnapshotPart
from .tiers import DeviceTier, HostTier
from .transfer import Transfer

_log = logging.getLogger("stateshift")


class DiskTier:
    """The ``disk`` residency (``tiers.Tier``): slots whose values are in the state's ``DiskHome``, made
    on first use in ``directory``; and disk snapshot parts, spans of the same file.

    Every write goes through the staging windows and is flushed (``settle``) before any slot changes
    residency, so a full disk raises ``DiskError("tier")`` with every value where it was."""

    residency = Residency.DISK

    def __init__(
        self, table: SlotTable, io: StagedIO, directory: str | None, device: DeviceTier, host: HostTier
    ) -> None:
        self.table, self.io, self.directory, self.device, self.host = table, io, directory, device, host
        self.engine = io.engine
        self.disk: DiskHome | None = None

    def home(self) -> DiskHome:
        """The state's disk home (its file is made now if it was not yet).

        Raises:
            DiskError("tier"): no disk directory was given to the state.
        """
        if self.disk is None:
            if self.directory is None:
                raise DiskError(
                    "tier",
                    "offload(..., to='disk') and snapshot(placement='disk') need ModelState(..., disk_dir=...): "
                    "no disk directory is set",
                )
            self.disk = self.table.disk = DiskHome(self.directory)
        return self.disk

    def describe(self) -> str | None:
        return None if self.disk is None else self.disk.describe()

    def close(self) -> None:
        self.io.close()
        if self.disk is not None:
            self.disk.close()

    def _region(self, gs: GroupState) -> tuple[DiskHome, int]:
        assert self.disk is not None
        return self.disk, self.disk.region(gs.name, gs.layout.total)

    def read(self, gs: GroupState, idx: list[int], arena: torch.Tensor) -> Transfer:
        disk, base = self._region(gs)
        return self.io.disk_to_arena(gs.plan(self.engine, idx, self.io.chunk), disk, base, arena)

    def load(self, gs: GroupState, idx: list[int], *, regrow: bool) -> Transfer:
        disk, base = self._region(gs)
        return self.io.into(gs.plan(self.engine, idx, self.io.chunk), disk, base)

    def take(self, groups: Sequence[GroupState], only: Only) -> Transfer:
        """Write every device- or host-resident slot ``only`` selects to the disk home, then (only then)
        release them; a group left with nothing on the host gives its home back to the pool."""
        disk = self.home()
        moving: dict[GroupState, tuple[list[int], list[int]]] = {}
        for gs in groups:
            dev = gs.select(lambda s: s.residency is Residency.DEVICE and s.releasable and matches(s, only))
            host = gs.select(lambda s: s.residency is Residency.HOST and s.native_home is None and matches(s, only))
            if dev or host:
                moving[gs] = (dev, host)
        moved, t0 = 0, time.perf_counter()
        for gs, (dev, host) in moving.items():
            base = disk.region(gs.name, gs.layout.total)
            if host:
                assert gs.home is not None
                gs.home.sync()
                moved += self.io.arena_to_disk(gs.plan(self.engine, host, self.io.chunk), gs.home.data, disk, base)
            if dev:
                moved += self.io.out(gs.plan(self.engine, dev, self.io.chunk), disk, base, frees_sources=True)
            disk.settle(base, gs.layout.total)
        for gs, (dev, host) in moving.items():
            self.device.release(gs, dev)
            for i in dev + host:
                gs.slots[i].residency = Residency.DISK
            self.host.give_up(gs)  # the host memory those values used is free again
        self.device.released({gs: dev for gs, (dev, _) in moving.items() if dev})
        _log.debug("offload to disk %s: %d bytes", [gs.name for gs in moving], moved)
        return Transfer(nbytes={"disk": moved}, host_seconds=time.perf_counter() - t0)

    def snapshot_parts(self, gss: list[GroupState]) -> tuple[SnapshotPart, ...]:
        """Disk snapshot parts of ``gss`` holding their current values; on an error their spans are freed."""
        disk = self.home()
        parts: list[SnapshotPart] = []
        try:
            for gs in gss:
                parts.append(SnapshotPart(gs.name, gs.layout, disk=(disk, disk.allocate(gs.layout.total))))
                self._write_group(gs, parts[-1])
        except BaseException:
            for p in parts:
                assert p.disk is not None
                disk.free(p.disk[1], p.layout.total)
            raise
        return tuple(parts)

    def _write_group(self, gs: GroupState, part: SnapshotPart) -> None:
        """Every slot's current values into a disk snapshot part, whatever their residency."""
        assert part.disk is not None
        disk, base = part.disk
        w = self.io.chunk
        by = gs.by_residency()
        own = [i for i in by[Residency.HOST] if gs.slots[i].native_home is None]
        if own:
            assert gs.home is not None
            gs.home.sync()
            self.io.arena_to_disk(gs.plan(self.engine, own, w), gs.home.data, disk, base)
        for i in by[Residency.HOST]:
            if gs.slots[i].native_home is not None:
                disk.write(base + gs.layout.offsets[i], gs.home_region(i).contiguous())
        if by[Residency.DISK]:
            self.io.disk_to_disk(
                gs.plan(self.engine, by[Residency.DISK], w), disk, disk.region(gs.name, gs.layout.total), base
            )
        if by[Residency.DROPPED]:
            self.io.zero(gs.plan(self.engine, by[Residency.DROPPED], w), disk, base)
        if by[Residency.DEVICE]:
            self.io.out(gs.plan(self.engine, by[Residency.DEVICE], w), disk, base)
        disk.settle(base, gs.layout.total)

    def read_part(self, gs: GroupState, part: SnapshotPart, device: list[int], home: list[int]) -> Transfer:
        """A disk snapshot part -> slots ``device`` (holding storage) and into the home regions of ``home``."""
        assert part.disk is not None
        disk, base = part.disk
        if home:
            assert gs.home is not None
            for run in gs.plan(self.engine, home, self.io.chunk).runs:
                disk.read(base + run.start, gs.home.data[run.start : run.end])
        return self.io.into(gs.plan(self.engine, device, self.io.chunk), disk, base) if device else Transfer()

    def write_part(
        self, gs: GroupState, part: SnapshotPart, offloaded: list[Slot], fresh: HostBlock | None
    ) -> Transfer:
        """Restore from a disk part: device slots in place, offloaded (not on disk) ones into a private home."""
        home_idx: list[int] = []
        if offloaded:
            home = self.host.install(gs, fresh, rewriting=offloaded)
            home_idx = gs.select(lambda s: s.residency is not Residency.DEVICE and s.residency is not Residency.DISK)
        t = self.read_part(gs, part, gs.select(lambda s: s.residency is Residency.DEVICE), home_idx)
        for i in home_idx:
            gs.slots[i].residency = Residency.HOST
        if offloaded:
            home.pending = t.merged(home.pending)
        return t

    def write_regions(self, todo: list[tuple[GroupState, SnapshotPart]]) -> None:
        """The parts' values of slots on disk, into new regions of the disk home that replace the groups'
        regions only once every write (and its flush) succeeded: a failing write changes nothing. Host
        parts must be safe to read on this thread (the caller waited)."""
        todo = [(gs, p) for gs, p in todo if gs.count(Residency.DISK)]
        if not todo:
            return
        disk = self.home()
        fresh: list[tuple[GroupState, int]] = []
        try:
            for gs, part in todo:
                fresh.append((gs, disk.allocate(gs.layout.total)))
                p, region = gs.plan(self.engine, gs.by_residency()[Residency.DISK], self.io.chunk), fresh[-1][1]
                if part.disk is not None:
                    self.io.disk_to_disk(p, disk, part.disk[1], region)
                else:
                    self.io.arena_to_disk(p, part.arena, disk, region)
                disk.settle(region, gs.layout.total)
        except BaseException:
            for gs, region in fresh:
                disk.free(region, gs.layout.total)
            raise
        for gs, region in fresh:
            disk.forget(gs.name)
            disk.adopt(gs.name, region, gs.layout.total)

    def forget(self, groups: Iterable[GroupState]) -> None:
        """A group with nothing left on disk gives its region up (the next disk offload writes a new one)."""
        if self.disk is not None:
            for gs in groups:
                if not any(s.residency is Residency.DISK for s in gs.slots):
                    self.disk.forget(gs.name)
