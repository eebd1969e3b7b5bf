"""The rollouter in its own process (``executor=process``) and under Ray (``executor=ray``) on one GPU, for every
policy family with every offload on and pi_old: the run finishes, the ledger balances, pi_old swaps; the process
executor also with the rollouter on a second GPU when there is one, and equal to the thread executor.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_rl_gpu_executors.py`` (PYTHONPATH=src:tests/rl; Ray as
``docs/notes/gpu-machine.md`` says, or the Ray tests skip).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
import policy_checks as pc
from rlkit import tiny

from stateshift.train.launch import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FAMILIES = ["builtin", "fsdp2", "megatron"]


@pytest.mark.parametrize("transport", ["builtin", "auto", "shared_host"])
@pytest.mark.parametrize("family", FAMILIES)
def test_process_executor_on_cuda(tmp_path, family, transport):
    """``auto`` is cuda_ipc here (both sides on one GPU); the others go through host shared memory."""
    s = pc.check_run(tmp_path, family, "run.device=cuda", "executor=process", f"rollout.weight_transport={transport}")
    assert s["rollout"]["executor"] == "process" and s["rollout"]["restarts"] == []
    assert s["memory"]["rollout_device_peak_allocated_bytes"] > 0  # the rollouter process computed on the GPU


@pytest.mark.parametrize("family", FAMILIES)
def test_process_executor_is_the_default_on_cuda_and_equals_the_thread_executor(tmp_path, family):
    det = [
        f"model.family={family}",
        "run.device=cuda",
        "trainer.steps=6",
        "async_training.staleness_threshold=0",
        "async_training.trigger_parameter_sync_step=2",
    ]
    proc = run(tiny(tmp_path / "p", *det), return_params=True)
    thread = run(tiny(tmp_path / "t", *det, "executor=inprocess"), return_params=True)
    assert proc.summary["rollout"]["executor"] == "process"
    assert proc.trained_uids == thread.trained_uids
    assert proc.losses == thread.losses
    for name, t in thread.params.items():
        assert torch.equal(proc.params[name], t), name


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_process_executor_with_the_rollouter_on_another_gpu(tmp_path):
    s = pc.check_run(tmp_path, "megatron", "run.device=cuda", "executor=process", "rollout.device=cuda:1")
    assert s["memory"]["rollout_device_peak_allocated_bytes"] > 0


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed here")
@pytest.mark.parametrize("family", FAMILIES)
def test_ray_executor_on_cuda(tmp_path, family):
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, logging_level="WARNING")
    try:
        s = pc.check_run(tmp_path, family, "run.device=cuda", "executor=ray")
    finally:
        ray.shutdown()
    assert s["rollout"]["executor"] == "ray" and s["memory"]["device"] == "cuda"
