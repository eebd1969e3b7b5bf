"""The policy families behind ``policies.Policy`` on the CPU: FSDP2 (gloo, world size 1) in process, Megatron-core
(patched for the CPU) in a subprocess; every offload on, pi_old and bypass modes, weights synced equal by name.

The checks themselves are in ``policy_checks.py``: the same code for every family.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import policy_checks as pc
import pytest
import torch
from raises import raises_kind
from rlkit import tiny

from stateshift.errors import ConfigError
from stateshift.train.build import build_policy, build_task
from stateshift.train.policies import Policy

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("family", ["builtin", "fsdp2"])
def test_family_trains_with_every_offload_and_pi_old(tmp_path, family):
    s = pc.check_run(tmp_path, family)
    assert s["memory"]["device"] == "cpu"


def test_fsdp2_bypass_mode_still_works(tmp_path):
    s = pc.check_run(tmp_path, "fsdp2", "trainer.old_logprob=bypass")
    assert s["pi_old"]["swaps"] == 0


@pytest.mark.parametrize("family", ["builtin", "fsdp2"])
def test_synced_weights_equal_the_trainers(tmp_path, family):
    pc.check_sync_equal(tmp_path, family)


@pytest.mark.parametrize("family", ["builtin", "fsdp2"])
def test_rollout_copy_is_built_without_a_policy_and_loaded_from_rollout_state_dict(tmp_path, family):
    pc.check_rollout_copy_alone(tmp_path, family)


@pytest.mark.parametrize("family", ["builtin", "fsdp2"])
def test_kv_cached_generation_equals_recomputing_the_sequence(tmp_path, family):
    diffs = pc.check_kv_cache(tmp_path, family)
    assert max(diffs.values()) <= pc.KV_ATOL["fp32"]


def test_fsdp2_policy_is_sharded_and_a_policy(tmp_path):
    from torch.distributed.fsdp import FSDPModule

    cfg = tiny(tmp_path, "model.family=fsdp2")
    policy = build_policy(cfg, build_task(cfg))
    assert isinstance(policy, Policy)
    assert isinstance(policy.model, FSDPModule)
    assert all(isinstance(layer, FSDPModule) for layer in policy.model.model.layers)
    assert not isinstance(policy.rollout_lm().module, FSDPModule)  # the rollouter's copy is plain


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: run.device=cuda is valid")
def test_run_device_cuda_without_cuda_is_a_config_error(tmp_path):
    with raises_kind(ConfigError, "config") as err:
        tiny(tmp_path, "run.device=cuda")
    assert err.value.key == "run.device" and "no CUDA device" in str(err.value)


def test_megatron_on_the_cpu_without_the_test_patch_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("STATESHIFT_MCORE_DEVICE", raising=False)
    cfg = tiny(tmp_path, "model.family=megatron")
    with raises_kind(ConfigError, "config") as err:
        build_policy(cfg, build_task(cfg))
    assert err.value.key == "run.device" and "run.device=cuda" in str(err.value)


def test_stop_accuracy_and_max_wall_end_a_run_early(tmp_path, monkeypatch):
    from stateshift.train import launch, loop

    res = launch.run(tiny(tmp_path / "a", "trainer.steps=50", "run.max_wall_s=0.001"))
    assert res.steps == 1 and res.summary["status"].startswith("finished early: run.max_wall_s")
    evals = iter([0.1, 0.3, 0.6, 0.9])  # after warm-up, then at steps 2, 4, 6
    monkeypatch.setattr(loop, "heldout_accuracy", lambda *a, **k: next(evals))
    res = launch.run(tiny(tmp_path / "b", "trainer.steps=50", "run.eval_every=2", "run.stop_accuracy=0.5"))
    assert res.steps == 4 and "held-out accuracy 0.600 >= run.stop_accuracy at step 4" in res.summary["status"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: tests/gpu/test_rl_gpu.py runs Megatron on it")
def test_megatron_policy_on_the_cpu(tmp_path):
    """``policy_checks.py megatron``: megatron-core 0.16.1 patched for the CPU (it allocates on CUDA otherwise)."""
    root = HERE.parents[1]
    env = dict(
        os.environ,
        STATESHIFT_MCORE_DEVICE="cpu",
        PYTHONPATH=os.pathsep.join([str(root / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(HERE / "policy_checks.py"), "megatron", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.split() == [
        "ok",
        "run",
        "ok",
        "bypass",
        "ok",
        "sync_equal",
        "ok",
        "rollout_copy_alone",
        "ok",
        "fresh_optimizer",
        "ok",
        "kv_cache",
        "ok",
        "process_equal",
    ], proc.stdout
