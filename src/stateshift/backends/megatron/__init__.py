"""Megatron-core: DDP-wrapped models (any residency), unwrapped chunks, Megatron optimizers.

Written against megatron-core 0.16.1 (``docs/notes/megatron-layout.md`` has the
object layout with ``file:line`` references). Nothing here imports
megatron: objects are recognised by their attributes, so the CPU fake in
``tests/fakes/`` and the real classes go through the same code.

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
  ``StateError("offloaded")``. After stateshift re-fills grads that Megatron had
  dropped, ``grad_data_size`` is reset, so ``restore_grad_buffers`` cannot
  zero accumulated grads. The price: Megatron's next own param offload
  allocates its pinned copy again.
- A storage released by someone else with no values anywhere raises
  ``StateError("foreign")`` naming the tensor; never an ``AttributeError``.
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

from typing import Any

import torch

from ...errors import ObjectError
from ..torch import TorchOptimizerBackend
from .model import MegatronModelBackend
from .objects import (
    UNWRAPPED_CHUNK_TYPES,
    chunks_of,
    inner_module,
    is_ddp_chunk,
    is_megatron_optimizer,
    is_unwrapped_chunk,
    master_pairs,
)
from .optimizer import MegatronOptimizerBackend
from .rebuild import MasterRebuild


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
            raise ObjectError(
                "backend",
                f"optimizer of type {type(optimizer).__name__} is neither a Megatron optimizer nor a torch.optim.Optimizer",
            )
    return out


def detect(model: Any, optimizer: Any = None) -> list[Any] | None:
    """Megatron backends if ``model`` is a Megatron chunk or a list of chunks (or ``optimizer`` is Megatron's)."""
    chunks = chunks_of(model)
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
