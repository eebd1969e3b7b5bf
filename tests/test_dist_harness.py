"""The multi-process gloo harness works, and FSDP2 runs on it (CPU, 2 ranks)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

try:
    from dist_harness import RankError, run_distributed
except ImportError:  # tests/ not on sys.path (importlib mode, or tests/ became a package)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_harness import RankError, run_distributed


# Rank bodies must live at module level: ranks locate them by module + name.


def _all_reduce(rank, world_size, scale, *, offset=0.0):
    t = torch.full((3,), float(rank + 1)) * scale + offset
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": t.tolist()}


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits for a peer that never comes
    return "unreachable"


def _rank0_segfaults(rank, world_size):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def _sleepy(rank, world_size):
    time.sleep(60)


def _env(rank, world_size):
    return {
        "threads": torch.get_num_threads(),
        "rand": torch.rand(4).tolist(),
        "master": (os.environ["MASTER_ADDR"], os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "extra": os.environ.get("DIST_HARNESS_TEST"),
    }


def test_all_reduce_two_ranks():
    results = run_distributed(_all_reduce, 2, args=(2.0,), kwargs={"offset": 1.0})
    # rank0: 2+1=3, rank1: 4+1=5 -> 8
    assert results == [
        {"rank": 0, "world": 2, "sum": [8.0, 8.0, 8.0]},
        {"rank": 1, "world": 2, "sum": [8.0, 8.0, 8.0]},
    ]


def test_rank_exception_reraised_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 raised ValueError: boom from rank 1") as info:
        run_distributed(_rank1_raises, 2, timeout=30, grace=2)
    message = str(info.value)
    assert "_rank1_raises" in message  # the rank's own traceback
    assert 'raise ValueError("boom from rank 1")' in message
    assert 1 in info.value.failures
    assert info.value.failures[1][0] == "ValueError"
    assert time.monotonic() - t0 < 20  # the blocked peer did not hold the test


def test_rank_exception_fails_a_test():
    # What a test author sees: RankError is an AssertionError, so pytest reports
    # a failure (not an error in the harness).
    assert issubclass(RankError, AssertionError)


def test_rank_crash_is_reported_not_fatal():
    with pytest.raises(RankError, match="SIGSEGV") as info:
        run_distributed(_rank0_segfaults, 2, timeout=30, grace=2)
    assert info.value.failures[0][0] == "RankDied"
    assert "_rank0_segfaults" in info.value.failures[0][2]  # faulthandler's dump


def test_timeout_terminates_ranks():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 2s"):
        run_distributed(_sleepy, 2, timeout=2)
    assert time.monotonic() - t0 < 15


def test_seeds_threads_and_env_are_deterministic():
    results = run_distributed(_env, 2, seed=7, env={"DIST_HARNESS_TEST": "yes"})
    torch.manual_seed(7)
    expected = torch.rand(4).tolist()
    for rank, r in enumerate(results):
        assert r["threads"] == 1
        assert r["rand"] == expected  # same seed on every rank
        assert r["master"] == ("127.0.0.1", str(rank), "2")
        assert r["extra"] == "yes"


def test_local_functions_are_rejected():
    def local(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(local, 2)


# ---------------------------------------------------------------- FSDP2 smoke


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.ReLU(), torch.nn.Linear(13, 8)) for _ in range(2)
        )
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _train(model, steps, release_between_steps=False):
    torch.manual_seed(123)  # same data on every rank and in the reference
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if release_between_steps:
            # Release every param shard's storage in place, then re-grow and refill it.
            for p in model.parameters():
                storage = p.to_local().untyped_storage()
                saved = torch.empty(storage.nbytes(), dtype=torch.uint8)
                saved.untyped_storage().copy_(storage)
                n = storage.nbytes()
                storage.resize_(0)
                storage.resize_(n)
                storage.copy_(saved.untyped_storage())
    return losses


def _fsdp2_body(rank, world_size, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    def build():
        torch.manual_seed(0)
        model = _MLP()
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    model = build()
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params)
    storages = [p.to_local().untyped_storage()._cdata for p in params]
    losses = _train(model, steps)
    assert [p.to_local().untyped_storage()._cdata for p in model.parameters()] == storages
    released = _train(build(), steps, release_between_steps=True)
    return losses, released


def test_fsdp2_trains_on_gloo_and_matches_single_process():
    steps = 3
    results = run_distributed(_fsdp2_body, 2, args=(steps,))
    torch.manual_seed(0)
    reference = _train(_MLP(), steps)
    for losses, released in results:
        # identical data on both ranks: the averaged gradient equals the local one
        assert losses == pytest.approx(reference, rel=1e-6, abs=1e-7)
        assert released == losses  # release + re-grow + refill is bit-identical
