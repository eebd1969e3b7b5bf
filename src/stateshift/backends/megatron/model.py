"""The Megatron model backend: DDP flat buffers (dense and expert-parallel), frozen params, module buffers.

See the package docstring (``__init__.py``) for the groups, the names and how
this coexists with Megatron's own offload.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.slot import Entry, NativeHome
from ...core.source import Check, Handle
from ...errors import ObjectError, StateError
from ..base import CheckpointFacts, Rebuild
from ..guards import MethodGuard, ModuleGuards
from ..torch import TreeWatch, join, walk
from .objects import inner_module, is_ddp_chunk, storage_bytes


def _forget_param_cpu(buf: Any, cpu: torch.Tensor) -> None:
    """Megatron must not reload this (now stale) host copy: drop it from the buffer."""
    if getattr(buf, "param_data_cpu", None) is cpu:
        buf.param_data_cpu = None


def _reinstate_param_cpu(buf: Any, cpu: torch.Tensor) -> None:
    """The buffer is released again (a ``swapped()`` lent it device memory): the host copy is its home again."""
    buf.param_data_cpu = cpu


def _forget_grad_size(buf: Any) -> None:
    """Grads re-filled (or replaced) by stateshift: Megatron's restore must not zero them again."""
    buf.grad_data_size = 0


def _reinstate_grad_size(buf: Any, size: int) -> None:
    """The grad buffer is released again after a ``swapped()``: Megatron's reload re-grows it (zeros)."""
    buf.grad_data_size = size


@dataclass
class _BufferRef:
    chunk: int
    kind: str  # "buffers" | "expert_parallel_buffers"
    index: int
    buffer: Any


@dataclass
class MegatronModelBackend:
    """Lists the state of Megatron model chunks (DDP-wrapped or not); see the module docstring."""

    chunks: list[torch.nn.Module]
    name: str = "megatron"
    groups: tuple[str, ...] = ("params", "frozen", "buffers", "grads")
    forward_groups: tuple[str, ...] = ("params", "frozen", "buffers")
    #: groups that training does not change (the pi_old helper leaves them out of its snapshots)
    static_groups: tuple[str, ...] = ("frozen",)
    _synced: dict[int, tuple[Any, int]] = field(default_factory=dict, repr=False)
    _guards: ModuleGuards | None = field(default=None, repr=False)
    _watch: TreeWatch = field(init=False, repr=False)
    #: per group: what its listing was built from (compared by identity) and the list (see ``entries``)
    _listed: dict[str, tuple[list[Any], list[Entry]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.chunks, torch.nn.Module):
            self.chunks = [self.chunks]
        self.chunks = list(self.chunks)
        for m in self.chunks:
            if not isinstance(m, torch.nn.Module):
                raise ObjectError("backend", f"a Megatron model chunk must be an nn.Module, not {type(m).__name__}")
        self.prefixes = [f"chunk{i}." if len(self.chunks) > 1 else "" for i in range(len(self.chunks))]
        self.inners = [inner_module(c) for c in self.chunks]
        self._normalize_expert_bias()
        # The DDP buffers are fixed once DDP is built; the module tree is walked again by
        # prepare() (modules added later, e.g. a LoRA adapter, are listed and guarded).
        self._modules: list[tuple[str, torch.nn.Module]] = self._walk()
        self._watch = TreeWatch(tuple(self.inners))
        self._watch.changed()
        self._refs: list[_BufferRef] = [
            _BufferRef(ci, kind, j, buf)
            for ci, chunk in enumerate(self.chunks)
            if is_ddp_chunk(chunk)
            for kind in ("buffers", "expert_parallel_buffers")
            for j, buf in enumerate(getattr(chunk, kind))
        ]
        self._inside: set[int] = {id(p) for ref in self._refs for p in ref.buffer.params}
        self.param_names: dict[int, str] = {}
        for owner, m in self._modules:
            for leaf, p in m._parameters.items():
                if p is not None:
                    self.param_names.setdefault(id(p), join(owner, leaf))
        self._views: dict[int, list[tuple[str, torch.nn.Parameter]]] = {
            id(ref.buffer): [
                (self.param_name(p, f"{self._base(ref)}.params.{k}"), p) for k, p in enumerate(ref.buffer.params)
            ]
            for ref in self._refs
        }

    def _walk(self) -> list[tuple[str, torch.nn.Module]]:
        return [
            (owner, m)
            for inner, prefix in zip(self.inners, self.prefixes, strict=True)
            for owner, m in walk(inner, prefix)
        ]

    def _normalize_expert_bias(self) -> None:
        """Do now what the router does at its first forward: keep ``expert_bias`` in fp32.

        Float16Module casts the router's buffers to bf16; ``TopKRouter`` swaps
        ``expert_bias.data`` back to fp32 (a new storage) at its first forward
        or state_dict (router.py:209-218). Doing it here keeps the slot's
        storage and dtype stable, so a snapshot taken before the first forward
        still fits afterwards.
        """
        for inner in self.inners:
            for m in inner.modules():
                fix = getattr(m, "_maintain_float32_expert_bias", None)
                bias = getattr(m, "expert_bias", None)
                if callable(fix) and isinstance(bias, torch.Tensor) and storage_bytes(bias) > 0:
                    fix()

    # -- traversal --------------------------------------------------------------------------
    def ddp_buffers(self) -> list[_BufferRef]:
        """Every ``_ParamAndGradBuffer`` of every DDP chunk: dense first, then expert-parallel."""
        return self._refs

    def buffer_params(self) -> set[int]:
        return self._inside

    def outside_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Params outside every DDP buffer, under every name they have."""
        inside = self._inside
        for owner, m in self._modules:
            for leaf, p in m._parameters.items():
                if p is not None and id(p) not in inside:
                    yield join(owner, leaf), p

    def _buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for owner, m in self._modules:
            for leaf, b in m._buffers.items():
                if b is not None:
                    yield join(owner, leaf), b

    def param_name(self, p: torch.Tensor, fallback: str) -> str:
        return self.param_names.get(id(p), fallback)

    def prepare(self, groups: Collection[str]) -> None:
        """Walk the modules again if the tree changed (``TreeWatch``; new ones are guarded), and settle
        Megatron's own host copies of ``param_data``.

        A ``param_data_cpu`` is stale as soon as the resident params change:
        it is forgotten whenever its buffer is seen resident, so Megatron can
        never reload old weights. One whose buffer is released is the values'
        home; Megatron's copy into it recorded no event, so the device is
        synchronised once per new copy before anything reads it.
        """
        if self._watch.changed():  # (one cheap pass; the named walk and the hooks only after a change)
            self._listed = {}
            self._modules = self._walk()
            if self._guards is not None:
                self._guards.cover(self._modules, ((n, p) for n, p in self._all_params()))
        if "params" not in groups:
            return
        for ref in self._refs:
            pd, cpu = getattr(ref.buffer, "param_data", None), getattr(ref.buffer, "param_data_cpu", None)
            if pd is None or cpu is None:
                continue
            if storage_bytes(pd) > 0:
                ref.buffer.param_data_cpu = None
            else:
                self._sync_native(cpu, pd.device)

    def _all_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for owner, m in self._modules:
            for leaf, p in m._parameters.items():
                if p is not None:
                    yield join(owner, leaf), p

    def entries(self, group: str) -> Sequence[Entry]:
        """One group's tensors: flat buffers with their views, params outside the buffers, module buffers, grads.

        The same list object while nothing it was built from changed (the slot table's fast path): the module
        tree (``prepare`` forgets every list when ``TreeWatch`` sees a change) and, for ``params``, each flat
        buffer's ``param_data`` and ``param_data_cpu`` objects and whether ``param_data`` holds memory (which
        decide its native home). Grads are listed afresh every time (``main_grad`` and ``grad_data`` change).
        """
        if group == "grads":
            return self._list(group)
        basis = [x for ref in self._refs for x in self._param_basis(ref)] if group == "params" else []
        cached = self._listed.get(group)
        if cached is not None and len(cached[0]) == len(basis) and all(map(operator.is_, cached[0], basis)):
            return cached[1]
        out = self._list(group)
        self._listed[group] = (basis, out)
        return out

    @staticmethod
    def _param_basis(ref: _BufferRef) -> tuple[Any, ...]:
        pd, cpu = getattr(ref.buffer, "param_data", None), getattr(ref.buffer, "param_data_cpu", None)
        return pd, cpu, pd is not None and storage_bytes(pd) > 0

    def _list(self, group: str) -> list[Entry]:
        if group == "buffers":
            return [Entry(name, "buffers", b) for name, b in self._buffers()]
        out: list[Entry] = []
        if group == "params":
            for ref in self._refs:
                out += self._param_entries(ref)
        if group == "grads":
            for ref in self._refs:
                out += self._grad_entries(ref)
        seen: set[int] = set()
        for name, p in self.outside_params():
            if group in ("params", "frozen") and group == ("params" if p.requires_grad else "frozen"):
                out.append(Entry(name, group, p))
            elif group == "grads" and p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(Entry(f"{name}.grad", "grads", p.grad))
        return out

    def _base(self, ref: _BufferRef) -> str:
        return f"{self.prefixes[ref.chunk]}{ref.kind}.{ref.index}"

    def _param_entries(self, ref: _BufferRef) -> Iterator[Entry]:
        buf, base = ref.buffer, self._base(ref)
        pd = getattr(buf, "param_data", None)
        if pd is not None:  # (None: no flat param buffer, each param keeps its own storage)
            home = self._param_home(buf, pd, base)
            yield Entry(f"{base}.param_data", "params", pd, nbytes=pd.numel() * pd.element_size(), native_home=home)
        for name, p in self._views[id(buf)]:
            yield Entry(name, "params", p)

    def _param_home(self, buf: Any, pd: torch.Tensor, base: str) -> NativeHome | None:
        """Megatron's own host copy of a released ``param_data`` (synchronised by ``prepare``), if any."""
        cpu = getattr(buf, "param_data_cpu", None)
        if storage_bytes(pd) > 0 or cpu is None:
            return None  # released by stateshift (tracked), or by someone else (StateError("foreign"))
        if cpu.dtype != pd.dtype or cpu.numel() != pd.numel():
            raise StateError(
                "foreign",
                f"Megatron's param_data_cpu is {cpu.dtype} x {cpu.numel()}, the buffer {pd.dtype} x {pd.numel()}",
                tensor=f"{base}.param_data",
            )
        return NativeHome(
            values=cpu,
            on_onload=functools.partial(_forget_param_cpu, buf, cpu),
            on_released=functools.partial(_reinstate_param_cpu, buf, cpu),
        )

    def _sync_native(self, cpu: torch.Tensor, device: torch.device) -> None:
        """Wait for Megatron's own (event-less, non-blocking) copy into ``param_data_cpu`` once per new write.

        Only a copy from a CUDA ``param_data`` can be in flight (from a CPU
        buffer it was synchronous), whatever else the machine has.
        """
        if device.type != "cuda":
            return
        seen = self._synced.get(id(cpu))
        if seen is not None and seen[0]() is cpu and seen[1] == cpu._version:
            return
        torch.cuda.synchronize(device)
        self._synced[id(cpu)] = (weakref.ref(cpu), cpu._version)

    def _grad_entries(self, ref: _BufferRef) -> Iterator[Entry]:
        buf, base = ref.buffer, self._base(ref)
        gd = getattr(buf, "grad_data", None)
        if gd is None:
            return
        native = None
        if storage_bytes(gd) == 0 and getattr(buf, "grad_data_size", 0) > 0:
            size = buf.grad_data_size
            native = NativeHome(
                values=None,
                on_onload=functools.partial(_forget_grad_size, buf),
                on_released=functools.partial(_reinstate_grad_size, buf, size),
            )
        yield Entry(f"{base}.grad_data", "grads", gd, nbytes=gd.numel() * gd.element_size(), native_home=native)
        for name, p in self._views[id(buf)]:
            mg = getattr(p, "main_grad", None)
            if isinstance(mg, torch.Tensor):
                yield Entry(f"{name}.main_grad", "grads", mg)

    # -- coverage and guards -----------------------------------------------------------------
    def coverage(self) -> dict[str, list[str]]:
        """What each group holds, by name, and what is deliberately not tracked."""
        out: dict[str, list[str]] = {g: [] for g in self.groups}
        self.prepare(self.groups)
        for g in self.groups:
            out[g] += [e.name for e in self.entries(g)]
        out["untracked"] = [
            "transient master grads (.grad of fp32 masters when grads are not fp32): rebuilt by every step",
            "bucket/shard views (bucket.param_data, cached shard lists): views of the listed flat buffers",
        ]
        return out

    def install_guards(self, check: Check) -> list[Handle]:
        """Forward pre-hooks on every model chunk (its whole tree) and every module owning tensors, backward hooks into ``main_grad`` / ``.grad``,
        and ``zero_grad_buffer`` of each DDP chunk (it writes ``grad_data``)."""
        inside = self._inside

        def grad_of(p: torch.nn.Parameter) -> tuple[Any, str]:
            return (getattr(p, "main_grad", None), "main_grad") if id(p) in inside else (p.grad, "grad")

        self._guards = ModuleGuards(check, grad_of=grad_of)
        for i, chunk in enumerate(self.chunks):
            if isinstance(chunk, torch.nn.Module):
                self._guards.cover_tree(chunk, f"model chunk {i} ({type(chunk).__name__})")
        self._watch.forget()  # walk and hook what exists now
        self.prepare(())
        handles: list[Handle] = [self._guards]
        for chunk in self.chunks:
            if is_ddp_chunk(chunk) and callable(getattr(chunk, "zero_grad_buffer", None)):
                grads: list[torch.Tensor] = [r.buffer.grad_data for r in self._refs if self.chunks[r.chunk] is chunk]
                handles.append(MethodGuard(check, chunk, "zero_grad_buffer", functools.partial(list, grads)))
        return handles

    def checkpoint_facts(self) -> CheckpointFacts:
        return CheckpointFacts(
            sharded=True,
            export_refusal="export_hf writes plain nn.Module weights under Hugging Face names; a Megatron model's "
            "names and flat buffers are its own (convert it with Megatron's checkpoint converters)",
        )

    def rebuild_plugin(self) -> Rebuild | None:
        return None
