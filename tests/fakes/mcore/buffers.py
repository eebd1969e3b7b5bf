"""Fake of megatron-core 0.16.1: configs, the param-and-grad buffer and its buckets (distributed/param_and_grad_buffer.py). See ``__init__.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

MCORE_VERSION = "0.16.1"


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
                self.buckets.append(
                    self._new_bucket(bucket_params, s, e, per_bucket_numel_unpadded[cur_bucket_id], cur_bucket_id)
                )
                bucket_params = []
                cur_bucket_id = b_id
            bucket_params.append(p)
        if bucket_params:
            s, e = self.bucket_indices[cur_bucket_id]
            self.buckets.append(
                self._new_bucket(bucket_params, s, e, per_bucket_numel_unpadded[cur_bucket_id], cur_bucket_id)
            )

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
