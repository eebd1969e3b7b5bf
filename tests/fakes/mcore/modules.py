"""Fake of megatron-core 0.16.1: Float16Module and DistributedDataParallel (transformer/module.py, distributed/distributed_data_parallel.py). See ``__init__.py``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from .buffers import (
    FakeDistributedDataParallelConfig,
    FakeParamAndGradBucketGroup,
    FakeParamAndGradBuffer,
    fake_partition_buckets,
)


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
