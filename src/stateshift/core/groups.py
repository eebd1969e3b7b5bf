"""The slot table: every group's slots, layout and home, kept in step with the backends' listings.

``SlotTable.refresh(groups)`` asks the sources to ``prepare`` and then to
list the groups' tensors, and turns the listing into slots: tensors sharing
a storage become one slot, a storage seen before keeps its slot (and its
residency), tensors created since the last look become new slots and
vanished ones are let go. When a group's slots change, its layout is rebuilt
and host-resident values are carried into a home of the new layout, so no
value is lost to a relayout.

Storages released or re-grown by the framework itself since the last look
(Megatron's ``offload_to_cpu`` / ``reload_from_cpu``) are followed: the
framework's host copy is adopted as the slot's home (``NativeHome``), or its
reload is taken as the truth. A storage released by someone else with no
known copy of its values raises ``StateError("foreign")``.

Only the verbs change residency (through the tiers, ``tiers.py``); the table changes what exists.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import ObjectError, StateError
from .disk import DiskHome
from .layout import Layout
from .pool import HostBlock, HostPool
from .slot import Entry, Residency, Slot, SlotInfo, all_releasable, member_info, regrow_all, storage_keys
from .source import Source
from .transfer import CopyEngine, Plan, Run, Transfer

Only = Callable[[str], bool] | Collection[str] | None


def matches(slot: Slot, only: Only) -> bool:
    """Whether ``only`` (names, or a predicate on names; ``None``: everything) selects one of the slot's members."""
    if only is None:
        return True
    names = [m.name for m in slot.info.members]
    if callable(only):
        return any(only(n) for n in names)
    return any(n in only for n in names)


def disown(slot: Slot) -> None:
    """Stop relying on the framework's copy of a slot's values, and tell the framework (once)."""
    native, slot.native_home = slot.native_home, None
    if native is not None:
        native.forget()


def _member_extent(t: torch.Tensor) -> int:
    """Bytes of storage a tensor needs (offset included)."""
    if t.numel() == 0:
        return 0
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return (int(t.storage_offset()) + span) * t.element_size()


#: every open slot table: a storage released by one of them is theirs (``holder``)
_TABLES: weakref.WeakSet[SlotTable] = weakref.WeakSet()


def holder(key: int, *, besides: SlotTable | None = None) -> SlotTable | None:
    """The open table (other than ``besides``) that tracks the storage ``key`` (offloaded values are in its
    homes), if any."""
    return next((t for t in list(_TABLES) if t is not besides and key in t.slots), None)


def _adopt_native(slot: Slot, es: list[Entry], table: SlotTable) -> None:
    """A storage released outside ``table``: host-resident in the framework's copy, or dropped if it kept none."""
    native = next((e.native_home for e in es if e.native_home is not None), None)
    if native is None and holder(slot.key, besides=table) is not None:
        raise StateError(
            "foreign",
            "its storage was released by another ModelState that is still alive and holds its values; get that "
            "state with ModelState.owner(tensor) and onload() or close() it first",
            tensor=es[0].name,
        )
    if native is None:
        raise StateError(
            "foreign",
            "its storage was released outside stateshift and its backend knows no copy of its values; "
            "reload it with the code that released it, or drop it explicitly",
            tensor=es[0].name,
        )
    if native.values is None:
        slot.residency = Residency.DROPPED
    else:
        if native.values.numel() * native.values.element_size() != slot.nbytes:
            raise StateError(
                "foreign",
                f"the framework's host copy holds {native.values.nbytes} bytes, expected {slot.nbytes}",
                tensor=es[0].name,
            )
        slot.residency = Residency.HOST
    slot.native_home = native


_STORAGE, _NBYTES = operator.attrgetter("storage"), operator.methodcaller("nbytes")
_TENSOR = operator.attrgetter("tensor")
_RESIDENCY, _NATIVE = operator.attrgetter("residency"), operator.attrgetter("native_home")
_RESIDENCIES = tuple(Residency)


def _follow_framework(slots: list[Slot], entries: Sequence[Entry], keys: list[int], table: SlotTable) -> None:
    """Storages the framework released or re-grew itself since the last look: adopt its copy, or take its reload.

    No framework copy anywhere and every storage holding memory (the resident steady state) or no slot
    resident (the offloaded one) leaves nothing to follow: that is checked without a Python loop (a verb
    pays this per slot)."""
    if not any(map(_NATIVE, slots)) and (
        0 not in map(_NBYTES, map(_STORAGE, slots)) or Residency.DEVICE not in map(_RESIDENCY, slots)
    ):
        return
    for s in slots:
        size = s.storage.nbytes()
        if s.residency is Residency.DEVICE and size == 0 and s.nbytes > 0:
            _adopt_native(s, [e for e, k in zip(entries, keys, strict=True) if k == s.key], table)
        elif s.native_home is not None and s.residency is not Residency.DEVICE and size == s.nbytes > 0:
            s.residency = Residency.DEVICE
            disown(s)


@dataclass(eq=False)
class GroupState:
    """The slots of one group, its current layout and its home arena."""

    name: str
    slots: list[Slot] = field(default_factory=list)
    layout: Layout = field(default_factory=lambda: Layout.build(()))
    home: HostBlock | None = None
    #: what the last full refresh saw: (names, tensor objects, storage keys)
    listed: tuple[list[str], list[torch.Tensor], list[int]] | None = field(default=None, repr=False)
    #: the sequence the source returned last (a source returns the same one while nothing changed)
    entries: Sequence[Entry] | None = field(default=None, repr=False)
    by_key: dict[int, Slot] = field(default_factory=dict, repr=False)
    #: copy plans by slot subset (``None``: every slot), valid until the next relayout
    plans: dict[tuple[tuple[int, ...] | None, int | None], Plan] = field(default_factory=dict, repr=False)
    _on_host: bool | None = field(default=None, repr=False)

    def plan(self, engine: CopyEngine, indices: list[int], chunk: int | None = None) -> Plan:
        """The copy plan between slots ``indices`` and any arena of this group's layout (cached).
        ``chunk``: no run longer than this (the disk tier's staging windows)."""
        key = (None if len(indices) == len(self.slots) else tuple(indices), chunk)
        p = self.plans.get(key)
        if p is None:
            slots = self.slots
            p = self.plans[key] = engine.plan(
                self.layout.offsets,
                [s.nbytes for s in slots],
                [s.device.type == "cpu" for s in slots],
                lambda i: slots[i].bytes(),
                indices,
                chunk,
                devices=[s.device for s in slots],
            )
        return p

    def select(self, keep: Callable[[Slot], bool]) -> list[int]:
        return [i for i, s in enumerate(self.slots) if keep(s)]

    def by_residency(self, indices: Sequence[int] | None = None) -> dict[Residency, list[int]]:
        """Slots ``indices`` (ascending and distinct; default all) per residency, every residency a key:
        one pass, and none in Python when they all share one (the steady state of every verb)."""
        if indices is not None and len(indices) == len(self.slots):
            indices = None  # (ascending, distinct and as many as the slots: all of them)
        idx = range(len(self.slots)) if indices is None else indices
        slots = self.slots if indices is None else list(map(self.slots.__getitem__, idx))
        found = list(map(_RESIDENCY, slots))
        out: dict[Residency, list[int]] = {r: [] for r in _RESIDENCIES}
        if not found or found.count(found[0]) == len(found):
            out[found[0] if found else Residency.DEVICE] = list(idx)
            return out
        for i, r in zip(idx, found, strict=True):
            out[r].append(i)
        return out

    def all_resident(self) -> bool:
        """Every slot ``DEVICE`` (checked without a Python loop: verbs ask this first)."""
        return self.count(Residency.DEVICE) == len(self.slots)

    def count(self, residency: Residency) -> int:
        """How many slots are ``residency`` (no Python loop)."""
        return list(map(_RESIDENCY, self.slots)).count(residency)

    def any_native(self) -> bool:
        """Whether a slot has a framework copy of its values (no Python loop)."""
        return any(map(_NATIVE, self.slots))

    def all_releasable(self) -> bool:
        """Every slot's storage can be released in place now (asked each time: ``tensor.numpy()`` makes a
        storage non-resizable at any moment; no Python loop)."""
        return all_releasable(self.slots)

    def any_on_host(self) -> bool:
        """Whether a slot's own storage is host memory (a CPU model's). A slot's device never changes, so
        this is asked once per slot list; a relayout forgets it (``SlotTable._relayout``). The answer
        holds no slot: a slot list kept here would keep the tensors a relayout let go of alive."""
        if self._on_host is None:
            self._on_host = any(s.device.type == "cpu" for s in self.slots)
        return self._on_host

    def offloaded(self) -> list[int]:
        """Every slot not resident, in slot order (what a whole onload brings back)."""
        by = self.by_residency()
        return sorted(by[Residency.HOST] + by[Residency.DROPPED] + by[Residency.DISK])

    def releasable(self, only: Only, *, checked: bool = False) -> list[int]:
        """Resident slots ``only`` selects whose storage can be released (what an offload moves).
        ``checked``: the caller just made sure every resident accelerator slot is (``DeviceTier.
        check_releasable``), so with no host slot none needs asking again."""
        if only is None and ((checked and not self.any_on_host()) or self.all_releasable()):
            return self.by_residency()[Residency.DEVICE]
        return self.select(lambda s: s.residency is Residency.DEVICE and s.releasable and matches(s, only))

    # -- copies between this group and arenas of its layout (homes, snapshots, stashes) -------------
    def copy_out(self, engine: CopyEngine, indices: list[int], arena: torch.Tensor, *, frees: bool = False) -> Transfer:
        """Device storage of slots ``indices`` -> their regions of ``arena``."""
        return engine.to_arena(self.plan(engine, indices), arena, frees_sources=frees) if indices else Transfer()

    def copy_in(self, engine: CopyEngine, indices: list[int], arena: torch.Tensor, *, regrow: bool = False) -> Transfer:
        """Regions of ``arena`` -> device storage of slots ``indices``. With ``regrow`` their released storage
        is given back run by run, just before each run's copy (overlapping the copies already going);
        otherwise they must hold storage."""
        if not indices:
            return Transfer()
        before = None
        if regrow:
            slots = self.slots

            def before(run: Run) -> None:
                regrow_all(list(map(slots.__getitem__, run.items)))

        return engine.from_arena(self.plan(engine, indices), arena, before=before)

    def exchange(self, engine: CopyEngine, indices: list[int], out: torch.Tensor, inp: torch.Tensor) -> Transfer:
        """Slots ``indices`` -> ``out`` and ``inp`` -> the slots, both directions at once."""
        return engine.exchange(self.plan(engine, indices), out, inp) if indices else Transfer()

    def copy_home(
        self, engine: CopyEngine, indices: list[int], arena: torch.Tensor, *, into_home: bool = False
    ) -> Transfer:
        """Offloaded slots ``indices``: their values (home or framework copy) -> ``arena``, or back with
        ``into_home``. Both arenas share the layout, so each run is one range copy."""
        native = [i for i in indices if self.slots[i].native_home is not None]
        own = [i for i in indices if self.slots[i].native_home is None] if native else indices
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if own:
            assert self.home is not None
            home = self.home.data
            for run in self.plan(engine, own).runs:
                a, b = (home, arena) if into_home else (arena, home)
                pairs.append((a[run.start : run.end], b[run.start : run.end]))
        for i in native:
            region = self.layout.region(arena, i)
            pairs.append((self.home_region(i), region) if into_home else (region, self.home_region(i)))
        return engine.copy(pairs)

    def zero_regions(self, engine: CopyEngine, indices: list[int], arena: torch.Tensor) -> None:
        """Write zeros into the regions of slots ``indices`` (dropped slots read as zeros)."""
        for run in self.plan(engine, indices).runs if indices else ():
            arena[run.start : run.end].zero_()

    def index(self) -> dict[int, int]:
        return {s.key: i for i, s in enumerate(self.slots)}

    def counts(self) -> dict[str, int]:
        out = {r.value: 0 for r in Residency}
        for s in self.slots:
            out[s.residency.value] += 1
        return out

    def home_is_whole(self) -> bool:
        """True when every slot's values are in the group home (so a snapshot may share it)."""
        return (
            self.home is not None
            and bool(self.slots)
            and all(s.residency is Residency.HOST and s.native_home is None for s in self.slots)
        )

    def has_native(self) -> bool:
        return any(s.native_home is not None for s in self.slots)

    def home_region(self, index: int) -> torch.Tensor:
        """Where slot ``index``'s offloaded values are: the framework's own copy, or the group home."""
        s = self.slots[index]
        if s.native_home is not None:
            v = s.native_home.values
            assert v is not None, "a dropped slot has no home region"
            return v.reshape(-1).view(torch.uint8) if v.dtype != torch.uint8 else v.reshape(-1)
        assert self.home is not None, f"slot {s.name!r} is {s.residency} but its group has no home"
        return self.home.regions(self.layout)[index]


class SlotTable:
    """Every group's ``GroupState``, refreshed from the sources' listings (see the module docstring)."""

    def __init__(self, sources: list[Source], pool: HostPool) -> None:
        owner: dict[str, str] = {}
        for b in sources:
            for g in b.groups:
                if g in owner:
                    raise ObjectError("backend", f"group {g!r} is listed by both backend {owner[g]!r} and {b.name!r}")
                owner[g] = b.name
        self.sources = sources
        self.pool = pool
        self.names: tuple[str, ...] = tuple(owner)
        self.forward: tuple[str, ...] = tuple(g for b in sources for g in b.forward_groups)
        self.groups: dict[str, GroupState] = {g: GroupState(g) for g in self.names}
        self.slots: dict[int, Slot] = {}
        #: the state's disk home, once it has one (a relayout reads values on disk back through it)
        self.disk: DiskHome | None = None
        _TABLES.add(self)

    def close(self) -> None:
        """This table no longer holds any storage (``holder`` stops naming it)."""
        _TABLES.discard(self)

    def refresh(self, groups: Iterable[str] | None = None) -> None:
        """Re-list ``groups`` (default all): new tensors become slots, vanished ones are forgotten (their values
        back in their storage first: ``_let_go``)."""
        wanted = frozenset(self.names if groups is None else groups)
        by_group = self._list(wanted)
        keys = {g: storage_keys(map(_TENSOR, entries)) for g, entries in by_group.items()}
        others = [gs.by_key for name, gs in self.groups.items() if name not in wanted]
        if any(not held.keys().isdisjoint(k) for held in others for k in keys.values()):
            # a storage listed now is still a slot of a group not asked for (``p.data`` set to an optimizer
            # state's tensor, or to its own grad): that group's listing is stale, so every group is re-listed
            return self.refresh()
        seen: dict[int, Slot] = {}
        for held in others:  # (``slots`` is the union of every group's ``by_key``)
            seen.update(held)
        for g, entries in by_group.items():
            self._refresh_group(self.groups[g], entries, keys[g], seen)
        self.slots = seen

    def prepare(self, groups: Iterable[str]) -> None:
        """Let each source bring its framework into a listable, movable state for ``groups``."""
        wanted = frozenset(groups)
        for b in self.sources:
            asked = wanted.intersection(b.groups)
            if asked:
                b.prepare(asked)

    def _list(self, wanted: frozenset[str]) -> dict[str, Sequence[Entry]]:
        self.prepare(wanted)
        by_group: dict[str, Sequence[Entry]] = {}
        for b in self.sources:
            for g in b.groups:
                if g in wanted:
                    entries = by_group[g] = b.entries(g)
                    bad = (
                        next((e for e in entries if e.group != g), None)
                        if entries is not self.groups[g].entries
                        else None
                    )
                    if bad is not None:
                        raise ObjectError(
                            "backend", f"backend {b.name!r} listed {bad.name!r} of group {bad.group!r} as group {g!r}"
                        )
        return by_group

    def _refresh_group(self, gs: GroupState, entries: Sequence[Entry], keys: list[int], seen: dict[int, Slot]) -> None:
        if (
            gs.listed is not None
            and keys == gs.listed[2]
            and seen.keys().isdisjoint(gs.by_key)
            and self._same(gs, entries)
        ):
            seen.update(gs.by_key)  # the same tensor objects, storages and names: nothing changed
            gs.entries = entries
            _follow_framework(gs.slots, entries, keys, self)
            return
        members: dict[int, list[Entry]] = {}
        for key, e in zip(keys, entries, strict=True):
            members.setdefault(key, []).append(e)
        slots: list[Slot] = []
        changed = False
        for key, es in members.items():
            if key in seen:
                raise ObjectError(
                    "backend",
                    f"tensor {es[0].name!r} (group {gs.name!r}) shares storage with {seen[key].name!r} "
                    f"(group {seen[key].info.group!r}); a storage belongs to one group",
                )
            slot, fresh = self._slot_for(key, gs.name, es)
            changed |= fresh
            seen[key] = slot
            slots.append(slot)
        if changed or len(slots) != len(gs.slots) or any(a is not b for a, b in zip(slots, gs.slots, strict=True)):
            layout = Layout.build(tuple(s.info for s in slots))
            if [s.key for s in gs.slots] != [s.key for s in slots] or layout != gs.layout:
                self._relayout(gs, slots, layout)
        gs.listed = ([e.name for e in entries], [e.tensor for e in entries], keys)
        gs.entries = entries
        gs.by_key = {sl.key: sl for sl in slots}
        _follow_framework(gs.slots, entries, keys, self)

    @staticmethod
    def _same(gs: GroupState, entries: Sequence[Entry]) -> bool:
        """The listing names the same tensor objects under the same names as last time (the source says so
        by returning the very same sequence, or the names and objects are compared)."""
        if entries is gs.entries:
            return True
        assert gs.listed is not None
        return [e.name for e in entries] == gs.listed[0] and all(
            map(operator.is_, (e.tensor for e in entries), gs.listed[1])
        )

    def _slot_for(self, key: int, group: str, es: list[Entry]) -> tuple[Slot, bool]:
        """The slot for one storage, and whether its fingerprint may have changed."""
        old = self.slots.get(key)
        if (
            old is not None
            and old.info.group == group
            and len(old.tensors) == len(es)
            and all(
                e.tensor is t and e.name == m.name for e, t, m in zip(es, old.tensors, old.info.members, strict=True)
            )
        ):
            return old, False  # the same tensor objects under the same names: nothing to re-derive
        first = es[0]
        storage = first.tensor.untyped_storage()
        if old is not None and (old.residency is not Residency.DEVICE or storage.nbytes() == 0):
            nbytes = old.nbytes  # offloaded by us, or released by the framework since we last looked
        elif storage.nbytes() > 0 or old is not None:
            nbytes = storage.nbytes()
        else:
            nbytes = first.nbytes if first.nbytes is not None else max(_member_extent(e.tensor) for e in es)
        info = SlotInfo(name=first.name, group=group, nbytes=nbytes, members=tuple(member_info(e) for e in es))
        tensors = tuple(e.tensor for e in es)
        if old is not None and old.info.group == group:
            if old.info != info:
                old.info, old._view = info, None
            old.tensors = tensors
            return old, True
        slot = Slot(key=key, info=info, storage=storage, device=first.tensor.device, tensors=tensors)
        if storage.nbytes() == 0 and nbytes > 0:
            _adopt_native(slot, es, self)
        return slot, True

    def _let_go(self, gs: GroupState, gone: list[Slot]) -> None:
        """Slots no longer listed whose values are not in their storage (a buffer made non-persistent while
        offloaded: the module still holds it) get storage and values back before their home is let go;
        dropped ones come back zero-filled, as an onload would. (Storage released in place only: a
        framework's own host copy, or an address-stable pause, stays the framework's / the policy's.)"""
        index = gs.index()
        for s in gone:
            if s.native_home is not None or s.storage.nbytes() != 0 or s.key not in index:
                continue
            regrow_all([s])
            view = s.bytes()
            if s.residency is Residency.HOST and gs.home is not None:
                gs.home.sync()
                view.copy_(gs.layout.region(gs.home.data, index[s.key]))
            elif s.residency is Residency.DISK and self.disk is not None:
                host = torch.empty(s.nbytes, dtype=torch.uint8)
                self.disk.read(self.disk.region(gs.name, gs.layout.total) + gs.layout.offsets[index[s.key]], host)
                view.copy_(host)
            else:
                view.zero_()
            s.residency = Residency.DEVICE

    def _relayout(self, gs: GroupState, slots: list[Slot], layout: Layout) -> None:
        """Adopt a new slot list; carry offloaded values over into a home of the new layout (values that were
        on disk come back to the host: the disk region had the old layout)."""
        old_home, old_layout, old_index = gs.home, gs.layout, gs.index()
        listed = {s.key for s in slots}
        self._let_go(gs, [s for s in gs.slots if s.key not in listed and s.residency is not Residency.DEVICE])
        keep = [s for s in slots if s.residency is Residency.HOST and s.native_home is None and s.key in old_index]
        from_disk = [s for s in slots if s.residency is Residency.DISK and s.key in old_index]
        new_home = self.pool.acquire(layout.total) if keep or from_disk else None
        new_index = {s.key: i for i, s in enumerate(slots)}
        if from_disk:  # first: a read can fail, and then the group keeps its old layout and its region
            assert self.disk is not None and new_home is not None
            base = self.disk.region(gs.name, old_layout.total)
            try:
                for s in from_disk:
                    self.disk.read(
                        base + old_layout.offsets[old_index[s.key]], layout.region(new_home.data, new_index[s.key])
                    )
            except BaseException:
                self.pool.release(new_home)
                raise
        gs.slots, gs.layout, gs.home = slots, layout, new_home
        gs.plans, gs._on_host = {}, None
        if old_home is not None and keep:
            old_home.sync()
            for s in keep:
                layout.region(new_home.data, new_index[s.key]).copy_(old_layout.region(old_home.data, old_index[s.key]))  # type: ignore[union-attr]
        if from_disk:
            for s in from_disk:
                s.residency = Residency.HOST
            self.disk.forget(gs.name)  # type: ignore[union-attr]
        if old_home is not None:
            self.pool.release(old_home)
