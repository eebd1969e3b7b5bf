"""The Megatron optimizer backend: fp32 masters and inner optimizer state (group ``optim``)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...core.slot import Entry
from ...core.source import Check, Handle
from ...errors import ObjectError
from ..base import CheckpointFacts, Rebuild
from ..guards import MethodGuard
from .objects import dp_shard_meta, master_pairs, optimizers_of, state_owners
from .rebuild import MasterRebuild

if TYPE_CHECKING:
    from .model import MegatronModelBackend


@dataclass
class MegatronOptimizerBackend:
    """Lists a Megatron optimizer's fp32 masters and inner state (group ``optim``)."""

    optimizer: Any
    param_names: dict[int, str] = field(default_factory=dict)
    model: MegatronModelBackend | None = None
    name: str = "megatron-optim"
    groups: tuple[str, ...] = ("optim",)
    forward_groups: tuple[str, ...] = ()
    static_groups: tuple[str, ...] = ()
    _plan_sig: Any = field(default=None, repr=False)
    _plan_cache: list[Any] = field(default_factory=list, repr=False)

    @property
    def leaves(self) -> list[Any]:
        return optimizers_of(self.optimizer)

    def _pname(self, oi: int, p: torch.Tensor | None, fallback: str) -> str:
        if p is not None and id(p) in self.param_names:
            return self.param_names[id(p)]
        return f"opt{oi}.{fallback}"

    def signature(self) -> tuple[Any, ...]:
        out = []
        for opt in self.leaves:
            inner = getattr(opt, "optimizer", None)
            out.append(
                (id(opt), id(inner), None if inner is None else tuple(len(g["params"]) for g in inner.param_groups))
            )
        return tuple(out)

    def plan(self) -> list[tuple[Any, list[tuple[str, torch.Tensor, tuple[Any, ...]]], list[tuple[str, torch.Tensor]]]]:
        """Per leaf optimizer: (inner, masters as (name, tensor, meta), inner params as (name, key)).

        Built once and again only when the optimizers' param groups change;
        the state tensors themselves are read at every listing (Megatron's own
        optimizer offload replaces them).
        """
        sig = self.signature()
        if self._plan_sig == sig:
            return self._plan_cache
        plan = []
        names: set[str] = set()
        for oi, opt in enumerate(self.leaves):
            masters = [
                (f"{self._pname(oi, p, f'masters.{k}')}.main_param", m, dp_shard_meta(opt, p))
                for k, (p, m) in enumerate(master_pairs(opt))
            ]
            inner = getattr(opt, "optimizer", None)
            keys: list[tuple[str, torch.Tensor]] = []
            if inner is not None:
                owner = {id(key): p for p, key in state_owners(opt)}
                for gi, group in enumerate(inner.param_groups):
                    for pi, key in enumerate(group["params"]):
                        keys.append((self._pname(oi, owner.get(id(key)), f"param_groups.{gi}.params.{pi}"), key))
            for name in [n for n, _, _ in masters] + [n for n, _ in keys]:
                if name in names:
                    raise ObjectError("backend", f"two optimizer tensors named {name!r}")
                names.add(name)
            plan.append((inner, masters, keys))
        self._plan_sig, self._plan_cache = sig, plan
        return plan

    def entries(self, group: str) -> Sequence[Entry]:
        """The fp32 masters, then every tensor of each inner optimizer's state."""
        out: list[Entry] = []
        for inner, masters, keys in self.plan():
            out += [Entry(name, "optim", master, meta) for name, master, meta in masters]
            if inner is None:
                continue
            state = inner.state
            for pname, key in keys:
                for k, v in (state.get(key) or {}).items():
                    if isinstance(v, torch.Tensor):
                        out.append(Entry(f"{pname}.{k}", "optim", v))
        return out

    def inner_touched(self, leaves: list[Any] | None = None) -> list[torch.Tensor]:
        """What Megatron's own ``offload_to_cpu``/``restore_from_cpu`` read: inner params and state."""
        out: list[torch.Tensor] = []
        for opt in self.leaves if leaves is None else leaves:
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                out.extend(group["params"])
            for st in inner.state.values():
                out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        return out

    def touched(self, leaves: list[Any] | None = None) -> list[torch.Tensor]:
        """Every tensor an optimizer step reads or writes: model params, main grads, masters, state."""
        leaves = self.leaves if leaves is None else leaves
        out = self.inner_touched(leaves)
        for opt in leaves:
            for p, _ in state_owners(opt):
                out.append(p)
                mg = getattr(p, "main_grad", None)
                if isinstance(mg, torch.Tensor):
                    out.append(mg)
        return out

    def prepare(self, groups: Collection[str]) -> None:
        """Nothing to prepare: the plan follows the param groups, the state is read as it is."""

    def coverage(self) -> dict[str, list[str]]:
        return {"optim": [e.name for e in self.entries("optim")]}

    def install_guards(self, check: Check) -> list[Handle]:
        handles: list[Handle] = []
        for method, tensors in (
            ("step", self.touched),
            ("offload_to_cpu", self.inner_touched),
            ("restore_from_cpu", self.inner_touched),
        ):
            if callable(getattr(self.optimizer, method, None)):
                handles.append(
                    MethodGuard(
                        check, self.optimizer, method, tensors, what=f"optimizer.{method}()", writes=method == "step"
                    )
                )
        for opt in self.leaves:
            inner = getattr(opt, "optimizer", None)
            if isinstance(inner, torch.optim.Optimizer):

                def pre_step(o: Any, args: Any, kwargs: Any, leaf: Any = opt) -> None:
                    check(self.touched([leaf]), "inner optimizer.step()", writes=True)

                handles.append(inner.register_step_pre_hook(pre_step))
        return handles

    def checkpoint_facts(self) -> CheckpointFacts:
        return CheckpointFacts(sharded=True)

    def rebuild_plugin(self) -> Rebuild | None:
        """The pi_old plug-in that recomputes bf16 params from the fp32 masters (see ``MasterRebuild``)."""
        return MasterRebuild(self)
