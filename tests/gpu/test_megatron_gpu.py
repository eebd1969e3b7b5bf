"""Real megatron-core 0.16.1 on the GPU: a bf16 GPTModel in Float16Module + mcore DDP with the
DistributedOptimizer, trained a few steps.

    python3 -m pytest -m gpu tests/gpu/test_megatron_gpu.py        # on the GPU machine

(a) params offloaded (by stateshift, or by Megatron's own ``offload_to_cpu``): pi_old is
    snapshotted while offloaded, the model trains, then under pi_old the forward logits equal
    those at snapshot time bit for bit, and after it the current weights are exactly back;
(b) the same with the params on the GPU;
(c) offload/onload of params + grads + optimizer between every step gives the same losses
    (and final state) as never offloading;
(d) an MoE model (4 experts, expert_bias on): snapshots cover expert_bias;
plus the stale ``reload_from_cpu`` regression on the real buffers.

Models are built by ``benchmarks/megatron_bench.py`` (``build_gpt``). With
``STATESHIFT_MCORE_DEVICE=cpu`` the same tests run on a CPU-only machine against real
megatron-core under patches (``patch_megatron_for_cpu``); ``tests/test_megatron_backend.py``
does that when megatron-core is installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "src", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from raises import raises_kind  # noqa: E402

from stateshift import ModelState, StateError  # noqa: E402
from stateshift.core.engine import core_of  # noqa: E402
from stateshift.rl import PiOldCycle, find_rebuild  # noqa: E402

DEVICE = os.environ.get("STATESHIFT_MCORE_DEVICE", "cuda")
_HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not _HAVE_MCORE, reason="needs megatron-core 0.16.1 (pip install 'megatron-core==0.16.1')"),
]


@pytest.fixture(scope="module")
def mb():
    """The benchmark module (builders), with one process group and model parallel size 1."""
    import megatron_bench

    megatron_bench.init_megatron(DEVICE)
    return megatron_bench


def _spec(mb, **kw):
    if DEVICE == "cuda":
        base = {"layers": 2, "hidden": 256, "heads": 4, "vocab": 512, "seq": 64, "lr": 1e-3}
    else:
        base = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 16, "lr": 1e-3}
    base.update(kw)
    return mb.GPTSpec(**base)


def _buffers(ddp):
    return ddp.buffers + ddp.expert_parallel_buffers


def _weights(ddp) -> dict[str, torch.Tensor]:
    """Every flat param buffer and every module buffer (expert_bias ...), cloned."""
    out = {f"param_data.{i}": b.param_data.detach().clone() for i, b in enumerate(_buffers(ddp))}
    out.update({f"buffer.{n}": b.detach().clone() for n, b in ddp.named_buffers()})
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), f"{k} differs"


def _copy_weights(src, dst, dst_opt) -> None:
    """Make ``dst`` an exact copy of ``src`` (params, module buffers, fp32 masters), whatever the init RNG did."""
    with torch.no_grad():
        for a, b in zip(_buffers(src), _buffers(dst), strict=True):
            b.param_data.copy_(a.param_data)
        for (_, a), (_, b) in zip(src.named_buffers(), dst.named_buffers(), strict=True):
            b.copy_(a)
    dst_opt.reload_model_params()  # masters from the copied params


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- (a) and (b)


@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("residency", ["on_gpu", "offloaded", "offloaded_by_megatron"])
def test_pi_old_forward_is_bit_exact_and_current_weights_come_back(mb, residency, placement):
    spec = _spec(mb)
    ddp, opt = mb.build_gpt(spec, DEVICE)
    state = ModelState(ddp, opt)
    for i in range(2):
        mb.train_step(ddp, opt, mb.batch(spec, i, DEVICE))
    probe = mb.batch(spec, 99, DEVICE)
    at_snapshot = mb.logits(ddp, probe)
    pi_old_weights = _weights(ddp)

    if residency == "offloaded":
        state.offload()
    elif residency == "offloaded_by_megatron":
        for b in _buffers(ddp):
            b.offload_to_cpu(move_params=True, move_grads=True)
        assert state.residency()["params"]["host"] == len(core_of(state).slots("params"))
        assert state.residency()["grads"]["dropped"] == len(core_of(state).slots("grads"))
    cycle = PiOldCycle(state, placement=placement, rebuild=find_rebuild(state))  # the rebuild path, on either side
    pi_old = cycle.begin()  # taken wherever the params are now
    assert pi_old.placement == placement
    if residency == "offloaded":
        state.onload()
    elif residency == "offloaded_by_megatron":
        for b in _buffers(ddp):
            b.reload_from_cpu(move_params=True, move_grads=True)  # Megatron's own reload, seen by stateshift

    for i in range(2, 5):
        mb.train_step(ddp, opt, mb.batch(spec, i, DEVICE))
    current = _weights(ddp)
    now = mb.logits(ddp, probe)
    assert not torch.equal(current["param_data.0"], pi_old_weights["param_data.0"]), (
        "training did not change the weights"
    )
    assert not torch.equal(now, at_snapshot)

    with cycle.old_policy():
        under_pi_old = mb.logits(ddp, probe)
        _assert_same(_weights(ddp), pi_old_weights)
    assert torch.equal(under_pi_old, at_snapshot), (under_pi_old - at_snapshot).abs().max().item()
    _assert_same(_weights(ddp), current)
    assert torch.equal(mb.logits(ddp, probe), now)
    assert cycle.stats.rebuilds == 1 and cycle.stats.stashed_bytes < state.nbytes("params"), cycle.stats
    # training goes on from exactly the current weights
    loss = mb.train_step(ddp, opt, mb.batch(spec, 5, DEVICE))
    assert torch.isfinite(torch.tensor(loss))
    cycle.end()


def test_pi_old_cycle_run_matches_a_frozen_copy(mb):
    """``run``: old log-probs of every mini-batch come from pi_old, training from the current weights."""
    spec = _spec(mb)
    ddp, opt = mb.build_gpt(spec, DEVICE)
    twin, twin_opt = mb.build_gpt(spec, DEVICE)  # a copy that stays pi_old for reference
    state = ModelState(ddp, opt)
    for i in range(2):
        mb.train_step(ddp, opt, mb.batch(spec, i, DEVICE))
    _copy_weights(ddp, twin, twin_opt)
    batches = [mb.batch(spec, 10 + i, DEVICE) for i in range(4)]
    cycle = PiOldCycle(state)
    olds = cycle.run(batches, lambda ids: mb.logits(ddp, ids), lambda ids: mb.train_step(ddp, opt, ids))
    for ids, got in zip(batches, olds, strict=True):
        assert torch.equal(got, mb.logits(twin, ids))
    assert cycle.stats.skipped_swaps == 1 and cycle.stats.swaps == 3
    if DEVICE == "cuda":  # a small model fits, with room for a device stash: cheaper than rebuilding
        assert cycle.stats.placement == "device" and cycle.stats.rebuilds == 0
        assert cycle.stats.stashed_bytes >= 3 * state.nbytes("params")
    else:
        assert cycle.stats.rebuilds == 3


# ----------------------------------------------------------------------------- (c)


def test_offload_onload_between_every_step_gives_the_same_losses(mb):
    spec = _spec(mb)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        a, a_opt = mb.build_gpt(spec, DEVICE)
        b, b_opt = mb.build_gpt(spec, DEVICE)
        _copy_weights(a, b, b_opt)
        _assert_same(_weights(a), _weights(b))
        state = ModelState(a, a_opt)
        losses_a, losses_b = [], []
        for i in range(5):
            ids = mb.batch(spec, i, DEVICE)
            losses_a.append(mb.train_step(a, a_opt, ids))
            losses_b.append(mb.train_step(b, b_opt, ids))
            _sync()
            held = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
            state.offload()  # params, frozen, buffers, grads, fp32 masters, Adam moments
            _sync()
            if DEVICE == "cuda":
                freed = held - torch.cuda.memory_allocated()
                assert freed >= 0.99 * state.nbytes() - (1 << 20), (freed, state.nbytes())
            assert all(c["device"] == 0 for c in state.residency().values())
            state.onload()
        assert losses_a == losses_b, (losses_a, losses_b)
        _assert_same(_weights(a), _weights(b))
        for oa, ob in zip(a_opt.chained_optimizers, b_opt.chained_optimizers, strict=True):
            for ma, mb_ in zip(oa.shard_fp32_from_float16_groups, ob.shard_fp32_from_float16_groups, strict=True):
                for x, y in zip(ma, mb_, strict=True):
                    assert torch.equal(x, y)
                    assert torch.equal(oa.optimizer.state[x]["exp_avg_sq"], ob.optimizer.state[y]["exp_avg_sq"])
    finally:
        torch.use_deterministic_algorithms(deterministic)


# ----------------------------------------------------------------------------- (d)


def test_moe_snapshots_cover_expert_bias(mb):
    spec = _spec(mb, experts=4, hidden=128 if DEVICE == "cuda" else 64)
    ddp, opt = mb.build_gpt(spec, DEVICE)
    state = ModelState(ddp, opt)
    routers = {n: m for n, m in ddp.module.module.named_modules() if getattr(m, "expert_bias", None) is not None}
    assert len(routers) == spec.layers
    for i in range(3):
        mb.train_step(ddp, opt, mb.batch(spec, i, DEVICE))
    bias_then = {n: r.expert_bias.detach().clone() for n, r in routers.items()}
    assert any(bool(b.abs().sum() > 0) for b in bias_then.values()), "expert_bias never moved"
    probe = mb.batch(spec, 99, DEVICE)
    at_snapshot = mb.logits(ddp, probe)

    cycle = PiOldCycle(state)
    values = cycle.begin().wait().tensors()
    for n, b in bias_then.items():
        assert b.dtype == torch.float32
        assert torch.equal(values[f"{n}.expert_bias"].to(b.device), b), n
    for i in range(3, 6):
        mb.train_step(ddp, opt, mb.batch(spec, i, DEVICE))
    bias_now = {n: r.expert_bias.detach().clone() for n, r in routers.items()}
    assert any(not torch.equal(bias_now[n], bias_then[n]) for n in routers)
    current = _weights(ddp)
    with cycle.old_policy():
        for n, r in routers.items():
            assert torch.equal(r.expert_bias, bias_then[n]), n
        under_pi_old = mb.logits(ddp, probe)
    torch.testing.assert_close(under_pi_old, at_snapshot, rtol=1e-3, atol=1e-3)
    _assert_same(_weights(ddp), current)
    for n, r in routers.items():
        assert torch.equal(r.expert_bias, bias_now[n])
    cycle.end()


# ----------------------------------------------------------------------------- coexistence


def test_megatron_reload_after_stateshift_offload_cannot_bring_back_stale_weights(mb):
    spec = _spec(mb)
    ddp, opt = mb.build_gpt(spec, DEVICE)
    state = ModelState(ddp, opt)
    mb.train_step(ddp, opt, mb.batch(spec, 0, DEVICE))
    for b in _buffers(ddp):  # Megatron's own offload and reload leave param_data_cpu behind
        b.offload_to_cpu()
        b.reload_from_cpu()
    mb.train_step(ddp, opt, mb.batch(spec, 1, DEVICE))
    current = _weights(ddp)
    state.offload("params")
    for b in _buffers(ddp):
        b.reload_from_cpu()  # with a stale param_data_cpu this would restore step-0 weights
    assert all(b.param_data.untyped_storage().nbytes() == 0 for b in _buffers(ddp))
    with raises_kind(StateError, "offloaded", match="params"):
        mb.logits(ddp, mb.batch(spec, 99, DEVICE))
    state.onload("params")
    _assert_same(_weights(ddp), current)
