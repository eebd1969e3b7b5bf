"""Prefetch on CUDA (``trainer.prefetch``): the onloads issued on the prefetch stream and waited for just before each
group's first read train the same bits as onloads waited for where they are needed, for every family, with every
offload on and pi_old (swaps included); and the prefetch path really ran.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_rl_prefetch_gpu.py`` (PYTHONPATH=src:tests/rl; Megatron as
``docs/notes/gpu-machine.md`` says).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
from rlkit import tiny

from stateshift.train.launch import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: deterministic (staleness 0: a schedule that does not depend on timing); an evaluation after every step parks
#: the trainer each time, so every step prefetches params, grads and optimizer state
COMMON = [
    "run.device=cuda",
    "executor=inprocess",
    "trainer.steps=6",
    "async_training.staleness_threshold=0",
    "async_training.trigger_parameter_sync_step=2",
    "async_training.require_batches=2",
    "run.eval_every=1",
    "trainer.param_offload=true",
    "trainer.grad_offload=true",
    "trainer.optimizer_offload=true",
    "trainer.old_logprob=pi_old",
]


@pytest.mark.parametrize("family", ["builtin", "fsdp2", "megatron"])
def test_prefetch_on_cuda_trains_the_same_bits(tmp_path, family):
    on = run(tiny(tmp_path / "on", f"model.family={family}", *COMMON, "trainer.prefetch=true"), return_params=True)
    off = run(tiny(tmp_path / "off", f"model.family={family}", *COMMON, "trainer.prefetch=false"), return_params=True)
    assert on.summary["status"] == off.summary["status"] == "finished"
    assert on.losses == off.losses  # exact float equality
    assert on.params is not None and off.params is not None
    for name, t in off.params.items():
        assert torch.equal(on.params[name], t), name
    waits = {k for k in on.summary["offload"]["seconds"] if k.startswith("prefetch_wait.")}
    assert waits == {"prefetch_wait.params", "prefetch_wait.grads", "prefetch_wait.optim"}, waits
    assert not any(k.startswith("prefetch_wait.") for k in off.summary["offload"]["seconds"])
    assert on.summary["pi_old"]["swaps"] == off.summary["pi_old"]["swaps"] > 0
