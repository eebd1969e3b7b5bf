"""ModelState: a model's state as groups of slots, and the verbs that move it.

Verbs: ``offload``, ``onload``, ``drop``, ``snapshot``, ``restore``,
``swapped`` and ``release``. Each works in every residency and every mix of
residencies (rule 1 of DESIGN.md): a slot is ``device``, ``host`` or
``dropped``, and each verb says what it does in each case -- there is no
side attribute whose absence could raise.

When results are safe to read: every verb returns without blocking the host
on device copies. Compute enqueued on the current stream after a verb is
ordered after that verb's copies, so the model may run (or be stepped) at
once. Host memory written by a verb (a snapshot's values, a home) is safe to
read on the host only after waiting: ``Snapshot.wait()`` or the returned
``Transfer.wait()``.

Homes: each group has one host arena (``home``) laid out like its
snapshots, taken from the pool the first time the group is offloaded and
kept for reuse. Homes and host snapshots share blocks copy-on-write: a
snapshot of a fully offloaded group, and a restore into one, move no bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
import inspect
import operator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .backends import Backend, detect_backends
from .errors import BackendError, ForeignStateError, NotReleasableError, OffloadedStateError, SwapActiveError, UnknownGroupError
from .pool import HostBlock, HostPool
from .slot import Entry, NativeHome, Residency, Slot, SlotInfo, member_info, storage_key
from .snapshot import PLACEMENTS, Layout, Placement, Snapshot, SnapshotPart, SnapshotStore
from .transfer import CopyEngine, Pair, Transfer

GroupArg = str | Iterable[str] | None
Only = Callable[[str], bool] | Collection[str] | None


def _member_extent(t: torch.Tensor) -> int:
    """Bytes of storage a tensor needs (offset included)."""
    if t.numel() == 0:
        return 0
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return (t.storage_offset() + span) * t.element_size()


def _disown(slot: Slot) -> None:
    """Stop relying on the framework's copy of a slot's values, and tell the framework (once)."""
    native, slot.native_home = slot.native_home, None
    if native is not None and native.on_onload is not None:
        native.on_onload()


def _adopt_native(slot: Slot, es: list[Entry]) -> None:
    """A storage released outside stateshift: host-resident in the framework's copy, or dropped if it kept none."""
    native = next((e.native_home for e in es if e.native_home is not None), None)
    if native is None:
        raise ForeignStateError(
            es[0].name,
            "its storage was released outside stateshift and its backend knows no copy of its values; "
            "reload it with the code that released it, or drop it explicitly",
        )
    if native.values is None:
        slot.residency = Residency.DROPPED
    else:
        if native.values.numel() * native.values.element_size() != slot.nbytes:
            raise ForeignStateError(
                es[0].name, f"the framework's host copy holds {native.values.nbytes} bytes, expected {slot.nbytes}"
            )
        slot.residency = Residency.HOST
    slot.native_home = native


def _follow_framework(slots: list[Slot], entries: list[Entry], keys: list[int]) -> None:
    """Storages the framework released or re-grew itself since the last look (e.g. Megatron's
    ``offload_to_cpu`` / ``reload_from_cpu``): adopt its copy, or take its reload as the truth."""
    for s in slots:
        size = s.storage.nbytes()
        if s.residency is Residency.DEVICE and size == 0 and s.nbytes > 0:
            _adopt_native(s, [e for e, k in zip(entries, keys, strict=True) if k == s.key])
        elif s.native_home is not None and s.residency is not Residency.DEVICE and size == s.nbytes > 0:
            s.residency = Residency.DEVICE
            _disown(s)


def _matches(slot: Slot, only: Only) -> bool:
    if only is None:
        return True
    names = [m.name for m in slot.info.members]
    if callable(only):
        return any(only(n) for n in names)
    return any(n in only for n in names)


@dataclass(eq=False)
class GroupState:
    """The slots of one group, its current layout and its home arena."""

    name: str
    slots: list[Slot] = field(default_factory=list)
    layout: Layout = field(default_factory=lambda: Layout.build(()))
    home: HostBlock | None = None
    #: what the last full refresh saw: (names, tensor objects, storage keys)
    listed: tuple[list[str], list[torch.Tensor], list[int]] | None = field(default=None, repr=False)
    by_key: dict[int, Slot] = field(default_factory=dict, repr=False)

    def index(self) -> dict[int, int]:
        return {s.key: i for i, s in enumerate(self.slots)}

    def counts(self) -> dict[str, int]:
        out = {r.value: 0 for r in Residency}
        for s in self.slots:
            out[s.residency.value] += 1
        return out


class ModelState:
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
            optimizer step).
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        backends: Iterable[Backend] | None = None,
        pool: HostPool | None = None,
        pin: bool | str = "auto",
        device: torch.device | None = None,
        snapshot_budget_bytes: int | None = None,
        guard: bool = True,
    ) -> None:
        self.backends: list[Backend] = list(backends) if backends is not None else detect_backends(model, optimizer)
        owner: dict[str, str] = {}
        for b in self.backends:
            for g in b.groups:
                if g in owner:
                    raise BackendError(f"group {g!r} is listed by both backend {owner[g]!r} and {b.name!r}")
                owner[g] = b.name
        self.groups: tuple[str, ...] = tuple(owner)
        self.forward_groups: tuple[str, ...] = tuple(g for b in self.backends for g in b.forward_groups)
        self.pool = pool if pool is not None else HostPool(pin=pin)  # type: ignore[arg-type]
        self.engine = CopyEngine(device)
        self.snapshots = SnapshotStore(snapshot_budget_bytes)
        self._groups: dict[str, GroupState] = {g: GroupState(g) for g in self.groups}
        self._slots: dict[int, Slot] = {}
        self._swapping: set[str] = set()
        self._handles: list[Any] = []
        self._takes_groups = {id(b): "groups" in inspect.signature(b.entries).parameters for b in self.backends}
        self.refresh()
        if guard:
            for b in self.backends:
                self._handles.extend(b.install_guards(self))

    # -- introspection --------------------------------------------------------------------
    @property
    def swapping(self) -> frozenset[str]:
        """The groups a ``swapped()`` context holds right now (backends that cache derived copies check it)."""
        return frozenset(self._swapping)

    def residency(self) -> dict[str, dict[str, int]]:
        """Per group, how many slots are ``device`` / ``host`` / ``dropped``."""
        self.refresh()
        return {g: gs.counts() for g, gs in self._groups.items()}

    def slots(self, group: str | None = None) -> list[Slot]:
        self.refresh()
        names = self._select(group, check_swap=False) if group is not None else self.groups
        return [s for g in names for s in self._groups[g].slots]

    def nbytes(self, groups: GroupArg = None) -> int:
        self.refresh()
        return sum(s.nbytes for g in self._select(groups, check_swap=False) for s in self._groups[g].slots)

    def layout(self, group: str) -> Layout:
        self.refresh()
        return self._groups[self._select(group, check_swap=False)[0]].layout

    # -- verbs ----------------------------------------------------------------------------
    def offload(self, groups: GroupArg = None, *, only: Only = None) -> Transfer:
        """Copy device-resident slots to their homes and release their device storage.

        ``host`` slots stay as they are; ``dropped`` slots stay dropped. The
        home is safe to read on the host after the returned transfer's ``wait()``.
        """
        names = self._select(groups)
        self.refresh(names)
        self._check_releasable(names, only)
        pairs: list[Pair] = []
        moved: list[tuple[GroupState, list[Slot]]] = []
        for g in names:
            gs = self._groups[g]
            moving = [s for s in gs.slots if s.residency is Residency.DEVICE and s.releasable and _matches(s, only)]
            if not moving:
                continue
            home = self._writable_home(gs, rewriting={s.key for s in moving})
            idx = gs.index()
            regions = home.regions(gs.layout)
            pairs += [(regions[idx[s.key]], s.bytes()) for s in moving]
            moved.append((gs, moving))
        transfer = self.engine.copy(pairs, frees_sources=True)
        for gs, moving in moved:
            assert gs.home is not None
            gs.home.pending = transfer.merged(gs.home.pending)
            for s in moving:
                s.release_storage()
                s.residency = Residency.HOST
        return transfer

    def drop(self, groups: GroupArg = None, *, only: Only = None) -> None:
        """Release device storage without keeping values (``onload`` zero-fills). ``host`` slots become ``dropped`` too."""
        names = self._select(groups)
        self.refresh(names)
        self._check_releasable(names, only)
        for g in names:
            for s in self._groups[g].slots:
                if s.residency is not Residency.DROPPED and s.releasable and _matches(s, only):
                    if s.residency is Residency.DEVICE:
                        s.release_storage()
                    s.residency = Residency.DROPPED
                    _disown(s)

    def onload(self, groups: GroupArg = None, *, only: Only = None) -> Transfer:
        """Re-grow device storage and fill it: from the home (``host``) or with zeros (``dropped``).

        The same tensor objects hold the values afterwards; compute enqueued
        after the call sees them.
        """
        names = self._select(groups)
        self.refresh(names)
        pairs: list[Pair] = []
        zero: list[Slot] = []
        onloaded: list[Slot] = []
        for g in names:
            gs = self._groups[g]
            idx = gs.index()
            for s in gs.slots:
                if s.residency is Residency.DEVICE or not _matches(s, only):
                    continue
                s.regrow_storage()
                if s.residency is Residency.HOST:
                    pairs.append((s.bytes(), self._home_region(gs, idx[s.key])))
                else:
                    zero.append(s)
                onloaded.append(s)
        self._sync_host_sources(pairs, names)
        transfer = self.engine.copy(pairs)
        for s in zero:
            s.bytes().zero_()
        for g in names:
            gs = self._groups[g]
            if gs.home is not None and pairs:
                gs.home.pending = transfer.merged(gs.home.pending)
        for s in onloaded:
            s.residency = Residency.DEVICE
            _disown(s)
        return transfer

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
        A snapshot under the same ``(tag, version)`` is replaced (released
        first, so its memory is reused). A host snapshot of a fully
        offloaded group shares the home's block instead of copying it.
        Values are safe to read on the host after ``snapshot.wait()``.
        """
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
        names = self._select(groups if groups is not None else self.forward_groups, check_swap=False)
        self.refresh(names)
        size = sum(self._groups[g].layout.total for g in names)
        self.snapshots.check_budget(size, replacing=(tag, version))
        old = self.snapshots._items.get((tag, version))
        if old is not None:
            self.snapshots.discard(old)
        parts: list[SnapshotPart] = []
        pairs: list[Pair] = []
        pending = Transfer()
        for g in names:
            gs = self._groups[g]
            if placement == "host" and self._home_is_whole(gs):
                assert gs.home is not None
                parts.append(SnapshotPart(g, gs.layout, host=self.pool.retain(gs.home)))
                pending = pending.merged(gs.home.pending)
                continue
            if placement == "host":
                part = SnapshotPart(g, gs.layout, host=self.pool.acquire(gs.layout.total))
            else:
                part = SnapshotPart(g, gs.layout, device=torch.empty(gs.layout.total, dtype=torch.uint8, device=self._device_for(gs)))
            parts.append(part)
            regions = part.regions()
            for i, s in enumerate(gs.slots):
                if s.residency is Residency.DEVICE:
                    pairs.append((regions[i], s.bytes()))
                elif s.residency is Residency.HOST:
                    pairs.append((regions[i], self._home_region(gs, i)))
                else:
                    regions[i].zero_()
        self._sync_host_sources(pairs, names)
        transfer = self.engine.copy(pairs).merged(pending)
        snap = Snapshot(tag=tag, version=version, placement=placement, parts=tuple(parts), _pool=self.pool, _transfer=transfer)
        for p in parts:
            if p.host is not None:
                p.host.pending = transfer
        self.snapshots.put(snap)
        return snap

    def restore(self, snapshot: Snapshot) -> Transfer:
        """Write the snapshot's values into its groups, wherever each slot lives now.

        ``device`` slots are written in place (no temporary full-size device
        tensor); ``host`` slots get the values in their home (a pointer copy
        when the whole group is offloaded); ``dropped`` slots become ``host``
        with the values. Checks the layout of every group first and changes
        nothing if any differs (``LayoutMismatchError`` names the tensor).
        """
        snapshot.check_alive()
        names = self._select(snapshot.groups)
        self.refresh(names)
        for part in snapshot.parts:
            self._groups[part.group].layout.check_compatible(part.layout)
        pairs: list[Pair] = []
        homes: list[GroupState] = []
        for part in snapshot.parts:
            gs = self._groups[part.group]
            offloaded = [s for s in gs.slots if s.residency is not Residency.DEVICE]
            if part.host is not None and offloaded and len(offloaded) == len(gs.slots) and not self._has_native(gs):
                old = gs.home
                gs.home = self.pool.retain(part.host)
                if old is not None:
                    self.pool.release(old)
                for s in offloaded:
                    s.residency = Residency.HOST
                continue
            home = self._writable_home(gs, rewriting={s.key for s in offloaded}) if offloaded else None
            regions = part.regions()
            for i, s in enumerate(gs.slots):
                if s.residency is Residency.DEVICE:
                    pairs.append((s.bytes(), regions[i]))
                else:
                    assert home is not None
                    pairs.append((self._home_region(gs, i), regions[i]))
                    s.residency = Residency.HOST
            if home is not None:
                homes.append(gs)
        self._sync_host_sources(pairs, names, snapshot)
        transfer = self.engine.copy(pairs)
        for gs in homes:
            assert gs.home is not None
            gs.home.pending = transfer.merged(gs.home.pending)
        for part in snapshot.parts:
            if part.host is not None:
                part.host.pending = transfer.merged(part.host.pending)
        return transfer

    @contextmanager
    def swapped(
        self,
        snapshot: Snapshot,
        *,
        rebuild: Mapping[str, Callable[[], None]] | None = None,
        stash: Literal["auto", "device", "host"] = "auto",
    ) -> Iterator[Snapshot]:
        """Inside, the model computes with the snapshot's values; after, it has exactly its own back.

        ``device`` slots are stashed (on the snapshot's placement) and
        overwritten; ``host`` and ``dropped`` slots get device storage filled
        from the snapshot and are released again on exit, their homes
        untouched. Changes made inside (e.g. an optimizer step) are discarded.
        Other verbs on these groups raise ``SwapActiveError`` inside.

        ``rebuild`` maps a group to a function that recomputes its current
        values on the device (e.g. bf16 params from the optimizer's fp32
        master weights): that group's device slots are then not stashed, and
        on exit the function runs instead of copying the stash back -- it must
        rewrite every device-resident slot of the group, on the current stream.

        ``stash``: where the current values wait. ``"device"`` costs device
        memory and moves them at device-copy speed; ``"host"`` uses a pooled
        pinned block and two PCIe crossings; ``"auto"`` takes the device when
        its free memory holds twice the stash, else the host.
        """
        if stash not in ("auto", "device", "host"):
            raise ValueError(f"stash must be 'auto', 'device' or 'host', not {stash!r}")
        rebuild = dict(rebuild or {})
        snapshot.check_alive()
        names = self._select(snapshot.groups)
        self.refresh(names)
        for part in snapshot.parts:
            self._groups[part.group].layout.check_compatible(part.layout)
        stash_pairs: list[Pair] = []
        write_pairs: list[Pair] = []
        undo: list[tuple[Slot, Residency, torch.Tensor | None]] = []
        stashes: list[HostBlock | torch.Tensor] = []
        on_device = self._stash_on_device(stash, [self._groups[p.group] for p in snapshot.parts if p.group not in rebuild])
        for part in snapshot.parts:
            gs = self._groups[part.group]
            arena: torch.Tensor | None = None
            rebuilt = part.group in rebuild
            if not rebuilt and any(s.residency is Residency.DEVICE for s in gs.slots):
                if on_device:
                    arena = torch.empty(gs.layout.total, dtype=torch.uint8, device=self._device_for(gs))
                    stashes.append(arena)
                else:
                    block = self.pool.acquire(gs.layout.total)
                    stashes.append(block)
                    arena = block.data
            regions = part.regions()
            for i, s in enumerate(gs.slots):
                if s.residency is Residency.DEVICE and rebuilt:
                    undo.append((s, Residency.DEVICE, None))
                elif s.residency is Residency.DEVICE:
                    assert arena is not None
                    region = gs.layout.region(arena, i)
                    stash_pairs.append((region, s.bytes()))
                    undo.append((s, Residency.DEVICE, region))
                else:
                    s.regrow_storage()
                    undo.append((s, s.residency, None))
                write_pairs.append((s.bytes(), regions[i]))
        stashed = self.engine.copy(stash_pairs)
        self._sync_host_sources(write_pairs, names, snapshot)
        written = self.engine.copy(write_pairs)
        for s, _, _ in undo:
            s.residency = Residency.DEVICE
        self._swapping.update(names)
        try:
            yield snapshot
        finally:
            back: list[Pair] = []
            for s, was, region in undo:
                if was is Residency.DEVICE and region is not None:
                    back.append((s.bytes(), region))
            for group in names:
                if group in rebuild and any(s.info.group == group and was is Residency.DEVICE for s, was, _ in undo):
                    rebuild[group]()
            self._sync_host_sources(back, names)
            returned = self.engine.copy(back)
            for s, was, _ in undo:
                if was is not Residency.DEVICE:
                    s.release_storage()
                    s.residency = was
            for st in stashes:
                if isinstance(st, torch.Tensor):
                    continue
                st.pending = returned.merged(stashed)
                self.pool.release(st)
            for part in snapshot.parts:
                if part.host is not None:
                    part.host.pending = written.merged(part.host.pending)
            self._swapping.difference_update(names)

    def release(self, snapshot: Snapshot) -> None:
        """Forget the snapshot and give its memory back (to the pool, for host snapshots)."""
        self.snapshots.discard(snapshot)

    def close(self) -> None:
        """Remove hooks, release snapshots and homes. Offloaded state stays offloaded and becomes unreachable."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.snapshots.clear()
        for gs in self._groups.values():
            if gs.home is not None:
                self.pool.release(gs.home)
                gs.home = None

    # -- guards ---------------------------------------------------------------------------
    def check_resident(self, tensors: Iterable[torch.Tensor], where: str) -> None:
        """Raise ``OffloadedStateError`` if any tensor's storage is released (cheap: no refresh)."""
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            if t.untyped_storage().nbytes() == 0:
                slot = self._slots.get(storage_key(t))
                if slot is None:
                    raise OffloadedStateError("(untracked)", "(a tensor)", "released", where)
                raise OffloadedStateError(slot.info.group, slot.name, slot.residency.value, where)

    # -- internals ------------------------------------------------------------------------
    def _select(self, groups: GroupArg, *, check_swap: bool = True) -> tuple[str, ...]:
        if groups is None:
            names: tuple[str, ...] = self.groups
        elif isinstance(groups, str):
            names = (groups,)
        else:
            names = tuple(groups)
        for g in names:
            if g not in self._groups:
                raise UnknownGroupError(g, self.groups)
        if check_swap:
            busy = [g for g in names if g in self._swapping]
            if busy:
                raise SwapActiveError(f"group(s) {busy} are inside a swapped() context")
        return names

    def refresh(self, groups: Iterable[str] | None = None) -> None:
        """Re-list the backends' tensors of ``groups`` (default all): new tensors become slots, vanished ones are forgotten.

        Every verb refreshes the groups it touches, so tensors created since
        the last verb (grads, optimizer state) are picked up and tensors that
        vanished (``grad = None``) are let go.
        """
        wanted = set(self.groups if groups is None else groups)
        by_group: dict[str, list[Entry]] = {g: [] for g in self.groups if g in wanted}
        for b in self.backends:
            asked = wanted.intersection(b.groups)
            if not asked:
                continue
            for e in b.entries(frozenset(asked)) if self._takes_groups[id(b)] else b.entries():
                if e.group not in self._groups:
                    raise BackendError(f"backend {b.name!r} listed {e.name!r} in undeclared group {e.group!r}")
                if e.group in by_group:
                    by_group[e.group].append(e)
        seen: dict[int, Slot] = {k: s for k, s in self._slots.items() if s.info.group not in wanted}
        for g, entries in by_group.items():
            gs = self._groups[g]
            names = [e.name for e in entries]
            tensors = [e.tensor for e in entries]
            keys = list(map(storage_key, tensors))
            if (
                gs.listed is not None
                and keys == gs.listed[2]
                and names == gs.listed[0]
                and all(map(operator.is_, tensors, gs.listed[1]))
                and seen.keys().isdisjoint(gs.by_key)
            ):
                seen.update(gs.by_key)  # the same tensor objects, storages and names: nothing changed
                _follow_framework(gs.slots, entries, keys)
                continue
            members: dict[int, list[Entry]] = {}
            for key, e in zip(keys, entries, strict=True):
                members.setdefault(key, []).append(e)
            slots: list[Slot] = []
            changed = False
            for key, es in members.items():
                if key in seen:
                    raise BackendError(
                        f"tensor {es[0].name!r} (group {g!r}) shares storage with {seen[key].name!r} "
                        f"(group {seen[key].info.group!r}); a storage belongs to one group"
                    )
                slot, fresh = self._slot_for(key, g, es)
                changed |= fresh
                seen[key] = slot
                slots.append(slot)
            if changed or len(slots) != len(gs.slots) or any(a is not b for a, b in zip(slots, gs.slots)):
                layout = Layout.build(tuple(s.info for s in slots))
                if [s.key for s in gs.slots] != [s.key for s in slots] or layout != gs.layout:
                    self._relayout(gs, slots, layout)
            gs.listed = (names, tensors, keys)
            gs.by_key = {sl.key: sl for sl in slots}
            _follow_framework(gs.slots, entries, keys)
        self._slots = seen

    def _slot_for(self, key: int, group: str, es: list[Entry]) -> tuple[Slot, bool]:
        """The slot for one storage, and whether its fingerprint may have changed."""
        old = self._slots.get(key)
        if (
            old is not None
            and old.info.group == group
            and len(old.tensors) == len(es)
            and all(e.tensor is t and e.name == m.name for e, t, m in zip(es, old.tensors, old.info.members))
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
            _adopt_native(slot, es)
        return slot, True

    def _relayout(self, gs: GroupState, slots: list[Slot], layout: Layout) -> None:
        """Adopt a new slot list; carry host-resident values over into a home of the new layout."""
        old_home, old_layout, old_index = gs.home, gs.layout, gs.index()
        keep = [s for s in slots if s.residency is Residency.HOST and s.native_home is None and s.key in old_index]
        gs.slots, gs.layout, gs.home = slots, layout, None
        if old_home is None:
            return
        if keep:
            gs.home = self.pool.acquire(layout.total)
            old_home.sync()
            new_index = gs.index()
            for s in keep:
                gs.layout.region(gs.home.data, new_index[s.key]).copy_(old_layout.region(old_home.data, old_index[s.key]))
        self.pool.release(old_home)

    def _home_is_whole(self, gs: GroupState) -> bool:
        """True when every slot's values are in the group home (so a snapshot may share it)."""
        return (
            gs.home is not None
            and bool(gs.slots)
            and all(s.residency is Residency.HOST and s.native_home is None for s in gs.slots)
        )

    def _has_native(self, gs: GroupState) -> bool:
        return any(s.native_home is not None for s in gs.slots)

    def _home_region(self, gs: GroupState, index: int) -> torch.Tensor:
        s = gs.slots[index]
        if s.native_home is not None:
            v = s.native_home.values
            assert v is not None, "a dropped slot has no home region"
            return v.reshape(-1).view(torch.uint8) if v.dtype != torch.uint8 else v.reshape(-1)
        assert gs.home is not None
        return gs.home.regions(gs.layout)[index]

    def _writable_home(self, gs: GroupState, rewriting: set[int]) -> HostBlock:
        """The group's home, private to it (copy-on-write) and free of pending host readers.

        Native slots being rewritten leave their framework copy: their values
        will now live in our home.
        """
        for s in gs.slots:
            if s.key in rewriting:
                _disown(s)
        if gs.home is None:
            gs.home = self.pool.acquire(gs.layout.total)
        elif gs.home.shared:
            old = gs.home
            gs.home = self.pool.acquire(gs.layout.total)
            carry = [
                i
                for i, s in enumerate(gs.slots)
                if s.residency is Residency.HOST and s.native_home is None and s.key not in rewriting
            ]
            if carry:
                old.sync()
                for i in carry:
                    gs.layout.region(gs.home.data, i).copy_(gs.layout.region(old.data, i))
            self.pool.release(old)
        gs.home.sync()
        return gs.home

    def _sync_host_sources(self, pairs: list[Pair], names: Iterable[str], snapshot: Snapshot | None = None) -> None:
        """Before host-to-host copies of groups ``names`` run on this thread, wait for device copies into their homes."""
        if not any(d.is_cpu and s.is_cpu for d, s in pairs):
            return
        for g in names:
            home = self._groups[g].home
            if home is not None:
                home.sync()
        if snapshot is not None:
            snapshot._transfer.wait()

    def _check_releasable(self, names: tuple[str, ...], only: Only) -> None:
        """Storage that cannot be resized cannot be released: fine on the host (it already is host
        memory, e.g. FSDP2's pinned shards under CPUOffloadPolicy: it stays where it is), an error
        on an accelerator -- raised before anything moves."""
        for g in names:
            for s in self._groups[g].slots:
                if s.residency is Residency.DEVICE and s.device.type != "cpu" and not s.releasable and _matches(s, only):
                    raise NotReleasableError(
                        s.name, f"its {s.device.type} storage is not resizable (allocated outside torch's caching "
                        "allocator?), so it cannot be released in place"
                    )

    def _stash_on_device(self, stash: str, groups: list[GroupState]) -> bool:
        if stash != "auto":
            return stash == "device"
        dev = self.engine.device
        if dev is None or not any(self._device_for(gs) == dev for gs in groups):
            return False
        need = sum(gs.layout.total for gs in groups)
        free, _ = torch.cuda.mem_get_info(dev)
        return free >= 2 * need

    def _device_for(self, gs: GroupState) -> torch.device:
        """Where a device-placed snapshot or stash of a group goes: the accelerator if the group lives there."""
        dev = self.engine.device
        if dev is not None and any(s.device.type == dev.type for s in gs.slots):
            return dev
        return torch.device("cpu")
