"""The core verbs on plain PyTorch, in every residency and mix."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, MIXES, assert_same, batch, capture, expected_after, make, perturb, train_step, warm

from stateshift import ModelState, Residency
from stateshift.core.engine import core_of


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def warmed(device):
    model, opt = make(device)
    warm(model, opt)
    state = ModelState(model, opt)
    return model, opt, state


def test_capture_matches_live_values(warmed):
    model, opt, state = warmed
    got = capture(state)
    assert torch.equal(got["tok.weight"].cpu(), model.tok.weight.detach().cpu())
    assert torch.equal(got["blocks.1.fc1.bias.grad"], model.blocks[1].fc1.bias.grad.cpu())
    exp_avg = opt.state[model.blocks[0].qkv.weight]["exp_avg"]
    assert torch.equal(got["blocks.0.qkv.weight.exp_avg"], exp_avg.cpu())
    assert got["tokens_seen"].item() > 0


@pytest.mark.parametrize("mix", list(MIXES))
def test_snapshot_in_every_mix(warmed, mix):
    model, opt, state = warmed
    before = capture(state)
    dropped = MIXES[mix](state)
    assert_same(capture(state), expected_after(before, dropped))


@pytest.mark.parametrize("mix", list(MIXES))
def test_offload_onload_round_trip(warmed, mix):
    model, opt, state = warmed
    before = capture(state)
    dropped = MIXES[mix](state)
    state.onload()
    assert all(c["host"] == 0 and c["dropped"] == 0 for c in state.residency().values())
    assert_same(capture(state), expected_after(before, dropped))
    train_step(model, opt, 1)  # the model still trains


@pytest.mark.parametrize("mix", list(MIXES))
def test_restore_into_every_mix(warmed, mix):
    model, opt, state = warmed
    saved = state.snapshot(state.groups, tag="saved")
    values = saved.tensors()
    perturb(model, opt)
    MIXES[mix](state)
    residency = state.residency()
    state.restore(saved)
    after = state.residency()
    for g in state.groups:  # restore keeps the residency class; dropped slots now hold values
        assert after[g]["device"] == residency[g]["device"]
    assert_same({k: v.cpu() for k, v in capture(state).items()}, {k: v.cpu() for k, v in values.items()})
    state.onload()
    assert_same(capture(state), {k: v.cpu() for k, v in values.items()})


@pytest.mark.parametrize("mix", list(MIXES))
def test_swapped_in_every_mix(warmed, mix):
    model, opt, state = warmed
    pi_old = state.snapshot(tag="pi_old")
    ids = batch(model.cfg, 7, device=next(model.parameters()).device)
    with torch.no_grad():
        old_logits = model.eval()(ids)
    train_step(model.train(), opt, 3)
    MIXES[mix](state)
    residency = state.residency()
    current = capture(state)
    with state.swapped(pi_old), torch.no_grad():
        assert torch.equal(model.eval()(ids), old_logits)
    assert state.residency() == residency
    assert_same(capture(state), current)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_snapshot_is_unchanged_by_later_updates(warmed, placement):
    model, opt, state = warmed
    snap = state.snapshot(tag="s", placement=placement)
    first = snap.tensors()
    for step in range(3):
        train_step(model, opt, step)
    perturb(model, opt)
    assert_same(snap.tensors(), first)


def test_restore_twice_gives_the_same_values(warmed):
    model, opt, state = warmed
    snap = state.snapshot(tag="s")
    perturb(model, opt)
    state.restore(snap)
    once = capture(state, state.forward_groups)
    perturb(model, opt)
    state.restore(snap)
    assert_same(capture(state, state.forward_groups), once)


def test_restore_while_offloaded_writes_home_and_onload_shows_it(warmed):
    model, opt, state = warmed
    snap = state.snapshot(tag="s")
    want = snap.tensors()
    perturb(model, opt)
    state.offload()
    state.restore(snap)
    assert state.residency()["params"]["device"] == 0
    state.onload()
    assert torch.equal(model.tok.weight.detach().cpu(), want["tok.weight"].cpu())
    assert torch.equal(model.blocks[1].fc2.bias.detach().cpu(), want["blocks.1.fc2.bias"].cpu())


def test_no_aliasing_save_current_restore_old_restore_current(warmed):
    """verl-omni #645: a snapshot of offloaded params aliased the live host tensors."""
    model, opt, state = warmed
    pi_old = state.snapshot(tag="pi_old")
    for step in range(2):
        train_step(model, opt, step)
    state.offload()
    current = state.snapshot(tag="current")  # taken while offloaded: shares the home copy-on-write
    want = current.tensors()
    state.restore(pi_old)  # writes the home: must not change `current`
    state.restore(current)
    state.onload()
    got = capture(state, state.forward_groups)
    assert_same(got, dict(want))
    assert not torch.equal(got["tok.weight"].cpu(), pi_old.tensors()["tok.weight"].cpu())


def test_tied_weights_stay_tied(warmed):
    model, opt, state = warmed
    assert model.head.weight is model.tok.weight
    state.offload()
    state.onload()
    assert model.head.weight is model.tok.weight
    assert model.head.weight.data_ptr() == model.tok.weight.data_ptr()
    slot = next(s for s in core_of(state).slots("params") if s.name == "tok.weight")
    assert [m.name for m in slot.info.members] == ["tok.weight", "head.weight"]
    with torch.no_grad():
        model.tok.weight.add_(1)
    assert torch.equal(model.head.weight, model.tok.weight)


def test_tensor_identity_survives_moves(warmed):
    model, opt, state = warmed
    params = [id(p) for p in model.parameters()]
    grads = [id(p.grad) for p in model.parameters()]
    exp = [id(s["exp_avg"]) for s in opt.state.values()]
    state.offload()
    state.onload()
    assert params == [id(p) for p in model.parameters()]
    assert grads == [id(p.grad) for p in model.parameters()]
    assert exp == [id(s["exp_avg"]) for s in opt.state.values()]


@pytest.mark.parametrize("set_to_none", [False, True])
def test_training_with_moves_between_steps_is_bit_identical(device, set_to_none):
    ref_model, ref_opt = make(device)
    model, opt = make(device)
    state = ModelState(model, opt)
    ref_losses, losses = [], []
    for step in range(4):
        ref_losses.append(train_step(ref_model, ref_opt, step, set_to_none=set_to_none))
        losses.append(train_step(model, opt, step, set_to_none=set_to_none))
        state.offload(["params", "buffers", "optim"])
        state.offload("grads")
        state.onload()
    assert losses == ref_losses
    ref_state = ModelState(ref_model, ref_opt)
    assert_same(capture(state), capture(ref_state))


def test_dropped_grads_come_back_zeroed(warmed):
    model, opt, state = warmed
    state.drop("grads")
    assert state.residency()["grads"]["dropped"] == len(list(model.parameters()))
    state.onload("grads")
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_residency_counts_and_release_of_storage(warmed):
    model, opt, state = warmed
    state.offload("params")
    assert all(s.residency is Residency.HOST for s in core_of(state).slots("params"))
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    state.onload("params")
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_new_tensors_are_picked_up(device):
    """Adam state appears at the first step; grads at the first backward."""
    model, opt = make(device)
    state = ModelState(model, opt)
    assert state.residency()["optim"]["device"] == 0 and state.residency()["grads"]["device"] == 0
    train_step(model, opt, 0)
    counts = state.residency()
    assert counts["grads"]["device"] > 0 and counts["optim"]["device"] > 0


def test_relayout_keeps_offloaded_values(warmed):
    """A group's slot set changes while some slots are offloaded (grads set to None and re-created)."""
    model, opt, state = warmed
    state.offload("params")
    before = capture(state, ["params"])
    for p in list(model.parameters())[:3]:
        p.grad = None
    assert state.residency()["grads"]["device"] == len(list(model.parameters())) - 3
    assert_same(capture(state, ["params"]), before)
    state.onload()
    assert_same(capture(state, ["params"]), before)


def test_swapped_with_rebuild_skips_the_stash(warmed):
    """A group whose current values can be recomputed on the device is not stashed."""
    model, opt, state = warmed
    pi_old = state.snapshot(tag="pi_old")
    train_step(model, opt, 4)
    current = {k: v.detach().clone() for k, v in model.named_parameters()}
    calls = []

    def rebuild() -> None:
        calls.append(1)
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(current[k])

    allocations = core_of(state).pool.stats.in_use_bytes
    with state.swapped(pi_old, rebuild={"params": rebuild}):
        assert torch.equal(model.tok.weight.cpu(), pi_old.tensors()["tok.weight"].cpu())
        assert core_of(state).pool.stats.in_use_bytes - allocations < state.layout("params").total  # no params stash
    assert calls == [1]
    assert all(torch.equal(p, current[k]) for k, p in model.named_parameters())


@pytest.mark.parametrize("stash", ["device", "host", "auto"])
def test_swapped_stash_placements_are_exact(warmed, stash):
    model, opt, state = warmed
    pi_old = state.snapshot(tag="pi_old")
    train_step(model, opt, 9)
    current = capture(state)
    with state.swapped(pi_old, stash=stash):
        assert_same(capture(state, state.forward_groups), pi_old.tensors())
    assert_same(capture(state), current)
    with pytest.raises(ValueError, match="stash"), state.swapped(pi_old, stash="disk"):
        pass


def test_host_storage_that_cannot_be_resized_stays_in_place():
    """FSDP2's pinned shards under CPUOffloadPolicy are not resizable: they already live on the host."""
    import numpy as np

    model = torch.nn.Linear(4, 3)
    fixed = torch.nn.Parameter(torch.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4)))
    assert not fixed.untyped_storage().resizable()
    model.weight = fixed
    state = ModelState(model)
    want = fixed.detach().clone()
    state.offload()
    assert fixed.untyped_storage().nbytes() == 48 and torch.equal(fixed.detach(), want)
    assert state.residency()["params"] == {"device": 1, "host": 1, "dropped": 0}
    snap = state.snapshot(tag="s")
    with torch.no_grad():
        fixed.add_(1)
    assert torch.equal(snap.tensors()["weight"], want)  # copied, never aliased
    state.restore(snap)
    state.onload()
    assert torch.equal(fixed.detach(), want)


def test_slots_and_nbytes_of_one_group_after_a_storage_moved_in_from_another_group():
    """A storage that left one group for another (here the optimizer's ``exp_avg`` tensor becomes a
    param's data and the optimizer gets a fresh one) belongs to one group again: ``slots("params")`` and
    ``nbytes("params")`` list it there, as a listing of every group does (re-listing only
    the asked group would keep the other group's stale slot and raise "shares storage")."""
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    total = state.nbytes("params")
    core_of(state).slots()
    p = model.tok.weight
    moved = opt.state[p]["exp_avg"]
    opt.state[p]["exp_avg"] = moved.clone()
    p.data = moved
    assert any(s.storage._cdata == moved.untyped_storage()._cdata for s in core_of(state).slots("params"))
    assert state.nbytes("params") == total
    assert len(core_of(state).slots()) == sum(len(core_of(state).slots(g)) for g in state.groups)


def test_a_verb_on_one_group_after_a_storage_moved_in_from_another_group():
    """The same move, met first by a verb on params alone (it raised "shares storage" before the table
    re-listed the group that held the storage): the values move with the group, the optimizer keeps its own."""
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    core_of(state).slots()
    p = model.tok.weight
    moved = opt.state[p]["exp_avg"]
    opt.state[p]["exp_avg"] = fresh = moved.clone().add_(1)
    p.data = moved
    want_p, want_opt = p.detach().clone(), fresh.clone()
    state.offload("params")
    state.onload("params")
    assert torch.equal(p, want_p) and p.untyped_storage()._cdata == moved.untyped_storage()._cdata
    snap = state.snapshot(["params", "optim"], tag="after")
    state.restore(snap)
    assert torch.equal(p, want_p) and torch.equal(opt.state[p]["exp_avg"], want_opt)
