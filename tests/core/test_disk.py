"""The disk tier (issue 14): every verb with ``disk`` in the mix, a full disk loses nothing, stale disk
homes are never loaded, host memory bounded by the staging windows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_same, capture, live, make, perturb, run_isolated, train_step, warm

from stateshift import DiskTierError, ModelState
from stateshift.core.disk import DiskHome, sweep_stale


def _state(tmp_path, **kw):
    model, opt = make()
    warm(model, opt)
    return model, opt, ModelState(model, opt, disk_dir=tmp_path / "disk", **kw)


def _first_block(name: str) -> bool:
    return name.startswith("blocks.0.")


#: residency mixes that put something on disk; each returns the groups it dropped
DISK_MIXES = {
    "all_on_disk": lambda st: (st.offload(to="disk"), set())[-1],
    "params_disk_optim_host": lambda st: (st.offload("params", to="disk"), st.offload("optim"), set())[-1],
    "host_then_disk": lambda st: (st.offload(), st.offload(["params", "optim"], to="disk"), set())[-1],
    "partial_disk": lambda st: (st.offload(["params", "optim"], only=_first_block, to="disk"), set())[-1],
    "disk_and_dropped": lambda st: (st.offload("params", to="disk"), st.drop("grads"), {"grads"})[-1],
}


def _expected(values, dropped):
    if "grads" not in dropped:
        return values
    return {k: (torch.zeros_like(v) if k.endswith(".grad") else v) for k, v in values.items()}


@pytest.mark.parametrize("mix", list(DISK_MIXES))
def test_snapshot_onload_restore_and_swap_with_disk_in_the_mix(tmp_path, mix):
    model, opt, state = _state(tmp_path)
    want = capture(state)
    dropped = DISK_MIXES[mix](state)
    assert any(c["disk"] for c in state.residency().values()), state.residency()
    assert_same(capture(state), _expected(want, dropped))  # snapshot reads the disk

    other = {k: v + 1.0 if v.dtype.is_floating_point else v for k, v in want.items()}
    snap = state.snapshot(tag="now")  # forward groups, wherever they live
    with state.swapped(snap):
        pass
    assert_same(capture(state), _expected(want, dropped))  # nothing changed by a round trip
    state.onload()
    perturb(model, opt)
    state.offload(["params", "optim"], to="disk")
    state.restore(snap)  # into slots on disk: they stay on disk, with the snapshot's values
    assert any(c["disk"] for c in state.residency().values())
    state.onload()
    got = capture(state)
    for name in (m.name for p in snap.parts for s in p.layout.slots for m in s.members):
        assert torch.equal(got[name], want[name]), name
    assert other  # (used only to make the values differ above)


def test_training_with_disk_moves_between_steps_is_bit_identical(tmp_path):
    model, opt, state = _state(tmp_path)
    ref_model, ref_opt = make()
    warm(ref_model, ref_opt)
    for step in range(3):
        assert train_step(model, opt, step) == train_step(ref_model, ref_opt, step)
        state.offload(["params", "optim"], to="disk")
        state.onload()
    assert_same(live(model, opt), live(ref_model, ref_opt))


def test_no_disk_dir_is_a_typed_error_that_changes_nothing():
    model, opt = make()
    state = ModelState(model, opt)
    before = capture(state)
    with pytest.raises(DiskTierError, match="disk_dir"):
        state.offload(to="disk")
    assert_same(capture(state), before)
    assert "disk" not in state.residency()["params"]  # no disk tier, three residencies


def test_close_brings_disk_values_back_and_removes_the_file(tmp_path):
    model, opt, state = _state(tmp_path)
    want = live(model, opt)
    state.offload(to="disk")
    path = state._disk.path
    assert path.exists()
    state.close()
    assert not path.exists()
    assert_same(live(model, opt), want)


def test_a_relayout_brings_values_on_disk_back_to_the_host(tmp_path):
    model, opt, state = _state(tmp_path)
    want = capture(state, ["params"])
    state.offload("params", to="disk")
    model.extra = torch.nn.Linear(2, 2)  # a new parameter: the layout changes
    extra = {k: v.detach().clone() for k, v in model.extra.named_parameters(prefix="extra")}
    state.onload("params")
    got = capture(state, ["params"])
    assert_same({k: got[k] for k in want}, want)
    assert all(torch.equal(got[k], v) for k, v in extra.items())


def test_host_memory_of_a_disk_offload_is_bounded_by_the_staging_windows(tmp_path):
    window = 16 << 10
    model, opt, state = _state(tmp_path, disk_window_bytes=window)
    total = state.nbytes()
    assert total > 16 * window  # (the model is larger than the windows)
    base = state.pool.stats.held_bytes
    state.offload(to="disk")
    stats = state.pool.stats
    assert stats.peak_held_bytes - base <= 2 * window, (stats, total)
    assert stats.in_use_bytes <= 2 * window  # no host home holds the values


def test_stale_disk_homes_are_removed_and_never_loaded(tmp_path):
    import socket

    d = tmp_path / "disk"
    d.mkdir()
    host = socket.gethostname().replace("-", "_")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = d / f"stateshift-{host}-{int(dead.stdout)}-abcdef012345.disk"
    stale.write_bytes(b"values of a killed process")
    other = d / "not-ours.disk"
    other.write_bytes(b"x")
    assert sweep_stale(d) == [stale] and not stale.exists() and other.exists()
    home = DiskHome(d)
    assert home.path != stale and home.path.name.startswith(f"stateshift-{host}-{os.getpid()}-")
    home.close()


_FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys, torch
    sys.path[:0] = sys.argv[1:3]
    from helpers import capture, make, warm, assert_same
    from stateshift import DiskTierError, ModelState
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt, disk_dir=sys.argv[3], disk_window_bytes=1 << 16)
    state.offload("grads")  # some values on the host first
    want, residency = capture(state), state.residency()
    resource.setrlimit(resource.RLIMIT_FSIZE, (state.nbytes("params") // 2, resource.RLIM_INFINITY))
    try:
        state.offload(to="disk")
    except DiskTierError as e:
        assert "full" in str(e), e
    else:
        raise AssertionError("the disk offload did not fail")
    assert state.residency() == residency, (state.residency(), residency)
    assert_same(capture(state), want)
    state.onload()
    assert_same(capture(state), want)
    print("OK")
    """
)


def test_a_full_disk_during_a_disk_offload_loses_nothing(tmp_path):
    proc = run_isolated(_FULL_DISK, str(tmp_path / "d"))
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])


# ----------------------------------------------------------------------------- snapshots on disk


@pytest.mark.parametrize("mix", ["resident", *DISK_MIXES])
def test_disk_snapshot_holds_its_values_and_restores_and_swaps_in_every_mix(tmp_path, mix):
    model, opt, state = _state(tmp_path, disk_window_bytes=64 << 10)
    want = capture(state)
    dropped = set() if mix == "resident" else DISK_MIXES[mix](state)
    snap = state.snapshot(state.groups, tag="pi_old", placement="disk")
    assert snap.placement == "disk" and all(p.disk is not None for p in snap.parts)
    assert_same(snap.tensors(), _expected(want, dropped))
    state.onload()
    perturb(model, opt)
    changed = capture(state)
    with state.swapped(snap, stash="host"):
        assert_same(capture(state), _expected(want, dropped))
    assert_same(capture(state), changed)  # the current values are back
    DISK_MIXES.get(mix, lambda st: set())(state)  # the same mix again, now holding the changed values
    state.restore(snap)
    state.onload()
    assert_same(capture(state), _expected(want, dropped))
    assert_same(snap.tensors(), _expected(want, dropped))  # a snapshot never changes
    path_span = snap.parts[0].disk
    state.release(snap)
    assert snap.released and path_span is not None


def test_a_disk_snapshot_whose_last_slot_ends_before_its_layout_reads_back(tmp_path):
    """Regression: the last region of the file used to end at its last slot's byte, and reading the whole
    part (its layout's padded total) ended early with DiskTierError."""
    m = torch.nn.Module()
    m.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(1023)), torch.nn.Parameter(torch.randn(5).half())])
    state = ModelState(m, disk_dir=tmp_path / "d")
    want = capture(state)
    state.offload(to="disk")
    snap = state.snapshot(tag="s", placement="disk")
    assert_same(snap.tensors(), want)
    state.close()


def test_a_disk_snapshot_needs_a_disk_dir():
    model, opt = make()
    state = ModelState(model, opt)
    with pytest.raises(DiskTierError, match="disk_dir"):
        state.snapshot(tag="s", placement="disk")


# ----------------------------------------------------------------------------- the planner


def test_planner_puts_groups_on_the_host_while_the_budget_holds_then_on_disk(tmp_path):
    from stateshift.core.pool import HostPool

    model, opt = make()
    warm(model, opt)
    probe = ModelState(model, opt, guard=False)
    sizes = {g: probe.layout(g).total for g in probe.groups}
    probe.close()
    pool = HostPool(budget_bytes=sizes["params"] + sizes["buffers"] + (64 << 10) * 2)
    state = ModelState(model, opt, pool=pool, disk_dir=tmp_path / "d", disk_window_bytes=64 << 10)
    want = live(model, opt)
    plan = state.plan_offload()
    assert {d.group: d.to for d in plan.decisions} == {"params": "host", "buffers": "host", "grads": "disk", "optim": "disk"}
    assert plan.host_peak_bytes <= pool.budget_bytes and plan.disk_bytes == sizes["grads"] + sizes["optim"]
    assert pool.stats.in_use_bytes == 0  # deciding allocated nothing
    state.offload(to="auto")
    assert state.last_offload_plan == plan
    r = state.residency()
    assert r["params"]["host"] and r["optim"]["disk"] and r["grads"]["disk"] and not r["optim"]["host"]
    assert pool.stats.peak_held_bytes <= pool.budget_bytes
    state.onload()
    assert_same(live(model, opt), want)


def test_planner_fails_before_anything_when_a_group_fits_nowhere():
    from stateshift import PoolBudgetError
    from stateshift.core.pool import HostPool

    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt, pool=HostPool(budget_bytes=1024))
    before, residency = live(model, opt), state.residency()
    with pytest.raises(PoolBudgetError, match="fits in neither"):
        state.offload(to="auto")
    assert state.residency() == residency and state.pool.stats.in_use_bytes == 0
    assert_same(live(model, opt), before)


def test_pi_old_cycle_goes_to_disk_when_the_host_budget_is_short(tmp_path):
    from stateshift.core.pool import HostPool
    from stateshift.rl import PiOldCycle

    def params():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt, pool=HostPool(budget_bytes=96 << 10), disk_dir=tmp_path / "d", disk_window_bytes=32 << 10)
    cycle = PiOldCycle(state)
    assert cycle.choose_placement() == "disk"  # the params do not fit in the host budget
    train_step(model, opt, 5)
    pi_old = params()
    cycle.begin()
    assert cycle.snapshot.placement == "disk"
    train_step(model, opt, 6)
    now = params()
    with cycle.old_policy():
        assert_same(params(), pi_old)
    assert_same(params(), now)
    cycle.end()
    assert state.pool.stats.peak_held_bytes <= 96 << 10
