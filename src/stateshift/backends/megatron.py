"""Megatron-core: DDP-wrapped models (any residency), unwrapped chunks, Megatron optimizers.

Written against megatron-core 0.16.1 (``docs/megatron-layout.md`` has the
object layout with ``file:line`` references). Nothing here imports
megatron: objects are recognised by their attributes, so the CPU fake in
``tests/fake_mcore.py`` and the real classes go through the same code.

Groups (``MegatronModelBackend``):

- ``params``: each DDP buffer's flat ``param_data`` (dense ``buffers`` and
  ``expert_parallel_buffers``), one slot per buffer whose members are the
  flat tensor and every parameter view in it; when a buffer has no
  ``param_data`` (``use_distributed_optimizer=False``), each of its params
  is its own slot. Trainable params of unwrapped chunks are here too.
- ``frozen``: parameters outside every DDP buffer (``requires_grad=False``:
  a frozen base under LoRA, a reference model's frozen weights).
- ``buffers``: every module buffer of every chunk (persistent and not), e.g.
  the MoE router's ``expert_bias`` (changed every step by
  ``finalize_model_grads``) and ``local_tokens_per_expert``.
- ``grads``: each buffer's flat ``grad_data`` (members: the flat tensor and
  every ``param.main_grad`` view), plus ``.grad`` of params outside buffers.

``MegatronOptimizerBackend`` lists group ``optim``: the fp32 master weights
(``shard_fp32_from_float16_groups`` of ``DistributedOptimizer``,
``fp32_from_float16_groups`` of ``Float16OptimizerWithFloat16Params``) and
every tensor in the inner optimizer's state, for each optimizer of a
``ChainedOptimizer``. DistributedOptimizer's fp32 model-param shards are
views into ``param_data`` and are not listed twice.

Coexistence with Megatron's own offload (rules, each tested):

- ``param_data`` released by ``_ParamAndGradBuffer.offload_to_cpu`` (storage
  empty, values in ``param_data_cpu``): listed with that copy as its
  ``NativeHome``; stateshift treats it as host-resident (snapshots copy it,
  onload refills the storage from it). Megatron records no event for its
  later non-blocking copies into ``param_data_cpu``, so the first time a new
  copy is seen the device is synchronised before anything reads it.
- ``grad_data`` released by Megatron (``grad_data_size > 0``): listed as
  released without values (``dropped``; onload zero-fills, like
  ``reload_from_cpu``).
- Stale host copies: whenever a buffer's ``param_data`` is seen resident,
  Megatron's ``param_data_cpu`` is set to ``None`` (it is stale as soon as the
  params change), and the same happens when stateshift takes over the values
  of a released buffer. Megatron's ``reload_from_cpu`` then cannot bring old
  weights back; it leaves the storage empty and the forward guard raises
  ``OffloadedStateError``. After stateshift re-fills grads that Megatron had
  dropped, ``grad_data_size`` is reset, so ``restore_grad_buffers`` cannot
  zero accumulated grads. The price: Megatron's next own param offload
  allocates its pinned copy again.
- A storage released by someone else with no values anywhere raises
  ``ForeignStateError`` naming the tensor; never an ``AttributeError``.
- ``param_data is None``: each param is its own slot (above).

Recognition (``detect``): a *DDP chunk* is an ``nn.Module`` whose ``buffers``
and ``expert_parallel_buffers`` attributes are lists (they shadow
``nn.Module.buffers``); an *unwrapped chunk* is an ``nn.Module`` whose class
derives from a class named ``MegatronModule``, or a ``Float16Module``-like
wrapper (has ``float16_convertor`` and ``module``), or whose class is in
``UNWRAPPED_CHUNK_TYPES`` (tests add their fakes there). A list of chunks
(virtual pipeline stages) is recognised if any element is. A *Megatron
optimizer* has ``chained_optimizers`` or an inner ``torch.optim.Optimizer``
in ``.optimizer`` without being one itself. ``backends(model, optimizer)``
builds the backends for any modules without detection.

Names: relative to the innermost model (DDP and ``Float16Module`` wrappers
stripped, as in Megatron's ``state_dict``); with several chunks each name
starts with ``chunk<i>.``. Flat buffers are ``buffers.<j>.param_data`` /
``expert_parallel_buffers.<j>.grad_data``; main grads ``<param>.main_grad``;
masters ``<param>.main_param``; optimizer state ``<param>.<key>``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import BackendError, ForeignStateError
from ..slot import Entry, NativeHome
from .torch import TorchOptimizerBackend, _join, _walk

if TYPE_CHECKING:
    from ..state import ModelState

#: extra classes accepted as unwrapped Megatron chunks by ``detect`` (e.g. test fakes)
UNWRAPPED_CHUNK_TYPES: set[type] = set()


# --------------------------------------------------------------------------- recognition


def is_ddp_chunk(obj: Any) -> bool:
    """A Megatron-core ``DistributedDataParallel`` (or a faithful fake of one)."""
    return (
        isinstance(obj, torch.nn.Module)
        and isinstance(getattr(obj, "buffers", None), list)
        and isinstance(getattr(obj, "expert_parallel_buffers", None), list)
        and isinstance(getattr(obj, "module", None), torch.nn.Module)
    )


def _is_float16_wrapper(obj: Any) -> bool:
    return hasattr(obj, "float16_convertor") and isinstance(getattr(obj, "module", None), torch.nn.Module)


def is_unwrapped_chunk(obj: Any) -> bool:
    """A Megatron model chunk that is not DDP-wrapped (e.g. a reference model)."""
    if not isinstance(obj, torch.nn.Module):
        return False
    if type(obj) in UNWRAPPED_CHUNK_TYPES or _is_float16_wrapper(obj):
        return True
    return any(c.__name__ == "MegatronModule" for c in type(obj).__mro__)


def is_megatron_optimizer(obj: Any) -> bool:
    """A Megatron optimizer (Distributed, Float16, FP32, Chained) or a fake of one."""
    if obj is None or isinstance(obj, torch.optim.Optimizer):
        return False
    if isinstance(getattr(obj, "chained_optimizers", None), list):
        return True
    return isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer) and hasattr(obj, "param_groups")


def _chunks_of(model: Any) -> list[torch.nn.Module] | None:
    if is_ddp_chunk(model) or is_unwrapped_chunk(model):
        return [model]
    if (
        isinstance(model, (list, tuple))
        and model
        and all(isinstance(m, torch.nn.Module) for m in model)
        and any(is_ddp_chunk(m) or is_unwrapped_chunk(m) for m in model)
    ):
        return list(model)
    return None


def inner_module(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP and Float16Module wrappers."""
    m: Any = chunk
    while is_ddp_chunk(m) or _is_float16_wrapper(m) or isinstance(
        m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    ):
        m = m.module
    return m


def _optimizers_of(optimizer: Any) -> list[Any]:
    """The leaf Megatron optimizers of a (possibly nested) ChainedOptimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if isinstance(chained, list):
        return [leaf for o in chained for leaf in _optimizers_of(o)]
    return [optimizer]


def _dp_shard_meta(opt: Any, p: torch.Tensor) -> tuple[Any, ...]:
    """(start, end) of the shard a DistributedOptimizer owns of ``p`` (fingerprint meta)."""
    getter = getattr(opt, "_get_model_param_range_map", None)
    if getter is None:
        return ()
    try:
        r = getter(p)["param"]
    except (KeyError, TypeError):
        return ()
    return ("shard", int(r.start), int(r.end))


def master_pairs(opt: Any) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model param, fp32 master) of one leaf Megatron optimizer (empty for FP32Optimizer)."""
    if hasattr(opt, "shard_fp32_from_float16_groups"):
        models, masters = opt.model_float16_groups, opt.shard_fp32_from_float16_groups
    elif hasattr(opt, "fp32_from_float16_groups"):
        models, masters = opt.float16_groups, opt.fp32_from_float16_groups
    else:
        return []
    return [(p, m) for mg, sg in zip(models, masters, strict=True) for p, m in zip(mg, sg, strict=True)]


def _state_owners(opt: Any) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model param, inner-optimizer key) for every inner param whose state is listed."""
    pairs = master_pairs(opt)
    if hasattr(opt, "shard_fp32_groups"):
        pairs += [(p, s) for mg, sg in zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True) for p, s in zip(mg, sg, strict=True)]
    elif hasattr(opt, "fp32_from_fp32_groups"):
        pairs += [(p, p) for g in opt.fp32_from_fp32_groups for p in g]
    return pairs


# --------------------------------------------------------------------------- native-offload bookkeeping


def _forget_param_cpu(buf: Any, cpu: torch.Tensor) -> None:
    """Megatron must not reload this (now stale) host copy: drop it from the buffer."""
    if getattr(buf, "param_data_cpu", None) is cpu:
        buf.param_data_cpu = None


def _forget_grad_size(buf: Any) -> None:
    """Grads re-filled (or replaced) by stateshift: Megatron's restore must not zero them again."""
    buf.grad_data_size = 0


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass
class _BufferRef:
    chunk: int
    kind: str  # "buffers" | "expert_parallel_buffers"
    index: int
    buffer: Any


# --------------------------------------------------------------------------- model backend


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

    def __post_init__(self) -> None:
        if isinstance(self.chunks, torch.nn.Module):
            self.chunks = [self.chunks]
        self.chunks = list(self.chunks)
        for m in self.chunks:
            if not isinstance(m, torch.nn.Module):
                raise BackendError(f"a Megatron model chunk must be an nn.Module, not {type(m).__name__}")
        self.prefixes = [f"chunk{i}." if len(self.chunks) > 1 else "" for i in range(len(self.chunks))]
        self.inners = [inner_module(c) for c in self.chunks]
        self._normalize_expert_bias()
        # The module tree and the DDP buffers are fixed once DDP is built: walk them once.
        # (Tensors are read from the modules at every listing, so replaced tensors are seen.)
        self._modules: list[tuple[str, torch.nn.Module]] = [
            (owner, m) for inner, prefix in zip(self.inners, self.prefixes, strict=True) for owner, m in _walk(inner, prefix)
        ]
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
                    self.param_names.setdefault(id(p), _join(owner, leaf))
        self._views: dict[int, list[tuple[str, torch.nn.Parameter]]] = {
            id(ref.buffer): [(self._name(p, f"{self._base(ref)}.params.{k}"), p) for k, p in enumerate(ref.buffer.params)]
            for ref in self._refs
        }

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
                if callable(fix) and isinstance(bias, torch.Tensor) and _storage_bytes(bias) > 0:
                    fix()

    # -- traversal --------------------------------------------------------------------------
    def ddp_buffers(self) -> list[_BufferRef]:
        """Every ``_ParamAndGradBuffer`` of every DDP chunk: dense first, then expert-parallel."""
        return self._refs

    def buffer_params(self) -> set[int]:
        return self._inside

    def _outside(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Params outside every DDP buffer, under every name they have."""
        inside = self._inside
        for owner, m in self._modules:
            for leaf, p in m._parameters.items():
                if p is not None and id(p) not in inside:
                    yield _join(owner, leaf), p

    def _buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for owner, m in self._modules:
            for leaf, b in m._buffers.items():
                if b is not None:
                    yield _join(owner, leaf), b

    def _name(self, p: torch.Tensor, fallback: str) -> str:
        return self.param_names.get(id(p), fallback)

    def entries(self, groups: Collection[str] | None = None) -> Iterator[Entry]:
        want = self.groups if groups is None else groups
        if "params" in want:
            for ref in self._refs:
                yield from self._param_entries(ref)
        if "params" in want or "frozen" in want or "grads" in want:
            outside = list(self._outside())
            for name, p in outside:
                group = "params" if p.requires_grad else "frozen"
                if group in want:
                    yield Entry(name, group, p)
        if "buffers" in want:
            for name, b in self._buffers():
                yield Entry(name, "buffers", b)
        if "grads" in want:
            for ref in self._refs:
                yield from self._grad_entries(ref)
            seen: set[int] = set()
            for name, p in outside:
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield Entry(f"{name}.grad", "grads", p.grad)

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
        cpu = getattr(buf, "param_data_cpu", None)
        if _storage_bytes(pd) > 0:
            if cpu is not None:
                buf.param_data_cpu = None  # stale as soon as the params change: Megatron must never reload it
            return None
        if cpu is None:
            return None  # released by stateshift (tracked), or by someone else (ForeignStateError)
        if cpu.dtype != pd.dtype or cpu.numel() != pd.numel():
            raise ForeignStateError(
                f"{base}.param_data",
                f"Megatron's param_data_cpu is {cpu.dtype} x {cpu.numel()}, the buffer {pd.dtype} x {pd.numel()}",
            )
        self._sync_native(cpu, pd.device)
        return NativeHome(values=cpu, on_onload=functools.partial(_forget_param_cpu, buf, cpu))

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
        if _storage_bytes(gd) == 0 and getattr(buf, "grad_data_size", 0) > 0:
            native = NativeHome(values=None, on_onload=functools.partial(_forget_grad_size, buf))
        yield Entry(f"{base}.grad_data", "grads", gd, nbytes=gd.numel() * gd.element_size(), native_home=native)
        for name, p in self._views[id(buf)]:
            mg = getattr(p, "main_grad", None)
            if isinstance(mg, torch.Tensor):
                yield Entry(f"{name}.main_grad", "grads", mg)

    # -- coverage and guards -----------------------------------------------------------------
    def coverage(self) -> dict[str, list[str]]:
        """What each group holds, by name, and what is deliberately not tracked."""
        out: dict[str, list[str]] = {g: [] for g in self.groups}
        for e in self.entries():
            out[e.group].append(e.name)
        out["untracked"] = [
            "transient master grads (.grad of fp32 masters when grads are not fp32): rebuilt by every step",
            "bucket/shard views (bucket.param_data, cached shard lists): views of the listed flat buffers",
        ]
        return out

    def install_guards(self, state: ModelState) -> list[Any]:
        handles: list[Any] = []
        for inner, prefix in zip(self.inners, self.prefixes, strict=True):
            for owner, m in inner.named_modules(prefix=prefix.rstrip(".")):
                own = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
                if not own:
                    continue
                where = f"forward of module {owner or type(m).__name__!r}"

                def pre_hook(mod: Any, args: Any, own: list[torch.Tensor] = own, where: str = where) -> None:
                    state.check_resident(own, where)

                handles.append(m.register_forward_pre_hook(pre_hook))
        inside = self._inside
        seen: set[int] = set()
        for inner in self.inners:
            for p in inner.parameters():
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                name = self._name(p, "(param)")

                def grad_hook(grad: torch.Tensor, p: Any = p, name: str = name, in_buffer: bool = id(p) in inside) -> None:
                    target = getattr(p, "main_grad", None) if in_buffer else p.grad
                    if isinstance(target, torch.Tensor):
                        leaf = "main_grad" if in_buffer else "grad"
                        state.check_resident((target,), f"backward accumulating into {name}.{leaf}")

                handles.append(p.register_hook(grad_hook))
        for chunk in self.chunks:
            if is_ddp_chunk(chunk) and callable(getattr(chunk, "zero_grad_buffer", None)):
                grads: list[torch.Tensor] = [r.buffer.grad_data for r in self._refs if self.chunks[r.chunk] is chunk]
                handles.append(_wrap_method(state, chunk, "zero_grad_buffer", functools.partial(list, grads)))
        return handles


# --------------------------------------------------------------------------- optimizer backend


@dataclass
class MegatronOptimizerBackend:
    """Lists a Megatron optimizer's fp32 masters and inner state (group ``optim``)."""

    optimizer: Any
    param_names: dict[int, str] = field(default_factory=dict)
    model: MegatronModelBackend | None = None
    name: str = "megatron-optim"
    groups: tuple[str, ...] = ("optim",)
    forward_groups: tuple[str, ...] = ()
    _plan_sig: Any = field(default=None, repr=False)
    _plan_cache: list[Any] = field(default_factory=list, repr=False)

    @property
    def leaves(self) -> list[Any]:
        return _optimizers_of(self.optimizer)

    def _pname(self, oi: int, p: torch.Tensor | None, fallback: str) -> str:
        if p is not None and id(p) in self.param_names:
            return self.param_names[id(p)]
        return f"opt{oi}.{fallback}"

    def _signature(self) -> tuple[Any, ...]:
        out = []
        for opt in self.leaves:
            inner = getattr(opt, "optimizer", None)
            out.append((id(opt), id(inner), None if inner is None else tuple(len(g["params"]) for g in inner.param_groups)))
        return tuple(out)

    def _plan(self) -> list[tuple[Any, list[tuple[str, torch.Tensor, tuple[Any, ...]]], list[tuple[str, torch.Tensor]]]]:
        """Per leaf optimizer: (inner, masters as (name, tensor, meta), inner params as (name, key)).

        Built once and again only when the optimizers' param groups change;
        the state tensors themselves are read at every listing (Megatron's own
        optimizer offload replaces them).
        """
        sig = self._signature()
        if self._plan_sig == sig:
            return self._plan_cache
        plan = []
        names: set[str] = set()
        for oi, opt in enumerate(self.leaves):
            masters = [
                (f"{self._pname(oi, p, f'masters.{k}')}.main_param", m, _dp_shard_meta(opt, p))
                for k, (p, m) in enumerate(master_pairs(opt))
            ]
            inner = getattr(opt, "optimizer", None)
            keys: list[tuple[str, torch.Tensor]] = []
            if inner is not None:
                owner = {id(key): p for p, key in _state_owners(opt)}
                for gi, group in enumerate(inner.param_groups):
                    for pi, key in enumerate(group["params"]):
                        keys.append((self._pname(oi, owner.get(id(key)), f"param_groups.{gi}.params.{pi}"), key))
            for name in [n for n, _, _ in masters] + [n for n, _ in keys]:
                if name in names:
                    raise BackendError(f"two optimizer tensors named {name!r}")
                names.add(name)
            plan.append((inner, masters, keys))
        self._plan_sig, self._plan_cache = sig, plan
        return plan

    def entries(self, groups: Collection[str] | None = None) -> Iterator[Entry]:
        if groups is not None and "optim" not in groups:
            return
        for inner, masters, keys in self._plan():
            for name, master, meta in masters:
                yield Entry(name, "optim", master, meta)
            if inner is None:
                continue
            state = inner.state
            for pname, key in keys:
                st = state.get(key)
                if st:
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor):
                            yield Entry(f"{pname}.{k}", "optim", v)

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
            for p, _ in _state_owners(opt):
                out.append(p)
                mg = getattr(p, "main_grad", None)
                if isinstance(mg, torch.Tensor):
                    out.append(mg)
        return out

    def install_guards(self, state: ModelState) -> list[Any]:
        handles: list[Any] = []
        for method, tensors in (("step", self.touched), ("offload_to_cpu", self.inner_touched), ("restore_from_cpu", self.inner_touched)):
            if callable(getattr(self.optimizer, method, None)):
                handles.append(_wrap_method(state, self.optimizer, method, tensors, what=f"optimizer.{method}()"))
        for opt in self.leaves:
            inner = getattr(opt, "optimizer", None)
            if isinstance(inner, torch.optim.Optimizer):

                def pre_step(o: Any, args: Any, kwargs: Any, leaf: Any = opt) -> None:
                    state.check_resident(self.touched([leaf]), "inner optimizer.step()")

                handles.append(inner.register_step_pre_hook(pre_step))
        return handles

    def rebuild_plugin(self, state: ModelState) -> MasterRebuild:
        """The pi_old plug-in that recomputes bf16 params from the fp32 masters (see ``MasterRebuild``)."""
        return MasterRebuild(state, self)


class _MethodGuard:
    """An instance-level wrapper of ``obj.<method>`` that checks residency first; ``remove()`` undoes it."""

    def __init__(self, state: ModelState, obj: Any, method: str, tensors: Callable[[], Iterable[torch.Tensor]], what: str) -> None:
        self.obj, self.method = obj, method
        original = getattr(obj, method)

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            state.check_resident(tensors(), what)
            return original(*args, **kwargs)

        self.guarded = guarded
        obj.__dict__[method] = guarded

    def remove(self) -> None:
        if self.obj.__dict__.get(self.method) is self.guarded:
            del self.obj.__dict__[self.method]


def _wrap_method(state: ModelState, obj: Any, method: str, tensors: Callable[[], Iterable[torch.Tensor]], what: str | None = None) -> _MethodGuard:
    return _MethodGuard(state, obj, method, tensors, what or f"{type(obj).__name__}.{method}()")


# --------------------------------------------------------------------------- pi_old rebuild plug-in


class MasterRebuild:
    """Recompute the current bf16 params from the fp32 masters instead of stashing and copying them back.

    After every Megatron optimizer step the model params equal the masters
    cast to bf16 (``_copy_main_params_to_model_params``), so inside a
    ``swapped(pi_old)`` the current params need not be stashed: on exit one
    multi-tensor cast writes them back from the masters on the device (and,
    with data parallelism, the param all-gather completes the shards other
    ranks own). ``available`` says when this is exact; otherwise the caller
    falls back to the stash.
    """

    group = "params"

    def __init__(self, state: ModelState, backend: MegatronOptimizerBackend) -> None:
        self.state = state
        self.backend = backend
        self._sig: Any = None

    def _prepare(self) -> None:
        """Where each master goes in the model's storage, and whether the rebuild can be exact at all.

        Cached until the optimizers' param groups change. ``needs_gather``:
        some param in a DDP buffer is not wholly covered by a master of this
        rank (data parallelism shards it), so the DistributedOptimizer's param
        all-gather must complete the rebuild.
        """
        sig = self.backend._signature()
        if sig == self._sig:
            return
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        whole: set[int] = set()
        for opt in self.backend.leaves:
            distributed = hasattr(opt, "shard_fp32_from_float16_groups")
            for p, master in master_pairs(opt):
                if distributed:
                    world = opt._get_model_param_range_map(p)["gbuf_world_in_bucket"]
                    gi, _, bi = opt.model_param_gbuf_map[p]
                    dsts.append(opt.buffers[gi].buckets[bi].param_data.view(-1)[world.start : world.end])
                else:
                    dsts.append(p.data)
                srcs.append(master)
                if master.numel() == p.numel():
                    whole.add(id(p))
        model = self.backend.model
        self._gather = model is not None and any(id(p) not in whole for ref in model.ddp_buffers() for p in ref.buffer.params)
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for d, m in zip(dsts, srcs, strict=True):
            pair = by_device.setdefault(d.device, ([], []))
            pair[0].append(d)
            pair[1].append(m)
        self._by_device = list(by_device.values())
        self._masters = srcs
        self._pairs = list(zip(dsts, srcs, strict=True))
        self._nbytes = (sum(m.numel() * m.element_size() for m in srcs), sum(d.numel() * d.element_size() for d in dsts))
        self._static = self._static_reason()
        self._sig = sig

    def _static_reason(self) -> str | None:
        model = self.backend.model
        if model is None:
            return "no Megatron model backend for this optimizer"
        leaves = self.backend.leaves
        for opt in leaves:
            cfg = getattr(opt, "config", None)
            if getattr(cfg, "use_precision_aware_optimizer", False) or getattr(getattr(opt, "ddp_config", None), "use_megatron_fsdp", False):
                return f"{type(opt).__name__} keeps its masters elsewhere (precision-aware optimizer / Megatron-FSDP)"
            if not hasattr(opt, "shard_fp32_from_float16_groups") and not hasattr(opt, "fp32_from_float16_groups"):
                return f"{type(opt).__name__} has no fp32 masters (the model params are the optimizer's own values)"
            fp32 = getattr(opt, "model_fp32_groups", None) or getattr(opt, "fp32_from_fp32_groups", None) or []
            if any(len(g) for g in fp32):
                return f"{type(opt).__name__} steps fp32 model params directly (they are their own masters)"
        for name, p in model._outside():
            if p.requires_grad:
                return f"param {name!r} is trainable but outside every DDP buffer: no master for it"
        covered = {id(p) for opt in leaves for p, _ in master_pairs(opt)}
        distributed = any(hasattr(o, "shard_fp32_from_float16_groups") for o in leaves)
        for ref in model.ddp_buffers():
            if getattr(ref.buffer, "param_data", None) is None and distributed:
                return "a DDP buffer has no param_data, which a DistributedOptimizer needs"
            for p in ref.buffer.params:
                if id(p) not in covered and not distributed:  # (distributed: another rank's shard, gathered)
                    return f"param {model._name(p, '?')!r} has no fp32 master in this optimizer"
        return None

    def available(self) -> str | None:
        """``None`` when rebuilding the params group from masters is exact now; otherwise why not.

        "On the device" means resident where the params they rebuild live:
        each master must be on its destination's own device (not the copy
        engine's: a CPU model on a CUDA machine has CPU masters and CPU
        params, and rebuilds on the CPU) and hold its storage (not released by
        ``state.offload("optim")``). Megatron's own ``offload_to_cpu`` moves
        the masters to the CPU (``p.data = p.data.cpu()``) while the params
        stay on the GPU: a rebuild would then cross PCIe, so the stash is used.
        """
        self._prepare()
        if self._static is not None:
            return self._static
        for dst, m in self._pairs:
            if _storage_bytes(m) == 0:
                return "the fp32 masters are not on the device (optimizer offloaded: their storage is released)"
            if m.device != dst.device:
                return f"the fp32 masters are not on the device of the params ({m.device}, params on {dst.device}: optimizer offloaded)"
        return None

    def nbytes(self) -> tuple[int, int]:
        """(bytes read from masters, bytes written into params) per rebuild."""
        self._prepare()
        return self._nbytes

    def __call__(self) -> None:
        self._prepare()
        released = [m for m in self._masters if _storage_bytes(m) == 0]
        names: set[str] = set()
        if released:  # offloaded inside the swap: bring them back for the rebuild, then put them away again
            keys = {id(m) for m in released}
            names = {name for _, masters, _ in self.backend._plan() for name, m, _ in masters if id(m) in keys}
            self.state.onload("optim", only=names)
        with torch.no_grad():
            for d_list, s_list in self._by_device:
                torch._foreach_copy_(d_list, s_list)
            if self._gather:
                for opt in self.backend.leaves:
                    for chunk in getattr(opt, "model_chunks", []):
                        sync = getattr(chunk, "start_param_sync", None)
                        if callable(sync):
                            sync(force_sync=True)
        if names:
            self.state.offload("optim", only=names)


# --------------------------------------------------------------------------- entry points


def backends(model: Any, optimizer: Any = None) -> list[Any]:
    """The Megatron backends for ``model`` (a chunk or a list of chunks) and ``optimizer``, without detection."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    mb = MegatronModelBackend(list(chunks))
    out: list[Any] = [mb]
    if optimizer is not None:
        if is_megatron_optimizer(optimizer):
            out.append(MegatronOptimizerBackend(optimizer, dict(mb.param_names), mb))
        elif isinstance(optimizer, torch.optim.Optimizer):
            out.append(TorchOptimizerBackend(optimizer, dict(mb.param_names)))
        else:
            raise BackendError(
                f"optimizer of type {type(optimizer).__name__} is neither a Megatron optimizer nor a torch.optim.Optimizer"
            )
    return out


def detect(model: Any, optimizer: Any = None) -> list[Any] | None:
    """Megatron backends if ``model`` is a Megatron chunk or a list of chunks (or ``optimizer`` is Megatron's)."""
    chunks = _chunks_of(model)
    if chunks is None:
        if is_megatron_optimizer(optimizer) and isinstance(model, torch.nn.Module):
            chunks = [model]
        else:
            return None
    return backends(chunks, optimizer)


__all__ = [
    "UNWRAPPED_CHUNK_TYPES",
    "MasterRebuild",
    "MegatronModelBackend",
    "MegatronOptimizerBackend",
    "backends",
    "detect",
    "inner_module",
    "is_ddp_chunk",
    "is_megatron_optimizer",
    "is_unwrapped_chunk",
    "master_pairs",
]
