"""Sharded checkpoints on gloo (CPU, 2 ranks): per-rank files, async, corruption, and resharding 2 -> 1 through DCP.

One multi-process run does the per-rank part (FSDP2 ``fully_shard``, so every
rank holds different shards) and writes a DCP checkpoint; the single-process
part then loads that DCP checkpoint into a plain, unsharded model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

try:
    from dist_harness import run_distributed
except ImportError:  # tests/ not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dist_harness import run_distributed

from helpers import assert_same, capture
from raises import raises_kind

from stateshift import ModelState
from stateshift.checkpoint import (
    async_save,
    init_optimizer_state,
    load,
    load_dcp,
    save,
    save_dcp,
    verify,
)
from stateshift.checkpoint.directory import Checkpoint
from stateshift.errors import CheckpointError, LayoutError

GROUPS = ("params", "buffers", "optim")


def read_manifest(path):
    return Checkpoint.open(path, files=()).manifest


class _MLP(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(8, 13, dtype=dtype), torch.nn.ReLU(), torch.nn.Linear(13, 8, dtype=dtype)
            )
            for _ in range(2)
        )
        self.head = torch.nn.Linear(8, 3, dtype=dtype)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def _sharded_body(rank: int, world_size: int, root: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root_p = Path(root)
    torch.manual_seed(0)
    model = _MLP()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(seed: int) -> None:
        torch.manual_seed(100 + seed)  # the same batch on every rank
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    state = ModelState(model, opt)
    at_save = capture(state, GROUPS)

    manifest = save(state, root_p / "ck", version=1)  # each rank writes its own shard
    # async: the checkpoint holds the values of the call while training goes on
    handle = async_save(state, root_p / "ck-async", version=2)
    step(1)
    assert handle.wait(60).version == 2
    after_step = capture(state, GROUPS)

    # load into an offloaded model (a pointer copy into the homes), then into a resident one
    state.offload("params")
    load(state, root_p / "ck")
    assert_same(capture(state, GROUPS), at_save)
    state.onload()
    step(2)
    load(state, root_p / "ck-async")
    assert_same(capture(state, GROUPS), at_save)

    # one corrupt shard: every rank raises, no rank changes its model
    dist.barrier()
    if rank == 0:
        f = root_p / "ck" / "params.rank1-of-2.safetensors"
        _flip(f, f.stat().st_size - 20)
    dist.barrier()
    step(3)
    before = capture(state, GROUPS)
    raised = None
    try:
        load(state, root_p / "ck")
    except CheckpointError as e:
        raised = (f"{type(e).__name__}({e.kind})", str(e))
    assert_same(capture(state, GROUPS), before)

    # a DCP checkpoint for resharding, and the values it must hold (whole tensors)
    save_dcp(root_p / "dcp", model, opt, version=5)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    exp_avg = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    return {
        "files": sorted(manifest.files),
        "world": manifest.layout["world_size"],
        "changed": not torch.equal(after_step["layers.0.0.weight"], at_save["layers.0.0.weight"]),
        "raised": raised,
        "full": full,
        "exp_avg": exp_avg,
    }


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return root, run_distributed(_sharded_body, 2, args=(str(root),), timeout=120)


def test_each_rank_writes_and_loads_its_own_shard(sharded):
    root, results = sharded
    for r in results:
        assert r["world"] == 2 and r["changed"]
        assert r["files"] == sorted(f"{g}.rank{k}-of-2.safetensors" for g in GROUPS for k in range(2))
    # rank 1 named its file; rank 0 was told rank 1 failed
    assert (
        results[1]["raised"][0] == "CheckpointError(corrupt)"
        and "params.rank1-of-2.safetensors" in results[1]["raised"][1]
    )
    assert results[0]["raised"][0] == "CheckpointError(failed)" and "rank 1" in results[0]["raised"][1]
    # the per-rank shards differ (FSDP2 gives each rank other rows)
    m = read_manifest(root / "ck-async")
    assert (
        m.version == 2
        and m.files["params.rank0-of-2.safetensors"].checksum != m.files["params.rank1-of-2.safetensors"].checksum
    )
    verify(root / "ck-async")


def test_per_rank_checkpoint_on_another_world_size_points_to_dcp(sharded):
    root, _ = sharded
    model = _MLP()
    opt = torch.optim.Adam(model.parameters())
    init_optimizer_state(opt)
    with raises_kind(LayoutError, "checkpoint_mismatch", match="2 ranks.*load_dcp"):
        load(ModelState(model, opt), root / "ck-async")


def test_reshard_two_ranks_to_one_through_dcp(sharded):
    root, results = sharded
    model = _MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    m = load_dcp(root / "dcp", model, opt, trusted=True)  # one process, no process group, an unsharded model
    assert m.version == 5 and m.layout == {"format": "dcp", "world_size": 2}
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), results[0]["full"][n]), n
        assert torch.equal(opt.state[p]["exp_avg"], results[0]["exp_avg"][n]), n
    assert torch.equal(results[0]["full"]["head.weight"], results[1]["full"]["head.weight"])


def test_dcp_dtype_mismatch_is_an_error_unless_cast(sharded):
    root, results = sharded
    model = _MLP(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with raises_kind(LayoutError, "checkpoint_mismatch", match="dtype is bfloat16 in the model but float32") as ei:
        load_dcp(root / "dcp", model)
    assert ei.value.tensor.startswith("model.")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    load_dcp(root / "dcp", model, cast=True, trusted=True)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), results[0]["full"][n].to(torch.bfloat16)), n


def test_dcp_corrupt_file_is_an_error_naming_it(sharded, tmp_path):
    import shutil

    root, _ = sharded
    copy = tmp_path / "dcp"
    shutil.copytree(root / "dcp", copy)
    victim = min(p for p in copy.iterdir() if p.suffix == ".distcp")
    _flip(victim, victim.stat().st_size // 2)
    model = _MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with raises_kind(CheckpointError, "corrupt") as ei:
        load_dcp(copy, model)
    assert ei.value.path == str(victim)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
