"""A small, faithful CPU fake of megatron-core 0.16.1's model-state layout.

Real megatron-core cannot build its DDP buffers or optimizers without CUDA
(``param_and_grad_buffer.py:800`` calls ``torch.cuda.current_device()``;
``optimizer.py:485`` allocates ``device='cuda'``), so CPU tests use this fake.
Every class and attribute names the real one it mirrors as ``file:line`` in
megatron-core 0.16.1 (paths relative to ``megatron/core/``). See
``docs/megatron-layout.md`` for the layout and the pitfalls.

What is faithful (the parts a state-moving library touches):

* one ``FakeParamAndGradBuffer`` per (param dtype, grad dtype), dense params in
  ``ddp.buffers``, ``allreduce=False`` params in ``ddp.expert_parallel_buffers``,
  frozen params (``requires_grad=False``) in no buffer at all;
* params are mapped in reverse order, with the distributed-optimizer padding
  (param starts at multiples of 64 elements, bucket ends at multiples of
  lcm(dp, 128)); ``param.data`` is set to a view of ``param_data`` and
  ``param.main_grad`` is a view of ``grad_data``; buckets hold their own views;
* ``param_data is None`` when ``use_distributed_optimizer=False``;
* ``offload_to_cpu`` / ``reload_from_cpu`` release and regrow the storage in
  place (``resize_``) and keep the values in ``param_data_cpu`` like the real
  ones; grads are dropped and come back zeroed;
* the DDP's grad-accumulator hooks add ``param.grad`` into ``main_grad``;
* optimizers keep the real attribute names and the real aliasing (fp32 master
  shards are clones, fp32 model-param shards are views into ``param_data``,
  master grads alias ``grad_data`` when it is fp32, the step writes back into
  the buffer through ``bucket.param_data`` views);
* the MoE router's ``expert_bias`` is a registered fp32 buffer, cast to bf16 by
  the Float16Module and swapped back to fp32 (``.data =``) at the first forward;
  the forward only accumulates ``local_tokens_per_expert`` and the bias is
  updated in ``fake_finalize_model_grads`` (as in the real
  ``finalize_model_grads``).

Deliberate differences (all because there is one process and maybe no GPU):
data-parallel world size is 1 (no collectives, each rank owns whole buckets);
``offload_to_cpu`` on a buffer that already lives on the CPU clones instead of
``.cpu()`` (which would alias and lose the values) and pins only when an
accelerator exists; the optimizer ``offload_to_cpu``/``restore_from_cpu`` move
between the buffers' device and the CPU instead of hard-coding CUDA; no fp8,
no nccl_ub, no overlap_param_gather hooks, no TE/Apex fused Adam (the real code
falls back to ``torch.optim.AdamW`` without them, ``optimizer/__init__.py:31``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import (
    Any,
)

import torch

MCORE_VERSION = "0.16.1"

__all__ = [
    "MCORE_VERSION",
    "BufferType",
    "FakeChainedOptimizer",
    "FakeDDP",
    "FakeDenseModel",
    "FakeDistributedDataParallel",
    "FakeDistributedDataParallelConfig",
    "FakeDistributedOptimizer",
    "FakeFP32Optimizer",
    "FakeFloat16Module",
    "FakeFloat16OptimizerWithFloat16Params",
    "FakeMegatronOptimizer",
    "FakeMixedPrecisionOptimizer",
    "FakeMoELayer",
    "FakeMoEModel",
    "FakeOptimizerConfig",
    "FakeParamAndGradBucket",
    "FakeParamAndGradBucketGroup",
    "FakeParamAndGradBuffer",
    "FakeProxyDict",
    "FakeTopKRouter",
    "build_fake_ddp",
    "build_fake_optimizer",
    "fake_finalize_model_grads",
    "fake_partition_buckets",
    "fake_train_step",
]


# --------------------------------------------------------------------------- configs


class BufferType(Enum):
    """distributed/param_and_grad_buffer.py:47 ``BufferType``."""

    PARAM = 1
    GRAD = 2


@dataclass
class FakeDistributedDataParallelConfig:
    """The fields of distributed/distributed_data_parallel_config.py that shape the layout.

    Defaults are the real ones (grad_reduce_in_fp32:11, overlap_grad_reduce:14,
    use_distributed_optimizer:25, bucket_size:41), except that the builder
    passes ``grad_reduce_in_fp32=True`` as GPU.md's runs did.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False


@dataclass
class FakeOptimizerConfig:
    """The fields of optimizer/optimizer_config.py that the fake uses (defaults as there:
    weight_decay:162, adam_beta1:236, adam_beta2:241, adam_eps:246, clip_grad:331)."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = True
    fp16: bool = False
    use_distributed_optimizer: bool = True
    log_num_zeros_in_grad: bool = False


# --------------------------------------------------------------------------- helpers


def _storage_numel(t: torch.Tensor) -> int:
    """``t.storage().size()`` of the real code (elements of a TypedStorage), without the
    TypedStorage deprecation warning."""
    return t.untyped_storage().nbytes() // t.element_size()


def _resize_storage(t: torch.Tensor, numel: int) -> None:
    """``t.storage().resize_(numel)`` of the real code, in elements."""
    t.untyped_storage().resize_(numel * t.element_size())


def _host_copy_like_cpu_pin(t: torch.Tensor) -> torch.Tensor:
    """Stand-in for ``t.cpu().pin_memory()`` (param_and_grad_buffer.py:976).

    On a device tensor this is exactly the real call. On a CPU tensor ``.cpu()``
    returns the same tensor, so the real code would keep an alias of the storage it
    is about to free; the fake clones instead, and pins only where an accelerator
    exists (``pin_memory()`` raises on a machine without one).
    """
    if t.device.type != "cpu":
        return t.cpu().pin_memory()
    out = t.detach().clone()
    if _accelerator_available():
        out = out.pin_memory()
    return out


def _accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6
    return bool(acc.is_available()) if acc is not None else torch.cuda.is_available()


def _pad(number: int, divisor: int) -> int:
    return int(math.ceil(number / divisor) * divisor)


# --------------------------------------------------------------------------- buckets


class FakeParamAndGradBucket:
    """distributed/param_and_grad_buffer.py:68 ``_ParamAndGradBucket``."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        param_data: torch.Tensor | None,
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
    ):
        #: :94 list of params in mapping order; :95 the same as a set.
        self.params_list = params
        self.params = set(params)
        assert len(self.params_list) == len(self.params)
        #: :98 a 1-D view of buffer.param_data[offset:offset+n] (None when the buffer has none).
        self.param_data = param_data
        #: :99 a 1-D view of buffer.grad_data[offset:offset+n].
        self.grad_data = grad_data
        #: :102 start of this bucket inside the buffer (elements).
        self.offset = offset
        #: :103
        self.numel_unpadded = numel_unpadded
        #: :104
        self.gradient_scaling_factor = gradient_scaling_factor
        #: :105
        self.bucket_id = bucket_id
        #: :106-110 param -> (start, end) *packed without padding*, i.e. not the buffer layout.
        self.param_to_index: dict[torch.nn.Parameter, tuple[int, int]] = {}
        pos = 0
        for p in params:
            self.param_to_index[p] = (pos, pos + p.numel())
            pos += p.numel()


class FakeParamAndGradBucketGroup:
    """distributed/param_and_grad_buffer.py:113 ``_ParamAndGradBucketGroup`` (dp world size 1:
    the collectives are no-ops)."""

    def __init__(self, buckets: list[FakeParamAndGradBucket], ddp_config):
        #: :135
        self.buckets = buckets
        #: :136
        self.ddp_config = ddp_config
        #: :147-152
        self.param_to_bucket = {}
        self.params = set()
        for bucket in buckets:
            for p in bucket.params_list:
                self.param_to_bucket[p] = bucket
                self.params.add(p)
        #: :154
        self.next_param_gather_bucket_group = None
        #: :181-184
        self.golden_per_param_grad_ready_counts: dict = {}
        self.per_param_grad_ready_counts: dict = {}
        self.is_last_microbatch = True
        self.is_first_batch = True
        #: :187-189
        self.param_gather_handle = None
        self.param_gather_dispatched = False
        self.grad_reduce_handle = None
        #: :197-198 lazily filled caches of *views* into bucket.param_data / bucket.grad_data.
        self.cached_param_buffer_shard_list: list[list[torch.Tensor] | None] = [None] * len(buckets)
        self.cached_grad_buffer_shard_list: list[list[torch.Tensor] | None] = [None] * len(buckets)

    def reset(self) -> None:
        """:200-210 bookkeeping only; it does not touch grad_data."""
        if self.is_first_batch and len(self.per_param_grad_ready_counts) > 0:
            self.golden_per_param_grad_ready_counts = self.per_param_grad_ready_counts
            self.is_first_batch = False
        self.per_param_grad_ready_counts = {}
        self.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """:364 with dp=1: scale by gradient_scaling_factor (1.0) and cache the local shard
        views like the real reduce-scatter path does."""
        for i, bucket in enumerate(self.buckets):
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            if self.ddp_config.use_distributed_optimizer and self.cached_grad_buffer_shard_list[i] is None:
                self.cached_grad_buffer_shard_list[i] = [bucket.grad_data[:]]

    def finish_grad_sync(self) -> None:
        """:507"""
        self.start_grad_sync()

    def start_param_sync(self, force_sync: bool = False) -> None:
        """:250 all-gather; nothing to gather with one rank."""
        for i, bucket in enumerate(self.buckets):
            if self.ddp_config.use_distributed_optimizer and self.cached_param_buffer_shard_list[i] is None:
                self.cached_param_buffer_shard_list[i] = [bucket.param_data[:]]

    def register_grad_ready(self, param, force_all_reduce: bool = False) -> None:
        """:539"""
        if self.is_last_microbatch:
            self.per_param_grad_ready_counts[param] = self.per_param_grad_ready_counts.get(param, 0) + 1


def fake_partition_buckets(
    buffers: list[FakeParamAndGradBuffer], force_single_bucket_group: bool = False
) -> list[FakeParamAndGradBucketGroup]:
    """distributed/param_and_grad_buffer.py:997 ``partition_buckets`` (no fp8 case): one group
    per bucket, or a single group when forced. Asserts distinct param dtypes like the real one."""
    if not buffers:
        return []
    dtypes = [b.param_dtype for b in buffers]
    assert len(set(dtypes)) == len(dtypes), "partition_buckets: two buffers with one param dtype"
    if force_single_bucket_group:
        return [FakeParamAndGradBucketGroup([bk for b in buffers for bk in b.buckets], buffers[0].ddp_config)]
    return [FakeParamAndGradBucketGroup([bk], b.ddp_config) for b in buffers for bk in b.buckets]


# --------------------------------------------------------------------------- the buffer


class FakeParamAndGradBuffer:
    """distributed/param_and_grad_buffer.py:564 ``_ParamAndGradBuffer``."""

    def __init__(
        self,
        ddp_config: FakeDistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: list[torch.nn.Parameter],
        bucket_size: int | None,
        param_to_name: dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float = 1.0,
        param_indices: list[int] | None = None,
        data_parallel_world_size: int = 1,
        device: torch.device | None = None,
    ):
        #: :611
        self.ddp_config = ddp_config
        #: :612 params in the order given (module order); the layout iterates them reversed.
        self.params = params
        #: :613
        self.param_indices = param_indices if param_indices is not None else list(range(len(params)))
        assert len(set(params)) == len(params)
        #: :623-628
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_world_size = data_parallel_world_size
        self.gradient_scaling_factor = gradient_scaling_factor
        self.nccl_ub = False
        #: :631 list of FakeParamAndGradBucket
        self.buckets: list[FakeParamAndGradBucket] = []
        #: :632 param -> bucket
        self.param_to_bucket: dict[torch.nn.Parameter, FakeParamAndGradBucket] = {}
        #: :633 param -> (start, end, bucket_id), element offsets into param_data / grad_data.
        self.param_index_map: dict[torch.nn.Parameter, tuple[int, int, int]] = {}
        #: :674 (start, end) of each bucket, padded.
        self.bucket_indices: list[tuple[int, int]] = []

        use_do = ddp_config.use_distributed_optimizer

        def pad_bucket_end(end: int) -> int:  # :638-656
            if not use_do:
                return end
            divisor = math.lcm(data_parallel_world_size, 128)
            if ddp_config.pad_buckets_for_high_nccl_busbw:
                divisor = math.lcm(data_parallel_world_size, 128, 2**16)
            return _pad(end, divisor)

        def pad_param_start(start: int) -> int:  # :658-666
            return _pad(start, 64) if use_do else start

        def needs_own_bucket(p) -> bool:  # :698-709
            return getattr(p, "shared_embedding", False) and use_do

        # First pass (:671-739): indices, in reverse param order.
        per_bucket_numel_unpadded: list[int] = []
        bucket_start = 0
        param_start = 0
        bucket_id = 0
        in_bucket = 0
        param_end = 0

        def close_bucket(end_of_params: int) -> int:
            nonlocal bucket_start, bucket_id, in_bucket
            per_bucket_numel_unpadded.append(end_of_params - bucket_start)
            end = pad_bucket_end(end_of_params)
            self.bucket_indices.append((bucket_start, end))
            bucket_start = end
            bucket_id += 1
            in_bucket = 0
            return end

        for p in params[::-1]:
            n = p.data.nelement()
            param_start = pad_param_start(param_start)
            if needs_own_bucket(p) and in_bucket > 0:
                param_start = close_bucket(param_start)
            param_end = param_start + n
            self.param_index_map[p] = (param_start, param_end, bucket_id)
            in_bucket += 1
            if (bucket_size is not None and param_end - bucket_start >= bucket_size) or needs_own_bucket(p):
                param_start = close_bucket(param_end)
            else:
                param_start = param_end
        if in_bucket > 0:
            close_bucket(param_end)

        #: :743 padded element count of param_data and grad_data.
        self.numel = self.bucket_indices[-1][1] if self.bucket_indices else 0
        #: :744
        self.numel_unpadded = sum(per_bucket_numel_unpadded)
        if use_do:
            assert self.numel % data_parallel_world_size == 0
        else:
            assert self.numel == self.numel_unpadded

        if device is None:
            device = params[0].device if params else torch.device("cpu")
        #: :751, :796-802 flat param storage; **None unless use_distributed_optimizer**.
        self.param_data: torch.Tensor | None = None
        if use_do:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device, requires_grad=False)
        #: :803-808 flat grad storage (always present).
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device, requires_grad=False)
        #: :810-812 bookkeeping of the native offload (element counts; param_data_cpu is the
        #: host copy made by offload_to_cpu and kept forever after).
        self.grad_data_size = 0
        self.param_data_size = 0
        self.param_data_cpu: torch.Tensor | None = None

        # Second pass (:814-869): point param.data / param.main_grad into the buffers, make buckets.
        bucket_params: list[torch.nn.Parameter] = []
        cur_bucket_id = 0
        for p in params[::-1]:
            start, _end, b_id = self.param_index_map[p]
            if self.param_data is not None:
                new_data = self._get(p.data.shape, start, BufferType.PARAM)
                old = p.data
                p.data = new_data  # :831
                assert old._base is None
                p.data.detach().copy_(old)  # :834
                del old
            p.main_grad = self._get(p.data.shape, start, BufferType.GRAD)  # :837
            if b_id != cur_bucket_id:
                s, e = self.bucket_indices[cur_bucket_id]
                self.buckets.append(self._new_bucket(bucket_params, s, e, per_bucket_numel_unpadded[cur_bucket_id], cur_bucket_id))
                bucket_params = []
                cur_bucket_id = b_id
            bucket_params.append(p)
        if bucket_params:
            s, e = self.bucket_indices[cur_bucket_id]
            self.buckets.append(self._new_bucket(bucket_params, s, e, per_bucket_numel_unpadded[cur_bucket_id], cur_bucket_id))

    def scale_gradients(self, scaling_factor: float) -> None:
        """:894"""
        self.grad_data *= scaling_factor

    def _get(self, shape: torch.Size, start_index: int, buffer_type: BufferType) -> torch.Tensor:
        """:898-913 a view of the flat buffer with ``shape``."""
        end_index = start_index + shape.numel()
        assert end_index <= self.numel
        if buffer_type == BufferType.PARAM:
            assert self.param_data is not None
            t = self.param_data[start_index:end_index]
        else:
            t = self.grad_data[start_index:end_index]
        return t.view(shape)

    def _new_bucket(self, bucket_params, start_index, end_index, numel_unpadded, bucket_id) -> FakeParamAndGradBucket:
        """:915-956"""
        assert (start_index, end_index) == self.bucket_indices[bucket_id]
        pd = None
        if self.param_data is not None:
            pd = self._get(torch.Size([end_index - start_index]), start_index, BufferType.PARAM)
        gd = self._get(torch.Size([end_index - start_index]), start_index, BufferType.GRAD)
        bucket = FakeParamAndGradBucket(
            params=bucket_params,
            param_data=pd,
            grad_data=gd,
            offset=start_index,
            numel_unpadded=numel_unpadded,
            gradient_scaling_factor=self.gradient_scaling_factor,
            bucket_id=bucket_id,
        )
        for p in bucket_params:
            assert p not in self.param_to_bucket
            self.param_to_bucket[p] = bucket
        return bucket

    def reset(self) -> None:
        """:958-962 ``grad_data.zero_()`` (crashes if grad storage is released)."""
        self.grad_data.zero_()

    def offload_to_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        """:964-977. Grads: record the size and ``resize_(0)`` (values dropped). Params: record
        the size, copy into ``param_data_cpu`` (allocated on the first call, reused and copied
        ``non_blocking`` later), then ``resize_(0)``. Grads are released before params are
        copied, so a failure in the param half leaves grads released."""
        if move_grads and self.grad_data is not None and _storage_numel(self.grad_data) > 0:
            self.grad_data_size = _storage_numel(self.grad_data)
            _resize_storage(self.grad_data, 0)
        if move_params and self.param_data is not None and _storage_numel(self.param_data) > 0:
            self.param_data_size = _storage_numel(self.param_data)
            if self.param_data_cpu is not None:
                self.param_data_cpu.copy_(self.param_data, non_blocking=True)
            else:
                self.param_data_cpu = _host_copy_like_cpu_pin(self.param_data)
            _resize_storage(self.param_data, 0)

    def reload_from_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        """:979-994. Params are regrown only if storage is empty *and* param_data_cpu exists
        (whoever released them); ``param_data_size`` is not reset and ``param_data_cpu`` is
        kept. Grads are regrown only if ``grad_data_size > 0`` and come back zeroed."""
        if (
            move_params
            and self.param_data is not None
            and self.param_data_cpu is not None
            and _storage_numel(self.param_data) == 0
        ):
            _resize_storage(self.param_data, self.param_data_size)
            self.param_data.copy_(self.param_data_cpu, non_blocking=True)
        if move_grads and self.grad_data is not None and self.grad_data_size > 0:
            _resize_storage(self.grad_data, self.grad_data_size)
            self.grad_data.zero_()
            self.grad_data_size = 0


# --------------------------------------------------------------------------- modules


def _fp32_to_float16(val, convert):
    if isinstance(val, torch.Tensor):
        return convert(val) if val.dtype == torch.float32 else val
    if isinstance(val, (tuple, list)):
        return type(val)(_fp32_to_float16(v, convert) for v in val)
    return val


def _float16_to_fp32(val):
    if isinstance(val, torch.Tensor):
        return val.float() if val.dtype in (torch.float16, torch.bfloat16) else val
    if isinstance(val, (tuple, list)):
        return type(val)(_float16_to_fp32(v) for v in val)
    return val


class FakeFloat16Module(torch.nn.Module):
    """transformer/module.py:412 ``Float16Module``: ``self.module = module.bfloat16()`` (:440),
    which casts params in place (same Parameter objects) and *replaces* float buffers such as
    ``expert_bias`` with new bf16 tensors; forward casts fp32 inputs to bf16 and bf16 outputs
    to fp32 (:453-496); ``state_dict`` delegates to the inner module, so its keys have no
    ``module.`` prefix (:498-501) while ``named_parameters`` do."""

    def __init__(self, module: torch.nn.Module, bf16: bool = True):
        super().__init__()
        self.fp16 = not bf16
        self.bf16 = bf16
        if bf16:
            self.add_module("module", module.bfloat16())
            self.float16_convertor = lambda v: v.bfloat16()
        else:
            self.add_module("module", module.half())
            self.float16_convertor = lambda v: v.half()

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        inputs = _fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if fp32_output:
            outputs = _float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict=strict)


class FakeDistributedDataParallel(torch.nn.Module):
    """distributed/distributed_data_parallel.py:22 ``DistributedDataParallel`` (with
    distributed/data_parallel_base.py:11 ``_BaseDataParallel``), dp world size 1."""

    def __init__(
        self,
        ddp_config: FakeDistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        config: Any = None,
    ):
        super().__init__()
        #: data_parallel_base.py:16 the wrapped model (a Float16Module in bf16 runs).
        self.module = module
        #: MegatronModule.config (TransformerConfig in the real one).
        self.config = config
        if not ddp_config.overlap_grad_reduce:  # :66-68
            ddp_config.bucket_size = None
        #: :70
        self.ddp_config = ddp_config
        #: :95-102
        self.bucket_size = None if disable_bucketing else ddp_config.bucket_size
        self.force_all_reduce = False
        #: :104 param -> bucket group (only params that are in a buffer).
        self.param_to_bucket_group: dict[torch.nn.Parameter, FakeParamAndGradBucketGroup] = {}

        param_to_name: dict[torch.nn.Parameter, str] = {}
        dense_params: list[torch.nn.Parameter] = []
        expert_parallel_params: list[torch.nn.Parameter] = []
        #: :110 trainable params only; frozen params are skipped (:111-113) and get no buffer,
        #: no main_grad, no hook, no optimizer state.
        self.params_with_grad: list[torch.nn.Parameter] = []
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            self.params_with_grad.append(p)
            p.grad_added_to_main_grad = False
            param_to_name[p] = name
            if getattr(p, "allreduce", True):  # :122-125
                dense_params.append(p)
            else:
                expert_parallel_params.append(p)

        def allocate(input_params):  # :127-252
            by_dtype: dict[tuple[torch.dtype, torch.dtype], list[torch.nn.Parameter]] = {}
            indices: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
            for p in input_params:
                grad_dtype = torch.float if ddp_config.grad_reduce_in_fp32 else p.dtype
                key = (p.dtype, grad_dtype)
                by_dtype.setdefault(key, []).append(p)
                indices.setdefault(key, []).append(len(indices.get(key, [])))
            buffers = [
                FakeParamAndGradBuffer(ddp_config, pd, gd, ps, self.bucket_size, param_to_name, 1.0, indices[(pd, gd)])
                for (pd, gd), ps in by_dtype.items()
            ]
            groups = fake_partition_buckets(buffers, force_single_bucket_group=disable_bucketing)
            for g in groups:
                for b in g.buckets:
                    for p in b.params_list:
                        self.param_to_bucket_group[p] = g
            return buffers, groups

        #: :291-293 one buffer per (param dtype, grad dtype) for dense params.
        self.buffers, self.bucket_groups = allocate(dense_params)
        #: :296-302 the same for params with ``allreduce=False`` (expert parallel).
        self.expert_parallel_buffers, self.expert_parallel_bucket_groups = allocate(expert_parallel_params)

        #: :320-345 grad-accumulator hooks; they keep ``param`` alive and write into main_grad.
        self.grad_accs = []
        for p in self.module.parameters():
            if p.requires_grad:
                tmp = p.expand_as(p)
                grad_acc = tmp.grad_fn.next_functions[0][0]
                grad_acc.register_hook(self._make_backward_post_hook(p))
                self.grad_accs.append(grad_acc)
        #: :347-353 (overlap_param_gather is not modelled: no forward pre-hooks)
        self.use_forward_hook = False
        self.remove_forward_pre_hook_handles: dict = {}
        self.overlap_param_gather_with_optimizer_step = False

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        """:420-448 add ``param.grad`` into ``param.main_grad`` and drop ``param.grad``."""

        def hook(*unused):
            if param in self.param_to_bucket_group:
                assert param.requires_grad
                if param.grad is not None and (
                    not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)
                ):
                    param.main_grad.add_(param.grad.data)
                param.grad = None
                if self.ddp_config.overlap_grad_reduce:
                    self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)

        return hook

    def forward(self, *inputs, **kwargs):
        """data_parallel_base.py:18-22"""
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """:450-461"""
        groups = self.bucket_groups + self.expert_parallel_bucket_groups
        for g in groups:
            g.is_last_microbatch = False
        try:
            yield
        finally:
            for g in groups:
                g.is_last_microbatch = True

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """:463"""
        for g in self.bucket_groups + self.expert_parallel_bucket_groups:
            g.start_param_sync(force_sync=force_sync)

    def start_grad_sync(self, *unused):
        """:513"""
        for g in self.bucket_groups + self.expert_parallel_bucket_groups:
            g.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        """:525"""
        for g in self.bucket_groups + self.expert_parallel_bucket_groups:
            g.finish_grad_sync()

    def scale_gradients(self, scaling_factor: float):
        """:537"""
        for b in self.buffers + self.expert_parallel_buffers:
            b.scale_gradients(scaling_factor)

    def zero_grad_buffer(self):
        """:542-556 reset ``grad_added_to_main_grad``, ``grad_data.zero_()`` on every buffer,
        reset every bucket group."""
        for p in self.params_with_grad:
            p.grad_added_to_main_grad = False
        for b in self.buffers + self.expert_parallel_buffers:
            b.reset()
        for g in self.bucket_groups + self.expert_parallel_bucket_groups:
            g.reset()

    def broadcast_params(self):
        """:558 (one rank: nothing to do)."""

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        """:575-594 ``offload_to_cpu(move_params=False, move_grads=True)`` on every buffer."""
        if synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()
        for b in self.buffers + self.expert_parallel_buffers:
            b.offload_to_cpu(move_params=False, move_grads=True)
        if empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """:596-611 ``reload_from_cpu(move_params=False, move_grads=True)`` on every buffer."""
        for b in self.buffers + self.expert_parallel_buffers:
            b.reload_from_cpu(move_params=False, move_grads=True)
        if synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()

    def state_dict(self, prefix="", keep_vars=False, destination=None):
        """data_parallel_base.py:73-82 delegates to the wrapped module (no ``module.`` prefix)."""
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars, destination=destination)

    def load_state_dict(self, state_dict, strict=True):
        """data_parallel_base.py:90-96"""
        self.module.load_state_dict(state_dict, strict=strict)


#: Short alias used in the brief.
FakeDDP = FakeDistributedDataParallel


# --------------------------------------------------------------------------- optimizers


def _zero_grad_group_helper(group: Iterable[torch.Tensor], set_to_none: bool) -> None:
    """optimizer/optimizer.py:57-75 (reading ``.grad`` of the non-leaf fp32 shard views warns in
    the real code too; the fake silences that one warning)."""
    for p in group:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            has_grad = getattr(p, "grad", None) is not None
        if has_grad:
            if set_to_none:
                p.grad = None
            else:
                g = p.grad
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()


def _is_float16(t: torch.Tensor) -> bool:
    """Stand-in for ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']``
    (distrib_optimizer.py:361, optimizer.py:671), which is False on CPU in the real code."""
    return t.dtype in (torch.float16, torch.bfloat16)


def _build_param_groups(model_chunks: Sequence[torch.nn.Module], expert: bool | None) -> list[dict]:
    """optimizer/__init__.py:108-229 ``_get_param_groups`` with the standard overrides (:70-96):
    trainable params only; bias / 1-D params get ``wd_mult=0``; groups sorted default-first;
    ``expert`` selects dense (False), expert-parallel (True) or both (None)."""
    groups: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            is_ep = not getattr(p, "allreduce", True)
            if expert is not None and is_ep != expert:
                continue
            wd_mult = 0.0 if (len(p.shape) == 1 or name.endswith(".bias")) else 1.0
            groups.setdefault((wd_mult, is_ep), []).append(p)
    out = []
    for (wd_mult, is_ep) in sorted(groups, key=lambda k: (k[0] != 1.0, k[1])):
        out.append({"params": groups[(wd_mult, is_ep)], "is_expert_parallel": is_ep, "wd_mult": wd_mult, "lr_mult": 1.0})
    return out


def _make_inner_adam(param_groups: list[dict], config: FakeOptimizerConfig) -> torch.optim.Optimizer:
    """optimizer/__init__.py:345-378: without TE/Apex the inner optimizer is
    ``torch.optim.AdamW`` (decoupled_weight_decay defaults to True); it is a subclass of
    ``torch.optim.Adam``. The per-group weight decay is ``weight_decay * wd_mult`` (set by the
    real param scheduler)."""
    for g in param_groups:
        g["weight_decay"] = config.weight_decay * g["wd_mult"]
    return torch.optim.AdamW(
        param_groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        foreach=False,
    )


class FakeMegatronOptimizer:
    """optimizer/optimizer.py:99 ``MegatronOptimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: FakeOptimizerConfig):
        #: :116 the inner torch optimizer; its ``.state`` is keyed by master tensors.
        self.optimizer = optimizer
        #: :122
        self.config = config
        self.is_stub_optimizer = optimizer is None

    # :278-285 ``state`` is the inner optimizer's state (a property).
    def _get_state(self):
        return self.optimizer.state

    def _set_state(self, value):
        self.optimizer.state = value

    state = property(_get_state, _set_state)

    # :287-300
    def _get_param_groups(self):
        return [] if self.is_stub_optimizer else self.optimizer.param_groups

    def _set_param_groups(self, value):
        self.optimizer.param_groups = value

    param_groups = property(_get_param_groups, _set_param_groups)

    def get_parameters(self) -> list[torch.Tensor]:
        """:125-134 the inner optimizer's params (masters / shards)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer else []

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """:136 (no dedup of shared / TP-duplicated params needed with one rank)."""
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def get_grad_norm(self) -> float:
        """:195"""
        grads = self.get_main_grads_for_grad_norm()
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    def clip_grad_norm(self, clip_grad: float) -> float:
        """:203"""
        norm = self.get_grad_norm()
        coef = clip_grad / (norm + 1.0e-6)
        if coef < 1.0:
            for g in self.get_main_grads_for_grad_norm():
                g.mul_(coef)
        return norm

    def count_zeros(self) -> float:
        """:223"""
        return float(sum((g == 0).sum().item() for g in self.get_main_grads_for_grad_norm()))

    def offload_to_cpu(self) -> None:
        """:344-362 moves every inner-optimizer param (``p.data = p.data.cpu()``) and *replaces*
        every state tensor (``state[k] = v.cpu()``) with a pageable CPU copy. Fake: "device" is
        wherever the tensor is; CPU tensors are left alone (as with ``is_cuda`` False)."""
        if self.optimizer is None or self.is_stub_optimizer:
            return
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if isinstance(p, torch.Tensor) and p.device.type != "cpu":
                    self._offloaded_device = p.device
                    p.data = p.data.cpu()
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    self._offloaded_device = v.device
                    st[k] = v.cpu()

    def restore_from_cpu(self) -> None:
        """:364-381 the reverse (``p.data = p.data.cuda()``, ``state[k] = v.cuda()``), which in
        the real code also moves the CPU ``step`` scalars to CUDA. Fake: back to the device
        recorded by offload_to_cpu; a no-op if nothing was moved."""
        dev = getattr(self, "_offloaded_device", None)
        if self.optimizer is None or self.is_stub_optimizer or dev is None:
            return
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if isinstance(p, torch.Tensor) and p.device.type == "cpu":
                    p.data = p.data.to(dev)
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    st[k] = v.to(dev)


class FakeMixedPrecisionOptimizer(FakeMegatronOptimizer):
    """optimizer/optimizer.py:437 ``MixedPrecisionOptimizer`` (bf16, no grad scaler)."""

    def __init__(self, optimizer, config):
        super().__init__(optimizer, config)
        #: :462 None for bf16 without loss scale.
        self.grad_scaler = None

    def prepare_grads(self) -> bool:
        """:524-557"""
        if not self.is_stub_optimizer:
            self._copy_model_grads_to_main_grads()
        return False

    def step_with_ready_grads(self) -> bool:
        """:560-590 inner ``optimizer.step()`` then ``_copy_main_params_to_model_params()``."""
        if not self.is_stub_optimizer:
            self.optimizer.step()
            self._copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self):
        """:593-623 returns (success, grad_norm, num_zeros_in_grad)."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = 0.0
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else 0
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def reload_model_params(self, state_dict=None):
        """:492"""
        if self.param_groups:
            self._copy_model_params_to_main_params()


class FakeFloat16OptimizerWithFloat16Params(FakeMixedPrecisionOptimizer):
    """optimizer/optimizer.py:626 ``Float16OptimizerWithFloat16Params``."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: FakeOptimizerConfig):
        super().__init__(optimizer, config)
        #: :657 model bf16/fp16 params (views into param_data if the DDP has one).
        self.float16_groups: list[list[torch.nn.Parameter]] = []
        #: :658 fp32 masters ``param.detach().clone().float()`` (:674); own storage; these
        #: replace the model params in the inner optimizer's param_groups (:680).
        self.fp32_from_float16_groups: list[list[torch.Tensor]] = []
        #: :659 fp32 model params themselves (no master copy).
        self.fp32_from_fp32_groups: list[list[torch.nn.Parameter]] = []
        for group in self.optimizer.param_groups:
            f16, f32, masters = [], [], []
            for i, p in enumerate(group["params"]):
                if not p.requires_grad:
                    continue
                if _is_float16(p):
                    f16.append(p)
                    main = p.detach().clone().float()
                    if hasattr(p, "shared"):
                        main.shared = p.shared
                    group["params"][i] = main
                    p.main_param = main  # :683
                    masters.append(main)
                    if p in self.optimizer.state:
                        self.optimizer.state[main] = self.optimizer.state.pop(p)
                elif p.dtype == torch.float32:
                    f32.append(p)
                else:
                    raise TypeError(f"Wrapped parameters must be fp32/fp16/bf16, got {p.dtype}")
            self.float16_groups.append(f16)
            self.fp32_from_float16_groups.append(masters)
            self.fp32_from_fp32_groups.append(f32)

    def zero_grad(self, set_to_none: bool = True):
        """:710-723"""
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for g in groups:
                _zero_grad_group_helper(g, set_to_none)

    def _get_model_and_main_params_data_float16(self):
        """:745-752"""
        model_data, main_data = [], []
        for mg, sg in zip(self.float16_groups, self.fp32_from_float16_groups, strict=True):
            for m, s in zip(mg, sg, strict=True):
                model_data.append(m.data)
                main_data.append(s.data)
        return model_data, main_data

    def _copy_model_grads_to_main_grads(self):
        """:754-772 ``main.grad = model.main_grad.float()`` (the *same tensor* as main_grad,
        i.e. a view of grad_data, when grads are fp32); fp32 params get ``grad = main_grad``."""
        for mg, sg in zip(self.float16_groups, self.fp32_from_float16_groups, strict=True):
            for m, s in zip(mg, sg, strict=True):
                if hasattr(m, "main_grad"):
                    s.grad = m.main_grad.float()
                elif m.grad is not None:
                    s.grad = m.grad.float()
                m.grad = None
        for mg in self.fp32_from_fp32_groups:
            for m in mg:
                m.grad = m.main_grad

    def _copy_main_params_to_model_params(self):
        """:774-779 plain loop copy for bf16 (``overflow_buf`` is None, :78-95)."""
        model_data, main_data = self._get_model_and_main_params_data_float16()
        for this, that in zip(main_data, model_data, strict=True):
            that.copy_(this)

    def _copy_model_params_to_main_params(self, state_dict=None):
        """:781-787"""
        model_data, main_data = self._get_model_and_main_params_data_float16()
        for this, that in zip(model_data, main_data, strict=True):
            that.copy_(this)

    def state_dict(self):
        """:789-797"""
        return {"optimizer": self.optimizer.state_dict(), "fp32_from_fp16_params": self.fp32_from_float16_groups}


class FakeFP32Optimizer(FakeMegatronOptimizer):
    """optimizer/optimizer.py:890 ``FP32Optimizer`` (no masters: the inner optimizer updates
    the model params directly; ``param.grad = param.main_grad`` at :936)."""

    def zero_grad(self, set_to_none: bool = True):
        for g in self.optimizer.param_groups:
            _zero_grad_group_helper(g["params"], set_to_none)

    def prepare_grads(self) -> bool:
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if hasattr(p, "main_grad"):
                    p.grad = p.main_grad
        return False

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    @torch.no_grad()
    def step(self):
        self.prepare_grads()
        grad_norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0.0 else None
        return self.step_with_ready_grads(), grad_norm, None

    def reload_model_params(self, state_dict=None):
        pass

    def state_dict(self):
        return self.optimizer.state_dict()


@dataclass
class _Range:
    """optimizer/distrib_optimizer.py:62 ``Range``."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


class FakeDistributedOptimizer(FakeMixedPrecisionOptimizer):
    """optimizer/distrib_optimizer.py:97 ``DistributedOptimizer`` with dp world size 1 (this
    rank owns every bucket whole, so each shard is the whole param)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: FakeOptimizerConfig,
        model_chunks: list[FakeDistributedDataParallel],
        per_model_buffers: dict[int, list[FakeParamAndGradBuffer]],
    ):
        super().__init__(optimizer, config)
        #: :528
        self.model_chunks = model_chunks
        self.ddp_config = model_chunks[0].ddp_config
        #: :534 the same buffer objects as ``ddp.buffers`` / ``ddp.expert_parallel_buffers``.
        self.buffers: list[FakeParamAndGradBuffer] = [b for bs in per_model_buffers.values() for b in bs]
        self.per_model_buffers = per_model_buffers
        #: :548-550 a second set of bucket-group objects over the same buckets.
        #: (Partitioned buffer by buffer, which for non-fp8 buffers gives the same groups and
        #: lets the fake's "distrib" kind hold dense and expert buffers of one dtype together.)
        self.per_model_bucket_groups = {
            i: [g for b in bs for g in fake_partition_buckets([b])] for i, bs in per_model_buffers.items()
        }
        #: :552-569 per buffer {(param_dtype, grad_dtype): [per-bucket {"param_map": {param: ranges}}]}
        self.gbuf_ranges: list[dict] = []
        for buffer in self.buffers:
            per_bucket = []
            for bucket in buffer.buckets:
                world = _Range(bucket.offset, bucket.offset + bucket.grad_data.numel())
                pmap = {}
                for p, (s, e, _b) in buffer.param_index_map.items():
                    lo, hi = max(s, world.start), min(e, world.end)
                    if hi > lo:
                        pmap[p] = {
                            "gbuf_world": _Range(lo, hi),
                            "gbuf_world_in_bucket": _Range(lo - bucket.offset, hi - bucket.offset),
                            "gbuf_local": _Range(lo - world.start, hi - world.start),
                            "param": _Range(lo - s, hi - s),
                        }
                per_bucket.append({"param_map": pmap})
            self.gbuf_ranges.append({(buffer.param_dtype, buffer.grad_dtype): per_bucket})
        #: :570 param -> (gbuf_index, dtype key, bucket_index)
        self.model_param_gbuf_map: dict[torch.nn.Parameter, tuple] = {}
        for gi, rm in enumerate(self.gbuf_ranges):
            for key, buckets in rm.items():
                for bi, r in enumerate(buckets):
                    for p in r["param_map"]:
                        self.model_param_gbuf_map[p] = (gi, key, bi)

        # :576-584 every 16-bit param gets main_param=None / main_param_sharded=True first.
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.requires_grad and _is_float16(p):
                    p.main_param = None
                    p.main_param_sharded = True

        # :587-589 ``_build_optimizer_group_ranges``: group params in *buffer* order.
        world_group = {p: gi for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        self.model_param_group_index_map: dict = {}
        self.opt_group_ranges = [{"params": []} for _ in self.optimizer.param_groups]
        for rm in self.gbuf_ranges:
            for buckets in rm.values():
                for r in buckets:
                    for p in r["param_map"]:
                        gi = world_group[p]
                        self.opt_group_ranges[gi]["params"].append(p)
                        self.model_param_group_index_map[p] = (gi, len(self.opt_group_ranges[gi]["params"]) - 1)
        for gi, gr in enumerate(self.opt_group_ranges):
            gr["orig_group"] = self.optimizer.param_groups[gi]
            gr["orig_group_idx"] = self.optimizer.param_groups[gi]

        #: :592-600 the five group lists (``_build_model_and_main_param_groups`` :307-457):
        #: model_float16_groups   model bf16 params (views into param_data)
        #: model_fp32_groups      model fp32 params (views into an fp32 param_data)
        #: shard_float16_groups   ``model_param.detach().view(-1)[range]``: views into param_data
        #: shard_fp32_groups      ``model_param.view(-1)[range]``: views into param_data, and
        #:                        *these* are the inner optimizer's params for fp32 model params
        #: shard_fp32_from_float16_groups  ``shard_model_param.clone().float()``: fp32 masters
        #:                        with their own storage (:399)
        self.model_float16_groups: list[list[torch.nn.Parameter]] = []
        self.model_fp32_groups: list[list[torch.nn.Parameter]] = []
        self.shard_float16_groups: list[list[torch.Tensor]] = []
        self.shard_fp32_groups: list[list[torch.Tensor]] = []
        self.shard_fp32_from_float16_groups: list[list[torch.Tensor]] = []
        for gr in self.opt_group_ranges:
            mf16, mf32, sf16, sf32, smain = [], [], [], [], []
            for mp in gr["params"]:
                prange = self._get_model_param_range_map(mp)["param"]
                if _is_float16(mp):
                    shard_model = mp.detach().view(-1)[prange.start : prange.end]
                    shard_main = shard_model.clone().float()
                    if hasattr(mp, "shared"):
                        shard_model.shared = mp.shared
                        shard_main.shared = mp.shared
                    mp.main_param = shard_main  # :411
                    mp.main_param_sharded = True  # :412
                    mf16.append(mp)
                    sf16.append(shard_model)
                    smain.append(shard_main)
                elif mp.dtype == torch.float32:
                    shard_model = mp.view(-1)[prange.start : prange.end]  # :421 (keeps grad_fn)
                    mf32.append(mp)
                    sf32.append(shard_model)
                else:
                    raise TypeError(f"Wrapped parameters must be fp32/fp16/bf16, got {mp.dtype}")
            gr["orig_group"]["params"] = [*sf32, *smain]  # :441-444
            self.model_float16_groups.append(mf16)
            self.model_fp32_groups.append(mf32)
            self.shard_float16_groups.append(sf16)
            self.shard_fp32_groups.append(sf32)
            self.shard_fp32_from_float16_groups.append(smain)
        # :607-608 assigned directly (bypasses add_param_group's leaf check), then a state round trip.
        self.optimizer.param_groups = [g["orig_group"] for g in self.opt_group_ranges]
        self.optimizer.load_state_dict(self.optimizer.state_dict())

    def _get_model_param_range_map(self, param):
        """:610-618"""
        gi, key, bi = self.model_param_gbuf_map[param]
        return self.gbuf_ranges[gi][key][bi]["param_map"][param]

    def zero_grad(self, set_to_none: bool = True):
        """:2269-2298"""
        for groups in (
            self.model_float16_groups,
            self.model_fp32_groups,
            self.shard_float16_groups,
            self.shard_fp32_groups,
            self.shard_fp32_from_float16_groups,
        ):
            for g in groups:
                _zero_grad_group_helper(g, set_to_none)

    def _copy_model_grads_to_main_grads(self):
        """:2386-2427 ``shard_main.grad = main_grad.view(-1)[range].float()``: a view of
        grad_data (no copy) when grad_data is fp32."""

        def copy(model_groups, shard_groups):
            for mg, sg in zip(model_groups, shard_groups, strict=True):
                for mp, sp in zip(mg, sg, strict=True):
                    r = self._get_model_param_range_map(mp)["param"]
                    assert r.size == sp.nelement()
                    sp.grad = mp.main_grad.view(-1)[r.start : r.end].float()

        copy(self.model_float16_groups, self.shard_fp32_from_float16_groups)
        copy(self.model_fp32_groups, self.shard_fp32_groups)

    def _copy_main_params_to_model_params(self):
        """:2429-2479 writes each master into ``buffers[g].buckets[b].param_data`` (the bucket's
        view), not through ``param.data``."""

        def copy(shard_groups, model_groups):
            for sg, mg in zip(shard_groups, model_groups, strict=True):
                for sp, mp in zip(sg, mg, strict=True):
                    wr = self._get_model_param_range_map(mp)["gbuf_world_in_bucket"]
                    assert wr.size == sp.nelement()
                    gi, _k, bi = self.model_param_gbuf_map[mp]
                    bucket_pd = self.buffers[gi].buckets[bi].param_data
                    bucket_pd.view(-1)[wr.start : wr.end].data.copy_(sp)

        copy(self.shard_fp32_from_float16_groups, self.model_float16_groups)
        copy(self.shard_fp32_groups, self.model_fp32_groups)

    def _copy_model_params_to_main_params(self, state_dict=None):
        """:2541-2595"""

        def copy(model_groups, shard_groups):
            for mg, sg in zip(model_groups, shard_groups, strict=True):
                for mp, sp in zip(mg, sg, strict=True):
                    r = self._get_model_param_range_map(mp)["param"]
                    sp.data.copy_(mp.view(-1)[r.start : r.end])

        copy(self.model_float16_groups, self.shard_fp32_from_float16_groups)
        copy(self.model_fp32_groups, self.shard_fp32_groups)

    def step_with_ready_grads(self) -> bool:
        """:2598-2623 parent step, then param all-gather (nothing to gather with one rank)."""
        ok = super().step_with_ready_grads()
        for chunk in self.model_chunks:
            chunk.start_param_sync()
        return ok

    def state_dict(self):
        """:628-688 only the non-parameter state (param groups without ``params``, plus a
        common ``step``); per-param state is saved through other methods."""
        inner = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in inner["state"].values()}
        out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for g in out["optimizer"]["param_groups"]:
            del g["params"]
            g["step"] = steps.pop() if len(steps) == 1 else None
        return out


class FakeProxyDict:
    """optimizer/optimizer.py:1038-1073 ``ProxyDict``: keys are ``(optimizer_index, key)``;
    a missing key returns None (``.get``); there is no ``keys``/``values``/``__contains__``."""

    def __init__(self, inner_dicts: list[dict]):
        self._inner_dicts = inner_dicts

    def __getitem__(self, key):
        idx, inner_key = key
        return self._inner_dicts[idx].get(inner_key)

    def __setitem__(self, key, value):
        idx, inner_key = key
        self._inner_dicts[idx][inner_key] = value

    def __len__(self) -> int:
        return sum(len(d) for d in self._inner_dicts)

    def __iter__(self) -> Iterator:
        for idx, d in enumerate(self._inner_dicts):
            for k in d:
                yield (idx, k)

    def items(self):
        for idx, d in enumerate(self._inner_dicts):
            for k, v in d.items():
                yield (idx, k), v


class FakeChainedOptimizer(FakeMegatronOptimizer):
    """optimizer/optimizer.py:1076 ``ChainedOptimizer``. ``get_megatron_optimizer`` always
    returns one (optimizer/__init__.py:689), even around a single optimizer."""

    def __init__(self, chained_optimizers: list[FakeMegatronOptimizer]):
        #: :1087-1097
        self.model_chunks: list = []
        self.config = chained_optimizers[0].config if chained_optimizers else None
        for o in chained_optimizers:
            for c in getattr(o, "model_chunks", []):
                if c not in self.model_chunks:
                    self.model_chunks.append(c)
        self.is_stub_optimizer = all(getattr(o, "is_stub_optimizer", False) for o in chained_optimizers)
        #: :1105
        self.chained_optimizers = chained_optimizers

    @property
    def optimizer(self):
        """:1107-1115 only valid with exactly one chained optimizer."""
        assert len(self.chained_optimizers) == 1, "ChainedOptimizer has more than one optimizer"
        return self.chained_optimizers[0].optimizer

    @property
    def param_groups(self) -> list[dict]:
        """:1117-1123"""
        return [g for o in self.chained_optimizers for g in o.param_groups]

    @property
    def state(self) -> FakeProxyDict:
        """:1125-1131"""
        return FakeProxyDict([o.state for o in self.chained_optimizers])

    def get_parameters(self):
        return [p for o in self.chained_optimizers for p in o.get_parameters()]

    def zero_grad(self, set_to_none: bool = True):
        for o in self.chained_optimizers:
            o.zero_grad(set_to_none)

    def prepare_grads(self) -> bool:
        """:1233-1239"""
        found = False
        for o in self.chained_optimizers:
            found |= o.prepare_grads()
        return found

    def step_with_ready_grads(self) -> bool:
        """:1242-1252"""
        ok = True
        for o in self.chained_optimizers:
            ok &= o.step_with_ready_grads()
        return ok

    def get_grad_norm(self) -> float:
        """:1269-1286"""
        return math.sqrt(sum(o.get_grad_norm() ** 2 for o in self.chained_optimizers))

    @torch.no_grad()
    def step(self):
        """:1308-1337 prepare all, one global norm, clip each with it, step all."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.get_grad_norm()
        for o in self.chained_optimizers:
            if o.config.clip_grad > 0.0:
                coef = o.config.clip_grad / (grad_norm + 1.0e-6)
                if coef < 1.0:
                    for g in o.get_main_grads_for_grad_norm():
                        g.mul_(coef)
        return self.step_with_ready_grads(), grad_norm, None

    def reload_model_params(self, state_dict=None):
        for o in self.chained_optimizers:
            o.reload_model_params()

    def state_dict(self):
        """:1178-1182 a single optimizer's dict, or a list of them."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [o.state_dict() for o in self.chained_optimizers]

    def offload_to_cpu(self):
        """:1414-1417"""
        for o in self.chained_optimizers:
            o.offload_to_cpu()

    def restore_from_cpu(self):
        """:1419-1422"""
        for o in self.chained_optimizers:
            o.restore_from_cpu()


# --------------------------------------------------------------------------- a tiny MoE model


class FakeTopKRouter(torch.nn.Module):
    """transformer/moe/router.py:131 ``TopKRouter`` with ``moe_router_enable_expert_bias`` and
    the sigmoid score function."""

    def __init__(self, hidden: int, num_experts: int, topk: int = 2, generator: torch.Generator | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.topk = topk
        #: router.py:52-54 an fp32 Parameter (cast to bf16 by the Float16Module).
        self.weight = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=generator) * 0.1)
        self.enable_expert_bias = True
        #: router.py:164-171 non-persistent fp32 buffer; accumulated in forward (:543), zeroed by
        #: finalize_model_grads (finalize_model_grads.py:285).
        self.register_buffer("local_tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        #: router.py:173-180 persistent fp32 buffer (in state_dict); not a parameter, so in no
        #: DDP buffer and no optimizer; updated in place by finalize_model_grads.py:315.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def _maintain_float32_expert_bias(self):
        """router.py:209-218 after the Float16Module cast, swap ``.data`` back to fp32: the
        buffer object stays, its storage changes (once)."""
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.to(torch.float32)

    def forward(self, x: torch.Tensor):
        """router.py:639-655 -> routing (:545) -> moe_utils.py:608 top-k with expert bias
        (the bias shifts the choice, :718-719, but not the probabilities)."""
        self._maintain_float32_expert_bias()
        logits = torch.nn.functional.linear(x, self.weight).float()
        scores = torch.sigmoid(logits)
        _, top = torch.topk(scores + self.expert_bias, k=self.topk, dim=-1)
        probs = scores.gather(-1, top)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True)
        if torch.is_grad_enabled():  # :539-543
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, top, routing_map


class FakeMoELayer(torch.nn.Module):
    """A SequentialMLP-like MoE layer (router + per-expert linear layers)."""

    def __init__(self, hidden: int, num_experts: int, topk: int = 2, generator=None):
        super().__init__()
        self.router = FakeTopKRouter(hidden, num_experts, topk, generator)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(num_experts)])

    def forward(self, x: torch.Tensor):
        probs, top, _ = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (probs * (top == e)).sum(dim=-1, keepdim=True).to(x.dtype)
            out = out + w * expert(x)
        return out


class FakeMoEModel(torch.nn.Module):
    """Input projection, one MoE layer, a frozen projection (``requires_grad=False``: outside
    every DDP buffer), output projection. Deterministic for a given ``seed``."""

    def __init__(self, hidden: int = 16, num_experts: int = 4, topk: int = 2, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = torch.nn.Linear(hidden, hidden)
            self.moe = FakeMoELayer(hidden, num_experts, topk, g)
            self.frozen = torch.nn.Linear(hidden, hidden)
            self.out = torch.nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.moe(h)
        h = self.frozen(h)
        return self.out(h)


class FakeDenseModel(torch.nn.Module):
    """Two linear layers and a frozen bias-free layer; deterministic for a given ``seed``."""

    def __init__(self, hidden: int = 16, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.l1 = torch.nn.Linear(hidden, hidden)
            self.frozen = torch.nn.Linear(hidden, hidden, bias=False)
            self.l2 = torch.nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.l2(self.frozen(torch.relu(self.l1(x))))


def fake_finalize_model_grads(model: list[FakeDistributedDataParallel], bias_update_rate: float = 1e-3) -> None:
    """distributed/finalize_model_grads.py:396 (what matters here): ``finish_grad_sync`` on
    each chunk, then ``_update_router_expert_bias`` (:293-315, ``expert_bias.copy_(bias +
    sign(mean - tokens) * rate)``), then ``reset_model_temporary_tensors`` (:279-290,
    ``local_tokens_per_expert.zero_()``)."""
    for chunk in model:
        chunk.finish_grad_sync()
    routers = [m for chunk in model for m in chunk.modules() if hasattr(m, "expert_bias") and m.expert_bias is not None]
    if routers:
        with torch.no_grad():
            tokens = torch.stack([r.local_tokens_per_expert for r in routers])
            bias = torch.stack([r.expert_bias for r in routers])
            avg = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1]
            updated = bias + torch.sign(avg - tokens) * bias_update_rate
            for r, u in zip(routers, updated, strict=True):
                r.expert_bias.copy_(u)
    for chunk in model:
        for m in chunk.modules():
            if hasattr(m, "expert_bias") and m.expert_bias is not None:
                m.local_tokens_per_expert.zero_()


# --------------------------------------------------------------------------- builders


def build_fake_ddp(
    module: torch.nn.Module,
    *,
    use_distributed_optimizer: bool = True,
    expert_parallel_param_filter: Callable[[str, torch.nn.Parameter], bool] | None = None,
    bf16: bool = True,
    grad_reduce_in_fp32: bool = True,
    bucket_size: int | None = None,
) -> FakeDistributedDataParallel:
    """Wrap ``module`` the way GPU.md's real run did: ``Float16Module`` (when ``bf16``), then
    ``DistributedDataParallel``.

    ``expert_parallel_param_filter(name, param)`` (names relative to ``module``) marks params
    with ``param.allreduce = False`` (what GroupedMLP/TE experts do with EP > 1,
    transformer/moe/experts.py:203-204); they go to ``ddp.expert_parallel_buffers``.
    ``bucket_size`` (elements) turns on ``overlap_grad_reduce`` so buffers split into buckets.
    """
    if expert_parallel_param_filter is not None:
        for name, p in module.named_parameters():
            if expert_parallel_param_filter(name, p):
                p.allreduce = False
    wrapped = FakeFloat16Module(module, bf16=True) if bf16 else module
    cfg = FakeDistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=bucket_size is not None,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    return FakeDistributedDataParallel(cfg, wrapped)


def _one_optimizer(chunks, config, expert: bool | None, buffer_attr: Sequence[str]):
    groups = _build_param_groups(chunks, expert)
    if not groups:
        return None
    inner = _make_inner_adam(groups, config)
    if config.use_distributed_optimizer:
        per_model = {i: [b for a in buffer_attr for b in getattr(c, a)] for i, c in enumerate(chunks)}
        return FakeDistributedOptimizer(inner, config, list(chunks), per_model)
    if config.bf16 or config.fp16:
        return FakeFloat16OptimizerWithFloat16Params(inner, config)
    return FakeFP32Optimizer(inner, config)


def build_fake_optimizer(
    ddp,
    kind: str = "distrib",
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    clip_grad: float = 1.0,
) -> FakeMegatronOptimizer:
    """Build an optimizer over ``ddp`` (a FakeDDP or a list of them).

    * ``"distrib"``: one FakeDistributedOptimizer over all buffers (dense and expert; the real
      ``get_megatron_optimizer`` would build two, see ``"chained"``). Needs a DDP built with
      ``use_distributed_optimizer=True``.
    * ``"float16"``: one FakeFloat16OptimizerWithFloat16Params over all trainable params.
    * ``"chained"``: what ``get_megatron_optimizer`` returns (optimizer/__init__.py:505-689):
      a FakeChainedOptimizer of a dense optimizer and, if there are expert-parallel params, an
      expert one; each is distributed when the DDP uses the distributed optimizer, else
      float16 (bf16 params) or FP32.
    """
    chunks = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    udo = chunks[0].ddp_config.use_distributed_optimizer
    bf16 = any(_is_float16(p) for c in chunks for p in c.parameters() if p.requires_grad)
    if kind == "distrib":
        if not udo:
            raise ValueError("kind='distrib' needs a DDP built with use_distributed_optimizer=True (param_data is None otherwise)")
        cfg = FakeOptimizerConfig(lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16, use_distributed_optimizer=True)
        return _one_optimizer(chunks, cfg, None, ("buffers", "expert_parallel_buffers"))
    if kind == "float16":
        cfg = FakeOptimizerConfig(lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=True, use_distributed_optimizer=False)
        return FakeFloat16OptimizerWithFloat16Params(_make_inner_adam(_build_param_groups(chunks, None), cfg), cfg)
    if kind == "chained":
        cfg = FakeOptimizerConfig(lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16, use_distributed_optimizer=udo)
        opts = [
            _one_optimizer(chunks, cfg, False, ("buffers",)),
            _one_optimizer(chunks, cfg, True, ("expert_parallel_buffers",)),
        ]
        return FakeChainedOptimizer([o for o in opts if o is not None])
    raise ValueError(f"unknown kind {kind!r}; expected 'distrib', 'float16' or 'chained'")


def fake_train_step(ddp, optimizer, x: torch.Tensor, target: torch.Tensor | None = None):
    """One Megatron-style step (GPU.md step 3): zero_grad_buffer, optimizer.zero_grad, forward,
    backward, finalize_model_grads (grad sync + expert-bias update), optimizer.step.
    Returns the loss (a float)."""
    chunks = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    out = chunks[0](x)
    loss = (out.float() - (target if target is not None else torch.zeros_like(out.float()))).pow(2).mean()
    loss.backward()
    loss = loss.detach()
    fake_finalize_model_grads(chunks)
    optimizer.step()
    return loss.item()
