"""The Megatron backend on the CPU fake of megatron-core 0.16.1 (``tests/fakes/mcore/``).

The residency matrix: every model/optimizer configuration (distributed optimizer with
expert-parallel buffers, one DistributedOptimizer, Float16 optimizer with ``param_data is
None``, dense with a frozen layer) x every residency mix (resident, offloaded by stateshift in
whole or in part, grads dropped, offloaded by Megatron's own ``offload_to_cpu`` on all buffers
or on one (the other never offloaded), grads dropped by Megatron, reloaded by Megatron with a
stale ``param_data_cpu`` behind) x every verb (snapshot, onload + training, restore, swapped).
Then the field failures of docs/notes/field.md that concern Megatron, the guards, detection, unwrapped and
virtual-pipeline chunks, the master-rebuild plug-in, and the engine's handling of storage a
framework releases or re-grows itself. A last test runs ``tests/gpu/test_megatron_gpu.py``
against the real megatron-core on the CPU when it is installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fakes.mcore import (
    FakeDenseModel,
    FakeFloat16Module,
    FakeMoEModel,
    build_fake_ddp,
    build_fake_optimizer,
    fake_finalize_model_grads,
    fake_train_step,
)
from fakes.mcore.setups import CONFIGS, HIDDEN, _x, after_steps, build, pretend_cuda_engine
from helpers import one_torch_thread
from raises import raises_kind

from stateshift import ModelState, ObjectError, StateError
from stateshift.backends import detect_backends, megatron as mg
from stateshift.backends.torch import TorchModuleBackend, TorchOptimizerBackend
from stateshift.core.engine import core_of
from stateshift.core.slot import Entry, NativeHome


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def buffers(ddp):
    return ddp.buffers + ddp.expert_parallel_buffers


def capture(state: ModelState, groups=None) -> dict[str, torch.Tensor]:
    snap = state.snapshot(groups if groups is not None else state.groups, tag="_capture")
    try:
        return snap.tensors()
    finally:
        state.release(snap)


def member_slots(state: ModelState) -> dict[str, str]:
    return {m.name: s.name for s in core_of(state).slots() for m in s.info.members}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:6]
    for k, v in a.items():
        assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
        assert torch.equal(v, b[k]), f"values differ at {k}"


def storage_bytes(t) -> int:
    return t.untyped_storage().nbytes()


def _trained_twin(config: str):
    ddp, opt = build(config)
    fake_train_step(ddp, opt, _x(0))
    return ddp, opt


@pytest.fixture
def trained(request):
    """(config, ddp, opt, state, make_twin): trained one step (grads, Adam moments and expert_bias
    exist); ``make_twin()`` builds an identical copy that never moves."""
    config = request.param
    ddp, opt = _trained_twin(config)
    state = ModelState(ddp, opt)
    yield config, ddp, opt, state, lambda: _trained_twin(config)
    # the model is never collected (Megatron's DDP holds its params from hooks): give it back whole, or its
    # released storages would keep the offloaded-touch check on for every later test of this process
    state.close()


# ----------------------------------------------------------------------------- residency mixes
# Each mix puts the state into some residency and returns the slot names whose values it dropped.


def _native(ddp, which="all", params=True, grads=True):
    for i, b in enumerate(buffers(ddp)):
        if which == "all" or i == which:
            b.offload_to_cpu(move_params=params, move_grads=grads)


def _grad_slots(state, ddp, which="all") -> set[str]:
    names = {s.name for s in core_of(state).slots("grads")}
    if which == "all":
        return names
    return {n for n in names if n.startswith("buffers.0.")}


MIXES = {
    "resident": lambda st, d: set(),
    "offloaded": lambda st, d: (st.offload(), set())[1],
    "params_offloaded": lambda st, d: (st.offload("params"), set())[1],
    "partial": lambda st, d: (
        st.offload(["params", "optim", "buffers"], only=lambda n: "expert" in n or n.startswith("out.")),
        set(),
    )[1],
    "grads_dropped": lambda st, d: (st.drop("grads"), _grad_slots(st, d))[1],
    "native_all": lambda st, d: (_native(d), _grad_slots(st, d))[1],
    "native_one_other_never": lambda st, d: (_native(d, which=0), _grad_slots(st, d, which=0))[1],
    "native_params_only": lambda st, d: (_native(d, grads=False), set())[1],
    "native_grads_only": lambda st, d: (d.offload_grad_buffers(), _grad_slots(st, d))[1],
    "native_reloaded": lambda st, d: (_native(d), [b.reload_from_cpu() for b in buffers(d)], _grad_slots(st, d))[2],
    "native_then_stateshift": lambda st, d: (_native(d, which=0), st.offload(), _grad_slots(st, d, which=0))[2],
    "stateshift_then_native": lambda st, d: (
        st.offload("optim"),
        st.offload("params", only=lambda n: "expert" in n),
        _native(d),
        _grad_slots(st, d),
    )[3],
}


def _expected(state, values, dropped_slots) -> dict[str, torch.Tensor]:
    owner = member_slots(state)
    return {k: torch.zeros_like(v) if owner[k] in dropped_slots else v for k, v in values.items()}


MATRIX = [pytest.param(c, id=c) for c in CONFIGS]


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("trained", MATRIX, indirect=True)
def test_snapshot_in_every_residency(trained, mix):
    config, ddp, _, state, *_ = trained
    truth = capture(state)
    dropped = MIXES[mix](state, ddp)
    got = capture(state)
    assert_same(got, _expected(state, truth, dropped))
    if mix == "native_all" and CONFIGS[config]["udo"]:
        assert state.residency()["params"] == {"device": 0, "host": len(core_of(state).slots("params")), "dropped": 0}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("trained", MATRIX, indirect=True)
def test_onload_from_every_residency_then_training_is_bit_identical(trained, mix):
    _, ddp, opt, state, make_twin = trained
    twin, twin_opt = make_twin()
    truth = capture(state)
    dropped = MIXES[mix](state, ddp)
    state.onload()
    assert all(c["host"] == 0 and c["dropped"] == 0 for c in state.residency().values()), state.residency()
    assert all(storage_bytes(b.grad_data) > 0 for b in buffers(ddp))
    assert_same(capture(state), _expected(state, truth, dropped))
    for i in range(2, 4):
        assert fake_train_step(ddp, opt, _x(i)) == fake_train_step(twin, twin_opt, _x(i))
    assert_same(
        capture(state, ["params", "buffers", "optim"]),
        capture(ModelState(twin, twin_opt), ["params", "buffers", "optim"]),
    )


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("trained", MATRIX, indirect=True)
def test_restore_into_every_residency(trained, mix):
    _, ddp, opt, state, *_ = trained
    truth = capture(state)
    saved = state.snapshot(state.groups, tag="saved")
    fake_train_step(ddp, opt, _x(7))
    MIXES[mix](state, ddp)
    state.restore(saved)
    state.restore(saved)  # twice: the same values twice
    assert_same(capture(state), truth)
    state.onload()
    assert_same(capture(state), truth)
    # Megatron's own reload must not bring back what was there before the restore
    for b in buffers(ddp):
        b.reload_from_cpu()
    assert_same(capture(state), truth)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("trained", MATRIX, indirect=True)
def test_swapped_in_every_residency(trained, mix):
    _, ddp, opt, state, *_ = trained
    old = capture(state)
    pi_old = state.snapshot(state.groups, tag="pi_old")
    fake_train_step(ddp, opt, _x(5))
    dropped = MIXES[mix](state, ddp)
    residency = state.residency()
    now = _expected(state, capture(state), dropped)
    with state.swapped(pi_old):
        assert_same(capture(state), old)
    assert state.residency() == residency
    assert_same(capture(state), now)
    state.onload()
    assert_same(capture(state), now)


# ----------------------------------------------------------------------------- training is bit-identical


@pytest.mark.parametrize("config", list(CONFIGS))
def test_offload_onload_between_every_step_leaves_training_bit_identical(config):
    ddp, opt = build(config)
    twin, twin_opt = build(config)
    state = ModelState(ddp, opt)
    verbs = [
        lambda: (state.offload(), state.onload()),
        lambda: (state.offload(["params", "optim"]), state.drop("grads"), state.onload()),
        lambda: (_native(ddp), state.onload()),
        lambda: (_native(ddp), [b.reload_from_cpu() for b in buffers(ddp)], state.offload(), state.onload()),
        lambda: (state.offload("grads"), ddp.offload_grad_buffers(), state.onload()),
    ]
    for i in range(2 * len(verbs)):
        assert fake_train_step(ddp, opt, _x(i)) == fake_train_step(twin, twin_opt, _x(i)), f"step {i}"
        verbs[i % len(verbs)]()
    assert_same(
        capture(state, ["params", "frozen", "buffers", "optim"]),
        capture(ModelState(twin, twin_opt), ["params", "frozen", "buffers", "optim"]),
    )


# ----------------------------------------------------------------------------- field failures (docs/notes/field.md)


def test_field_snapshot_of_natively_offloaded_buffers_reads_param_data_cpu_and_copies_it():
    """verl #6026: a snapshot of buffers offloaded by Megatron read the empty GPU storage (and then a
    side attribute ``cpu_data`` that only verl's own offload sets): AttributeError."""
    ddp, opt = build("distrib_ep")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    want = {i: b.param_data.clone() for i, b in enumerate(buffers(ddp))}
    views = {n: p.detach().clone() for n, p in ddp.module.module.named_parameters() if p.requires_grad}
    _native(ddp)
    for b in buffers(ddp):
        assert not hasattr(b.param_data, "cpu_data") and storage_bytes(b.param_data) == 0
    snap = state.snapshot(tag="pi_old").wait()
    got = snap.tensors()
    assert torch.equal(got["buffers.0.param_data"], want[0])
    assert torch.equal(got["expert_parallel_buffers.0.param_data"], want[1])
    for n, v in views.items():
        assert torch.equal(got[n], v), n
    ddp.buffers[0].param_data_cpu.add_(1)  # the snapshot is a copy, not an alias of Megatron's host copy
    assert torch.equal(snap.tensors()["buffers.0.param_data"], want[0])


def test_field_expert_bias_is_in_snapshots_and_swaps():
    """Snapshots covered parameters only; the MoE router's expert_bias (a buffer updated every step
    by finalize_model_grads) was left out, so pi_old log-probs used the current bias."""
    ddp, opt = build("distrib_ep")
    state = ModelState(ddp, opt)
    router = ddp.module.module.moe.router
    for i in range(2):
        fake_train_step(ddp, opt, _x(i))
    bias_then = router.expert_bias.clone()
    assert bias_then.dtype == torch.float32 and bool(bias_then.abs().sum() > 0)
    pi_old = state.snapshot(tag="pi_old")
    assert "buffers" in pi_old.groups and "moe.router.expert_bias" in pi_old.tensors()
    fake_train_step(ddp, opt, _x(2))
    bias_now = router.expert_bias.clone()
    assert not torch.equal(bias_now, bias_then)
    with state.swapped(pi_old):
        assert torch.equal(router.expert_bias, bias_then)
    assert torch.equal(router.expert_bias, bias_now)
    state.offload("buffers")
    assert storage_bytes(router.expert_bias) == 0
    state.onload("buffers")
    assert torch.equal(router.expert_bias, bias_now)


def test_expert_bias_dtype_is_settled_before_the_first_forward():
    """Float16Module casts expert_bias to bf16 and the router swaps it back to fp32 at its first
    forward (a new storage); the backend does that first, so an early snapshot still fits."""
    ddp, opt = build("distrib")
    router = ddp.module.module.moe.router
    state = ModelState(ddp, opt)
    assert router.expert_bias.dtype == torch.float32
    early = state.snapshot(tag="early")
    fake_train_step(ddp, opt, _x(0))
    state.restore(early)  # no LayoutError("mismatch")
    assert torch.equal(router.expert_bias, torch.zeros_like(router.expert_bias))


def test_field_param_data_none_means_one_slot_per_param():
    """verl #5782: with use_distributed_optimizer=False some versions have param_data = None."""
    ddp, opt = build("float16_no_param_data")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    assert all(b.param_data is None for b in buffers(ddp))
    trainable = [p for p in ddp.parameters() if p.requires_grad]
    assert len(core_of(state).slots("params")) == len({p.untyped_storage()._cdata for p in trainable})
    before = capture(state)
    state.offload()
    assert all(storage_bytes(p) == 0 for p in trainable)
    assert all(storage_bytes(b.grad_data) == 0 for b in buffers(ddp))
    snap = state.snapshot(tag="s")
    assert_same(snap.tensors(), {k: v for k, v in before.items() if k in snap.tensors()})
    state.onload()
    assert_same(capture(state), before)


def test_field_expert_parallel_buffers_are_offloaded_too():
    """verl #1766: expert-parallel buffers were never offloaded."""
    ddp, opt = build("distrib_ep")
    fake_train_step(ddp, opt, _x(0))
    assert ddp.expert_parallel_buffers
    state = ModelState(ddp, opt)
    names = {s.name for s in core_of(state).slots()}
    assert {"expert_parallel_buffers.0.param_data", "expert_parallel_buffers.0.grad_data"} <= names
    before = capture(state)
    state.offload()
    for b in ddp.expert_parallel_buffers:
        assert storage_bytes(b.param_data) == 0 and storage_bytes(b.grad_data) == 0
    state.onload()
    assert_same(capture(state), before)


def test_field_stale_reload_from_cpu_after_stateshift_offload():
    """Megatron keeps param_data_cpu forever after its first offload; if someone else releases the
    storage, its reload_from_cpu restores those old values (docs/notes/megatron-layout.md, section 7.4)."""
    ddp, opt = build("distrib_ep")
    state = ModelState(ddp, opt)
    fake_train_step(ddp, opt, _x(0))
    _native(ddp)
    for b in buffers(ddp):
        b.reload_from_cpu()
    stale = [b.param_data_cpu.clone() for b in buffers(ddp)]
    fake_train_step(ddp, opt, _x(1))
    current = capture(state, ["params"])
    state.offload("params")
    assert all(b.param_data_cpu is None for b in buffers(ddp))
    for b in buffers(ddp):
        b.reload_from_cpu()  # now a no-op: nothing stale to bring back
        assert storage_bytes(b.param_data) == 0
    with raises_kind(StateError, "offloaded", match="params"):
        ddp(_x(9))
    state.onload("params")
    assert_same(capture(state, ["params"]), current)
    assert not all(torch.equal(b.param_data, s) for b, s in zip(buffers(ddp), stale, strict=True))


def test_field_stale_reload_after_stateshift_onload_of_a_native_offload():
    ddp, opt = build("distrib")
    state = ModelState(ddp, opt)
    fake_train_step(ddp, opt, _x(0))
    _native(ddp)
    state.onload()  # stateshift re-fills from param_data_cpu and tells Megatron to forget it
    assert all(b.param_data_cpu is None for b in buffers(ddp))
    fake_train_step(ddp, opt, _x(1))
    current = capture(state, ["params"])
    state.offload("params")
    for b in buffers(ddp):
        b.reload_from_cpu()
    state.onload("params")
    assert_same(capture(state, ["params"]), current)


def test_megatron_reload_after_stateshift_adopted_its_offload_is_followed():
    ddp, opt = build("distrib_ep")
    state = ModelState(ddp, opt)
    fake_train_step(ddp, opt, _x(0))
    want = capture(state, ["params"])
    _native(ddp)
    assert state.residency()["params"]["host"] == 2 and state.residency()["grads"]["dropped"] == 2
    for b in buffers(ddp):
        b.reload_from_cpu()  # Megatron's own reload: its values are the truth again
    assert state.residency()["params"]["device"] == 2 and state.residency()["grads"]["device"] == 2
    assert all(b.param_data_cpu is None and b.grad_data_size == 0 for b in buffers(ddp))
    fake_train_step(ddp, opt, _x(1))
    after = capture(state, ["params"])
    assert not torch.equal(after["buffers.0.param_data"], want["buffers.0.param_data"])
    state.offload()
    assert all(storage_bytes(b.param_data) == 0 for b in buffers(ddp))
    state.onload()
    assert_same(capture(state, ["params"]), after)


def test_grads_dropped_by_megatron_then_refilled_by_stateshift_are_not_zeroed_by_megatron_later():
    ddp, opt = build("distrib_ep")
    state = ModelState(ddp, opt)
    fake_train_step(ddp, opt, _x(0))
    ddp.offload_grad_buffers()
    assert all(b.grad_data_size > 0 for b in buffers(ddp))
    state.onload("grads")
    assert all(b.grad_data_size == 0 for b in buffers(ddp))
    ddp.zero_grad_buffer()
    ddp(_x(1)).float().pow(2).mean().backward()
    grads = [b.grad_data.clone() for b in buffers(ddp)]
    assert any(bool(g.abs().sum() > 0) for g in grads)
    ddp.restore_grad_buffers()  # would zero the accumulated grads if grad_data_size were still set
    assert all(torch.equal(b.grad_data, g) for b, g in zip(buffers(ddp), grads, strict=True))


def test_storage_released_by_someone_else_without_values_is_a_clear_error():
    ddp, opt = build("distrib")
    state = ModelState(ddp, opt)
    fake_train_step(ddp, opt, _x(0))
    ddp.buffers[0].param_data.untyped_storage().resize_(0)  # e.g. verl's own offload, values elsewhere
    for make in (lambda: state.snapshot(tag="x"), lambda: ModelState(ddp, opt)):
        with raises_kind(StateError, "foreign") as info:
            make()
        assert info.value.tensor == "buffers.0.param_data"
        assert not isinstance(info.value, AttributeError)


def test_a_host_copy_of_the_wrong_size_is_a_clear_error():
    ddp, opt = build("distrib")
    state = ModelState(ddp, opt)
    b = ddp.buffers[0]
    b.offload_to_cpu()
    b.param_data_cpu = b.param_data_cpu[:-1].clone()
    with raises_kind(StateError, "foreign", match="param_data_cpu"):
        state.snapshot(tag="x")


# ----------------------------------------------------------------------------- coverage


def test_every_tensor_is_listed_once_in_its_group():
    ddp, opt = build("distrib_ep")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    assert [type(b) for b in state.backends] == [mg.MegatronModelBackend, mg.MegatronOptimizerBackend]
    members = {m.name: s.info.group for s in core_of(state).slots() for m in s.info.members}
    inner = ddp.module.module
    for name, p in inner.named_parameters():
        assert members[name] == ("params" if p.requires_grad else "frozen"), name
        if p.requires_grad:
            assert members[f"{name}.main_grad"] == "grads"
            assert members[f"{name}.main_param"] == "optim"
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert members[f"{name}.{k}"] == "optim"
    for name, _ in inner.named_buffers():
        assert members[name] == "buffers"
    for kind in ("buffers", "expert_parallel_buffers"):
        assert members[f"{kind}.0.param_data"] == "params" and members[f"{kind}.0.grad_data"] == "grads"
    masters = sum(len(g) for o in opt.chained_optimizers for g in o.shard_fp32_from_float16_groups)
    states = sum(len(v) for o in opt.chained_optimizers for v in o.optimizer.state.values())
    assert len(core_of(state).slots("optim")) == masters + states
    assert state.nbytes() == sum(s.nbytes for s in core_of(state).slots())
    cov = state.backends[0].coverage()
    assert "moe.router.expert_bias" in cov["buffers"] and "frozen.weight" in cov["frozen"]


def test_fp32_model_params_are_not_listed_twice():
    ddp = build_fake_ddp(FakeDenseModel(HIDDEN), bf16=False)
    opt = build_fake_optimizer(ddp, "distrib")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    optim = {m.name for s in core_of(state).slots("optim") for m in s.info.members}
    assert not any(n.endswith(".main_param") for n in optim)
    assert "l1.weight.exp_avg" in optim
    before = capture(state)
    state.offload()
    state.onload()
    assert_same(capture(state), before)


def test_names_are_those_of_megatron_state_dict():
    ddp, opt = build("distrib_ep")
    state = ModelState(ddp, opt)
    names = {m.name for s in core_of(state).slots() for m in s.info.members}
    assert set(ddp.state_dict()) <= names


# ----------------------------------------------------------------------------- guards


def test_forward_with_offloaded_params_or_expert_bias_is_a_python_error():
    ddp, opt = build("distrib_ep")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    state.offload("params", only=lambda n: "expert" in n)
    with raises_kind(StateError, "offloaded", match="'params'"):
        ddp(_x(1))
    state.onload()
    state.offload("buffers")
    with raises_kind(StateError, "offloaded", match="'buffers'"):
        ddp(_x(1))
    state.onload()
    ddp(_x(1))


def test_a_module_added_after_verbs_is_listed_and_guarded():
    """Verbs look at the module tree with one cheap pass (``TreeWatch``) and walk it by name only after a
    change: an adapter added between two verbs must still be listed, moved and guarded."""
    ddp, opt = build("dense_float16")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    state.offload("params")
    state.onload("params")
    inner = ddp.module.module
    inner.adapter = torch.nn.Linear(HIDDEN, HIDDEN)  # outside every DDP buffer, like a LoRA adapter
    state.offload("params")
    names = {s.name for s in core_of(state).slots("params")}
    assert any("adapter.weight" in n for n in names), names
    with raises_kind(StateError, "offloaded", match="adapter"):
        inner.adapter(torch.zeros(1, HIDDEN))
    state.onload("params")
    inner.adapter.weight = torch.nn.Parameter(torch.ones(HIDDEN, HIDDEN))  # replaced: a new object, new hooks
    state.offload("params")
    with raises_kind(StateError, "offloaded", match="adapter"):
        inner.adapter(torch.zeros(1, HIDDEN))
    state.onload("params")
    assert torch.equal(inner.adapter.weight, torch.ones(HIDDEN, HIDDEN))


_UNFROZEN_ADAPTER = """
import sys
sys.path[:0] = sys.argv[1:3]
import torch
from fakes.mcore import fake_train_step
from fakes.mcore.setups import HIDDEN, _x, build
from stateshift import ModelState, StateError

ddp, opt = build("dense_float16")
fake_train_step(ddp, opt, _x(0))
inner = ddp.module.module
inner.adapter = torch.nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)  # frozen: group 'frozen', no grad hook
state = ModelState(ddp, opt)
state.offload()
state.onload()
inner.adapter.weight.requires_grad_(True)  # unfrozen between verbs: same objects, same names
x = torch.zeros(2, HIDDEN)
inner.adapter(x).sum().backward()
state.offload("grads")
try:
    inner.adapter(x).sum().backward()  # accumulates into the released adapter.weight.grad
except StateError as e:
    if e.kind != "offloaded":
        raise
    print("RAISED", e)
"""


def test_a_param_unfrozen_after_verbs_is_guarded():
    """``TreeWatch`` must see ``requires_grad`` change: the guards hook gradients of trainable params only."""
    from helpers import assert_isolated

    assert_isolated(_UNFROZEN_ADAPTER, "RAISED", "adapter.weight.grad")


def test_backward_into_offloaded_main_grads_is_a_python_error():
    ddp, opt = build("distrib")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    out = ddp(_x(1)).float().pow(2).mean()
    state.drop("grads")
    with raises_kind(StateError, "offloaded", match="main_grad"):
        out.backward()


def test_zero_grad_buffer_and_optimizer_step_with_offloaded_state_are_python_errors():
    ddp, opt = build("distrib_ep")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    state.offload("grads")
    with raises_kind(StateError, "offloaded", match="grads"):
        ddp.zero_grad_buffer()
    state.onload("grads")
    state.offload("optim")
    with raises_kind(StateError, "offloaded", match="optim"):
        opt.step()
    with raises_kind(StateError, "offloaded", match="optim"):
        opt.offload_to_cpu()  # Megatron's own optimizer offload would read released storage
    state.onload("optim")
    fake_train_step(ddp, opt, _x(1))
    state.close()
    assert "step" not in opt.__dict__ and "zero_grad_buffer" not in ddp.__dict__  # guards removed


# ----------------------------------------------------------------------------- detection and chunks


def test_detection_does_not_import_megatron():
    had = "megatron" in sys.modules
    ddp, opt = build("distrib")
    found = detect_backends(ddp, opt)
    assert [type(b) for b in found] == [mg.MegatronModelBackend, mg.MegatronOptimizerBackend]
    assert ("megatron" in sys.modules) == had
    plain = torch.nn.Linear(2, 2)
    assert mg.detect(plain, torch.optim.Adam(plain.parameters())) is None
    assert [type(b) for b in detect_backends(plain)] == [TorchModuleBackend]
    torch_opt = torch.optim.Adam([p for p in ddp.parameters() if p.requires_grad])
    assert [type(b) for b in detect_backends(ddp, torch_opt)] == [mg.MegatronModelBackend, TorchOptimizerBackend]
    with raises_kind(ObjectError, "backend", match="neither a Megatron"):
        mg.backends(ddp, object())


def test_unwrapped_chunk_reference_model():
    ref = FakeFloat16Module(FakeDenseModel(HIDDEN, seed=3))
    state = ModelState(ref)
    assert [type(b) for b in state.backends] == [mg.MegatronModelBackend]
    assert {s.name for s in core_of(state).slots("frozen")} == {"frozen.weight"}
    assert {m.name for s in core_of(state).slots("params") for m in s.info.members} == {
        "l1.weight",
        "l1.bias",
        "l2.weight",
        "l2.bias",
    }
    out = ref(_x(0))
    snap = state.snapshot(tag="ref")
    state.offload()
    assert all(storage_bytes(p) == 0 for p in ref.parameters())
    with raises_kind(StateError, "offloaded"):
        ref(_x(0))
    state.onload()
    assert torch.equal(ref(_x(0)), out)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1)
    state.restore(snap)
    assert torch.equal(ref(_x(0)), out)


def test_registry_of_unwrapped_chunk_types():
    class MyChunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

    assert mg.detect(MyChunk()) is None
    mg.UNWRAPPED_CHUNK_TYPES.add(MyChunk)
    try:
        assert [type(b) for b in mg.detect(MyChunk())] == [mg.MegatronModelBackend]
    finally:
        mg.UNWRAPPED_CHUNK_TYPES.discard(MyChunk)


def test_virtual_pipeline_list_of_chunks():
    def two():
        chunks = [build_fake_ddp(FakeMoEModel(HIDDEN, seed=s)) for s in (0, 1)]
        return chunks, build_fake_optimizer(chunks, "chained")

    chunks, opt = two()
    twin, twin_opt = two()
    state = ModelState(chunks, opt)
    names = {s.name for s in core_of(state).slots("params")}
    assert names == {"chunk0.buffers.0.param_data", "chunk1.buffers.0.param_data"}
    assert "chunk1.moe.router.expert_bias" in {s.name for s in core_of(state).slots("buffers")}

    def step(cs, o, i):
        for c in cs:
            c.zero_grad_buffer()
        o.zero_grad()
        loss = (cs[1](cs[0](_x(i))).float() ** 2).mean()
        loss.backward()
        fake_finalize_model_grads(cs)
        o.step()
        return loss.item()

    for i in range(3):
        assert step(chunks, opt, i) == step(twin, twin_opt, i)
        state.offload()
        chunks[1].buffers[0].param_data  # noqa: B018
        state.onload()
    assert_same(capture(state, ["params", "optim"]), capture(ModelState(twin, twin_opt), ["params", "optim"]))


# ----------------------------------------------------------------------------- master rebuild


@pytest.mark.parametrize("config", ["distrib_ep", "distrib", "float16_no_param_data", "dense_float16"])
def test_master_rebuild_gives_back_exactly_the_current_params(config):
    ddp, opt = build(config)
    state = ModelState(ddp, opt)
    for i in range(2):
        fake_train_step(ddp, opt, _x(i))
    pi_old = state.snapshot(["params", "buffers"], tag="pi_old")
    fake_train_step(ddp, opt, _x(2))
    now = capture(state)
    plugin = state.backends[1].rebuild_plugin()
    assert plugin.available() is None  # masters and params both on the CPU, whatever the engine drives
    calls = []

    def rebuild():
        calls.append(1)
        plugin()

    old = pi_old.tensors()
    with state.swapped(pi_old, rebuild={"params": rebuild}):
        inside = capture(state, ["params"])
        assert_same(inside, {k: old[k] for k in inside})
    assert calls == [1]
    assert_same(capture(state), now)


@pytest.mark.parametrize("engine", ["as_built", "on_cuda"])
def test_master_rebuild_refuses_when_it_would_not_be_exact(engine, monkeypatch):
    dense32 = build_fake_ddp(FakeDenseModel(HIDDEN), bf16=False)
    opt32 = build_fake_optimizer(dense32, "distrib")
    assert "fp32 model params" in ModelState(dense32, opt32).backends[1].rebuild_plugin().available()
    ddp, opt = build("distrib")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    if engine == "on_cuda":
        pretend_cuda_engine(state, monkeypatch)
    plugin = state.backends[1].rebuild_plugin()
    assert plugin.available() is None  # "on the device" = where the params live (the CPU here)
    state.offload("optim")
    assert "not on the device" in plugin.available()
    state.onload("optim")
    assert plugin.available() is None
    # a master on another device than its params (as after Megatron's own offload_to_cpu on a
    # GPU: p.data = p.data.cpu()); "meta" stands in for the other device on a CPU-only machine
    leaf = mg.objects.optimizers_of(opt)[0]
    masters = leaf.shard_fp32_from_float16_groups[0]
    values = masters[0]
    masters[0] = torch.empty_like(values, device="meta")
    plugin._sig = None  # (the plan is cached per param-group signature, which this does not change)
    try:
        assert "not on the device of the params (meta, params on cpu" in plugin.available()
    finally:
        masters[0] = values
        plugin._sig = None
    assert plugin.available() is None


def test_master_rebuild_counts_nan_equal_to_nan():
    """A NaN param written by the optimizer's cast matches its NaN master even where the two casts give the
    NaN other bits (the CPU's vectorised cast and its scalar one do), and -0.0 equals 0.0; a real
    difference beside them is still found."""
    ddp, opt = build("distrib")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    plugin = state.backends[1].rebuild_plugin()
    assert plugin.available() is None
    dst, master = plugin._destinations()[0].view(-1), plugin._masters[0].view(-1)
    with torch.no_grad():
        master[0] = float("nan")
        dst[0] = master[0].to(dst.dtype)  # the scalar cast
        master[1], dst[1] = 0.0, -0.0
    assert master.to(dst.dtype)[0].view(torch.int16) != dst[0].view(torch.int16)  # (the case this test is about)
    assert plugin.available() is None
    with torch.no_grad():
        dst[2] = master[2].to(dst.dtype) + 1
    assert "not the fp32 masters' cast" in plugin.available()


def test_master_rebuild_copes_with_masters_offloaded_inside_the_swap():
    ddp, opt = after_steps("distrib")
    state = ModelState(ddp, opt)
    pi_old = state.snapshot(["params"], tag="pi_old")
    fake_train_step(ddp, opt, _x(2))
    now = capture(state, ["params"])
    plugin = state.backends[1].rebuild_plugin()
    with state.swapped(pi_old, rebuild={"params": plugin}):
        state.offload("optim")
    assert state.residency()["optim"]["device"] == 0
    state.onload("optim")
    assert_same(capture(state, ["params"]), now)


# ----------------------------------------------------------------------------- engine: storage a framework releases


class _Framework:
    """A framework that offloads a tensor itself (values in ``cpu``, or none)."""

    def __init__(self, keep_values: bool = True) -> None:
        self.t = torch.arange(16, dtype=torch.float32)
        self.cpu = None
        self.keep = keep_values
        self.forgotten = 0

    def offload(self):
        self.cpu = self.t.detach().clone() if self.keep else None
        self.t.untyped_storage().resize_(0)

    def reload(self):
        self.t.untyped_storage().resize_(64)
        if self.cpu is not None:
            self.t.copy_(self.cpu)
        else:
            self.t.zero_()

    def forget(self):
        self.forgotten += 1
        self.cpu = None


class _Backend:
    name, groups, forward_groups = "fw", ("params",), ("params",)

    def __init__(self, fw):
        self.fw = fw

    def prepare(self, groups):
        pass

    def entries(self, group):
        native = None
        if self.fw.t.untyped_storage().nbytes() == 0 and (self.fw.cpu is not None or not self.fw.keep):
            native = NativeHome(values=self.fw.cpu, on_onload=self.fw.forget)
        return [Entry("t", "params", self.fw.t, nbytes=64, native_home=native)]

    def install_guards(self, check):
        return []


@pytest.mark.parametrize("keep", [True, False])
def test_engine_adopts_a_release_by_the_framework_after_tracking_started(keep):
    fw = _Framework(keep)
    state = ModelState(None, backends=[_Backend(fw)])
    assert state.residency()["params"]["device"] == 1
    fw.offload()
    assert state.residency()["params"] == {"device": 0, "host": int(keep), "dropped": int(not keep)}
    want = torch.arange(16, dtype=torch.float32) if keep else torch.zeros(16)
    assert torch.equal(state.snapshot(tag="s").tensors()["t"], want)
    assert fw.forgotten == 0
    state.onload()
    assert torch.equal(fw.t, want) and fw.forgotten == 1 and fw.cpu is None


def test_engine_follows_a_reload_by_the_framework():
    fw = _Framework()
    state = ModelState(None, backends=[_Backend(fw)])
    fw.offload()
    assert state.residency()["params"]["host"] == 1
    fw.reload()
    with torch.no_grad():
        fw.t.add_(1)
    assert state.residency()["params"]["device"] == 1 and fw.forgotten == 1
    state.offload()
    assert fw.t.untyped_storage().nbytes() == 0
    state.onload()
    assert torch.equal(fw.t, torch.arange(16, dtype=torch.float32) + 1)


@pytest.mark.parametrize("verb", ["restore", "drop"])
def test_engine_tells_the_framework_when_newer_values_replace_its_copy(verb):
    fw = _Framework()
    state = ModelState(None, backends=[_Backend(fw)])
    saved = state.snapshot(tag="s")
    with torch.no_grad():
        fw.t.mul_(3)
    fw.offload()
    state.residency()
    if verb == "restore":
        state.restore(saved)
    else:
        state.drop()
    assert fw.forgotten == 1 and fw.cpu is None  # the framework cannot reload its older copy now
    state.onload()
    assert torch.equal(fw.t, torch.arange(16, dtype=torch.float32) if verb == "restore" else torch.zeros(16))
    assert fw.forgotten == 1


# ----------------------------------------------------------------------------- the real megatron-core, on CPU

_HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE_MCORE, reason="megatron-core is not installed (pip install 'megatron-core==0.16.1')")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is here: tests/gpu/test_megatron_gpu.py runs on it for real"
)
def test_real_megatron_core_on_cpu():
    """tests/gpu/test_megatron_gpu.py against the real megatron-core 0.16.1 GPTModel + DDP +
    DistributedOptimizer, on the CPU (megatron patched by benchmarks/megatron_bench.py)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        STATESHIFT_MCORE_DEVICE="cpu",
        PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "-W",
            "ignore",
            str(root / "tests" / "gpu" / "test_megatron_gpu.py"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=root,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "10 passed" in summary and "skipped" not in summary, proc.stdout[-2000:]
