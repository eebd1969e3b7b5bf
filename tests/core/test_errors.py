"""Bad input: a typed error naming the first offending tensor, and nothing changed."""

from __future__ import annotations

import errno

import pytest
import torch
from helpers import DEVICES, SMALL, assert_same, batch, build_model, capture, live, lm_loss, make, train_step, warm
from raises import raises_kind

from stateshift import BudgetError, LayoutError, ModelState, StateError
from stateshift.core.engine import core_of
from stateshift.core.pool import HostPool


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def warmed(device):
    model, opt = make(device)
    warm(model, opt)
    return model, opt, ModelState(model, opt)


def _other(device, **changes):
    model, opt = make(device, seed=1, **changes)
    return model, ModelState(model, opt)


@pytest.mark.parametrize(
    "changes, tensor, what",
    [
        ({"width": 48}, "tok.weight", "shape"),
        ({"dtype": torch.float64}, "tok.weight", "dtype"),
        ({"layers": 3}, "blocks.2.ln1.weight", "in the snapshot (group 'params') but not in the model"),
        ({"layers": 1}, "blocks.1.ln1.weight", "in the model (group 'params') but not in the snapshot"),
        ({"tied": False}, "tok.weight", "tied or shared tensors differ"),
    ],
)
def test_snapshot_from_another_model_is_refused(warmed, device, changes, tensor, what):
    model, opt, state = warmed
    other_model, other_state = _other(device, **changes)
    foreign = other_state.snapshot(tag="foreign")
    before = capture(state)
    with raises_kind(LayoutError, "mismatch") as info:
        state.restore(foreign)
    assert info.value.tensor == tensor
    assert what in str(info.value)
    with raises_kind(LayoutError, "mismatch"), state.swapped(foreign):
        pass
    assert_same(capture(state), before)


def test_snapshot_from_identical_model_is_accepted(warmed, device):
    model, opt, state = warmed
    other_model, other_state = _other(device)
    state.restore(other_state.snapshot(tag="x"))
    assert torch.equal(model.tok.weight, other_model.tok.weight)


def test_released_snapshot_is_refused(warmed):
    model, opt, state = warmed
    snap = state.snapshot(tag="s")
    state.release(snap)
    before = capture(state)
    for use in (lambda: state.restore(snap), lambda: state.swapped(snap).__enter__(), snap.tensors, snap.wait):
        with raises_kind(StateError, "released"):
            use()
    assert_same(capture(state), before)


def test_unknown_group_lists_valid_ones(warmed):
    model, opt, state = warmed
    with raises_kind(LayoutError, "unknown_group") as info:
        state.offload(["params", "optimizer"])
    assert "optimizer" in str(info.value) and "params, buffers, grads, optim" in str(info.value)
    assert state.residency()["params"]["host"] == 0  # nothing moved, not even params


def test_forward_while_offloaded_is_a_python_error(warmed):
    model, opt, state = warmed
    ids = batch(model.cfg, 0, device=next(model.parameters()).device)
    state.offload("params")
    with raises_kind(StateError, "offloaded") as info:
        model(ids)
    assert info.value.group == "params"
    state.onload("params")
    model(ids)


def test_forward_with_offloaded_buffers_is_refused(warmed):
    model, opt, state = warmed
    ids = batch(model.cfg, 0, device=next(model.parameters()).device)
    state.offload("buffers")
    with raises_kind(StateError, "offloaded") as info:
        model(ids)
    assert info.value.group == "buffers" and info.value.tensor == "tokens_seen"


def test_backward_into_offloaded_grads_is_refused(warmed):
    model, opt, state = warmed
    ids = batch(model.cfg, 0, device=next(model.parameters()).device)
    state.drop("grads")
    loss = lm_loss(model, ids)
    with raises_kind(StateError, "offloaded") as info:
        loss.backward()
    assert info.value.group == "grads"
    state.onload("grads")
    lm_loss(model, ids).backward()


def test_optimizer_step_with_offloaded_state_is_refused(warmed):
    model, opt, state = warmed
    state.offload("optim")
    with raises_kind(StateError, "offloaded") as info:
        opt.step()
    assert info.value.group == "optim"
    state.onload("optim")
    opt.step()


def test_verbs_inside_swapped_on_the_same_groups_are_refused(warmed):
    model, opt, state = warmed
    snap = state.snapshot(tag="s")
    with state.swapped(snap):
        with raises_kind(StateError, "swap_active"):
            state.offload("params")
        state.offload("optim")  # other groups are free
        state.onload("optim")


def test_exception_inside_swapped_still_restores(warmed):
    model, opt, state = warmed
    snap = state.snapshot(tag="s")
    train_step(model, opt, 5)
    current = capture(state)
    with pytest.raises(KeyError), state.swapped(snap):
        raise KeyError("boom")
    assert_same(capture(state), current)


def test_pinning_impossible_without_accelerator():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so pinning is possible")
    with raises_kind(StateError, "no_pinning"):
        HostPool(pin=True)
    model = build_model(SMALL)
    with raises_kind(StateError, "no_pinning"):
        ModelState(model, pin=True)


def test_pool_budget_error_changes_nothing(device):
    model, opt = make(device)
    warm(model, opt)
    probe = ModelState(model, opt, guard=False)
    fits = probe.layout("params").total + probe.layout("buffers").total  # not grads, not optim
    probe.close()
    state = ModelState(model, opt, pool=HostPool(budget_bytes=fits))
    before = live(model, opt)
    with raises_kind(BudgetError, "pool"):
        state.offload()
    assert all(c["host"] == 0 for c in state.residency().values())
    assert_same(live(model, opt), before)
    state.offload(["params", "buffers"])  # what fits still works


def test_snapshot_budget(warmed):
    model, opt, state = warmed
    first = state.snapshot(tag="a")
    core_of(state).snapshots.budget_bytes = first.nbytes + 10
    state.snapshot(tag="a")  # replacing the same key fits
    with raises_kind(BudgetError, "snapshot"):
        state.snapshot(tag="b")
    assert core_of(state).snapshots.keys() == [("a", None)]


@pytest.mark.parametrize("bad", [{"pin": "yes"}, {"budget_bytes": -1}])
def test_pool_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        HostPool(**bad)


def test_bad_placement(warmed):
    model, opt, state = warmed
    with pytest.raises(ValueError, match="placement"):
        state.snapshot(tag="s", placement="gpu")  # ("disk" is a placement since the disk tier)


@pytest.mark.parametrize("given", [None, "params", {"params": None}])
def test_verbs_given_something_else_than_a_snapshot_raise_a_type_error(given):
    """restore, check_restore and swapped name what they were given instead of failing on an attribute."""
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    want = live(model, opt)
    for verb in (state.restore, core_of(state).check_restore, lambda s: state.swapped(s).__enter__()):
        with pytest.raises(TypeError, match="a Snapshot"):
            verb(given)
    assert_same(live(model, opt), want)


def test_errors_of_the_trainer_keep_their_detail_through_pickling():
    """What a rollouter process or Ray actor raises reaches the trainer whole: same class, message, attributes."""
    import pickle

    from stateshift import StateShiftError
    from stateshift.errors import (
        BudgetError,
        CheckpointError,
        ConfigError,
        DiskError,
        LayoutError,
        ObjectError,
        RunError,
        StateError,
        SyncError,
    )

    errors = [
        ConfigError("config", "must be > 0", key="trainer.lr"),
        ConfigError("weight_sync", "not in the rollout model", name="head.weight"),
        ConfigError("metrics_log", "not JSON", path="run/metrics.jsonl", line=3),
        RunError("run_dir_busy", path="run"),
        DiskError.from_os_error(OSError(28, "No space left on device"), "run/model.safetensors", "w"),
        RunError("link_closed", "gone"),
        ConfigError("usage", "--device"),
        LayoutError("mismatch", "shape differs", tensor="w", field="shape"),
        CheckpointError("read", "EIO", path="ck/params.safetensors", errno=5, tensor="w"),
        CheckpointError("not_found", "nothing there", path="ck"),
        DiskError("tier", "no disk_dir"),
        StateError("offloaded", "forward", group="params", tensor="w", residency="host"),
        ObjectError("snapshot_handle", "not a handle", function="restore", got="dict"),
        BudgetError("sync", "budget", holders=(("r", 1),)),
        SyncError("receiver_lost", receiver="r", version=1, cause="died"),
    ]
    for err in errors:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and vars(back) == vars(err) and back.kind == err.kind
        assert isinstance(back, StateShiftError)
        if isinstance(err, OSError):
            assert (back.errno, back.strerror, back.filename) == (err.errno, err.strerror, err.filename)
    assert isinstance(errors[4], OSError) and pickle.loads(pickle.dumps(errors[4])).errno == 28
    assert errors[9].errno == errno.ENOENT and str(errors[9]) == "no stateshift checkpoint at 'ck': nothing there"


@pytest.mark.parametrize("kind", ["unknown_group", "mismatch", "checkpoint_mismatch"])
def test_a_layout_errors_message_is_bounded_whatever_the_names_it_carries(kind):
    long = "x" * 100_000  # a tensor or group name read from a hostile checkpoint or handle
    err = LayoutError(kind, "why", tensor=long, group=long, valid=("params",))
    assert len(str(err)) < 1000 and err.tensor == long and err.group == long  # the attributes keep it whole
