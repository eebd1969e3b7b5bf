"""The verl drop-ins on the CPU fake of megatron-core 0.16.1: every function, every residency, the handles,
and verl's fully-async pi_old sequence against a reference that never moves.

Values are read straight from the model's tensors once they are resident (``weights``), not through
stateshift. Residencies: on the device; offloaded by the drop-ins; released by Megatron's own
``offload_to_cpu`` on every buffer; one buffer Megatron's and the rest the drop-ins'.
"""

from __future__ import annotations

import gc
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from fakes.mcore import FakeDenseModel, build_fake_ddp, build_fake_optimizer, fake_train_step
from fakes.mcore.setups import _x, after_steps
from helpers import one_torch_thread

import stateshift.integrations.verl as V
from stateshift import LayoutError, ObjectError, StateError
from stateshift.integrations.verl.registry import take

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from raises import raises_kind
from verl_sequence import compare, megatron_fns, megatron_native_offload, reference_fns, run_sequence, weights

from stateshift.core.engine import core_of


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def bufs(ddp):
    return ddp.buffers + ddp.expert_parallel_buffers


def assert_same(a, b, what=""):
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys())[:5])
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: values differ at {k}"


def optim_values(opt) -> dict[str, torch.Tensor]:
    out = {}
    for i, leaf in enumerate(getattr(opt, "chained_optimizers", [opt])):
        for g, group in enumerate(
            getattr(leaf, "shard_fp32_from_float16_groups", None) or getattr(leaf, "fp32_from_float16_groups", [])
        ):
            out.update({f"{i}.m.{g}.{j}": t.detach().clone() for j, t in enumerate(group)})
        for j, st in enumerate(leaf.optimizer.state.values()):
            out.update({f"{i}.s.{j}.{k}": v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def put(models, residency: str) -> None:
    """Put the model in a residency, as verl's engine or Megatron would."""
    if residency == "offloaded":
        V.offload_megatron_model_to_cpu(models)
    elif residency == "native":
        megatron_native_offload(models)
    elif residency == "mixed":
        bufs(models[0])[0].offload_to_cpu(move_params=True, move_grads=True)
        V.offload_megatron_model_to_cpu(models)


RESIDENCIES = ["device", "offloaded", "native", "mixed"]
CONFIGS = ["distrib_ep", "dense_float16"]  # MoE + expert-parallel buffers + chained; dense + frozen + Float16 optimizer


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("residency", RESIDENCIES)
def test_offload_then_load_gives_the_same_values_and_zeroed_grads(config, residency):
    ddp, opt = after_steps(config, 1)
    models = [ddp]
    truth = weights(models)
    put(models, residency)
    V.offload_megatron_model_to_cpu(models)  # offloading again in any residency is fine
    assert all(b.param_data.untyped_storage().nbytes() == 0 for b in bufs(ddp))
    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in bufs(ddp))
    with raises_kind(StateError, "offloaded"):
        ddp(_x(0))
    V.load_megatron_model_to_gpu(models)
    assert_same(weights(models), truth, residency)
    assert all(torch.count_nonzero(b.grad_data) == 0 for b in bufs(ddp))
    fake_train_step(ddp, opt, _x(3))  # trains on from there


@pytest.mark.parametrize("config", CONFIGS)
def test_load_without_grads_or_frozen_params_leaves_them_released(config):
    ddp, _ = after_steps(config, 1)
    models = [ddp]
    truth = weights(models)
    V.offload_megatron_model_to_cpu(models)
    V.load_megatron_model_to_gpu(models, load_grad=False, load_frozen_params=False)
    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in bufs(ddp))
    frozen = [p for p in ddp.module.parameters() if not p.requires_grad]
    assert frozen and all(p.untyped_storage().nbytes() == 0 for p in frozen)
    assert V.model_state(models).residency()["frozen"]["host"] == len(core_of(V.model_state(models)).slots("frozen"))
    V.load_megatron_model_to_gpu(models)
    assert_same(weights(models), truth)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("at_copy", RESIDENCIES)
@pytest.mark.parametrize("at_restore", RESIDENCIES)
def test_copy_then_restore_in_every_residency(config, at_copy, at_restore):
    ddp, opt = after_steps(config, 1)
    models = [ddp]
    put(models, at_copy)
    V.load_megatron_model_to_gpu(models)
    truth = weights(models)
    put(models, at_copy)
    handle = V.copy_megatron_model_to_cpu(models)
    V.load_megatron_model_to_gpu(models)
    fake_train_step(ddp, opt, _x(5))
    trainable = next(f"0.{n}" for n, p in ddp.module.named_parameters() if p.requires_grad)
    assert not torch.equal(weights(models)[trainable], truth[trainable])
    put(models, at_restore)
    V.restore_megatron_model_from_cpu(models, handle)
    V.restore_megatron_model_from_cpu(models, handle)  # twice: the same values twice
    V.load_megatron_model_to_gpu(models)
    assert_same(weights(models), truth, f"{at_copy} -> {at_restore}")
    if config == "distrib_ep":
        assert any(k.endswith("expert_bias") for k in truth)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("model_offloaded", [False, True])
def test_optimizer_and_master_offload_round_trip(config, model_offloaded):
    ddp, opt = after_steps(config, 2)
    models = [ddp]
    truth = optim_values(opt)
    if model_offloaded:
        V.offload_megatron_model_to_cpu(models)
    V.offload_megatron_copy_params(opt)
    state = V.optimizer_state(opt)
    masters = [s for s in core_of(state).slots("optim") if s.name.endswith(".main_param")]
    assert masters and state.residency()["optim"]["host"] == len(masters)
    V.offload_megatron_optimizer(opt)
    assert state.residency()["optim"]["device"] == 0
    V.load_megatron_copy_params(opt)
    assert state.residency()["optim"]["device"] == len(masters)
    V.load_megatron_optimizer(opt)
    assert_same(optim_values(opt), truth)
    V.load_megatron_model_to_gpu(models)
    twin, twin_opt = after_steps(config, 2)
    assert fake_train_step(ddp, opt, _x(9)) == fake_train_step(twin, twin_opt, _x(9))
    assert_same(weights(models), weights([twin]))


def test_restore_refuses_what_is_not_its_handle_and_changes_nothing():
    ddp, opt = after_steps("distrib_ep", 1)
    models = [ddp]
    V.offload_megatron_model_to_cpu(models)
    residency = V.model_state(models).residency()
    other, _ = after_steps("distrib_ep", 1)
    foreign = V.copy_megatron_model_to_cpu([other])
    fsdp_kind = take(V.model_state(models), "fsdp2", ["params"])
    released = V.copy_megatron_model_to_cpu(models)
    released.release()
    cases = [
        ({"model_chunk_0": {"buffer_states": [], "is_ddp": True}}, "dict"),
        (foreign, "another model"),
        (fsdp_kind, "fsdp2 handle"),
        (released, "released"),
        (None, "nothing"),
    ]
    for bad, what in cases:
        with raises_kind(ObjectError, "snapshot_handle") as err:
            V.restore_megatron_model_from_cpu(models, bad)
        assert err.value.function == "restore_megatron_model_from_cpu", what
        assert isinstance(err.value, TypeError)
    assert V.model_state(models).residency() == residency


def test_a_rebuilt_model_gets_a_new_state_and_refuses_the_old_handles():
    ddp, _ = after_steps("dense_float16", 1)
    handle = V.copy_megatron_model_to_cpu([ddp])
    old_state = V.model_state([ddp])
    rebuilt, _ = after_steps("dense_float16", 1)
    assert V.model_state([rebuilt]) is not old_state
    assert V.model_state([ddp]) is old_state  # found again from the same objects
    with raises_kind(ObjectError, "snapshot_handle", match="another model"):
        V.restore_megatron_model_from_cpu([rebuilt], handle)


def test_a_changed_layout_is_a_layout_error_naming_the_tensor():
    model = FakeDenseModel(16, seed=0)
    ddp = build_fake_ddp(model)
    build_fake_optimizer(ddp, "float16")
    handle = V.copy_megatron_model_to_cpu([ddp])
    ddp.module.module.register_buffer("extra", torch.zeros(3))
    with raises_kind(LayoutError, "mismatch"):
        V.restore_megatron_model_from_cpu([ddp], handle)


def test_a_dropped_handle_gives_its_memory_back():
    ddp, _ = after_steps("distrib_ep", 1)
    state = V.model_state([ddp])
    saved = {n: V.copy_megatron_model_to_cpu([ddp]) for n in range(3)}
    assert len(core_of(state).snapshots) == 3
    del saved[1], saved[2]
    gc.collect()
    V.offload_megatron_model_to_cpu([ddp])  # any drop-in call releases what was dropped
    assert len(core_of(state).snapshots) == 1


# ------------------------------------------------------------------ verl's fully-async sequence


def _run(config: str, fns, mix: str, n: int = 3, cycles: int = 2, kick: float = 0.0):
    """The sequence on a fresh model; ``kick``: after each step, move the MoE ``expert_bias`` by that much
    (a fast bias update rate, so that routing, and the old log-probs, depend on it)."""
    ddp, opt = after_steps(config, 1)
    models = [ddp]

    def train(step):
        fake_train_step(ddp, opt, _x(step))
        for name, b in ddp.module.named_buffers():
            if kick and name.endswith("expert_bias"):
                b.add_(torch.randn(b.shape, generator=torch.Generator().manual_seed(step)) * kick)

    def forward(step):
        with torch.no_grad():
            return ddp(_x(100 + step)).float().clone()

    result = run_sequence(
        fns,
        models,
        opt,
        forward=forward,
        train=train,
        n=n,
        cycles=cycles,
        mix=mix,
        native_offload=megatron_native_offload,
    )
    return result, (weights(models) if result.error is None else None)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mix", ["device", "offloaded", "native", "mixed"])
def test_fully_async_sequence_equals_a_reference_that_never_moved(config, mix):
    kick = 1.0 if config == "distrib_ep" else 0.0
    ref, ref_final = _run(config, reference_fns(), "device", kick=kick)
    assert ref.error is None and len(ref.old) == 6
    got, final = _run(config, megatron_fns(V), mix, kick=kick)
    report = compare(got, ref, final, ref_final)
    assert report["error"] is None, report["where"]
    assert report["mismatches"] == 0 and report["computed"] == 6, report
    assert report["final_equal"], report
    # pi_old really is old: the recomputes of a cycle differ from what the current weights would give
    assert not all(torch.equal(a, b) for a, b in pairwise(got.old[:3]))


def test_the_sequence_driver_sees_a_snapshot_that_misses_the_expert_bias():
    """The comparison can fail: a copy without module buffers (verl 0.9.1 copies only ``param_data``)
    recomputes old log-probs with the current ``expert_bias`` on the MoE model."""
    ref, ref_final = _run("distrib_ep", reference_fns(), "device", kick=1.0)
    params_only = reference_fns()
    keep = params_only.copy
    params_only.copy = lambda m: {
        k: v for k, v in keep(m).items() if "expert_bias" not in k and "local_tokens" not in k
    }
    real_restore = params_only.restore

    def restore(m, saved):
        missing = {k: t for k, t in weights(m).items() if k not in saved}
        real_restore(m, {**missing, **saved})

    params_only.restore = restore
    got, final = _run("distrib_ep", params_only, "device", kick=1.0)
    report = compare(got, ref, final, ref_final)
    assert report["mismatches"] > 0, report


# ------------------------------------------------------------------ random sequences of every drop-in


def _reference_step(ops, rng):
    return ops[int(torch.randint(len(ops), (1,), generator=rng))]


@pytest.mark.parametrize("seed", range(2))
def test_random_sequences_of_every_function_against_a_twin_that_never_moves(seed):
    """Random calls of every drop-in (and Megatron's own offload, training steps, dropped handles) on one model;
    the same calls on a twin where copies are plain clones and nothing moves. Whenever both are loaded, their
    weights (and after each step, their losses) are equal bit for bit."""
    ddp, opt = after_steps("distrib_ep", 1)
    twin, twin_opt = after_steps("distrib_ep", 1)
    models, ref = [ddp], reference_fns()
    handles: list[tuple[object, dict]] = []
    rng = torch.Generator().manual_seed(seed)
    step = 10

    def check():
        V.load_megatron_model_to_gpu(models)
        V.load_megatron_optimizer(opt)
        assert_same(weights(models), weights([twin]), f"seed {seed}")
        assert_same(optim_values(opt), optim_values(twin_opt), f"seed {seed} optim")

    ops = [
        "offload_model",
        "load_model",
        "load_partial",
        "native",
        "offload_opt",
        "load_opt",
        "offload_masters",
        "load_masters",
        "copy",
        "restore",
        "drop_handle",
        "train",
        "check",
    ]
    for _ in range(40):
        op = _reference_step(ops, rng)
        if op == "offload_model":
            V.offload_megatron_model_to_cpu(models)
        elif op == "load_model":
            V.load_megatron_model_to_gpu(models)
        elif op == "load_partial":
            V.load_megatron_model_to_gpu(models, load_grad=False, load_frozen_params=False)
        elif op == "native":
            megatron_native_offload(models)
        elif op == "offload_opt":
            V.offload_megatron_optimizer(opt)
        elif op == "load_opt":
            V.load_megatron_optimizer(opt)
        elif op == "offload_masters":
            V.offload_megatron_copy_params(opt)
        elif op == "load_masters":
            V.load_megatron_copy_params(opt)
        elif op == "copy":
            handles.append((V.copy_megatron_model_to_cpu(models), ref.copy([twin])))
        elif op == "restore" and handles:
            h, twin_saved = handles[int(torch.randint(len(handles), (1,), generator=rng))]
            V.restore_megatron_model_from_cpu(models, h)
            ref.restore([twin], twin_saved)
        elif op == "drop_handle" and handles:
            handles.pop(0)
            gc.collect()
        elif op == "train":
            check()
            step += 1
            assert fake_train_step(ddp, opt, _x(step)) == fake_train_step(twin, twin_opt, _x(step))
        elif op == "check":
            check()
    check()
    assert len(core_of(V.model_state(models)).snapshots) == len(handles)


def test_two_threads_share_one_state_and_lose_nothing():
    """A rollout-side thread copies and restores while the trainer thread offloads and loads the same model:
    one state is built for it, and the weights come out as they went in."""
    import threading

    ddp, opt = after_steps("distrib_ep", 1)
    models = [ddp]
    truth = weights(models)
    states, errors = [], []
    start = threading.Barrier(2)

    def snapshots():
        start.wait()
        for _ in range(6):
            h = V.copy_megatron_model_to_cpu(models)
            V.restore_megatron_model_from_cpu(models, h)
            states.append(V.model_state(models))

    def moves():
        start.wait()
        for _ in range(6):
            V.offload_megatron_model_to_cpu(models)
            V.offload_megatron_optimizer(opt)
            V.load_megatron_model_to_gpu(models)
            V.load_megatron_optimizer(opt)
            states.append(V.model_state(models))

    def guarded(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(f,)) for f in (snapshots, moves)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len({id(s) for s in states}) == 1
    V.load_megatron_model_to_gpu(models)
    assert_same(weights(models), truth)


def test_the_same_first_chunk_with_other_chunks_closes_the_old_state_with_a_warning():
    ddp, _ = after_steps("dense_float16", 1)
    second, _ = after_steps("dense_float16", 1)
    truth = weights([ddp])
    handle = V.copy_megatron_model_to_cpu([ddp])
    V.offload_megatron_model_to_cpu([ddp])
    old = V.model_state([ddp])
    with pytest.warns(UserWarning, match="chunks changed"):
        new = V.model_state([ddp, second])
    assert old.closed and new is not old
    assert_same(weights([ddp]), truth)  # closing brought the offloaded values back
    with raises_kind(ObjectError, "snapshot_handle", match="closed"):
        V.restore_megatron_model_from_cpu([ddp, second], handle)


def test_an_offload_that_cannot_get_host_memory_changes_nothing():
    """The pool's budget is too small for the params: ``BudgetError("pool")``, and the model (grads too) is as it was."""
    from stateshift import BudgetError

    ddp, opt = after_steps("distrib_ep", 1)
    models = [ddp]
    state = V.model_state(models)
    truth = weights(models)
    grads = [b.grad_data.clone() for b in bufs(ddp)]
    core_of(state).pool.budget_bytes = 16
    with raises_kind(BudgetError, "pool"):
        V.offload_megatron_model_to_cpu(models)
    assert all(c["host"] == 0 and c["dropped"] == 0 for c in state.residency().values())
    assert_same(weights(models), truth)
    assert all(torch.equal(b.grad_data, g) for b, g in zip(bufs(ddp), grads, strict=True))
    core_of(state).pool.budget_bytes = None
    V.offload_megatron_model_to_cpu(models)
    V.load_megatron_model_to_gpu(models)
    assert_same(weights(models), truth)
