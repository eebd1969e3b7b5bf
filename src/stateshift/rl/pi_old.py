"""The pi_old cycle of fully-asynchronous PPO, moving the fewest bytes.

The pattern: pi_old (the policy that generated the rollouts) is fixed over
a cycle of N mini-batches; before each mini-batch the old log-probs are
computed under pi_old, then the *current* weights train on it. Done
naively (verl: 4 saves + 6 restores per cycle of 4) that is many full copies
through PCIe. Here:

- **one snapshot per cycle** (``begin``), taken wherever the params live
  (device-resident: one copy; offloaded: zero-copy from the home);
- **device placement when it fits** (``placement="auto"``): pi_old stays on
  the GPU the params live on and each swap is a device-to-device copy;
  otherwise host (pinned, pooled, reused by the next cycle). The decision
  follows where the state lives, not what the machine has: params on the
  CPU (a CPU model, even on a machine with CUDA) get ``host`` -- pooled CPU
  memory, which *is* their own device's memory, so every copy is host to
  host -- and a GPU's free memory is only consulted for params on that GPU;
- **no stash of the current weights when rebuilding them is cheaper**: a
  backend plug-in (``Rebuild``; Megatron: ``MasterRebuild``, bf16 params
  recomputed from the fp32 master shards on the device) replaces "copy out,
  copy back" with one cast on the device. That saves two PCIe crossings per
  swap when pi_old is on the host, and a stash's device memory; but each
  swap first checks that the params *are* the masters' cast (reads both,
  then a host sync), so with pi_old on the device and room for a device
  stash the stash is faster (it moves 6P device bytes against 5P plus the
  check, and never waits for the GPU) and ``rebuild="auto"`` stashes;
- **no swap for the first mini-batch** in ``run``: right after ``begin`` the
  current weights *are* pi_old.

Bytes per cycle of N mini-batches with params of P bytes on the device:
host placement ``P + (N-1)P`` through PCIe (plus, without a rebuild plug-in,
``2(N-1)P`` of stash traffic); device placement the same counts as
device-to-device copies (plus the stash's ``2(N-1)P`` when it stashes).
``CycleStats`` records what was moved, by where each copy really ran (a
slot's own device, the snapshot's own memory): for params on the CPU every
copy is host to host, whether or not the machine has a GPU.

When results are safe to read: as for ``ModelState.swapped`` -- the model
computes under pi_old inside ``old_policy()`` (compute enqueued there is
ordered after the swap's copies) and with its own weights after it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..backends.base import Rebuild
from ..core.engine import core_of
from ..core.ranks import on_every_rank
from ..core.slot import Residency
from ..core.snapshot import Snapshot
from ..core.state import ModelState
from ..errors import DiskError, LayoutError

CyclePlacement = Literal["auto", "host", "device", "disk"]


def find_rebuild(state: ModelState) -> Rebuild | None:
    """The first rebuild plug-in a backend of ``state`` offers (``backend.rebuild_plugin()``), if any."""
    for b in state.backends:
        make = getattr(b, "rebuild_plugin", None)
        plugin = make() if callable(make) else None
        if plugin is not None:
            return plugin
    return None


@dataclass
class CycleStats:
    """What the cycles so far did. Each copy counts its bytes once, by where it ran:
    ``pcie_bytes`` (device <-> host), ``device_bytes`` (device to device), ``host_bytes``
    (host to host); ``rebuild_bytes`` is what rebuilds read and wrote on the device. ``both_ways_bytes``
    (part of ``pcie_bytes``) is what a swap with a pinned host pi_old and stash sent out to the host while
    as many bytes of pi_old came in: the copy engine runs the two directions at once (``exchange``), so a
    bound may count those pairs at the bidirectional ceiling. A disk pi_old moves one way, then the other."""

    placement: str = ""
    cycles: int = 0
    snapshots: int = 0
    swaps: int = 0
    skipped_swaps: int = 0
    rebuilds: int = 0
    stashed_bytes: int = 0
    pcie_bytes: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    rebuild_bytes: int = 0
    both_ways_bytes: int = 0
    fallbacks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def default_groups(state: ModelState) -> tuple[str, ...]:
    """The forward groups that training changes (backends may mark some ``static_groups``, e.g. frozen weights)."""
    static = {g for b in state.backends for g in getattr(b, "static_groups", ())}
    return tuple(g for g in state.forward_groups if g not in static)


class PiOldCycle:
    """pi_old over a cycle of mini-batches: ``begin``, then ``old_policy()`` per mini-batch, then ``end``.

    Args:
        state: the model's ``ModelState``.
        groups: what pi_old holds (default: ``default_groups(state)``, e.g.
            ``params`` and ``buffers`` -- MoE ``expert_bias`` included --
            but not frozen weights).
        placement: ``"auto"`` (device if the params live on the copy engine's
            GPU and the snapshot fits in that GPU's free memory with
            ``device_headroom_bytes`` to spare, else host while the pool's
            budget holds it, else disk when the state has a disk tier; params
            on the CPU: host, i.e. CPU memory), ``"host"``, ``"device"`` or
            ``"disk"`` (the state's ``disk_dir``). An explicit
            ``"device"`` is honoured as ``ModelState.snapshot`` places it: on
            the copy engine's accelerator (``core_of(state).engine.device``; the CPU when
            there is none), so for a CPU model on a CUDA machine it costs GPU
            memory and PCIe copies -- ``"auto"`` never picks that. Pass
            ``ModelState(..., device=torch.device("cpu"))`` to keep a CPU model
            off the GPU altogether.
        rebuild: ``"auto"`` (the plug-in a backend offers, used where it is
            the cheaper way back: pi_old on the host or disk, or on the device
            without room for a device stash), ``None`` (always stash), or a
            ``Rebuild`` (used at every swap where it is exact).
        device_headroom_bytes: GPU memory that must stay free after placing
            pi_old on the device (default: max(1 GiB, 5% of the device)).
        tag: the snapshot's tag in ``core_of(state).snapshots``.
    """

    def __init__(
        self,
        state: ModelState,
        *,
        groups: Iterable[str] | None = None,
        placement: CyclePlacement = "auto",
        rebuild: Rebuild | Literal["auto"] | None = "auto",
        device_headroom_bytes: int | None = None,
        tag: str = "pi_old",
    ) -> None:
        if placement not in ("auto", "host", "device", "disk"):
            raise ValueError(f"placement must be 'auto', 'host', 'device' or 'disk', not {placement!r}")
        if placement == "disk" and state.disk_dir is None:
            raise DiskError("tier", "placement='disk' needs a state with a disk tier: ModelState(..., disk_dir=...)")
        self.state = state
        self.groups = tuple(groups) if groups is not None else default_groups(state)
        unknown = [g for g in self.groups if g not in state.groups]
        if unknown:
            raise LayoutError("unknown_group", group=unknown[0], valid=state.groups)  # now, not at the first swap
        self.placement = placement
        self.rebuild: Rebuild | None = find_rebuild(state) if rebuild == "auto" else rebuild  # type: ignore[assignment]
        if self.rebuild is not None and not isinstance(self.rebuild, Rebuild):
            raise TypeError(f"rebuild must be 'auto', None or a Rebuild, not {type(self.rebuild).__name__}")
        self._rebuild_auto = rebuild == "auto"
        self._rebuilding = self.rebuild is not None  # this cycle's swaps rebuild (decided by begin())
        self.device_headroom_bytes = device_headroom_bytes
        self.tag = tag
        self.stats = CycleStats()
        self._snapshot: Snapshot | None = None
        self._warned: set[str] = set()
        self._listing: dict[str, list[Any]] | None = None  # the groups' slots while begin() runs

    # -- the cycle ------------------------------------------------------------------------
    @property
    def snapshot(self) -> Snapshot:
        if self._snapshot is None or self._snapshot.released:
            raise RuntimeError("no pi_old: call begin() first")
        return self._snapshot

    def state_device(self) -> torch.device | None:
        """The one accelerator the groups' slots live on (resident or not); the CPU if none does.

        ``None`` when they span several accelerators. A slot's device is its
        storage's own (an offloaded slot keeps it), never the copy engine's.
        """
        devices = {s.device for g in self.groups for s in self._slots(g)}
        accelerators = {d for d in devices if d.type != "cpu"}
        if not accelerators:
            return torch.device("cpu")
        return accelerators.pop() if len(accelerators) == 1 else None

    def choose_placement(self) -> Literal["host", "device", "disk"]:
        """Where pi_old goes this cycle: ``device`` when it fits (with headroom), else ``host`` when the
        pool's budget holds it, else ``disk`` (when the state has a disk tier).

        Based on where the state lives (``state_device``) and on the free
        memory of *that* device: params on the CPU -> not ``device`` (CPU memory
        is their own); on a GPU -> ``device`` if that GPU is the copy engine's
        (device snapshots and stashes are allocated there) and has room for
        pi_old and the stash of each swap (or, with a rebuild plug-in, for
        pi_old and the stash of the groups it does not rebuild). This rank's
        own answer: ``begin()`` also asks the other ranks whether each has room
        for a stash (with data parallelism they must all rebuild or all stash).
        """
        return self._decide()[0]

    @property
    def rebuilding(self) -> bool:
        """Whether the swaps of the cycle ``begin()`` started rebuild ``rebuild.group`` (where exact) or stash it."""
        return self._rebuilding

    def _decide(self, agree: Callable[[bool], bool] = bool) -> tuple[Literal["host", "device", "disk"], bool]:
        """This cycle's placement, and whether its swaps rebuild (``rebuild``'s docstring says when).

        ``agree``: whether a flag holds on every rank. ``begin()`` passes ``on_every_rank``: with
        data parallelism the rebuild's check and all-gather are collectives, so the ranks must
        all rebuild or all stash, and each only knows its own GPU's memory. It is called on the
        same branch on every rank (the same placement and plug-in), never on the host or disk one.
        """
        plugin = self.rebuild is not None and self.rebuild.group in self.groups
        if self.placement in ("host", "disk"):
            return self.placement, plugin  # type: ignore[return-value]
        layouts = core_of(self.state).layouts(self.groups)
        need = sum(layout.total for layout in layouts.values())
        stashed = 2 * need  # pi_old, and each swap's stash of the current values
        rebuilt = stashed - (layouts[self.rebuild.group].total if plugin else 0)  # type: ignore[union-attr]
        asks = plugin and self._rebuild_auto  # stash or rebuild is the GPU's memory's call
        room = self._device_room() if asks or self.placement == "auto" else None
        stash = not plugin or (asks and agree(room is not None and room >= stashed))
        if self.placement == "device":  # (no room to ask -- a CPU engine, several GPUs -- : the plug-in)
            return "device", not stash
        if room is not None and room >= (stashed if stash else rebuilt):
            return "device", not stash
        host = rebuilt if plugin else stashed  # on the host the plug-in always pays: a stash crosses PCIe
        budget = core_of(self.state).pool.budget_bytes
        if (
            budget is None
            or core_of(self.state).pool.stats.in_use_bytes + host <= budget
            or self.state.disk_dir is None
        ):
            return "host", plugin
        return "disk", plugin

    def _device_room(self) -> int | None:
        """Bytes the state's GPU can still give this cycle (free, cached and unused, less the headroom);
        ``None`` when the groups do not live on the copy engine's CUDA device."""
        dev = self.state_device()
        if dev is None or dev.type != "cuda" or dev != core_of(self.state).engine.device:
            return None
        free, total = torch.cuda.mem_get_info(dev)
        free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return free - (
            self.device_headroom_bytes if self.device_headroom_bytes is not None else max(1 << 30, total // 20)
        )

    def begin(self, version: int | None = None) -> Snapshot:
        """Take pi_old from the current weights (replacing the previous cycle's). Returns at once (async copy)."""
        if self._snapshot is not None and not self._snapshot.released:
            self.state.release(self._snapshot)
        self._listing = self._list(self.groups)  # one listing for the placement and the accounting
        try:
            placement, self._rebuilding = self._decide(on_every_rank)
            self._snapshot = self.state.snapshot(self.groups, tag=self.tag, version=version, placement=placement)
            self._account_snapshot(placement)  # (as listed before it: a snapshot moves nothing between residencies)
        finally:
            self._listing = None
        self.stats.placement = placement
        self.stats.snapshots += 1
        self.stats.cycles += 1
        return self._snapshot

    @contextmanager
    def old_policy(self) -> Iterator[Snapshot]:
        """Inside, the model computes with pi_old; after, with exactly its current weights again."""
        snap = self.snapshot
        slots = self._list(snap.groups)  # one listing for the checks and the accounting below
        rebuild: dict[str, Callable[[], None]] = {}
        plugin = self.rebuild if self._rebuilding else None
        if (
            plugin is not None
            and plugin.group in snap.groups
            and any(s.residency is Residency.DEVICE for s in slots[plugin.group])
        ):
            why = plugin.available()
            if why is None:
                rebuild[plugin.group] = plugin
            else:
                self._fallback(f"stashing {plugin.group!r} instead of rebuilding it: {why}")
        self._account_swap(snap, rebuild, slots)
        # the current weights wait where pi_old lives (memory permitting; a disk pi_old: where they fit)
        stash = "auto" if snap.placement == "disk" else snap.placement
        with self.state.swapped(snap, rebuild=rebuild, stash=stash):
            yield snap
        self.stats.swaps += 1
        self.stats.rebuilds += bool(rebuild)

    def end(self) -> None:
        """Release pi_old (its memory goes back to the pool or the allocator, for the next cycle)."""
        if self._snapshot is not None:
            self.state.release(self._snapshot)
            self._snapshot = None

    def run(
        self,
        minibatches: Iterable[Any],
        old_fn: Callable[[Any], Any],
        train_fn: Callable[[Any], Any],
        *,
        version: int | None = None,
        skip_first: bool = True,
    ) -> list[Any]:
        """One whole cycle: for each mini-batch, ``old_fn(mb)`` under pi_old, then ``train_fn(mb)``.

        Returns the ``old_fn`` results. With ``skip_first`` the first
        mini-batch needs no swap (the current weights are pi_old until the
        first ``train_fn``) and a cycle of one mini-batch no snapshot at all.
        ``old_fn`` should not change the forward groups (compute under
        ``torch.no_grad()``): inside ``old_policy()`` such changes are
        discarded, in a skipped swap they would be kept.
        """
        batches: Sequence[Any] = list(minibatches)
        out: list[Any] = []
        if len(batches) > 1 or not skip_first:
            self.begin(version)
        try:
            for i, mb in enumerate(batches):
                if i == 0 and skip_first:
                    out.append(old_fn(mb))
                    self.stats.skipped_swaps += 1
                else:
                    with self.old_policy():
                        out.append(old_fn(mb))
                train_fn(mb)
        finally:
            self.end()
        return out

    # -- accounting -----------------------------------------------------------------------
    def _fallback(self, why: str) -> None:
        self.stats.fallbacks.append(why)
        logging.getLogger("stateshift").info("pi_old cycle: %s", why)
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"pi_old cycle: {why}", stacklevel=3)

    def _move(self, nbytes: int, src_device: bool, dst_device: bool) -> None:
        if src_device and dst_device:
            self.stats.device_bytes += nbytes
        elif src_device or dst_device:
            self.stats.pcie_bytes += nbytes
        else:
            self.stats.host_bytes += nbytes

    def _list(self, groups: Sequence[str]) -> dict[str, list[Any]]:
        """The groups' slots, by group, from one listing of them all (each listing walks the model)."""
        by: dict[str, list[Any]] = {g: [] for g in groups}
        for s in core_of(self.state).slots(groups):
            by[s.info.group].append(s)
        return by

    def _slots(self, group: str) -> list[Any]:
        """The group's slots: listed afresh, or as listed at the start of the ``begin()`` running now."""
        return self._listing[group] if self._listing is not None else core_of(self.state).slots(group)

    # Where each copy runs follows the tensors themselves: a slot's storage is on its own
    # device (``slot.device``: the CPU for a CPU model, even on a CUDA machine); homes and host
    # snapshots are CPU memory; a device snapshot or stash is where ModelState allocated it
    # (the copy engine's accelerator, else the CPU).

    def _device_snapshot_on_accelerator(self) -> bool:
        return core_of(self.state).engine.device is not None

    def _account_snapshot(self, placement: str) -> None:
        to_dev = placement == "device" and self._device_snapshot_on_accelerator()
        for g in self.groups:
            slots = self._slots(g)
            whole_home = (
                placement == "host"
                and slots
                and all(s.residency is Residency.HOST and s.native_home is None for s in slots)
            )
            for s in slots:
                if s.residency is Residency.DEVICE:
                    self._move(s.nbytes, _on_accelerator(s), to_dev)
                elif s.residency is Residency.HOST and not whole_home:
                    self._move(s.nbytes, False, to_dev)  # from the (CPU) home

    def _account_swap(
        self, snap: Snapshot, rebuild: dict[str, Callable[[], None]], slots: Mapping[str, list[Any]]
    ) -> None:
        for part in snap.parts:
            at_dev = part.device is not None and part.device.device.type != "cpu"
            # the stash waits where pi_old lives (``stash=snap.placement``: same device as the part)
            for s in slots[part.group]:
                on_dev = _on_accelerator(s)
                self._move(s.nbytes, at_dev, on_dev)  # write pi_old in
                if s.residency is Residency.DEVICE and part.group not in rebuild:
                    self.stats.stashed_bytes += s.nbytes
                    self._move(s.nbytes, on_dev, at_dev)  # stash out
                    if (
                        on_dev and part.host is not None and part.host.pinned
                    ):  # out to pinned host memory while pi_old comes in
                        self.stats.both_ways_bytes += s.nbytes  # (a disk part moves one way, then the other)
                    self._move(s.nbytes, at_dev, on_dev)  # and back
        for fn in rebuild.values():
            read, written = fn.nbytes() if hasattr(fn, "nbytes") else (0, 0)  # type: ignore[attr-defined]
            self.stats.rebuild_bytes += read + written


def _on_accelerator(slot: Any) -> bool:
    """Whether the slot's storage (when resident) is accelerator memory: its own device, not the engine's."""
    return slot.device.type != "cpu"
