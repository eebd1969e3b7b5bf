"""The verbs, as functions of a state's ``Core``: each moves slots from one tier to another.

``ModelState`` (``state.py``) holds the lock and documents each verb's
contract; these functions check their arguments and reserve memory first (an
error changes nothing), then dispatch through the tiers (``tiers.py``):

- ``offload``: into the host tier (or the disk tier, or as ``plan_offload`` decides);
- ``drop``: into the dropped tier; ``onload``: into the device tier;
- ``snapshot``: every tier ``read``\\ s its slots into a new arena (or the disk
  tier writes a disk part); ``restore``: the snapshot's values into each slot's
  tier (device slots in place, offloaded ones into homes, disk ones into new regions).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping

import torch

from ..errors import BudgetError
from .disk import OffloadDecision, OffloadPlan
from .engine import Core, GroupArg
from .groups import GroupState, Only, matches
from .pool import HostBlock
from .slot import Residency, Slot
from .snapshot import PLACEMENTS, Placement, Snapshot, SnapshotPart
from .swap import swap_out
from .transfer import Transfer

_log = logging.getLogger("stateshift")


def offload(core: Core, groups: GroupArg, only: Only, to: str) -> tuple[Transfer, OffloadPlan | None]:
    """Move device-resident slots into the host tier (``to="host"``), device- and host-resident ones into
    the disk tier (``"disk"``), or each group where ``plan_offload`` puts it (``"auto"``: the plan is returned)."""
    if to not in ("host", "disk", "auto"):
        raise ValueError(f"to must be 'host', 'disk' or 'auto', not {to!r}")
    gss = core.listed(groups)
    core.device.check_releasable(gss, only)
    if to != "auto":
        transfer = core.disk.take(gss, only) if to == "disk" else core.host.take(gss, only)
        _log.debug("offload %s to %s: %d bytes", [gs.name for gs in gss], to, transfer.total_bytes)
        return transfer, None
    plan = _plan(core, gss, only, None)
    _log.info("offload plan: %s", plan.describe())
    disk = [core.groups[d.group] for d in plan.decisions if d.to == "disk"]
    transfer = core.disk.take(disk, only) if disk else Transfer()
    host = [core.groups[d.group] for d in plan.decisions if d.to == "host"]
    return (transfer.merged(core.host.take(host, only)) if host else transfer), plan


def plan_offload(core: Core, groups: GroupArg, only: Only, host_budget_bytes: int | None) -> OffloadPlan:
    """Where ``offload(groups, to="auto")`` would put each group (see ``ModelState.plan_offload``)."""
    return _plan(core, core.listed(groups), only, host_budget_bytes)


def _plan(core: Core, gss: list[GroupState], only: Only, budget: int | None) -> OffloadPlan:
    budget = core.pool.budget_bytes if budget is None else budget
    directory = core.disk_dir
    if budget is not None and directory is not None:
        budget -= 2 * core.disk.io.window  # room for the staging windows of whatever goes to disk
    held = core.pool.stats.in_use_bytes
    disk_free = shutil.disk_usage(directory).free if directory is not None and os.path.isdir(directory) else None
    decisions, peak, to_disk = [], held, 0
    for gs in gss:
        moving = sum(s.nbytes for s in gs.slots if s.residency is Residency.DEVICE and matches(s, only))
        need = gs.layout.total if moving and (gs.home is None or gs.home.shared) else 0
        if budget is None or held + need <= budget:
            decisions.append(OffloadDecision(gs.name, "host", moving))
            held += need
        elif directory is not None and (disk_free is None or to_disk + gs.layout.total <= disk_free):
            decisions.append(OffloadDecision(gs.name, "disk", moving))
            to_disk += gs.layout.total
        else:
            where = "and no disk tier is set (disk_dir)" if directory is None else "and the disk is too full"
            raise BudgetError(
                "pool",
                f"group {gs.name!r} ({need} bytes) fits in neither the host budget ({budget} bytes for homes, {held} held) {where}",
            )
        peak = max(peak, held + (2 * core.disk.io.window if to_disk else 0))
    return OffloadPlan(tuple(decisions), peak, to_disk)


def drop(core: Core, groups: GroupArg, only: Only) -> None:
    """Move the slots ``only`` selects into the dropped tier (values not kept)."""
    names = core.select(groups)
    core.check_not_rebuild_read(names)
    gss = core.listed(names)
    core.device.check_releasable(gss, only)
    core.dropped.take(gss, only)


def onload(core: Core, groups: GroupArg, only: Only) -> Transfer:
    """Move the slots ``only`` selects (default every one offloaded) into the device tier."""
    gss = core.listed(groups)
    transfer = core.device.take(gss, only)
    core.disk.forget(gss)
    _log.debug("onload %s: %d bytes", [gs.name for gs in gss], transfer.total_bytes)
    return transfer


def snapshot(core: Core, groups: GroupArg, tag: str, version: int | None, placement: Placement) -> Snapshot:
    """A new snapshot of the groups' current values, read from every tier (see ``ModelState.snapshot``)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    gss = core.listed(groups if groups is not None else core.forward, check_swap=False)
    shared = {gs.name for gs in gss if placement == "host" and gs.home_is_whole()}
    old = core.make_room_for(
        tag, version, gss, [gs.layout.total for gs in gss if placement == "host" and gs.name not in shared]
    )
    device_arenas = {gs.name: core.device.arena(gs) for gs in gss if placement == "device"}
    if placement == "disk":  # writes can fail (a full disk): the old snapshot goes only once the new one is written
        return core.store(
            Snapshot.of(
                tag=tag, version=version, placement=placement, parts=core.disk.snapshot_parts(gss), pool=core.pool
            )
        )
    if old is not None:
        core.snapshots.discard(old)
    parts: list[SnapshotPart] = []
    transfer = Transfer()
    for gs in gss:
        if gs.name in shared:  # a fully offloaded group: the snapshot shares the home (copy-on-write)
            assert gs.home is not None
            parts.append(SnapshotPart(gs.name, gs.layout, host=core.pool.retain(gs.home)))
            transfer = transfer.merged(gs.home.pending)
            continue
        arena = device_arenas.get(gs.name)
        part = (
            SnapshotPart(gs.name, gs.layout, device=arena)
            if arena is not None
            else SnapshotPart(gs.name, gs.layout, host=core.pool.acquire(gs.layout.total))
        )
        parts.append(part)
        transfer = transfer.merged(read_group(core, gs, part.arena))
    return core.store(
        Snapshot.of(
            tag=tag, version=version, placement=placement, parts=tuple(parts), pool=core.pool, transfer=transfer
        )
    )


def read_group(core: Core, gs: GroupState, arena: torch.Tensor) -> Transfer:
    """Every slot's current values into ``arena``, each read by the tier it lives in."""
    transfer = Transfer()
    for r, idx in gs.by_residency().items():
        if idx:
            transfer = transfer.merged(core.tiers[r].read(gs, idx, arena))
    return transfer


def restore(core: Core, snapshot: Snapshot) -> Transfer:
    """Write the snapshot's values into each slot's tier (see ``ModelState.restore``)."""
    adopt, rewrite = core.restore_plan(snapshot)
    fresh = core.host.reserve([core.groups[g] for g in rewrite])
    for gs, part in adopt:
        core.host.adopt(gs, part)
    adopted = {gs.name for gs, _ in adopt}
    return _write_parts(core, snapshot, [p for p in snapshot.parts if p.group not in adopted], fresh, rewrite)


def _write_parts(
    core: Core,
    snapshot: Snapshot,
    parts: list[SnapshotPart],
    fresh: dict[str, HostBlock],
    rewrite: Mapping[str, list[Slot]],
) -> Transfer:
    """Copy ``parts`` into their groups: disk slots into new regions first (only these writes can fail),
    device slots in place, the others into (private) homes."""
    todo = [(core.groups[p.group], p) for p in parts]
    if any(p.host is not None and gs.count(Residency.DISK) for gs, p in todo):
        snapshot.wait()  # host-to-host: its own copies must be done before this thread reads it
    core.disk.write_regions(todo)
    transfer = Transfer()
    for gs, part in todo:
        offloaded = rewrite.get(gs.name, [])
        if part.disk is not None:
            transfer = transfer.merged(core.disk.write_part(gs, part, offloaded, fresh.get(gs.name)))
            continue
        resident = gs.by_residency()[Residency.DEVICE]
        if part.host is not None and offloaded:
            snapshot.wait()  # host-to-host: its own copies must be done before this thread reads it
        if offloaded:
            transfer = transfer.merged(core.host.write(gs, part, fresh.get(gs.name), offloaded))
        transfer = transfer.merged(gs.copy_in(core.engine, resident, part.arena))
    for part in snapshot.parts:
        if part.host is not None:
            part.host.pending = transfer.merged(part.host.pending)
    return transfer


def close(core: Core) -> None:
    """End open ``swapped()`` contexts, bring back every slot stateshift released, remove the hooks, release
    snapshots, homes and the disk tier (see ``ModelState.close``)."""
    for swap, snap in reversed(list(core.swaps)):
        swap_out(core, swap, snap)
    core.table.refresh()
    core.device.bring_back(
        core.groups.values(), lambda s: s.residency is not Residency.DEVICE and s.native_home is None
    )
    for h in core.handles:
        h.remove()
    core.handles.clear()
    core.snapshots.clear()
    for gs in core.groups.values():
        if gs.home is not None:
            core.pool.release(gs.home)
            gs.home = None
    core.closed = True
    core.disk.close()
    core.table.close()
