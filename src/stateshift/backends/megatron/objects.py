"""Recognising Megatron-core objects, and the facts of their layout the backends read.

Nothing here imports megatron: objects are recognised by their attributes,
so the CPU fake in ``tests/fakes/`` and the real classes go through the same
code (``docs/notes/megatron-layout.md`` has the layout with ``file:line``
references into megatron-core 0.16.1).
"""

from __future__ import annotations

from typing import Any

import torch

#: extra classes accepted as unwrapped Megatron chunks by ``detect`` (e.g. test fakes)
UNWRAPPED_CHUNK_TYPES: set[type] = set()


def is_ddp_chunk(obj: Any) -> bool:
    """A Megatron-core ``DistributedDataParallel`` (or a faithful fake of one)."""
    return (
        isinstance(obj, torch.nn.Module)
        and isinstance(getattr(obj, "buffers", None), list)
        and isinstance(getattr(obj, "expert_parallel_buffers", None), list)
        and isinstance(getattr(obj, "module", None), torch.nn.Module)
    )


def is_float16_wrapper(obj: Any) -> bool:
    return hasattr(obj, "float16_convertor") and isinstance(getattr(obj, "module", None), torch.nn.Module)


def is_unwrapped_chunk(obj: Any) -> bool:
    """A Megatron model chunk that is not DDP-wrapped (e.g. a reference model)."""
    if not isinstance(obj, torch.nn.Module):
        return False
    if type(obj) in UNWRAPPED_CHUNK_TYPES or is_float16_wrapper(obj):
        return True
    return any(c.__name__ == "MegatronModule" for c in type(obj).__mro__)


def is_megatron_optimizer(obj: Any) -> bool:
    """A Megatron optimizer (Distributed, Float16, FP32, Chained) or a fake of one."""
    if obj is None or isinstance(obj, torch.optim.Optimizer):
        return False
    if isinstance(getattr(obj, "chained_optimizers", None), list):
        return True
    return isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer) and hasattr(obj, "param_groups")


def chunks_of(model: Any) -> list[torch.nn.Module] | None:
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
    while (
        is_ddp_chunk(m)
        or is_float16_wrapper(m)
        or isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
    ):
        m = m.module
    return m


def optimizers_of(optimizer: Any) -> list[Any]:
    """The leaf Megatron optimizers of a (possibly nested) ChainedOptimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if isinstance(chained, list):
        return [leaf for o in chained for leaf in optimizers_of(o)]
    return [optimizer]


def dp_shard_meta(opt: Any, p: torch.Tensor) -> tuple[Any, ...]:
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


def state_owners(opt: Any) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model param, inner-optimizer key) for every inner param whose state is listed."""
    pairs = master_pairs(opt)
    if hasattr(opt, "shard_fp32_groups"):
        pairs += [
            (p, s)
            for mg, sg in zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True)
            for p, s in zip(mg, sg, strict=True)
        ]
    elif hasattr(opt, "fp32_from_fp32_groups"):
        pairs += [(p, p) for g in opt.fp32_from_fp32_groups for p in g]
    return pairs


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()
