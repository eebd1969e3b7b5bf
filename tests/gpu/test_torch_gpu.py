"""CUDA-only checks of the engine on plain PyTorch (run on the GPU machine: tests/gpu/run_gpu_suite.sh).

The CPU correctness suite runs on CUDA too (its tests are parametrized over
``helpers.DEVICES``); this file adds what only a GPU can show: stream
ordering of asynchronous copies, released device memory, pinned exact sizes.
"""

from __future__ import annotations

import pytest
import torch

from stateshift import ModelState
from stateshift.core.engine import core_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUMEL = 64 << 20  # 256 MiB of fp32 per tensor: copies take milliseconds, long enough to race


class Big(torch.nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(NUMEL, device="cuda")) for _ in range(n))


def test_snapshot_then_inplace_update_holds_pre_update_values():
    """Rule 4: the compute stream waits for the snapshot's copy before writing."""
    model = Big()
    state = ModelState(model)
    for i in range(12):
        snap = state.snapshot("params", tag="ordering", placement="host")
        with torch.no_grad():
            for p in model.w:
                p.add_(1.0)  # enqueued at once on the compute stream
        values = snap.wait().tensors()
        for name, v in values.items():
            assert torch.all(v == float(i)), f"iteration {i}: {name} holds post-update values"


def test_restore_then_compute_reads_restored_values():
    model = Big()
    state = ModelState(model)
    with torch.no_grad():
        for p in model.w:
            p.fill_(7.0)
    snap = state.snapshot("params", tag="r")
    for i in range(8):
        with torch.no_grad():
            for p in model.w:
                p.fill_(float(-i))
        state.restore(snap)
        sums = [p.sum().item() for p in model.w]  # compute stream, right after the async restore
        assert sums == [7.0 * NUMEL] * len(sums), f"iteration {i}: read before the restore landed"


def test_offload_releases_device_memory():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = Big(4)
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = ModelState(model, opt)
    tracked = state.nbytes()
    state.offload()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    assert held <= 0.01 * tracked, f"{held} bytes still allocated after offloading {tracked}"
    state.onload()
    assert all(torch.all(p.grad == 1) for p in model.parameters())


def test_pinned_pool_exact_sizes_and_reuse():
    model = Big()
    state = ModelState(model)
    assert core_of(state).pool.pinned
    state.snapshot("params", tag="a")
    s = core_of(state).pool.stats
    assert s.held_bytes == state.layout("params").total  # no power-of-two rounding
    assert all(p.host.data.is_pinned() for p in core_of(state).snapshots.get("a").parts)
    for _ in range(3):
        state.snapshot("params", tag="a")
    assert core_of(state).pool.stats.allocations == s.allocations


def test_swapped_on_gpu_is_exact_with_many_small_tensors():
    torch.manual_seed(0)
    small = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(1000 + i, device="cuda")) for i in range(3000))
    state = ModelState(small)
    snap = state.snapshot("params", tag="old")
    old = [p.detach().clone() for p in small]
    with torch.no_grad():
        for p in small:
            p.mul_(3)
    cur = [p.detach().clone() for p in small]
    with state.swapped(snap):
        assert all(torch.equal(p, o) for p, o in zip(small, old, strict=True))
    assert all(torch.equal(p, c) for p, c in zip(small, cur, strict=True))
    state.offload()
    state.onload()
    assert all(torch.equal(p, c) for p, c in zip(small, cur, strict=True))
