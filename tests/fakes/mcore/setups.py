"""Ready-made fake Megatron setups shared by the backend and pi_old tests."""

from __future__ import annotations

import torch

from stateshift.core.engine import core_of

from .builders import build_fake_ddp, build_fake_optimizer, fake_train_step
from .models import FakeDenseModel, FakeMoEModel

HIDDEN = 16


def _x(seed: int, n: int = 8) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _is_expert(name, _p):
    return ".experts." in name


def pretend_cuda_engine(state, monkeypatch):
    """What a machine with CUDA gives a CPU model: ``ModelState``'s copy engine drives cuda:0.

    The model stays on the CPU, so nothing is copied to a GPU; what this exercises are the
    decisions (rebuild availability, pi_old placement, byte accounting), which must follow
    where the state lives. A GPU's free memory must not be consulted for CPU-resident state.
    (On a machine with CUDA the engine already is on a GPU: this changes nothing there.)
    """
    monkeypatch.setattr(core_of(state).engine, "device", torch.device("cuda", 0))

    def no_gpu_memory(*_a, **_k):
        raise AssertionError("a GPU's memory was consulted for state that lives on the CPU")

    for fn in ("mem_get_info", "memory_reserved", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, fn, no_gpu_memory)


CONFIGS = {
    # what get_megatron_optimizer builds with EP > 1: Chained(Distributed dense, Distributed expert)
    "distrib_ep": {"model": "moe", "ep": True, "udo": True, "kind": "chained"},
    "distrib": {"model": "moe", "ep": False, "udo": True, "kind": "distrib"},
    # use_distributed_optimizer=False: param_data is None, Chained(Float16 dense, Float16 expert)
    "float16_no_param_data": {"model": "moe", "ep": True, "udo": False, "kind": "chained"},
    "dense_float16": {"model": "dense", "ep": False, "udo": True, "kind": "float16"},
}


def build(config: str, seed: int = 0):
    c = CONFIGS[config]
    model = FakeMoEModel(HIDDEN, seed=seed) if c["model"] == "moe" else FakeDenseModel(HIDDEN, seed=seed)
    ddp = build_fake_ddp(
        model, use_distributed_optimizer=c["udo"], expert_parallel_param_filter=_is_expert if c["ep"] else None
    )
    return ddp, build_fake_optimizer(ddp, c["kind"])


def after_steps(config: str, steps: int = 2):
    """``build(config)`` after ``steps`` fake training steps (so the optimizer has state): ``(ddp, opt)``."""
    ddp, opt = build(config)
    for i in range(steps):
        fake_train_step(ddp, opt, _x(i))
    return ddp, opt
