"""The wide state machine's shared pieces: one rule set, several backends, two drivers.

``Machine`` holds a system under test (a model, its optimizer and a
``ModelState`` over them, with a host pool and a temporary checkpoint
directory) and a *reference*: an identical model + optimizer built the same
way that never moves. Each verb method takes explicit arguments, applies the
verb to the state under test, and -- only if it succeeded -- applies its
meaning to the reference and to the machine's model of residency, snapshots
and checkpoints:

========================  =====================================================
verb                      meaning for the reference / the model
========================  =====================================================
offload / onload          nothing / ``device`` <-> ``host`` (``only=`` subsets)
drop (every group)        the dropped slots' tensors become zeros
snapshot                  remember the reference's values (tags, versions,
                          ``host`` / ``device`` placement, replacement,
                          taken right after an offload: copy-on-write homes)
snapshot_from             the same, filled from the reference's bytes; a
                          failing ``fill`` must change nothing
restore                   write the remembered values in; ``dropped`` -> ``host``
enter_swap / exit_swap    ``swapped()`` entered in one step and left in a later
                          one (any verbs in between, nested swaps), every stash
                          placement, Megatron's master rebuild
pi_old                    snapshot, train, forward under the snapshot, go on
release / clear_snapshots the snapshot(s) released (async saves in flight too)
train                     one step on both (after ``onload``)
forward                   the same output; refused (``(StateError, "offloaded")``)
                          while a forward group is not resident
save / async_save / wait  remember the values of the saved groups per path
load                      write a checkpoint's values in; ``dropped`` -> ``host``
budget                    pool and snapshot-store budgets (tight ... none)
close_reopen              ``close()``, then a new ``ModelState`` on the model
native_offload / _reload  Megatron's own ``offload_to_cpu`` / ``reload_from_cpu``
========================  =====================================================

Invariants (``check``, after every step): every tensor of the state under
test (read through a snapshot, in whatever residency it is) equals the
reference bit for bit; every live snapshot still holds the values it was
taken with and every released one reads as released; the store holds exactly
the snapshots the machine expects (and ``get(tag)`` picks the highest
version); every slot's residency is the one the verbs asked for and
``residency()`` counts agree. A verb may raise only the errors it must
(``(StateError, "swap_active")``, ``(StateError, "released")``, ``(LayoutError, "checkpoint_mismatch")``)
or, under a budget, ``(BudgetError, "pool")`` / ``(BudgetError, "snapshot")``; after an
error the invariants above must hold *unchanged* (the reference was not
touched), no pooled block may have leaked and no checkpoint directory changed.

Drivers: ``hypothesis_machine`` builds a ``RuleBasedStateMachine`` whose rules
draw the same arguments (``spaces``); ``drive`` runs a seeded, weighted random
sequence (``WEIGHTS``; inside FSDP2 ranks every rank draws the same rules, and
the ranks agree before a collective whose entry depends on a per-rank outcome).

Short fixed sequences of the same rules are in ``test_verb_interactions.py``;
the machine steps around none of them.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from raises import raises_kind

from stateshift import BudgetError, CheckpointError, LayoutError, ModelState, Residency, StateError
from stateshift.backends import detect_backends
from stateshift.checkpoint import async_save, load, save
from stateshift.core.engine import core_of
from stateshift.core.pool import HostPool

DEVICE, HOST, DROPPED = Residency.DEVICE, Residency.HOST, Residency.DROPPED
#: the groups an optimizer step reads or writes: a step while one is swapped raises ``(StateError, "swap_active")``
STEPPED = frozenset({"params", "grads", "optim"})
Key = tuple[str, str]  # (group, slot name)


# ----------------------------------------------------------------------------- values


def listing(backends: Iterable[Any], groups: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Name -> live tensor of every entry the backends list (the reference's values, read directly)."""
    out: dict[str, torch.Tensor] = {}
    for b in backends:
        asked = [g for g in b.groups if groups is None or g in groups]
        if asked:
            b.prepare(asked)
            for g in asked:
                for e in b.entries(g):
                    out[e.name] = e.tensor
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaNs and signed zeros included), same dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def first_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    """The first name whose tensors are not bit-identical (or a note on differing names); None if all are."""
    if got.keys() != want.keys():
        return f"names differ: {sorted(got.keys() ^ want.keys())[:6]}"
    names = list(want)
    alike = all(got[k].dtype == want[k].dtype and got[k].shape == want[k].shape for k in names)
    if alike and (
        not names or torch.equal(torch.cat([bits(got[k]) for k in names]), torch.cat([bits(want[k]) for k in names]))
    ):
        return None
    for k in names:
        if not same(got[k], want[k]):
            return k
    raise AssertionError("unreachable: the concatenations differ but no tensor does")


# ----------------------------------------------------------------------------- targets


class Target:
    """One backend's model + optimizer: how to build (deterministically), train and list them."""

    name = "?"
    groups: tuple[str, ...] = ()
    #: ``only=`` arguments: member-name prefixes
    prefixes: tuple[str, ...] = ()
    #: offers Megatron's master rebuild (``state.backends[1].rebuild_plugin()``)
    rebuild = False
    #: offers Megatron's own offload (``native_offload`` / ``native_reload``)
    native = False
    #: checkpoint save/load are collectives (several ranks): see ``Machine.save``
    collective = False

    def build(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def train(self, model: Any, opt: Any, step: int) -> float:
        raise NotImplementedError

    def buffers(self, model: Any) -> list[Any]:
        """Megatron: the DDP's flat buffers (``native`` targets only)."""
        return []

    def forward(self, model: Any, step: int) -> torch.Tensor:
        """One forward in training mode (buffers updated in forward change; grad mode is the caller's)."""
        raise NotImplementedError


class TorchTarget(Target):
    """The tests' built-in GPT (``helpers.CountingGPT``: tied embedding, a persistent buffer) with Adam."""

    groups = ("params", "buffers", "grads", "optim")
    prefixes = ("blocks.0.", "blocks.1.", "tok.")

    def __init__(self, device: str | None = None) -> None:
        self.device = device or os.environ.get("STATESHIFT_TEST_DEVICE", "cpu")
        self.name = "torch" if self.device == "cpu" else f"torch-{self.device}"

    def build(self):
        from helpers import make, warm

        model, opt = make(self.device)
        warm(model, opt)
        return model, opt

    def train(self, model, opt, step):
        from helpers import train_step

        return train_step(model, opt, step)

    def forward(self, model, step):
        from helpers import batch

        return model(batch(model.cfg, step, device=self.device)[:, :-1])


class MegatronTarget(Target):
    """A configuration of the Megatron CPU fake (``fakes.mcore.setups.CONFIGS``)."""

    groups = ("params", "frozen", "buffers", "grads", "optim")
    prefixes = ("inp.", "moe.experts.", "out.", "expert_parallel_buffers.", "frozen.")
    rebuild = True
    native = True

    def __init__(self, config: str) -> None:
        self.config = config
        self.name = f"megatron-{config}"

    def build(self):
        from fakes.mcore import fake_train_step
        from fakes.mcore.setups import _x, build

        ddp, opt = build(self.config)
        fake_train_step(ddp, opt, _x(0))
        return ddp, opt

    def train(self, model, opt, step):
        from fakes.mcore import fake_train_step
        from fakes.mcore.setups import _x

        return fake_train_step(model, opt, _x(100 + step))

    def buffers(self, model):
        return list(model.buffers) + list(model.expert_parallel_buffers)

    def forward(self, model, step):
        from fakes.mcore.setups import _x

        return model(_x(100 + step))


def _fsdp2_suite():
    """``tests/backends/test_fsdp2.py`` (its model, builder and training step), imported once by path."""
    import importlib.util
    import sys

    name = "_fsdp2_suite_for_machines"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "backends" / "test_fsdp2.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


class FSDP2Target(Target):
    """``test_fsdp2.Net`` (tied weights, uneven and empty shards, a buffer) under ``fully_shard`` on gloo."""

    groups = ("params", "buffers", "grads", "optim")
    prefixes = ("blocks.0.", "embed.", "tiny")
    collective = True

    def __init__(self, offload_policy: bool = False) -> None:
        self.offload_policy = offload_policy
        self.name = "fsdp2" + ("-cpu-offload-policy" if offload_policy else "")
        self._mesh = None

    def build(self):
        suite = _fsdp2_suite()
        import torch.distributed as dist

        if self._mesh is None:
            self._mesh = suite.make_mesh("cpu", dist.get_world_size())
        model, opt = suite.build("cpu", self._mesh, offload=self.offload_policy)
        suite.train_step(model, opt, 0, "cpu")
        return model, opt

    def train(self, model, opt, step):
        return _fsdp2_suite().train_step(model, opt, 100 + step, "cpu")

    def forward(self, model, step):
        suite = _fsdp2_suite()
        return model(suite.ids_for(100 + step, "cpu"))


# ----------------------------------------------------------------------------- the machine's records


@dataclass(eq=False)
class Tracked:
    """A snapshot the machine took, the values it must hold, and whether the machine released it."""

    snap: Any
    values: dict[str, torch.Tensor]
    groups: tuple[str, ...]
    released: bool = False


@dataclass(eq=False)
class Frame:
    """An open ``swapped()`` context."""

    tracked: Tracked
    cm: Any
    groups: tuple[str, ...]
    was: dict[Key, Residency]
    outer: dict[str, torch.Tensor]
    rebuild: bool
    #: its slots whose values lived in the framework's own copy on entry (theirs again on exit)
    natives: frozenset[Key] = frozenset()


@dataclass(eq=False)
class Ckpt:
    values: dict[str, dict[str, torch.Tensor]]  # group -> name -> values
    #: call order of the save: saves are written in call order, ``latest`` names the last durable one
    seq: int = 0
    version: int | None = None
    step: str = ""

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(self.values)


@dataclass(eq=False)
class Pending:
    path: int
    ckpt: Ckpt
    handle: Any
    #: its staged snapshot was released (``snapshots.clear()``) while it was written: the write may be aborted
    abortable: bool = False
    #: the pooled bytes its writer may hold until it is done (its groups' layouts, padding included)
    holds: int = 0


class _FillFailed(RuntimeError):
    """A ``snapshot_from`` fill that fails (a disk read, say)."""


class _RaisedInside(RuntimeError):
    """An exception raised in the body of a ``swapped()`` context."""


Expected = type[BaseException] | tuple[type[BaseException], str]
"""An error a call may raise: a class, or a stateshift error class and its ``kind``."""


def _expected(e: BaseException, allowed: Iterable[Expected]) -> bool:
    return any(
        isinstance(e, a) if isinstance(a, type) else isinstance(e, a[0]) and getattr(e, "kind", None) == a[1]
        for a in allowed
    )


def _name(e: BaseException | Expected) -> str:
    """``ClassName`` or ``ClassName(kind)``."""
    if isinstance(e, tuple):
        return f"{e[0].__name__}({e[1]})"
    kind = getattr(e, "kind", None) if isinstance(e, BaseException) else None
    return type(e).__name__ + (f"({kind})" if kind else "") if isinstance(e, BaseException) else e.__name__


class Machine:
    """One state under test against its reference; see the module docstring."""

    def __init__(self, target: Target, tmpdir: str | None = None) -> None:
        self.target = target
        self.model, self.opt = target.build()
        self.ref_model, self.ref_opt = target.build()
        self.ref_backends = detect_backends(self.ref_model, self.ref_opt)
        self.pool = HostPool()
        self.state = ModelState(self.model, self.opt, pool=self.pool)
        self._own_tmp = tmpdir is None
        self.tmp = Path(tmpdir if tmpdir is not None else tempfile.mkdtemp(prefix="stateshift-machine-"))
        self.res: dict[Key, Residency] = {}
        self.native: set[Key] = set()
        self._load_structure()
        self.snaps: list[Tracked] = []
        self.stored: dict[tuple[str, int | None], Tracked] = {}
        self.frames: list[Frame] = []
        self.ckpts: dict[int, Ckpt] = {}
        self._seq = 0
        self.pending: list[Pending] = []
        self.step = 0
        self.steps = 0
        self.stats: Counter[str] = Counter()
        self._ref_plugin = None
        self._ref_live: dict[str, torch.Tensor] | None = None
        if target.rebuild:
            self._ref_plugin = self.ref_backends[1].rebuild_plugin()

    # -- structure ---------------------------------------------------------------------------
    def _load_structure(self) -> None:
        """Slot names, members and releasability from the state under test (its structure, not its residency)."""
        self.members: dict[Key, tuple[str, ...]] = {}
        self.releasable: dict[Key, bool] = {}
        self.group_of: dict[str, str] = {}
        for s in core_of(self.state).slots():
            key = (s.info.group, s.name)
            self.members[key] = tuple(m.name for m in s.info.members)
            self.releasable[key] = s.releasable
            self.res.setdefault(key, DEVICE)
            for m in s.info.members:
                self.group_of[m.name] = s.info.group

    def _keys(self, groups: Iterable[str], prefix: str | None = None) -> list[Key]:
        gs = set(groups)
        return [
            k
            for k, names in self.members.items()
            if k[0] in gs and (prefix is None or any(n.startswith(prefix) for n in names))
        ]

    def _names(self, groups: Iterable[str]) -> list[str]:
        return [n for k in self._keys(groups) for n in self.members[k]]

    @property
    def swapping(self) -> set[str]:
        return {g for f in self.frames for g in f.groups}

    # -- the reference -------------------------------------------------------------------------
    def ref(self, groups: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Name -> live tensor of the reference (the objects are listed again after every training step).

        FSDP2: the reference is resharded first, as every verb reshards the state under test (a write into
        the shards while the root is left unsharded by a forward would not reach the next forward)."""
        if self.target.collective:
            for b in self.ref_backends:
                b.prepare(set(b.groups))
        if self._ref_live is None:
            self._ref_live = listing(self.ref_backends)
        if groups is None:
            return self._ref_live
        gs = set(groups)
        return {n: t for n, t in self._ref_live.items() if self.group_of[n] in gs}

    def ref_clone(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        live = self.ref()
        return {n: live[n].detach().clone() for n in names}

    def ref_write(self, values: dict[str, torch.Tensor]) -> None:
        live = self.ref()
        with torch.no_grad():
            for n, v in values.items():
                live[n].copy_(v)

    def ref_zero(self, names: Iterable[str]) -> None:
        live = self.ref()
        with torch.no_grad():
            for n in names:
                live[n].zero_()

    # -- reading the state under test -------------------------------------------------------------
    @contextmanager
    def _unbudgeted(self) -> Iterator[None]:
        """The pool and snapshot budgets lifted for the duration (the machine's own reads must not fail)."""
        saved = (self.pool.budget_bytes, core_of(self.state).snapshots.budget_bytes)
        self.pool.budget_bytes = core_of(self.state).snapshots.budget_bytes = None
        try:
            yield
        finally:
            self.pool.budget_bytes, core_of(self.state).snapshots.budget_bytes = saved

    def read(self, groups: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Every member's values, wherever it lives (through a snapshot taken with the budgets lifted)."""
        with self._unbudgeted():
            snap = self.state.snapshot(tuple(groups) if groups is not None else self.state.groups, tag="_read")
            try:
                return snap.tensors()
            finally:
                self.state.release(snap)

    # -- calling a verb ------------------------------------------------------------------------
    def _dir_listing(self, path: int) -> list[tuple[str, int, float]]:
        root = self.tmp / f"ckpt{path}"
        if not root.exists():
            return []
        return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*"))

    def _call(
        self,
        verb: str,
        fn: Callable[[], Any],
        *,
        must: tuple[Expected, ...] = (),
        budget: bool = False,
        paths: Iterable[int] | None = None,
        may: tuple[Expected, ...] = (),
    ) -> tuple[bool, Any]:
        """Run ``fn``; (True, result) or (False, None) after an error it was allowed to raise.

        After an error: no pooled block leaked, no checkpoint directory changed
        (the value, residency and snapshot invariants are checked by ``check``
        against a reference and a model that were not touched). Pooled bytes
        in use may drop by what async saves under way had staged: their
        writer threads give it back when they finish, at any moment (and
        checkpoint verbs, ``paths`` given, collect finished saves first).
        """
        allowed: tuple[Expected, ...] = must + may
        if budget and self.pool.budget_bytes is not None:
            allowed += ((BudgetError, "pool"),)
        if budget and core_of(self.state).snapshots.budget_bytes is not None:
            allowed += ((BudgetError, "snapshot"),)
        in_use, allocations = self.pool.stats.in_use_bytes, self.pool.stats.allocations
        writing = sum(q.holds for q in self.pending if not q.handle.done())
        dirs = {p: self._dir_listing(p) for p in paths or () if not any(q.path == p for q in self.pending)}
        swapping = self.state.swapping
        try:
            out = fn()
        except Exception as e:
            if not _expected(e, allowed):
                raise
            self.stats[f"{verb}: {_name(e)}"] += 1
            now = self.pool.stats.in_use_bytes
            assert now == in_use or (paths is not None and now < in_use) or in_use - writing <= now < in_use, (
                f"{verb} raised {type(e).__name__} but pooled bytes in use went {in_use} -> {now} "
                f"({writing} staged by async saves under way)"
            )
            assert self.state.swapping == swapping, f"{verb} raised {type(e).__name__} and changed the open swaps"
            for p, before in dirs.items():
                assert self._dir_listing(p) == before, f"{verb} raised {type(e).__name__} and changed checkpoint {p}"
            return False, None
        if must:
            raise AssertionError(f"{verb} succeeded; it must raise one of {[_name(t) for t in must]}")
        self.stats[verb] += 1
        budget_bytes = self.pool.budget_bytes
        if (
            budget_bytes is not None
            and self.pool.stats.allocations > allocations
            and not (paths and self.target.collective)
        ):
            assert self.pool.stats.held_bytes <= budget_bytes, (
                f"{verb} allocated pooled memory past the budget: holds {self.pool.stats.held_bytes} > {budget_bytes}"
            )
        return True, out

    def _agree(self, flag: bool) -> bool:
        """Several ranks (FSDP2): whether ``flag`` holds on every rank -- a collective, so every rank asks.
        A verb may fail under a budget on one rank only (shards differ in size); collectives that follow
        (a forward's all-gather) must be entered by all ranks or none."""
        if not self.target.collective:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _conflict(self, groups: Iterable[str]) -> tuple[Expected, ...]:
        return ((StateError, "swap_active"),) if self.swapping.intersection(groups) else ()

    def _groups(self, groups: tuple[str, ...] | None) -> tuple[str, ...]:
        return tuple(self.state.groups) if groups is None else groups

    # -- verbs ------------------------------------------------------------------------------------
    def _only(self, prefix: str | None) -> Any:
        """``only=``: a predicate on names for ``"prefix"``, the collection of matching names for ``"names:prefix"``."""
        if prefix is None:
            return None
        if prefix.startswith("names:"):
            p = prefix.removeprefix("names:")
            return frozenset(n for names in self.members.values() for n in names if n.startswith(p))
        return lambda n: n.startswith(prefix)

    def _keys_only(self, groups: Iterable[str], prefix: str | None) -> list[Key]:
        return self._keys(groups, None if prefix is None else prefix.removeprefix("names:"))

    def offload(self, groups: tuple[str, ...] | None, prefix: str | None) -> None:
        names = self._groups(groups)
        only = self._only(prefix)
        ok, _ = self._call(
            "offload", lambda: self.state.offload(groups, only=only), must=self._conflict(names), budget=True
        )
        if ok:
            for k in self._keys_only(names, prefix):
                if self.res[k] is DEVICE and self.releasable[k]:
                    self.res[k] = HOST

    def onload(self, groups: tuple[str, ...] | None, prefix: str | None) -> None:
        names = self._groups(groups)
        only = self._only(prefix)
        ok, _ = self._call("onload", lambda: self.state.onload(groups, only=only), must=self._conflict(names))
        if ok:
            for k in self._keys_only(names, prefix):
                if self.res[k] is not DEVICE:
                    self.res[k] = DEVICE
                    self.native.discard(k)

    def drop(self, groups: tuple[str, ...] | None, prefix: str | None) -> None:
        names = self._groups(groups)
        must = self._conflict(names) or self._rebuild_read(names)
        only = self._only(prefix)
        ok, _ = self._call("drop", lambda: self.state.drop(groups, only=only), must=must)
        if ok:
            for k in self._keys_only(names, prefix):
                if self.res[k] is not DROPPED and self.releasable[k]:
                    self.res[k] = DROPPED
                    self.native.discard(k)
                    self.ref_zero(self.members[k])

    def snapshot(
        self, groups: tuple[str, ...] | None, tag: str, version: int | None, placement: str, offload_first: bool
    ) -> None:
        names = groups if groups is not None else tuple(self.state.forward_groups)
        if offload_first and placement == "host":
            self.offload(names, None)  # the pi_old pattern: a host snapshot then shares the homes copy-on-write
        ok, snap = self._call(
            "snapshot", lambda: self.state.snapshot(groups, tag=tag, version=version, placement=placement), budget=True
        )
        if self._everywhere(ok, lambda: self._unmake(snap, tag, version)):
            self._track(snap, names, tag, version)

    def _track(self, snap: Any, names: tuple[str, ...], tag: str, version: int | None) -> None:
        assert snap.groups == names and snap.key == (tag, version), (snap.groups, names, snap.key)
        tracked = Tracked(snap, self.ref_clone(self._names(names)), names)
        old = self.stored.get((tag, version))
        if old is not None:
            old.released = True
        self.stored[(tag, version)] = tracked
        self.snaps.append(tracked)

    def snapshot_from(self, groups: tuple[str, ...] | None, tag: str, version: int | None, fail: bool) -> None:
        """``snapshot_from`` filled with the reference's current bytes (or a ``fill`` that fails: nothing changed)."""
        names = self._groups(groups)
        ref = self.ref()

        def fill(part):
            if fail:
                raise _FillFailed("the source of the values failed")
            for i, info in enumerate(part.layout.slots):
                storage = ref[info.members[0].name].untyped_storage()
                part.region(i).copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (info.nbytes,), (1,)))

        ok, snap = self._call(
            "snapshot_from",
            lambda: core_of(self.state).snapshot_from(groups, fill, tag=tag, version=version),
            must=(_FillFailed,) if fail else (),
            budget=True,
        )
        if self._everywhere(ok, lambda: self._unmake(snap, tag, version)):
            self._track(snap, names, tag, version)

    def _unmake(self, snap: Any, tag: str, version: int | None) -> None:
        """Release a snapshot just taken; the one it replaced under its key was released by the engine then."""
        self.state.release(snap)
        old = self.stored.get((tag, version))
        if old is not None and old.snap.released:
            old.released = True
            del self.stored[(tag, version)]

    def _everywhere(self, ok: bool, undo: Callable[[], None]) -> bool:
        """Whether a verb succeeded on every rank (FSDP2); where it succeeded but not everywhere, ``undo`` it.

        A verb under a budget may fail on one rank only (shards differ in size). The ranks must go on with
        the same snapshots and swaps, or a later rule trains on one rank and not on another and the
        forward's all-gather waits for ever (a seed-7 walk of 1500 steps did).
        """
        everywhere = self._agree(ok)
        if ok and not everywhere:
            undo()
            self.stats["undone: not done on every rank"] += 1
        return everywhere

    def pi_old(self, stash: str, rebuild: bool, offload_after: bool) -> None:
        """The RL pattern: snapshot the forward groups, train, compute under the snapshot, go on (maybe offloaded)."""
        before = len(self.snaps)
        self.snapshot(None, "pi_old", None, "host", False)
        if not self._agree(len(self.snaps) > before):
            return  # refused under a budget (on some rank)
        self.train()
        depth = len(self.frames)
        self.enter_swap(0, stash, rebuild)
        if len(self.frames) > depth:  # on every rank (enter_swap agrees)
            self.forward(False)
            self.exit_swap()
        if offload_after:
            self.offload(None, None)

    def _pick(self, pick: int) -> Tracked | None:
        """A recent live snapshot for ``pick`` < 4 (if there is one), else a recent one, released or not."""
        live = [t for t in self.snaps if not t.released]
        pool = live if pick < 4 and live else self.snaps
        return pool[-1 - pick % len(pool)] if pool else None

    def restore(self, pick: int) -> None:
        t = self._pick(pick)
        if t is None:
            return
        must = ((StateError, "released"),) if t.released else self._conflict(t.groups) or self._rebuild_read(t.groups)
        ok, _ = self._call("restore", lambda: self.state.restore(t.snap), must=must, budget=True)
        if ok:
            self.ref_write(t.values)
            self._written(t.groups)

    def _written(self, groups: Iterable[str]) -> None:
        """After a restore or load: dropped slots hold the values in a home; the framework's copy is stale."""
        for k in self._keys(groups):
            if self.res[k] is DROPPED:
                self.res[k] = HOST
            if self.res[k] is not DEVICE:
                self.native.discard(k)

    def release(self, pick: int) -> None:
        t = self._pick(pick)
        if t is None:
            return
        self._call("release", lambda: self.state.release(t.snap))
        t.released = True
        if self.stored.get(t.snap.key) is t:
            del self.stored[t.snap.key]

    def enter_swap(self, pick: int, stash: str, rebuild: bool) -> None:
        """Enter ``swapped()`` of a recent snapshot; with several ranks, entered on all of them or on none."""
        depth = len(self.frames)
        self._enter_swap_here(pick, stash, rebuild)
        self._everywhere(len(self.frames) > depth, self.exit_swap)

    def _enter_swap_here(self, pick: int, stash: str, rebuild: bool) -> None:
        t = self._pick(pick)
        if t is None:
            return
        must = ((StateError, "released"),) if t.released else self._conflict(t.groups)
        fn, stashed = None, False
        if rebuild and self.target.rebuild and "params" in t.groups and not must:
            plugin = self.state.backends[1].rebuild_plugin()
            why = plugin.available()
            if why is None:
                assert self._rebuild_exact(), (
                    "available() says the rebuild is exact; the reference's changes the params"
                )
                fn = plugin
            elif "offloaded" in why and any(self.res[k] is not DEVICE for k in self._keys(("params",))):
                fn, stashed = plugin, True  # partly offloaded params: the engine stashes them instead (no rebuild)
                self.stats["rebuild: params offloaded (stashed)"] += 1
            else:
                self.stats["rebuild: not available"] += 1
        if not must:
            placement = core_of(self.state).stash_placement(t.groups, stash)
            # "auto" without CUDA: the host, unless the pool's budget cannot hold the stash (then the device, i.e. CPU memory)
            auto = ("host", "device") if torch.cuda.is_available() or self.pool.budget_bytes is not None else ("host",)
            assert placement in ((stash,) if stash != "auto" else auto), (stash, placement)
        cm = self.state.swapped(t.snap, rebuild={"params": fn} if fn is not None else None, stash=stash)
        ok, _ = self._call("enter_swap" + ("+rebuild" if fn else ""), cm.__enter__, must=must, budget=True)
        if not ok:
            return
        keys = self._keys(t.groups)
        frame = Frame(
            t,
            cm,
            t.groups,
            {k: self.res[k] for k in keys},
            self.ref_clone(self._names(t.groups)),
            fn is not None and not stashed,
            frozenset(k for k in keys if k in self.native),
        )
        self.ref_write(t.values)
        for k in keys:
            self.res[k] = DEVICE
        self.frames.append(frame)

    def _rebuild_exact(self) -> bool:
        """Would the reference's master rebuild give its current params back exactly?"""
        live = self.ref(["params"])
        before = {n: t.detach().clone() for n, t in live.items()}
        self._ref_plugin()
        exact = first_difference({n: t.detach() for n, t in live.items()}, before) is None
        self.ref_write(before)
        return exact

    def exit_swap(self, error: bool = False) -> None:
        """Leave the innermost ``swapped()``: normally, or with an exception raised in its body (which the
        context lets through, after giving the current values back all the same)."""
        if not self.frames:
            return
        frame = self.frames.pop()
        if error:
            inside = _RaisedInside("raised inside swapped()")

            def leave():
                try:
                    suppressed = frame.cm.__exit__(_RaisedInside, inside, None)
                except _RaisedInside as e:
                    assert e is inside, "swapped() replaced the body's exception"
                else:
                    assert not suppressed, "swapped() swallowed the body's exception"

            self._call("exit_swap (body raised)", leave)
        else:
            self._call("exit_swap", lambda: frame.cm.__exit__(None, None, None))
        self._left(frame)

    def _left(self, frame: Frame) -> None:
        """The reference after a context's exit: its own values and residencies back, and the framework's
        copies it had (one the framework made inside is forgotten)."""
        self.ref_write(frame.outer)
        self.res.update(frame.was)
        for k in frame.was:
            if k in frame.natives:
                self.native.add(k)
            else:
                self.native.discard(k)

    def _rebuild_read(self, names: Iterable[str]) -> tuple[Expected, ...]:
        """``drop``, ``restore`` and ``load`` of the masters an open rebuild reads raise ``(StateError, "swap_active")``."""
        return ((StateError, "swap_active"),) if "optim" in names and any(f.rebuild for f in self.frames) else ()

    def step_in_swap(self) -> None:
        """``optimizer.step()`` inside a swap of the state it steps: refused before it runs, nothing changed."""
        if not any("params" in f.groups for f in self.frames):
            return
        self._call("step_in_swap", self.opt.step, must=((StateError, "swap_active"), (StateError, "offloaded")))

    def train(self) -> None:
        if any(STEPPED.intersection(f.groups) for f in self.frames):
            self.stats["train: skipped (a step inside a swap of its state is refused: step_in_swap)"] += 1
            return
        outside = [g for g in self.state.groups if g not in self.swapping]
        if outside:
            self.onload(tuple(outside), None)
        self.step += 1
        loss = self.target.train(self.model, self.opt, self.step)
        ref_loss = self.target.train(self.ref_model, self.ref_opt, self.step)
        self._ref_live = None
        assert same(torch.tensor(loss), torch.tensor(ref_loss)), f"loss {loss} != reference {ref_loss}"
        self.stats["train"] += 1

    def forward(self, grad: bool) -> None:
        """A forward as the model is now: refused (``(StateError, "offloaded")``, nothing changed) when a forward
        group is not resident, else the same output as the reference's (in training mode, buffers updated
        in forward change on both)."""
        waiting = any(self.res[k] is not DEVICE for k in self._keys(self.state.forward_groups))
        if self.target.collective and not self._agree(not waiting):
            return  # one rank refusing while another all-gathers would hang (ranks differ after budget errors)
        self.step += 1
        try:
            with torch.set_grad_enabled(grad):
                ok, out = self._call(
                    "forward",
                    lambda: self.target.forward(self.model, self.step),
                    must=((StateError, "offloaded"),) if waiting else (),
                )
                if ok:
                    want = self.target.forward(self.ref_model, self.step)
                    assert same(out.detach(), want.detach()), "forward output differs from the reference's"
        finally:
            for m in (self.model, self.ref_model):
                m.train(True)

    # -- checkpoints -------------------------------------------------------------------------------
    def _path(self, path: int) -> Path:
        """A run directory: each save makes a fresh ``step-<n>`` in it and moves ``latest`` once durable."""
        return self.tmp / f"ckpt{path}"

    def save(
        self, groups: tuple[str, ...] | None, path: int, mode: str, version: int | None, again: bool = False
    ) -> None:
        names = groups if groups is not None else tuple(g for g in self.state.groups if g != "grads")
        if again and path in self.ckpts and mode == "sync":
            # checkpoints are never overwritten: the same directory again raises, nothing changes
            step = self.ckpts[path].step
            exists = (FileExistsError, (CheckpointError, "write")) if self.target.collective else (FileExistsError,)
            self._call(
                "save (exists)",
                lambda: save(self.state, self._path(path) / step, groups, tag="machine"),
                must=exists,
                budget=True,
                paths=[path],
            )
            return
        self._seq += 1
        ckpt = Ckpt({g: self.ref_clone(self._names([g])) for g in names}, self._seq, version, f"step-{self._seq}")
        write = save if mode == "sync" else async_save

        def call():
            return write(
                self.state, self._path(path) / ckpt.step, groups, tag="machine", version=version, update_latest=True
            )

        # with several ranks, a budget error on one rank makes the others raise (CheckpointError, "write")
        may = ((CheckpointError, "write"),) if self.target.collective else ()
        ok, handle = self._call(mode + "_save", call, budget=True, paths=[path], may=may)
        if ok:
            if mode == "sync":
                self._saved(path, ckpt)
            else:
                holds = sum(self.state.layout(g).total for g in names)
                self.pending.append(Pending(path, ckpt, handle, holds=holds))

    def wait_saves(self) -> None:
        while self.pending:
            p = self.pending[0]  # (still pending while it is waited for: what it staged may go back meanwhile)
            # an aborted write raises (StateError, "released"); with several ranks, the others (CheckpointError, "write")
            aborted = (
                ((StateError, "released"), (CheckpointError, "write"))
                if self.target.collective
                else ((StateError, "released"),)
            )
            try:
                ok, _ = self._call("wait_save", p.handle.wait, may=aborted if p.abortable else ())
            finally:
                self.pending.remove(p)
            if ok:
                self._saved(p.path, p.ckpt)

    def _saved(self, path: int, ckpt: Ckpt) -> None:
        if path not in self.ckpts or self.ckpts[path].seq < ckpt.seq:
            self.ckpts[path] = ckpt

    def load(self, path: int, groups: tuple[str, ...] | None) -> None:
        if any(q.path == path for q in self.pending):
            self.wait_saves()
        ckpt = self.ckpts.get(path)
        if ckpt is None:
            return
        names = ckpt.groups if groups is None else groups
        bad = [g for g in names if g not in ckpt.values]
        must = ((LayoutError, "checkpoint_mismatch"),) if bad else self._conflict(names) or self._rebuild_read(names)

        # with several ranks, an error on one rank (a budget) makes the others raise CheckpointError
        may = (CheckpointError,) if self.target.collective else ()
        ok, manifest = self._call(
            "load", lambda: load(self.state, self._path(path), groups), must=must, budget=True, paths=[path], may=may
        )
        if ok:
            assert (manifest.tag, manifest.version) == ("machine", ckpt.version), (
                manifest.tag,
                manifest.version,
                ckpt.version,
            )
            for g in names:
                self.ref_write(ckpt.values[g])
            self._written(names)

    def clear_snapshots(self) -> None:
        """``core_of(state).snapshots.clear()``: every snapshot released, async saves being written included (aborted,
        or finished first: either way the checkpoint at their path is a whole one)."""
        self._call("clear_snapshots", core_of(self.state).snapshots.clear)
        for t in self.snaps:
            t.released = True
        self.stored.clear()
        for p in self.pending:
            p.abortable = True

    # -- budgets, close --------------------------------------------------------------------------
    def budget(self, pool: str | None, snaps: str | None) -> None:
        total = self.state.nbytes()
        levels = {None: None, "tight": 0, "some": total // 2, "roomy": 3 * total}
        self.pool.budget_bytes = None if pool is None else self.pool.stats.in_use_bytes + levels[pool]
        core_of(self.state).snapshots.budget_bytes = (
            None if snaps is None else core_of(self.state).snapshots.nbytes + levels[snaps]
        )
        self.stats[f"budget {pool}/{snaps}"] += 1

    def close_reopen(self, pool: str) -> None:
        """``close()``, check it, then a new ``ModelState`` on the same objects (with the same pool or a ``"new"`` one)."""
        state = self.state
        for p in self.pending:
            p.abortable = True  # close() releases the snapshots an async save is writing
        state.close()  # open swaps are ended (each frame's own values come back)
        assert state.closed
        while self.frames:
            frame = self.frames.pop()
            self._call("exit_swap (after close)", lambda: frame.cm.__exit__(None, None, None))  # noqa: B023 - a no-op now; called at once
            self._left(frame)
        self.wait_saves()
        for (
            k,
            r,
        ) in self.res.items():  # close() re-grows everything it released: offloaded values back, dropped as zeros
            if r is not DEVICE and k not in self.native:
                self.res[k] = DEVICE
        for verb in (lambda: state.offload(), lambda: state.onload(), lambda: state.snapshot(tag="x"), state.residency):
            with raises_kind(StateError, "closed"):
                verb()
        if self.snaps:
            with pytest.raises(StateError, check=lambda e: e.kind in ("closed", "released")):
                state.restore(self.snaps[-1].snap)
        for t in self.snaps:
            t.released = True
        self.stored.clear()
        # the model holds its values on the device, read straight from its tensors -- but for values
        # that live in Megatron's own host copy (its offload_to_cpu): those stay there (documented)
        framework = {n for k in self.native for n in self.members[k]}
        direct = {
            n: t.detach() for n, t in listing(detect_backends(self.model, self.opt)).items() if n not in framework
        }
        for name, t in direct.items():
            assert t.numel() == 0 or t.untyped_storage().nbytes() > 0, f"{name} has no storage after close()"
        diff = first_difference(direct, {k: v.detach() for k, v in self.ref().items() if k not in framework})
        assert diff is None, f"after close(), the model's own tensors differ from the reference at {diff}"
        assert self.pool.stats.in_use_bytes == 0, f"close() left {self.pool.stats.in_use_bytes} pooled bytes in use"
        budget = core_of(state).snapshots.budget_bytes
        if pool == "new":
            self.pool = HostPool()
        self.state = ModelState(self.model, self.opt, pool=self.pool, snapshot_budget_bytes=budget)
        for k in self.res:
            if k not in self.native:  # the new state adopts the framework's copies again
                self.res[k] = DEVICE
        self.stats["close_reopen"] += 1

    # -- Megatron's own offload ------------------------------------------------------------------
    def _buffer_keys(self, index: int) -> tuple[list[Key], list[Key]]:
        bufs = self.target.buffers(self.model)
        b = bufs[index % len(bufs)]
        attr = "buffers" if any(b is x for x in self.model.buffers) else "expert_parallel_buffers"
        j = [i for i, x in enumerate(getattr(self.model, attr)) if x is b][0]
        params = [k for k in self.members if k == ("params", f"{attr}.{j}.param_data")]
        grads = [k for k in self.members if k == ("grads", f"{attr}.{j}.grad_data")]
        return params, grads

    def native_offload(self, buffer: int, params: bool, grads: bool) -> None:
        if not self.target.native:
            return
        bufs = self.target.buffers(self.model)
        b = bufs[buffer % len(bufs)]
        pkeys, gkeys = self._buffer_keys(buffer)
        self._call("native_offload", lambda: b.offload_to_cpu(move_params=params, move_grads=grads))
        if params:
            for k in pkeys:
                if self.res[k] is DEVICE:
                    self.res[k] = HOST
                    self.native.add(k)
        if grads:
            for k in gkeys:
                if self.res[k] is DEVICE:
                    self.res[k] = DROPPED
                    self.native.add(k)
                    self.ref_zero(self.members[k])

    def native_reload(self, buffer: int) -> None:
        if not self.target.native or self.swapping.intersection({"params", "grads"}):
            return
        bufs = self.target.buffers(self.model)
        b = bufs[buffer % len(bufs)]
        pkeys, gkeys = self._buffer_keys(buffer)
        self._call("native_reload", b.reload_from_cpu)
        for k in pkeys + gkeys:
            if k in self.native:
                self.res[k] = DEVICE
                self.native.discard(k)

    # -- invariants --------------------------------------------------------------------------------
    def check(self) -> None:
        self.steps += 1
        got = self.read()
        want = self.ref()
        diff = first_difference(got, {k: v.detach() for k, v in want.items()})
        assert diff is None, f"{self.target.name}: divergence from the reference at {diff}"
        for t in self.snaps:
            if t.released:
                assert t.snap.released, f"snapshot {t.snap.key} should have been released"
                continue
            assert not t.snap.released, f"snapshot {t.snap.key} was released behind the machine's back"
            t.snap.wait()
            diff = first_difference(dict(t.snap.views()), t.values)
            assert diff is None, f"live snapshot {t.snap.key} changed at {diff}"
        keys = {k for k in core_of(self.state).snapshots.keys() if not k[0].startswith("_")}  # noqa: SIM118 - iterating gives Snapshots
        assert keys == set(self.stored), f"store holds {sorted(keys, key=str)}, expected {sorted(self.stored, key=str)}"
        for tag in {k[0] for k in self.stored}:
            versions = [v for (t, v) in self.stored if t == tag and v is not None]
            want_key = (tag, max(versions)) if versions else (tag, None)
            assert core_of(self.state).snapshots.get(tag) is self.stored[want_key].snap, (
                f"get({tag!r}) is not {want_key}"
            )
        counts: dict[str, Counter[str]] = {g: Counter() for g in self.state.groups}
        for s in core_of(self.state).slots():
            key = (s.info.group, s.name)
            assert s.residency is self.res[key], f"{key} is {s.residency}, expected {self.res[key]}"
            counts[s.info.group][s.residency.value] += 1
            if s.nbytes > 0:
                released = s.storage.nbytes() == 0
                assert released == (s.residency is not DEVICE), (
                    f"{key} is {s.residency} with {s.storage.nbytes()} bytes of storage"
                )
        for g, c in self.state.residency().items():
            assert {r: n for r, n in c.items() if n} == {r: n for r, n in counts[g].items() if n}, (g, c, counts[g])
        assert self.state.swapping == frozenset(self.swapping)

    def teardown(self) -> None:
        try:
            while self.frames:
                self.exit_swap()
            self.wait_saves()
            for t in self.snaps:
                if not t.released:
                    self.state.release(t.snap)
            self.pool.budget_bytes = None
            core_of(self.state).snapshots.budget_bytes = None
            self.state.onload()
            self.state.close()
            assert self.pool.stats.in_use_bytes == 0, f"{self.pool.stats.in_use_bytes} pooled bytes leaked"
        finally:
            if self._own_tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
            _record(self)


# ----------------------------------------------------------------------------- argument spaces and drivers


def spaces(target: type[Target] | Target) -> dict[str, dict[str, list[Any]]]:
    """Every rule's arguments and their possible values (one definition for both drivers)."""
    G = tuple(target.groups)
    singles = [(g,) for g in G]
    some = [None, *singles, *itertools.combinations(G, 2)]
    whole = [None, *singles, ("params", "optim"), ("optim", "params"), G]
    prefixes = [None, None, *target.prefixes, f"names:{target.prefixes[0]}"]
    out: dict[str, dict[str, list[Any]]] = {
        "offload": {"groups": some, "prefix": prefixes},
        "onload": {"groups": some, "prefix": prefixes},
        "drop": {"groups": [*singles, *itertools.combinations(G, 2)], "prefix": prefixes},
        "snapshot": {
            "groups": whole,
            "tag": ["a", "b"],
            "version": [None, 1, 2],
            "placement": ["host", "device"],
            "offload_first": [False, True],
        },
        "snapshot_from": {"groups": whole, "tag": ["a", "b"], "version": [None, 1, 2], "fail": [False, True]},
        "pi_old": {"stash": ["auto", "device", "host"], "rebuild": [True, False], "offload_after": [False, True]},
        "restore": {"pick": list(range(5))},
        "release": {"pick": list(range(5))},
        "enter_swap": {"pick": list(range(5)), "stash": ["auto", "device", "host"], "rebuild": [False, True]},
        "exit_swap": {"error": [False, False, True]},
        "train": {},
        "save": {
            "groups": [None, *singles, G],
            "path": [0, 1],
            "mode": ["sync", "async"],
            "version": [None, 3],
            "again": [False, False, False, True],
        },
        "wait_saves": {},
        "load": {"path": [0, 1], "groups": [None, None, *singles]},
        "budget": {"pool": [None, "tight", "some", "roomy"], "snaps": [None, "tight", "some", "roomy"]},
        "forward": {"grad": [False, True]},
        "close_reopen": {"pool": ["same", "new"]},
        "clear_snapshots": {},
        "step_in_swap": {},
    }
    if target.native:
        out["native_offload"] = {"buffer": [0, 1], "params": [True, False], "grads": [True, False]}
        out["native_reload"] = {"buffer": [0, 1]}
    return out


#: how often the random driver picks each rule (relative)
WEIGHTS = {
    "offload": 6,
    "onload": 5,
    "drop": 3,
    "snapshot": 6,
    "restore": 5,
    "release": 2,
    "enter_swap": 4,
    "exit_swap": 4,
    "train": 5,
    "save": 3,
    "wait_saves": 2,
    "load": 3,
    "budget": 2,
    "close_reopen": 1,
    "native_offload": 2,
    "native_reload": 2,
    "forward": 3,
    "snapshot_from": 2,
    "pi_old": 2,
    "clear_snapshots": 1,
    "step_in_swap": 1,
}


def drive(machine: Machine, rng: random.Random, steps: int, log: Callable[[str], None] | None = None) -> None:
    """A seeded random sequence of ``steps`` rules, with ``check()`` after each (the same on every rank)."""
    space = spaces(machine.target)
    names = sorted(space)
    weights = [WEIGHTS[n] for n in names]
    machine.check()
    for i in range(steps):
        name = rng.choices(names, weights)[0]
        args = {p: rng.choice(opts) for p, opts in space[name].items()}
        if log is not None:
            log(f"{i}: {name}({', '.join(f'{k}={v!r}' for k, v in args.items())})")
        getattr(machine, name)(**args)
        machine.check()


def hypothesis_machine(name: str, variants: list[Callable[[], Target]], target_cls: type[Target]):
    """A ``RuleBasedStateMachine`` over ``Machine``: each example builds one of ``variants``, then runs rules."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

    sp = spaces(target_cls)

    def args(rule_name: str) -> dict[str, Any]:
        return {p: st.sampled_from(opts) for p, opts in sp[rule_name].items()}

    def built(self) -> bool:
        # The only precondition: whether a rule applies (a live snapshot, an open swap, a checkpoint) can
        # depend on timing (an async save aborted by a clear, or reaped before a budget is set), and
        # hypothesis needs the same draws to choose the same rules; rules that do not apply do nothing.
        return self.m is not None

    class Verbs(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.m: Machine | None = None

        @initialize(variant=st.sampled_from(range(len(variants))))
        def build(self, variant):
            self.m = Machine(variants[variant]())

        @precondition(built)
        @rule(**args("offload"))
        def offload(self, groups, prefix):
            self.m.offload(groups, prefix)

        @precondition(built)
        @rule(**args("onload"))
        def onload(self, groups, prefix):
            self.m.onload(groups, prefix)

        @precondition(built)
        @rule(**args("drop"))
        def drop(self, groups, prefix):
            self.m.drop(groups, prefix)

        @precondition(built)
        @rule(**args("snapshot"))
        def snapshot(self, groups, tag, version, placement, offload_first):
            self.m.snapshot(groups, tag, version, placement, offload_first)

        @precondition(built)
        @rule(**args("snapshot_from"))
        def snapshot_from(self, groups, tag, version, fail):
            self.m.snapshot_from(groups, tag, version, fail)

        @precondition(built)
        @rule(**args("pi_old"))
        def pi_old(self, stash, rebuild, offload_after):
            self.m.pi_old(stash, rebuild, offload_after)

        @precondition(built)
        @rule(**args("restore"))
        def restore(self, pick):
            self.m.restore(pick)

        @precondition(built)
        @rule(**args("release"))
        def release(self, pick):
            self.m.release(pick)

        @precondition(built)
        @rule(**args("enter_swap"))
        def enter_swap(self, pick, stash, rebuild):
            self.m.enter_swap(pick, stash, rebuild)

        @precondition(built)
        @rule(**args("exit_swap"))
        def exit_swap(self, error):
            self.m.exit_swap(error)

        @precondition(built)
        @rule()
        def train(self):
            self.m.train()

        @precondition(built)
        @rule(**args("save"))
        def save(self, groups, path, mode, version, again):
            self.m.save(groups, path, mode, version, again)

        @precondition(built)
        @rule()
        def wait_saves(self):
            self.m.wait_saves()

        @precondition(built)
        @rule(**args("load"))
        def load(self, path, groups):
            self.m.load(path, groups)

        # hypothesis favours the first rules and the simplest values: a budget, a clear or a close every
        # few steps would leave little else to test, so those act on one draw in eight (``chance == 7``)
        @precondition(built)
        @rule(chance=st.integers(0, 7), **args("budget"))
        def budget(self, chance, pool, snaps):
            if chance == 7 or pool is None and snaps is None:
                self.m.budget(pool, snaps)

        @precondition(built)
        @rule()
        def step_in_swap(self):
            self.m.step_in_swap()

        @precondition(built)
        @rule(**args("forward"))
        def forward(self, grad):
            self.m.forward(grad)

        @precondition(built)
        @rule(chance=st.integers(0, 7))
        def clear_snapshots(self, chance):
            if chance == 7:
                self.m.clear_snapshots()

        @precondition(built)
        @rule(chance=st.integers(0, 7), **args("close_reopen"))
        def close_reopen(self, chance, pool):
            if chance == 7:
                self.m.close_reopen(pool)

        if target_cls.native:

            @precondition(built)
            @rule(**args("native_offload"))
            def native_offload(self, buffer, params, grads):
                self.m.native_offload(buffer, params, grads)

            @precondition(built)
            @rule(**args("native_reload"))
            def native_reload(self, buffer):
                self.m.native_reload(buffer)

        @invariant()
        def consistent(self):
            if self.m is not None:
                self.m.check()

        def teardown(self):
            if self.m is not None:
                self.m.teardown()

    Verbs.__name__ = Verbs.__qualname__ = name
    return Verbs


# ----------------------------------------------------------------------------- step accounting

#: steps (invariant checks) run in this process, per target name
STEPS: Counter[str] = Counter()
STATS: Counter[str] = Counter()


def _record(machine: Machine) -> None:
    STEPS[machine.target.name] += machine.steps
    STATS.update(machine.stats)
    log = os.environ.get("STATESHIFT_MACHINE_LOG")
    if log:
        with open(log, "a") as f:
            rank = f" rank={os.environ['RANK']}" if "RANK" in os.environ else ""
            f.write(f"{os.getpid()} {machine.target.name}{rank} steps={machine.steps}\n")
