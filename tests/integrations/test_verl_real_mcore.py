"""The verl drop-ins on real megatron-core 0.16.1 on the CPU (patched as ``benchmarks/megatron_bench.py`` does):
the benchmark's fully-async sequence on an MoE GPT, in a child process (megatron-core takes ~15 s to import)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.skipif(
    not importlib.util.find_spec("megatron") or not importlib.util.find_spec("megatron.core"),
    reason="needs megatron-core",
)
def test_real_megatron_core_on_cpu_moe_sequence(tmp_path):
    """The benchmark's sequence on real megatron-core 0.16.1 (MoE GPT, expert_bias on, patched for the CPU),
    the drop-ins' offload and Megatron's own alternately: exact against the reference."""
    import json
    import subprocess

    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parents[2] / "benchmarks" / "verl_bench.py"),
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--impls",
        "stateshift",
        "--cases",
        "moe",
        "--mixes",
        "mixed",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--vocab",
        "64",
        "--seq",
        "8",
        "--n",
        "2",
        "--cycles",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*-verl.json")]
    assert not result["failed_cases"], result["failed_cases"]
    (row,) = result["rows"]
    assert row["error"] is None and row["mismatches"] == 0 and row["computed"] == 4 and row["final_equal"], row
