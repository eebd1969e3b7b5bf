"""A small, faithful CPU fake of megatron-core 0.16.1's model-state layout.

Real megatron-core cannot build its DDP buffers or optimizers without CUDA
(``param_and_grad_buffer.py:800`` calls ``torch.cuda.current_device()``;
``optimizer.py:485`` allocates ``device='cuda'``), so CPU tests use this fake.
Every class and attribute names the real one it mirrors as ``file:line`` in
megatron-core 0.16.1 (paths relative to ``megatron/core/``). See
``docs/notes/megatron-layout.md`` for the layout and the pitfalls.

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

The fake is split by what it fakes: ``buffers`` (configs, buckets, the
buffer), ``modules`` (Float16Module, DDP), ``optimizers`` (base, Float16,
FP32), ``distributed`` (DistributedOptimizer, ChainedOptimizer), ``models``
(tiny dense and MoE models), ``builders``.
"""

from __future__ import annotations

from .buffers import (
    MCORE_VERSION,
    BufferType,
    FakeDistributedDataParallelConfig,
    FakeOptimizerConfig,
    FakeParamAndGradBucket,
    FakeParamAndGradBucketGroup,
    FakeParamAndGradBuffer,
    fake_partition_buckets,
)
from .builders import build_fake_ddp, build_fake_optimizer, fake_train_step
from .distributed import FakeChainedOptimizer, FakeDistributedOptimizer, FakeProxyDict
from .models import FakeDenseModel, FakeMoELayer, FakeMoEModel, FakeTopKRouter, fake_finalize_model_grads
from .modules import FakeDDP, FakeDistributedDataParallel, FakeFloat16Module
from .optimizers import (
    FakeFloat16OptimizerWithFloat16Params,
    FakeFP32Optimizer,
    FakeMegatronOptimizer,
    FakeMixedPrecisionOptimizer,
)

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
