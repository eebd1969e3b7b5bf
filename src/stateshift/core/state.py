"""ModelState: a model's state as groups of slots, and the verbs that move it.

Verbs: ``offload``, ``onload``, ``drop``, ``snapshot``, ``restore``,
``swapped`` and ``release``. Each works in every residency and every mix of
residencies: a slot is ``device``, ``host`` or ``dropped``, and each verb
says what it does in each case -- there is no side attribute whose absence
could raise.

When results are safe to read: a verb returns without blocking the host on device copies (except with
``free_device_memory`` and ``offload(to="disk")``). Compute enqueued on the current stream after a verb is
ordered after that verb's copies, so the model may run (or be stepped) at once. Host memory written by a
verb (a snapshot's values, a home) is safe to read on the host only after waiting: ``Snapshot.wait()`` or
the returned ``Transfer.wait()``.

An error changes nothing: each verb validates and allocates everything it
needs (pooled host blocks, device arenas) before it changes a residency, a
home or a byte of the model.

Threads: verbs on one ``ModelState`` are serialised by a lock, so a
rollout thread and a training thread may both call them; ``swapped()``
holds it on entry and exit, not while its body runs (verbs on the swapped
groups raise ``StateError("swap_active")`` meanwhile). Guarded forwards, backwards and
optimizer steps are readers of the state's ``ReaderGate`` (``locking.py``): a verb
waits for those running in other threads, and they wait for a running verb;
``offload``/``drop`` from inside one on its own thread raise
``StateError("inside_compute")``.

Direct touches: while any storage is released, every tensor operation on
it (not only the hooked ones) raises ``StateError("offloaded")`` (``touch.py``).

Homes: each group has one host arena (``home``) laid out like its
snapshots, taken from the pool the first time the group is offloaded and
kept for reuse. Homes and host snapshots share blocks copy-on-write: a
snapshot of a fully offloaded group, and a restore into one, move no bytes.

Shape: ``ModelState`` is the user's facade -- the verbs above plus
``residency``, ``nbytes``, ``stats``, ``layout``, ``plan_offload`` and
``close`` -- over an internal ``Core`` (``engine.py``) that holds the slot
table, the tiers (``tiers.py``: device, host, dropped, disk) and the lock.
What the libraries on the engine need beyond the verbs (slots, layouts, ``snapshot_from``, ``check_restore``,
the pool, the snapshot store) is the core's internal API, reached with ``core_of(state)`` (``engine.py``).

Lifetime: the guard hooks a ``ModelState`` installs on the model hold it, so it lives as long as the model;
one built with ``guard=False`` keeps itself alive while it holds offloaded values, until ``close()``.
``close()`` brings offloaded values back to the device before it gives the homes up.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch

from . import verbs
from .disk import DISK_WINDOW, OffloadPlan
from .engine import Core, GroupArg, core_of
from .groups import Only
from .layout import Layout
from .locking import Guard, locked, verb_scope
from .pool import HostPool, PoolStats
from .slot import Residency, storage_key
from .snapshot import Placement, Snapshot
from .source import Source, detect
from .swap import swap_in, swap_out
from .transfer import Transfer

__all__ = ["GroupArg", "ModelState", "core_of"]
_log = logging.getLogger("stateshift")

#: states built with ``guard=False`` that hold offloaded values: kept alive until ``close()``
_KEEP_ALIVE: set[ModelState] = set()
#: every open state, for ``ModelState.owner``
_OPEN: weakref.WeakSet[ModelState] = weakref.WeakSet()


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
        snapshot_budget_bytes: byte budget of the state's snapshot store (every snapshot it holds).
        guard: install hooks that raise ``StateError("offloaded")`` when compute
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
            ``StateError("address_stable")`` without it). A group becomes address-stable
            the first time it is onloaded, and then moves whole. Accepted with
            a warning, and a no-op, on a machine without CUDA. See ``stable.py``.
        disk_dir: where ``offload(..., to="disk")`` keeps values: one scratch file per state
            in this directory, removed on ``close()`` and at exit (``disk.py``); opened with
            ``O_DIRECT`` where the filesystem allows it, buffered otherwise (``describe_disk()``).
        disk_window_bytes: each of the two pinned staging windows disk transfers go through
            (host memory a disk offload uses: twice this, whatever it moves).

    Raises:
        ValueError: ``disk_window_bytes`` below one byte.
        ObjectError("backend"): no backend knows the model (detection).
        StateError("address_stable"): ``address_stable=True`` without ``torch_memory_saver`` on a CUDA machine.
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
        sources = list(backends) if backends is not None else detect(model, optimizer)
        self._core = core = Core(
            sources,
            pool if pool is not None else HostPool(pin=pin),  # type: ignore[arg-type]
            device,
            snapshot_budget_bytes=snapshot_budget_bytes,
            guarded=guard,
            free_device_memory=free_device_memory,
            address_stable=address_stable,
            disk_dir=None if disk_dir is None else os.fspath(disk_dir),
            disk_window_bytes=disk_window_bytes,
            facade=self,
        )
        #: the decisions of the last ``offload(..., to="auto")``
        self.last_offload_plan: OffloadPlan | None = None
        try:
            core.table.refresh()
        except BaseException:
            core.table.close()
            raise
        if guard:
            for b in sources:
                core.handles.extend(b.install_guards(Guard(core.check_resident, core.gate)))
        _OPEN.add(self)
        core.publish_released()  # (a framework may have released storage before: Megatron's own offload)

    @classmethod
    def owner(cls, tensor: torch.Tensor) -> ModelState | None:
        """The open ``ModelState`` that tracks ``tensor``'s storage (e.g. one whose reference was lost
        while it held offloaded values: it is kept alive, and this gets it back), or ``None``."""
        t = getattr(tensor, "_local_tensor", tensor)  # a DTensor's storage is its local shard's
        key = storage_key(t)
        return next((s for s in list(_OPEN) if not s.closed and key in s._core.table.slots), None)

    # -- read-only facts --------------------------------------------------------------------------------
    @property
    def groups(self) -> tuple[str, ...]:
        """The group names, in order (``params``, ``grads``, ``optim``, ... as the backends list them)."""
        return self._core.names

    @property
    def forward_groups(self) -> tuple[str, ...]:
        """The groups the forward pass reads (``snapshot()``'s default)."""
        return self._core.forward

    @property
    def backends(self) -> list[Source]:
        """The backends that list the model's tensors."""
        return self._core.backends

    @property
    def disk_dir(self) -> str | None:
        """The disk tier's directory (``None``: no disk tier)."""
        return self._core.disk_dir

    @property
    def free_device_memory(self) -> bool:
        """Whether ``offload`` and ``drop`` hand released device memory back to the driver (settable)."""
        return self._core.device.free_memory

    @free_device_memory.setter
    def free_device_memory(self, value: bool) -> None:
        self._core.device.free_memory = value

    @property
    def swapping(self) -> frozenset[str]:
        """The groups a ``swapped()`` context holds right now."""
        return frozenset(self._core.swapping)

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def stats(self) -> PoolStats:
        """The pinned host pool's counters (bytes in use, held, allocated; shared by states sharing a pool)."""
        return self._core.pool.stats

    @locked
    def residency(self) -> dict[str, dict[str, int]]:
        """Per group, how many slots are ``device`` / ``host`` / ``dropped`` (and ``disk``, with a disk tier).

        Returns:
            group -> residency name -> slot count.
        """
        core = self._core
        core.table.refresh()
        hide = () if core.disk_dir is not None else (Residency.DISK.value,)  # a state without a disk tier reports three
        return {g: {k: n for k, n in gs.counts().items() if k not in hide} for g, gs in core.groups.items()}

    @locked
    def nbytes(self, groups: GroupArg = None) -> int:
        """Bytes of the slots of ``groups`` (default all), wherever they live.

        Raises:
            LayoutError("unknown_group"): a name is not a group of this state.
        """
        return sum(s.nbytes for gs in self._core.listed(groups, check_swap=False) for s in gs.slots)

    @locked
    def layout(self, group: str) -> Layout:
        """The group's layout now: names, shapes, dtypes and offsets of its slots (a snapshot's fingerprint).

        Raises:
            LayoutError("unknown_group"): ``group`` is not a group of this state.
        """
        return self._core.layouts(group)[group]

    def describe_disk(self) -> str | None:
        """The disk home in use: its file, its I/O mode (``O_DIRECT`` or ``buffered``) and why, and the
        bytes each mode moved; ``None`` while nothing went to disk (the file is made on first use)."""
        return self._core.disk.describe()

    # -- verbs ------------------------------------------------------------------------------------------
    @locked
    def offload(
        self, groups: GroupArg = None, *, only: Only = None, to: Literal["host", "disk", "auto"] = "host"
    ) -> Transfer:
        """Copy device-resident slots to their homes and release their device storage.

        ``to="host"``: into pinned host homes; ``host`` and ``disk`` slots stay
        as they are. ``to="disk"``: into the state's disk home (``disk_dir``),
        host-resident slots too (their host memory goes back to the pool);
        done when this returns (the copies went through the staging windows).
        ``to="auto"``: as ``plan_offload`` decides (host while the pool's budget
        holds, disk beyond), the decision logged and kept in ``last_offload_plan``.
        ``dropped`` slots stay dropped. With ``free_device_memory`` (the default)
        the released memory goes back to the driver before this returns (see ``__init__``).

        Args:
            groups: a group name, several, or ``None`` for every group.
            only: member names (or a predicate) selecting the slots to move; ``None``: all.
            to: ``"host"``, ``"disk"`` or ``"auto"``.

        Returns:
            The transfer; a host home is safe to read on the host after its ``wait()``.

        Raises:
            LayoutError("unknown_group"): a name is not a group of this state.
            StateError("swap_active"): a group is inside a ``swapped()`` context.
            StateError("not_releasable"): an accelerator slot's storage cannot be resized (nothing moved).
            BudgetError("pool"): the homes do not fit the pool's budget (nothing moved).
            DiskError("tier"): no ``disk_dir``, or a full disk (every value where it was).
            StateError("inside_compute"): called from inside a guarded forward or step on this thread.
            ValueError: ``to`` is none of the three (nothing moved).
        """
        transfer, plan = verbs.offload(self._core, groups, only, to)
        if plan is not None:
            self.last_offload_plan = plan
        self._keep_alive()
        return transfer

    @locked
    def plan_offload(
        self, groups: GroupArg = None, *, only: Only = None, host_budget_bytes: int | None = None
    ) -> OffloadPlan:
        """Where ``offload(groups, to="auto")`` would put each group, and the host memory it would hold at its
        peak, decided before anything is allocated.

        Args:
            groups: a group name, several, or ``None`` for every group.
            only: the slots that would move (as ``offload``).
            host_budget_bytes: the host budget (default the pool's); the disk (``disk_dir``) takes the rest.

        Returns:
            An ``OffloadPlan``: a decision per group, the host peak and the bytes to disk.

        Raises:
            BudgetError("pool"): naming the group that fits nowhere.
        """
        return verbs.plan_offload(self._core, groups, only, host_budget_bytes)

    @locked
    def drop(self, groups: GroupArg = None, *, only: Only = None) -> None:
        """Release device storage without keeping values (``onload`` zero-fills). ``host`` slots become ``dropped`` too.

        Args:
            groups: a group name, several, or ``None`` for every group.
            only: the slots to drop; ``None``: all.

        Raises:
            LayoutError("unknown_group"): a name is not a group of this state.
            StateError("swap_active"): a group is inside a ``swapped()`` context, or read by an active context's rebuild.
            StateError("not_releasable"): an accelerator slot's storage cannot be resized (nothing dropped).
            StateError("inside_compute"): called from inside a guarded forward or step on this thread.
        """
        verbs.drop(self._core, groups, only)

    @locked
    def onload(self, groups: GroupArg = None, *, only: Only = None) -> Transfer:
        """Re-grow device storage and fill it: from the home (``host``), the disk (``disk``) or with zeros (``dropped``).

        The same tensor objects hold the values afterwards; compute enqueued
        after the call sees them.

        Args:
            groups: a group name, several, or ``None`` for every group.
            only: the slots to bring back; ``None``: every offloaded one.

        Returns:
            The transfer (device-side; nothing to wait for before compute).

        Raises:
            LayoutError("unknown_group"): a name is not a group of this state.
            StateError("swap_active"): a group is inside a ``swapped()`` context.
            DiskError("tier"): the disk cannot be read (the storage re-grown for it is released again).
        """
        transfer = verbs.onload(self._core, groups, only)
        if groups is None and only is None:
            _KEEP_ALIVE.discard(self)
        return transfer

    @locked
    def snapshot(
        self,
        groups: GroupArg = None,
        *,
        tag: str = "snapshot",
        version: int | None = None,
        placement: Placement = "host",
    ) -> Snapshot:
        """Copy the groups' current values, wherever they live, into a new snapshot.

        A snapshot under the same ``(tag, version)`` is replaced (released
        first, so its memory is reused). A host snapshot of a fully
        offloaded group shares the home's block instead of copying it.

        Args:
            groups: default: those the forward pass reads (params, buffers, ...).
            tag: the snapshot's name (e.g. ``"pi_old"``).
            version: an optional integer version.
            placement: ``"host"`` (pooled pinned memory), ``"device"``, or ``"disk"``
                (a span of the state's disk home, written before this returns; needs ``disk_dir``).

        Returns:
            The snapshot; its values are safe to read on the host after ``snapshot.wait()``.

        Raises:
            LayoutError("unknown_group"): a name is not a group of this state.
            BudgetError("snapshot"): the snapshot store's budget would be exceeded.
            BudgetError("pool"): the host blocks do not fit the pool's budget.
            DiskError("tier"): ``placement="disk"`` without ``disk_dir``, or a full disk (the old snapshot stays).
            ValueError: an unknown ``placement`` (nothing taken).
        """
        return verbs.snapshot(self._core, groups, tag, version, placement)

    @locked
    def restore(self, snapshot: Snapshot) -> Transfer:
        """Write the snapshot's values into its groups, wherever each slot lives now.

        ``device`` slots are written in place (no temporary full-size device
        tensor); ``host`` slots get the values in their home (a pointer copy
        when the whole group is offloaded); ``dropped`` slots become ``host``
        with the values. Slots on disk get the values in a new region,
        switched to only once every write succeeded.

        Args:
            snapshot: a snapshot of this state's groups.

        Returns:
            The transfer; a home it wrote is safe to read on the host after its ``wait()``.

        Raises:
            LayoutError("mismatch"): a group's layout differs (names the tensor; nothing changed).
            StateError("released"): the snapshot was released.
            StateError("swap_active"): a group is inside a ``swapped()`` context or read by its rebuild.
            BudgetError("pool"): private homes do not fit the pool's budget (nothing changed).
            DiskError("tier"): a full disk (nothing changed), or a disk snapshot that cannot be read part way
                (its groups' device and host slots partly restored: restore again once it reads).
        """
        transfer = verbs.restore(self._core, snapshot)
        self._keep_alive()
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

        ``device`` slots are stashed and overwritten; ``host`` and ``dropped``
        slots get device storage filled from the snapshot and are released
        again on exit, their homes untouched. Changes made inside (e.g. an
        optimizer step) are discarded. Other verbs on these groups raise
        ``StateError("swap_active")`` inside.

        Args:
            snapshot: a snapshot of this state's groups.
            rebuild: group -> a function that recomputes its current values on the device
                (e.g. bf16 params from the optimizer's fp32 master weights): that group's device
                slots are then not stashed, and on exit the function runs instead of copying the
                stash back -- after every other group has its own values back, with the tensors it
                declares in ``reads()`` made resident (``swap.py``). It must rewrite every
                device-resident slot of the group, on the current stream. Groups it reads cannot
                be dropped or restored inside the context.
            stash: where the current values wait. ``"device"`` costs device memory and moves them
                at device-copy speed; ``"host"`` uses a pooled pinned block and two PCIe crossings;
                ``"auto"`` takes the device when its free memory holds twice the stash, else the host.

        Returns:
            A context manager yielding ``snapshot``.

        Raises:
            ValueError: an unknown ``stash``.
            LayoutError("mismatch"): a group's layout differs (nothing changed).
            LayoutError("unknown_group"): a rebuild names a group outside the snapshot.
            StateError("swap_active"): a group is already inside a ``swapped()`` context.
        """
        if stash not in ("auto", "device", "host"):
            raise ValueError(f"stash must be 'auto', 'device' or 'host', not {stash!r}")
        core = self._core
        with verb_scope(core, "swapped"):
            swap = swap_in(core, snapshot, dict(rebuild or {}), stash)
        try:
            yield snapshot
        finally:
            swap_out(core, swap, snapshot)

    @locked
    def release(self, snapshot: Snapshot) -> None:
        """Forget the snapshot and give its memory back (to the pool, for host snapshots).

        Args:
            snapshot: a snapshot of this state (releasing it twice does nothing).
        """
        self._core.snapshots.discard(snapshot)

    def close(self) -> None:
        """Give the model back whole, then remove hooks, release snapshots and homes.

        Nothing is lost to a close and nothing is left released behind the
        removed guards: an active ``swapped()`` context is ended first (the
        model gets its own values back; the context's exit then does
        nothing), and every slot whose storage stateshift released is
        re-grown -- offloaded values come back to the device, dropped ones as
        zeros (``drop()`` before a close does not save device memory after
        it). Values kept in a framework's own host copy stay there.
        Idempotent; other verbs raise ``StateError("closed")`` afterwards.
        """
        core = self._core
        with core.lock:
            if core.closed:
                return
            with verb_scope(core, "close"):
                verbs.close(core)
        _KEEP_ALIVE.discard(self)
        _OPEN.discard(self)

    def _keep_alive(self) -> None:
        """A state without guard hooks (nothing else holds it) keeps itself alive while it holds values in homes."""
        if not self._core.guarded and self._core.holds_host_values():
            _KEEP_ALIVE.add(self)
