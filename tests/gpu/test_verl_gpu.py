"""The verl drop-ins against verl 0.9.1's own functions on the GPU, real megatron-core and FSDP2.

    python3 -m pytest -m gpu tests/gpu/test_verl_gpu.py        # on the GPU machine (docs/guide/verl.md)

For a small dense and MoE Megatron GPT and an FSDP2 model, verl's fully-async pi_old sequence
(``benchmarks/verl_sequence.py``) in every residency mix: stateshift's drop-ins, and what
``install()`` gives by default (stateshift's ``SAFE`` functions beside verl's others), must give 0
mismatching old log-probs and final weights equal to a reference that never moved; verl's own
functions (loaded from ``.whl-verl/``) run the same sequence and what they give -- an error where it
happened, or a count of wrong values -- is printed, not asserted. The FSDP rank bodies of
``tests/integrations/test_verl_fsdp2.py`` run here on CUDA at world size 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
for _p in (
    ROOT / "src",
    ROOT / "benchmarks",
    ROOT / "tests",
    ROOT / "tests" / "integrations",
    ROOT / "tests" / "backends",
):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

_HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
WHEEL = ROOT / ".whl-verl" / "verl-0.9.1-py3-none-any.whl"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _args(**kw) -> argparse.Namespace:
    base = dict(
        device="cuda",
        layers=2,
        hidden=256,
        heads=4,
        vocab=512,
        seq=64,
        experts=4,
        n=3,
        cycles=2,
        mixes=["device", "offloaded", "native", "mixed"],
    )
    return argparse.Namespace(**{**base, **kw})


def _impls(module: str) -> dict:
    from stateshift.integrations import verl as ours

    impls = {"stateshift": ours, "stateshift-device": ours}  # pi_old in pinned host memory / in GPU memory
    if WHEEL.exists():
        import types

        import verl_bench

        mu, fu, _ = verl_bench.load_verl(str(WHEEL))
        verl_mod = mu if module == "megatron" else fu
        impls["verl"] = verl_mod
        # install()'s default: stateshift's SAFE functions beside verl's own others
        impls["default-install"] = types.SimpleNamespace(
            **{
                n: getattr(ours if n in ours.SAFE else verl_mod, n)
                for n in ours.SAFE + ours.ON_REQUEST
                if hasattr(verl_mod, n)
            }
        )
    return impls


def _check(rows) -> None:
    for r in rows:
        print(
            r["model"],
            r["impl"],
            r["mix"],
            "mismatches",
            r["mismatches"],
            "final_equal",
            r["final_equal"],
            "error",
            r["error"],
        )
    ours = [r for r in rows if r["impl"] in ("stateshift", "stateshift-device", "default-install")]
    assert ours
    for r in ours:
        assert r["error"] is None, (r["mix"], r["where"])
        assert r["mismatches"] == 0 and r["computed"] == r["old_logprobs"] and r["final_equal"], r


@pytest.mark.skipif(not _HAVE_MCORE, reason="needs megatron-core 0.16.1")
@pytest.mark.parametrize("case", ["dense", "moe"])
def test_megatron_sequence_stateshift_exact_verl_recorded(case):
    import verl_bench

    _check(verl_bench._megatron_case(case, _args(), _impls("megatron")))


@pytest.mark.skipif(not _HAVE_MCORE, reason="needs megatron-core 0.16.1")
def test_megatron_native_offload_of_flat_buffers_over_one_copy_chunk():
    """Megatron's own ``offload_to_cpu`` between phases, with a flat ``param_data`` over 64 MiB (so it crosses
    PCIe in chunks): every load after it must give the values back (it once raised ``setStorage ... out of
    bounds for storage of size 0``)."""
    import verl_bench

    from stateshift.integrations import verl as ours

    args = _args(layers=2, hidden=1024, heads=8, vocab=32000, seq=32, n=2, cycles=2, mixes=["native", "mixed"])
    _check(verl_bench._megatron_case("dense", args, {"stateshift": ours, "stateshift-device": ours}))


def test_fsdp2_sequence_stateshift_exact_verl_recorded():
    import verl_bench

    _check(verl_bench._fsdp2_case(_args(), _impls("fsdp2")))


def test_fsdp2_round_trips_on_cuda():
    import test_verl_fsdp2 as T
    import verl_bench

    verl_bench.init_dist("cuda")
    assert T.round_trips(0, 1, "cuda")
    assert T.handle_errors(0, 1, "cuda") == ["fsdp2_sharded_load_from_cpu"] * 3 + ["mesh"]
