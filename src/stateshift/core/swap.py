"""What a ``swapped()`` context holds between its entry and its exit.

``ModelState.swapped`` (``state.py``) calls ``swap_in`` on entry, which fills a
``Swap``: which slots it overwrote with the snapshot's values and what each was
before, where their current values wait (the stash), and the transfers that
wrote them. On exit ``swap_out`` reads the same record to put things back. Both
are functions of the state's ``Core`` (``engine.py``): the record is plain data,
so the entry and exit code read as two halves of one verb.

A *rebuilder* (``rebuild={"params": fn}``) recomputes a group's current
values on the device instead of having them stashed: ``fn()`` must rewrite
every device-resident slot of its group on the current stream. If it reads
other state (Megatron's bf16 params are rebuilt from the optimizer's fp32
masters), it says which with ``reads()``; the exit puts those groups back
first and makes the tensors it names resident while it runs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ..errors import LayoutError
from .engine import Core
from .groups import GroupState, disown, matches
from .locking import verb_scope
from .pool import HostBlock
from .slot import NativeHome, Residency
from .snapshot import Snapshot, SnapshotPart
from .transfer import Transfer

_log = logging.getLogger("stateshift")


@runtime_checkable
class Rebuilder(Protocol):
    """A rebuild function that also says what it reads (plain callables read nothing tracked)."""

    def __call__(self) -> None: ...

    def reads(self) -> Mapping[str, Collection[str]]:
        """Group -> member names whose device values the rebuild reads."""
        ...


def reads_of(fn: Callable[[], None]) -> Mapping[str, Collection[str]]:
    """What a rebuild function reads (nothing, for a plain callable)."""
    return fn.reads() if isinstance(fn, Rebuilder) else {}


@dataclass(eq=False)
class Swap:
    """The record of one ``swapped()`` context (see the module docstring).

    Per group: ``resident`` slots (device storage valid on entry: stashed,
    or rebuilt, and overwritten) and ``offloaded`` ones (slot index, and the
    residency and framework copy to return to: given device storage for the
    context only). ``ended``: the exit ran (``close()`` inside the context
    runs it early; the context's own exit then does nothing).
    """

    groups: tuple[str, ...]
    rebuild: dict[str, Callable[[], None]]
    resident: dict[str, list[int]] = field(default_factory=dict)
    offloaded: dict[str, list[tuple[int, Residency, NativeHome | None]]] = field(default_factory=dict)
    #: the groups the rebuilds read (counted: nested contexts may read the same group)
    reads: Counter[str] = field(default_factory=Counter)
    ended: bool = False
    #: host blocks and device arenas holding the stash (host blocks go back to the pool on exit)
    stashes: list[HostBlock | torch.Tensor] = field(default_factory=list)
    #: group -> the byte arena its stash lives in (a host block's data or a device tensor)
    arenas: dict[str, torch.Tensor] = field(default_factory=dict)
    stashed: Transfer = field(default_factory=Transfer)
    written: Transfer = field(default_factory=Transfer)

    def rebuilt_groups(self) -> list[str]:
        """Groups whose rebuild must run on exit: those with a rebuilder and a slot that was resident."""
        return [g for g in self.groups if g in self.rebuild and self.resident.get(g)]


def swap_in(core: Core, snapshot: Snapshot, rebuild: dict[str, Callable[[], None]], stash: str) -> Swap:
    """The entry (under the state's lock): check, stash or mark for rebuild, lend storage, write the snapshot."""
    Snapshot.given(snapshot, "swapped()")
    names = core.select(snapshot.groups)
    unknown = [g for g in rebuild if g not in names]
    if unknown:
        raise LayoutError("unknown_group", group=unknown[0], valid=names)
    core.table.refresh(names)
    for part in snapshot.parts:
        core.groups[part.group].layout.check_compatible(part.layout)
    swap = Swap(names, {g: fn for g, fn in rebuild.items() if _rebuildable(core, g)})
    rebuild = swap.rebuild
    stashing = [
        core.groups[p.group]
        for p in snapshot.parts
        if p.group not in rebuild and any(s.residency is Residency.DEVICE for s in core.groups[p.group].slots)
    ]
    _new_stashes(core, swap, stashing, core.stash_on_device(stash, stashing))
    try:
        _give_storage(core, swap, snapshot)
    except BaseException:
        _undo_regrow(core, swap)
        raise
    begun: set[str] = set()
    try:
        for part in snapshot.parts:
            begun.add(part.group)  # (a group's stash is written before anything of the snapshot's)
            _write_swapped(core, swap, part, snapshot)
    except BaseException:  # e.g. a disk snapshot that cannot be read: every group gets its own values back
        swap.arenas = {g: a for g, a in swap.arenas.items() if g in begun}  # the others' stashes hold nothing
        swap.ended = True
        _end_swap(core, swap, snapshot)
        raise
    for g in names:
        for i, _, _ in swap.offloaded[g]:
            core.groups[g].slots[i].residency = Residency.DEVICE
    core.swapping.update(names)
    swap.reads.update(g for fn in rebuild.values() for g in reads_of(fn))
    core.rebuild_reads.update(swap.reads)
    core.swaps.append((swap, snapshot))
    return swap


def _rebuildable(core: Core, g: str) -> bool:
    """A rebuild rewrites every slot of its group, so it is used only when all of them are resident;
    otherwise the group is stashed (its offloaded slots are released again before a rebuild could run)."""
    if all(s.residency is Residency.DEVICE for s in core.groups[g].slots):
        return True
    _log.debug("swapped(): group %r is partly offloaded, so it is stashed instead of rebuilt", g)
    return False


def _new_stashes(core: Core, swap: Swap, groups: list[GroupState], on_device: bool) -> None:
    """Allocate every stash arena before anything changes (device memory, or pooled pinned blocks)."""
    if not on_device:
        core.pool.check_room(sum(gs.layout.total for gs in groups))
    for gs in groups:
        if on_device:
            swap.stashes.append(core.device.arena(gs))
        else:
            swap.stashes.append(core.pool.acquire(gs.layout.total))
    swap.arenas = {
        gs.name: (st if isinstance(st, torch.Tensor) else st.data) for gs, st in zip(groups, swap.stashes, strict=True)
    }


def _give_storage(core: Core, swap: Swap, snapshot: Snapshot) -> None:
    """Record each group's residency; offloaded slots get device storage (uninitialised) for the context.

    A framework's own copy of a lent slot is hidden from the framework meanwhile (``on_onload``;
    ``on_released`` hands it back on exit): Megatron's ``offload_to_cpu`` inside the context would
    otherwise copy the snapshot's values into it, and its ``reload_from_cpu`` read it."""
    for part in snapshot.parts:
        gs = core.groups[part.group]
        swap.resident[gs.name] = gs.select(lambda s: s.residency is Residency.DEVICE)
        offloaded = swap.offloaded[gs.name] = [
            (i, s.residency, s.native_home) for i, s in enumerate(gs.slots) if s.residency is not Residency.DEVICE
        ]
        for _, _, native in offloaded:
            if native is not None:
                native.forget()
        core.device.regrow(gs, [i for i, _, _ in offloaded])


def _write_swapped(core: Core, swap: Swap, part: SnapshotPart, snapshot: Snapshot) -> None:
    """Stash the group's resident values (unless rebuilt) and write the snapshot's into every slot.

    A host stash and a host snapshot cross PCIe in both directions at once (``exchange``)."""
    gs = core.groups[part.group]
    resident, stash = swap.resident[gs.name], swap.arenas.get(gs.name)
    offloaded = [i for i, _, _ in swap.offloaded[gs.name]]
    if part.host is not None and gs.any_on_host():
        snapshot.wait()  # host-to-host copies read the snapshot on this thread
    if part.disk is not None:  # through the staging windows (the stash first)
        if stash is not None:
            swap.stashed = swap.stashed.merged(gs.copy_out(core.engine, resident, stash))
        swap.written = swap.written.merged(core.disk.read_part(gs, part, resident + offloaded, []))
        return
    if stash is not None and stash.is_cpu and part.host is not None:
        t = gs.exchange(core.engine, resident, stash, part.arena)
        swap.stashed, swap.written = swap.stashed.merged(t), swap.written.merged(t)
    else:
        if stash is not None:
            swap.stashed = swap.stashed.merged(gs.copy_out(core.engine, resident, stash))
        swap.written = swap.written.merged(gs.copy_in(core.engine, resident, part.arena))
    swap.written = swap.written.merged(gs.copy_in(core.engine, offloaded, part.arena))


def _undo_regrow(core: Core, swap: Swap) -> None:
    """A failed entry: give back the storage re-grown so far and the stashes."""
    for g, offloaded in swap.offloaded.items():
        gs = core.groups[g]
        if not core.device.storage.paused(g):
            core.device.release(gs, [i for i, _, _ in offloaded if gs.slots[i].storage.nbytes() > 0])
        for _, _, native in offloaded:
            if native is not None:
                native.reinstate()
    _free_stashes(core, swap, Transfer())


def swap_out(core: Core, swap: Swap, snapshot: Snapshot) -> None:
    """The exit: give back what was lent, then each group's own values (stash or rebuild). Once."""
    with core.lock:
        if swap.ended:
            return
        with verb_scope(core, "swapped() exit"):
            if not swap.ended:
                swap.ended = True
                _end_swap(core, swap, snapshot)


def _end_swap(core: Core, swap: Swap, snapshot: Snapshot) -> None:
    """Release the lent storage first, so the backends' ``prepare`` sees those slots as they were on
    entry (Megatron keeps its ``param_data_cpu``); then the stash goes back, then the rebuilds run."""
    returned = Transfer()
    try:
        for g, offloaded in swap.offloaded.items():
            _give_back_lent(core, core.groups[g], offloaded)
        core.table.prepare(swap.groups)  # e.g. FSDP2: no all-gathered copy of the snapshot outlives the context
        for g, stash in swap.arenas.items():
            _regrow_taken(core, core.groups[g], swap.resident[g])
            returned = returned.merged(core.groups[g].copy_in(core.engine, swap.resident[g], stash))
        for g in swap.rebuilt_groups():
            _regrow_taken(core, core.groups[g], swap.resident[g], zero=True)
            _run_rebuild(core, swap.rebuild[g])
    finally:
        _free_stashes(core, swap, returned)
        for part in snapshot.parts:
            if part.host is not None:
                part.host.pending = swap.written.merged(part.host.pending)
        core.swapping.difference_update(swap.groups)
        core.rebuild_reads -= swap.reads
        core.swaps[:] = [(sw, sn) for sw, sn in core.swaps if sw is not swap]


def _give_back_lent(core: Core, gs: GroupState, offloaded: list[tuple[int, Residency, NativeHome | None]]) -> None:
    """Release the storage lent to offloaded slots; each gets its residency and framework copy back.

    A copy the framework made inside the context (Megatron's ``offload_to_cpu``, seen by a refresh)
    holds the snapshot's values: the framework is told to forget it."""
    core.device.release(gs, [i for i, _, _ in offloaded if gs.slots[i].storage.nbytes() > 0])
    for i, was, native in offloaded:
        slot = gs.slots[i]
        if slot.native_home is not native:
            disown(slot)
        slot.residency, slot.native_home = was, native
        if native is not None:
            native.reinstate()


def _regrow_taken(core: Core, gs: GroupState, idx: list[int], *, zero: bool = False) -> None:
    """Slots whose storage the framework released inside the context (Megatron's ``offload_to_cpu``)
    get it back before their own values are written (a copy into released storage would crash);
    the framework's copy of the snapshot's values is forgotten. ``zero``: for a rebuild, which writes
    only what it recomputes (Megatron's masters cover the params, not the zero padding between them
    in the buffer), the storage is zeroed first rather than left uninitialised."""
    taken = [i for i in idx if gs.slots[i].storage.nbytes() == 0]
    core.device.regrow(gs, taken)
    if zero and taken:
        torch._foreach_zero_([gs.slots[i].bytes() for i in taken])
    for i in taken:
        gs.slots[i].residency = Residency.DEVICE
        disown(gs.slots[i])


def _free_stashes(core: Core, swap: Swap, returned: Transfer) -> None:
    for st in swap.stashes:
        if isinstance(st, HostBlock):
            st.pending = returned.merged(swap.stashed)
            core.pool.release(st)
    swap.stashes.clear()


def _run_rebuild(core: Core, fn: Callable[[], None]) -> None:
    """Run a rebuild with the offloaded tensors it reads lent back to the device, then released again.

    Their homes are not written: the rebuild only reads them, so the
    values stay where they were and the slots stay ``host``.
    """
    lent: list[tuple[GroupState, list[int]]] = []
    for g, wanted in reads_of(fn).items():
        gs = core.groups.get(g)
        if gs is not None:
            moves_whole = core.device.storage.paused(g)  # an address-stable group is mapped back whole
            idx = gs.select(lambda s: s.residency is Residency.HOST and (moves_whole or matches(s, wanted)))  # noqa: B023 - select calls it at once
            if idx:
                lent.append((gs, idx))
    core.device.fill(lent)
    try:
        fn()
    finally:
        for gs, idx in lent:
            core.device.release(gs, idx)
