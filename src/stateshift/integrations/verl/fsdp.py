"""verl 0.9.1's FSDP functions (``verl/utils/fsdp_utils.py``), on ``ModelState``.

Same names, arguments and return values as verl's, except the first element
of what ``fsdp2_sharded_save_to_cpu`` returns: a ``SnapshotHandle`` (opaque)
instead of a dict of CPU shards; the second is the first DTensor parameter's
``DTensorSpec``, as in verl, so a caller that unpacks ``(state, spec)`` and
passes both back works unchanged. Differences a caller can see:

- the model keeps its device: offload releases the local shards' device
  storage in place (values in pinned homes) instead of ``model.to("cpu")``;
- the save and load work with the params offloaded (verl's need them on the
  device) and copy buffers too; the load refuses a handle that does not fit
  (``ObjectError("snapshot_handle")``, ``LayoutError("mismatch")`` naming the tensor)
  instead of skipping names that are missing;
- an FSDP1 model (``FullyShardedDataParallel``) goes to verl's own function
  when ``install()`` put these in place (``ObjectError("backend")`` otherwise).

Every function returns without waiting for device copies; compute enqueued
afterwards on the current stream is ordered after them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ... import ModelState
from ...core.engine import core_of
from ...errors import LayoutError, ObjectError
from .registry import SnapshotHandle, check_handle, model_state, optimizer_state, original, take


def _is_fsdp1(model: Any) -> bool:
    return any(c.__name__ == "FullyShardedDataParallel" for c in type(model).__mro__)


def _fsdp1(name: str, *args: Any) -> Any:
    """FSDP1 is not stateshift's: verl's own function, when ``install()`` kept it."""
    fn = original(name)
    if fn is None:
        raise ObjectError(
            "backend",
            f"{name}: FSDP1 (FullyShardedDataParallel) is not supported by stateshift; use verl's own function",
        )
    return fn(*args)


@contextmanager
def _empty_cache(state: ModelState, empty_cache: bool) -> Iterator[None]:
    old, state.free_device_memory = state.free_device_memory, empty_cache and state.free_device_memory
    try:
        yield
    finally:
        state.free_device_memory = old


@torch.no_grad()
def offload_fsdp_model_to_cpu(model: Any, empty_cache: bool = True) -> None:
    """Offload the local shards of params, grads and buffers to pinned host homes (the model keeps its device).

    Args:
        model: an FSDP2 (``fully_shard``) or plain module; FSDP1 goes to verl's own function.
        empty_cache: hand the released device memory back to the driver.
    """
    if _is_fsdp1(model):
        return _fsdp1("offload_fsdp_model_to_cpu", model, empty_cache)
    state = model_state(model)
    with _empty_cache(state, empty_cache):
        state.offload()
    return None


@torch.no_grad()
def load_fsdp_model_to_gpu(model: Any) -> None:
    """Bring the local shards back to the device: the same tensor objects, the same values."""
    if _is_fsdp1(model):
        return _fsdp1("load_fsdp_model_to_gpu", model)
    model_state(model).onload()
    return None


@torch.no_grad()
def offload_fsdp_optimizer(optimizer: Any) -> None:
    """Offload every optimizer state tensor (local shards) to pinned host homes; nothing before the first step."""
    if not optimizer.state:
        return
    optimizer_state(optimizer).offload("optim")


@torch.no_grad()
def load_fsdp_optimizer(optimizer: Any, device_id: Any) -> None:
    """Bring the optimizer state back to the device it was offloaded from.

    Args:
        optimizer: the optimizer.
        device_id: verl's target device; the state goes back where it lived (its own device), with a
            warning if that is not ``device_id``.
    """
    if not optimizer.state:
        return
    state = optimizer_state(optimizer)
    want = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    elsewhere = sorted(
        {
            str(s.device)
            for s in core_of(state).slots("optim")
            if s.device.type != want.type or (want.index is not None and s.device.index not in (None, want.index))
        }
    )
    if elsewhere:
        warnings.warn(
            f"load_fsdp_optimizer: the optimizer state goes back to {', '.join(elsewhere)}, where it lived, not to {want}",
            stacklevel=2,
        )
    state.onload("optim")


def _first_dtensor_spec(model: Any, function: str) -> Any:
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            return p._spec
    raise ObjectError("backend", f"{function}: no DTensor parameter in the model (is it wrapped with fully_shard?)")


@torch.no_grad()
def fsdp2_sharded_save_to_cpu(model: Any) -> tuple[SnapshotHandle, Any]:
    """A snapshot of this rank's local shards of params and buffers, wherever they live (offloaded too).

    Returns:
        ``(handle, global_spec)``: a ``SnapshotHandle`` for ``fsdp2_sharded_load_from_cpu`` and the
        ``DTensorSpec`` of the first DTensor parameter (verl's second value).

    Raises:
        ObjectError("backend"): the model has no DTensor parameter.
    """
    spec = _first_dtensor_spec(model, "fsdp2_sharded_save_to_cpu")
    state = model_state(model)
    return take(state, "fsdp2", state.forward_groups), spec


@torch.no_grad()
def fsdp2_sharded_load_from_cpu(model: Any, cpu_sharded_state: SnapshotHandle, target_spec: Any) -> None:
    """Write the handle's shards back into the model, wherever each lives now; then a barrier (as verl).

    Args:
        model: the FSDP2 model the handle was taken from.
        cpu_sharded_state: the handle from ``fsdp2_sharded_save_to_cpu``.
        target_spec: the spec returned with it; its device mesh must be the model's.

    Raises:
        ObjectError("snapshot_handle"): not such a handle (e.g. verl's own dict); nothing changed.
        LayoutError("mismatch"): another device mesh, or the model's tensors changed (names the first); nothing changed.
    """
    current = _first_dtensor_spec(model, "fsdp2_sharded_load_from_cpu").device_mesh
    state = model_state(model)
    snap = check_handle(cpu_sharded_state, state, "fsdp2", "fsdp2_sharded_load_from_cpu")
    if getattr(target_spec, "device_mesh", None) != current:
        raise LayoutError(
            "mismatch",
            f"target_spec's mesh {getattr(target_spec, 'device_mesh', target_spec)} is not the model's {current}",
            tensor="(device mesh)",
            field="meta",
        )
    state.restore(snap)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
