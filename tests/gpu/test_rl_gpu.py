"""``stateshift train`` on a GPU: every policy family with run.device=cuda, every offload on, pi_old and bypass,
weights synced equal by name, and the device memory an offload frees handed back to the driver.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_rl_gpu.py`` (PYTHONPATH=src:tests/rl).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
import policy_checks as pc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FAMILIES = ["builtin", "fsdp2", "megatron"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_on_cuda_with_every_offload_and_pi_old(tmp_path, family):
    s = pc.check_run(tmp_path, family, "run.device=cuda")
    assert s["memory"]["device"] == "cuda" and s["memory"]["device_peak_allocated_bytes"] > 0
    assert s["pool"]["peak_held_bytes"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bypass_on_cuda(tmp_path, family):
    pc.check_run(tmp_path, family, "run.device=cuda", "trainer.old_logprob=bypass")


@pytest.mark.parametrize("family", FAMILIES)
def test_synced_weights_equal_on_cuda(tmp_path, family):
    pc.check_sync_equal(tmp_path, family, "run.device=cuda")


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cached_generation_equals_recomputing_on_cuda(tmp_path, family):
    """Same tokens from the same seed with and without the KV cache; log-probs within ``KV_ATOL`` (bf16 for Megatron)."""
    diffs = pc.check_kv_cache(tmp_path, family, "run.device=cuda")
    print(family, diffs)
