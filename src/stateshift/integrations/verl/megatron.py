"""verl 0.9.1's Megatron functions (``verl/utils/megatron_utils.py``), on ``ModelState``.

Same names, arguments and return values as verl's, except what the copy
function returns: a ``SnapshotHandle`` (opaque) instead of a dict of CPU
tensors, which only ``restore_megatron_model_from_cpu`` reads. What each does,
in every residency (on the device, offloaded by these functions, released by
Megatron's own ``offload_to_cpu``, or a mix of them, buffer by buffer):

- ``offload_megatron_model_to_cpu``: params (each DDP flat ``param_data``),
  frozen params, module buffers (MoE ``expert_bias``) and the ``.grad`` of
  params outside DDP buffers go to pinned host homes; the DDP flat
  ``grad_data`` buffers are released without values (verl does the same: they
  come back zeroed).
- ``load_megatron_model_to_gpu``: the same tensor objects get their values
  back on the device (grads zeroed unless ``load_grad=False``, which leaves
  them released; frozen params stay offloaded with ``load_frozen_params=False``).
- ``copy_megatron_model_to_cpu``: a snapshot of params and buffers (and of the
  frozen params of chunks that are not DDP-wrapped: verl copies every param of
  those), wherever they live; it never aliases live memory.
- ``restore_megatron_model_from_cpu``: writes a snapshot back, wherever each
  tensor lives now (offloaded ones get the values in their home).
- The optimizer functions move the fp32 masters (``*_copy_params``) or the
  whole ``optim`` group (masters and Adam state).

Values are safe to use as verl uses them: every function returns without
waiting for device copies, and compute enqueued afterwards on the current
stream is ordered after them. Host values of a handle are safe to read after
``handle.wait()``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...backends.megatron import is_ddp_chunk
from .registry import SnapshotHandle, check_handle, model_state, optimizer_state, take


def _flat_grads(name: str) -> bool:
    """The DDP flat grad buffers (and the ``main_grad`` views in them): released without values on offload;
    the ``.grad`` of params outside the buffers (unwrapped chunks) is kept, as verl keeps it."""
    return name.endswith((".grad_data", ".main_grad"))


def _is_master(name: str) -> bool:
    return name.endswith(".main_param")


def _chunk_list(models: Any) -> list[Any]:
    return list(models) if isinstance(models, (list, tuple)) else [models]


def _clear_fp8_workspaces(models: Any) -> None:
    """Drop Transformer-Engine's cached FP8 weight copies (``_fp8_workspaces``): rebuilt lazily by the next forward."""
    for chunk in _chunk_list(models):
        for module in chunk.modules():
            cache = getattr(module, "_fp8_workspaces", None)
            if isinstance(cache, dict):
                cache.clear()


def _free_megatron_scratch() -> None:
    """What verl frees after an optimizer offload: TE's dummy weight-grad cache and Megatron's global memory
    buffer (only where those modules are already imported: nothing is imported here)."""
    te = sys.modules.get("transformer_engine.pytorch.module.base")
    if te is not None and isinstance(getattr(te, "_dummy_wgrads", None), dict):
        te._dummy_wgrads.clear()
    ps = sys.modules.get("megatron.core.parallel_state")
    buf = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) if ps is not None else None
    if buf is not None and isinstance(getattr(buf, "buffer", None), dict):
        buf.buffer.clear()


@torch.no_grad()
def offload_megatron_model_to_cpu(models: Any) -> None:
    """Offload params, frozen params and buffers to pinned host homes; release the DDP grad buffers.

    Args:
        models: the model chunks (a list, as verl passes them; DDP-wrapped or not).

    Raises:
        StateError("offloaded"): never here; a forward on the offloaded model raises it (guards).
        StateError("foreign"): a storage released by someone else with no values anywhere.
    """
    state = model_state(models)
    # one offload (it allocates: if it fails, nothing changed), then the release of the flat grads (it cannot fail)
    state.offload(["params", "frozen", "buffers", "grads"], only=lambda name: not _flat_grads(name))
    state.drop("grads", only=_flat_grads)
    _clear_fp8_workspaces(models)


@torch.no_grad()
def load_megatron_model_to_gpu(models: Any, load_grad: bool = True, load_frozen_params: bool = True) -> None:
    """Bring the model back to the device: the same tensor objects, the same values.

    Args:
        models: the model chunks.
        load_grad: re-grow the grad buffers, zeroed (``False``: they stay released).
        load_frozen_params: bring the frozen params back too (``False``: they stay offloaded).
    """
    state = model_state(models)
    groups = ["params", "buffers"] + (["frozen"] if load_frozen_params else []) + (["grads"] if load_grad else [])
    state.onload(groups)


@torch.no_grad()
def copy_megatron_model_to_cpu(models: Any) -> SnapshotHandle:
    """A snapshot of the model's weights (params, buffers such as ``expert_bias``), wherever they live.

    Args:
        models: the model chunks.

    Returns:
        A ``SnapshotHandle`` for ``restore_megatron_model_from_cpu`` (pinned host memory by default;
        ``install(placement="device")`` keeps it on the device). It never aliases live memory.
    """
    state = model_state(models)
    groups = ["params", "buffers"]
    if not all(is_ddp_chunk(c) for c in _chunk_list(models)):
        groups.append("frozen")  # verl copies every param of a chunk that is not DDP-wrapped
    return take(state, "megatron", groups)


@torch.no_grad()
def restore_megatron_model_from_cpu(models: Any, cpu_state: SnapshotHandle) -> None:
    """Write the handle's values back into the model, wherever each tensor lives now.

    Args:
        models: the model chunks the handle was taken from.
        cpu_state: a handle from ``copy_megatron_model_to_cpu`` of the same model.

    Raises:
        ObjectError("snapshot_handle"): ``cpu_state`` is not such a handle (e.g. verl's own dict); nothing changed.
        LayoutError("mismatch"): the model's tensors changed since (names the first); nothing changed.
    """
    state = model_state(models)
    state.restore(check_handle(cpu_state, state, "megatron", "restore_megatron_model_from_cpu"))


@torch.no_grad()
def offload_megatron_copy_params(optimizers: Any) -> None:
    """Offload the optimizer's fp32 master weights (``shard_fp32_from_float16_groups``) to pinned host homes."""
    optimizer_state(optimizers).offload("optim", only=_is_master)


@torch.no_grad()
def load_megatron_copy_params(optimizers: Any) -> None:
    """Bring the fp32 master weights back to the device."""
    optimizer_state(optimizers).onload("optim", only=_is_master)


@torch.no_grad()
def offload_megatron_optimizer(optimizers: Any) -> None:
    """Offload the optimizer's masters and state (``exp_avg``, ``exp_avg_sq``, ...), for every chained optimizer."""
    optimizer_state(optimizers).offload("optim")
    _free_megatron_scratch()


@torch.no_grad()
def load_megatron_optimizer(optimizers: Any) -> None:
    """Bring the optimizer's masters and state back to the device."""
    optimizer_state(optimizers).onload("optim")
