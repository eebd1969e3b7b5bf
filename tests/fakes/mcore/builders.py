"""Fake of megatron-core 0.16.1: builders of fake DDP models and optimizers, and one training step. See ``__init__.py``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .buffers import FakeDistributedDataParallelConfig, FakeOptimizerConfig
from .distributed import FakeChainedOptimizer, FakeDistributedOptimizer
from .models import fake_finalize_model_grads
from .modules import FakeDistributedDataParallel, FakeFloat16Module
from .optimizers import (
    FakeFloat16OptimizerWithFloat16Params,
    FakeFP32Optimizer,
    FakeMegatronOptimizer,
    _build_param_groups,
    _is_float16,
    _make_inner_adam,
)


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
            raise ValueError(
                "kind='distrib' needs a DDP built with use_distributed_optimizer=True (param_data is None otherwise)"
            )
        cfg = FakeOptimizerConfig(
            lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16, use_distributed_optimizer=True
        )
        return _one_optimizer(chunks, cfg, None, ("buffers", "expert_parallel_buffers"))
    if kind == "float16":
        cfg = FakeOptimizerConfig(
            lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=True, use_distributed_optimizer=False
        )
        return FakeFloat16OptimizerWithFloat16Params(_make_inner_adam(_build_param_groups(chunks, None), cfg), cfg)
    if kind == "chained":
        cfg = FakeOptimizerConfig(
            lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16, use_distributed_optimizer=udo
        )
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
