"""Address-stable onload with torch_memory_saver (optional extra), on the GPU machine.

A CUDA graph captured on address-stable weights replays with the same output after an offload and
an onload; the device addresses do not move. Runs in a subprocess: torch_memory_saver's allocator
ends a process whose pools are destroyed outside a region with status 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from raises import raises_kind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = f"""
import json, os, sys
sys.path[:0] = [{str(ROOT / "benchmarks")!r}, {str(ROOT / "src")!r}]
import tms_bench
print(json.dumps(tms_bench._graph_check()))
sys.stdout.flush()
os._exit(0)
"""


def test_cuda_graph_replays_after_offload_and_onload():
    pytest.importorskip("torch_memory_saver", reason="the tms extra is not installed here")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["graph_replay_equal"], result


def test_address_stable_without_the_extra_is_a_clear_error(monkeypatch):
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import block_import

    from stateshift import ModelState, StateError

    block_import(monkeypatch, "torch_memory_saver")
    with raises_kind(StateError, "address_stable", match=r"stateshift\[tms\]"):
        ModelState(torch.nn.Linear(4, 4).cuda(), address_stable=True)
