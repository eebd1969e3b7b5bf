"""The FSDP2 backend on CUDA: world size 1, NCCL (run on the GPU machine).

    python3 -m pytest -m gpu tests/gpu/test_fsdp2_gpu.py

Runs the rank bodies of ``tests/test_fsdp2.py`` (every verb in every
residency, training with moves, the aliasing regression, restore after
steps, guards, the sharding mismatch) with ``device="cuda"``; the CPU suite
runs the same bodies at world size 1 (``test_world_size_one_suite``), so
these execute code already known to pass there. Added here: the same suite
under ``CPUOffloadPolicy(pin_memory=True)`` (shards in pinned host memory,
not resizable: offload and drop leave them in place; the CPU suite runs
that path with a non-resizable stand-in, ``cases.unresizable_host_shards``),
released device memory, and stream ordering of snapshot / restore around
compute on real shards.

Each test is one process (``run_distributed``, forkserver), so a CUDA fault
fails one test, not the session. Determinism: ``use_deterministic_algorithms
(True, warn_only=True)`` with ``CUBLAS_WORKSPACE_CONFIG`` set, since the
suite compares losses of two models bit for bit.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [
    p for p in (os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "backends")) if p not in sys.path
]

import test_fsdp2 as cases  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

from stateshift.core.engine import core_of  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
        reason="needs torch.distributed with NCCL",
    ),
]

ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
TIMEOUT = 300


def on_cuda(rank, world, body_name, kwargs):
    """Run a body of tests/test_fsdp2.py with device="cuda" (module level: ranks import it by name)."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.use_deterministic_algorithms(True, warn_only=True)
    body = getattr(cases, body_name)
    return body(rank, world, "cuda", **kwargs)


def run(body_name, **kwargs):
    return run_distributed(on_cuda, 1, args=(body_name, kwargs), backend="nccl", timeout=TIMEOUT, env=ENV)


# -- the CPU suite, on CUDA ----------------------------------------------------------------------


def test_every_verb_in_every_residency_cuda():
    assert run("every_verb_in_every_residency") == [list(cases.MIXES)]


def test_every_verb_with_fsdp_cpu_offload_policy_cuda():
    """Shards already in pinned host memory: offload/drop leave them in place; snapshots copy, never alias."""
    mixes = ["resident", "all_offloaded", "partial", "mixed"]
    assert run("every_verb_in_every_residency", mixes=mixes, offload_policy=True) == [mixes]


def test_training_with_moves_equals_training_without_cuda():
    results = run("training_with_moves_equals_training_without")
    assert len(results[0]) == 4


def test_no_aliasing_and_restore_after_steps_cuda():
    """verl-omni #645, with CPUOffloadPolicy(pin_memory=True) and with stateshift's own offload."""
    assert run("aliasing_and_restore_after_steps") == [True]


def test_guards_and_fsdp_states_cuda():
    """Forward / backward / step on released shards: a Python error, the CUDA context stays healthy."""
    assert run("guards_and_fsdp_states") == [True]


def test_sharding_mismatch_is_a_typed_error_cuda():
    reasons = run("sharding_mismatch")
    assert set(reasons[0]) == {"dim_names", "hsdp_1xN"}
    assert "'cuda'" in reasons[0]["dim_names"] and "'Replicate()', 'Shard(dim=0)'" in reasons[0]["hsdp_1xN"]


# -- what only a GPU shows -----------------------------------------------------------------------

WIDTH = 2048  # 4 x 16 MiB fp32 weights: copies long enough to race


def _wide(device, width):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(device)
    mesh = cases.make_mesh(device, 1)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def _wide_step(model, opt, seed, width, device):
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(seed)).to(device)
    opt.zero_grad(set_to_none=False)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def memory_and_ordering(rank, world, device="cuda", width=WIDTH):
    """(``device="cpu"`` and a small ``width`` run the same code as a smoke test on a CPU machine.)"""
    from stateshift import ModelState

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    model, opt = _wide(device, width)
    _wide_step(model, opt, 0, width, device)
    with torch.no_grad():  # leaves the root unsharded: the verb reshards first
        model(torch.ones(2, width, device=device))
    state = ModelState(model, opt)
    tracked = sum(s.nbytes for s in core_of(state).slots() if s.device.type == device)
    values = cases.direct(model, opt)

    # offload releases the device memory of every shard, grad and optimizer state
    freed = tracked
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    state.offload()
    if cuda:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # lets the allocator retire blocks freed behind stream events
        freed = before - torch.cuda.memory_allocated()
        assert freed >= tracked, f"offload freed {freed} bytes of {tracked} tracked"
    state.onload()
    cases.assert_same(cases.direct(model, opt), values, "onload")

    # a snapshot taken right before an optimizer step holds the pre-step values (rule 4)
    for i in range(6):
        pre = cases.direct(model)
        snap = state.snapshot(tag="ordering")
        opt.step()  # enqueued at once on the compute stream, writes the shards
        got = {k: v.cpu() for k, v in snap.wait().tensors().items()}
        cases.assert_same(got, {k: v for k, v in pre.items() if k in got}, f"iteration {i}: snapshot")

    # compute right after a restore reads the restored values; the same for device placement
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1)).to(device)
    for placement in ("host", "device"):
        snap = state.snapshot(tag=f"restore-{placement}", placement=placement)
        with torch.no_grad():
            want = model(x).cpu()
        for i in range(4):
            _wide_step(model, opt, 10 + i, width, device)
            state.restore(snap)
            with torch.no_grad():
                got = model(x).cpu()  # no wait: the compute stream is ordered after the restore
            assert torch.equal(got, want), f"{placement} iteration {i}: forward read pre-restore values"
        with state.swapped(snap), torch.no_grad():
            assert torch.equal(model(x).cpu(), want), f"{placement}: forward inside swapped()"
    state.close()
    return {"tracked": tracked, "freed": freed}


def test_offload_releases_memory_and_copies_are_stream_ordered_cuda():
    results = run_distributed(memory_and_ordering, 1, backend="nccl", timeout=TIMEOUT, env=ENV)
    assert results[0]["freed"] >= results[0]["tracked"] > 0
