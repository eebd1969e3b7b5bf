"""The disk tier (issue 14): every verb with ``disk`` in the mix, a full disk loses nothing, stale disk
homes are never loaded, host memory bounded by the staging windows, ``O_DIRECT`` where the
filesystem allows it and buffered I/O where it does not (both bit-exact, odd sizes included)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_isolated, assert_same, capture, live, make, perturb, train_step, warm
from raises import raises_kind

from stateshift import DiskError, ModelState
from stateshift.core import disk as disk_mod
from stateshift.core.disk import DiskHome, sweep_stale
from stateshift.core.engine import core_of


def refuse_o_direct(monkeypatch) -> None:
    """Make opening with ``O_DIRECT`` fail with ``EINVAL``, as tmpfs (before Linux 6.6) and some network
    filesystems do; every other open is the real one."""
    real = os.open

    def fake(path, flags, *args, **kw):
        if disk_mod.O_DIRECT and flags & disk_mod.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", fake)


@pytest.fixture(params=["O_DIRECT", "buffered"])
def io_mode(request, monkeypatch, tmp_path):
    """Run a test in each I/O mode: ``O_DIRECT`` where this filesystem accepts it, ``buffered`` by an open
    that refuses ``O_DIRECT`` (the fallback path, not a flag)."""
    if request.param == "buffered":
        refuse_o_direct(monkeypatch)
    else:
        probe = DiskHome(tmp_path / "probe")
        mode, why = probe.io_mode, probe.why
        probe.close()
        if mode != "O_DIRECT":
            pytest.skip(f"{tmp_path} does not take O_DIRECT here: {why}")
    return request.param


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
    with raises_kind(DiskError, "tier", match="disk_dir"):
        state.offload(to="disk")
    assert_same(capture(state), before)
    assert "disk" not in state.residency()["params"]  # no disk tier, three residencies


def test_close_brings_disk_values_back_and_removes_the_file(tmp_path):
    model, opt, state = _state(tmp_path)
    want = live(model, opt)
    state.offload(to="disk")
    path = core_of(state).disk_home.path
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
    base = core_of(state).pool.stats.held_bytes
    state.offload(to="disk")
    stats = core_of(state).pool.stats
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
    from stateshift import DiskError, ModelState
    from stateshift.core.engine import core_of
    if sys.argv[4] == "buffered":  # the filesystem refuses O_DIRECT
        import errno, os
        from stateshift.core import disk
        real = os.open
        os.open = lambda p, f, *a: (_ for _ in ()).throw(OSError(errno.EINVAL, "no")) if f & disk.O_DIRECT else real(p, f, *a)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt, disk_dir=sys.argv[3], disk_window_bytes=1 << 16)
    state.offload("grads")  # some values on the host first
    want, residency = capture(state), state.residency()
    resource.setrlimit(resource.RLIMIT_FSIZE, (state.nbytes("params") // 2, resource.RLIM_INFINITY))
    try:
        state.offload(to="disk")
    except DiskError as e:
        if e.kind != "tier":
            raise
        assert "full" in str(e), e
    else:
        raise AssertionError("the disk offload did not fail")
    assert state.residency() == residency, (state.residency(), residency)
    assert core_of(state).disk_home.io_mode == sys.argv[4], core_of(state).disk_home.describe()
    assert_same(capture(state), want)
    state.onload()
    assert_same(capture(state), want)
    print("OK")
    """
)


@pytest.mark.parametrize("mode", ["O_DIRECT", "buffered"])
def test_a_full_disk_during_a_disk_offload_loses_nothing(tmp_path, mode):
    probe = DiskHome(tmp_path / "probe")
    if mode == "O_DIRECT" and probe.io_mode != mode:
        pytest.skip(f"{tmp_path} does not take O_DIRECT here: {probe.why}")
    probe.close()
    assert_isolated(_FULL_DISK, "OK", args=(str(tmp_path / "d"), mode))


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
    part (its layout's padded total) ended early with DiskError("tier")."""
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
    with raises_kind(DiskError, "tier", match="disk_dir"):
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
    assert {d.group: d.to for d in plan.decisions} == {
        "params": "host",
        "buffers": "host",
        "grads": "disk",
        "optim": "disk",
    }
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
    from stateshift import BudgetError
    from stateshift.core.pool import HostPool

    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt, pool=HostPool(budget_bytes=1024))
    before, residency = live(model, opt), state.residency()
    with raises_kind(BudgetError, "pool", match="fits in neither"):
        state.offload(to="auto")
    assert state.residency() == residency and core_of(state).pool.stats.in_use_bytes == 0
    assert_same(live(model, opt), before)


def test_pi_old_cycle_goes_to_disk_when_the_host_budget_is_short(tmp_path):
    from stateshift.core.pool import HostPool
    from stateshift.rl import PiOldCycle

    def params():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    model, opt = make()
    warm(model, opt)
    state = ModelState(
        model, opt, pool=HostPool(budget_bytes=96 << 10), disk_dir=tmp_path / "d", disk_window_bytes=32 << 10
    )
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
    assert core_of(state).pool.stats.peak_held_bytes <= 96 << 10


# ----------------------------------------------------------------------------- I/O modes


def test_o_direct_is_used_where_the_filesystem_allows_it(tmp_path):
    home = DiskHome(tmp_path)
    if home.io_mode != "O_DIRECT":
        home.close()
        pytest.skip(f"{tmp_path} does not take O_DIRECT here: {home.why}")
    assert home.align >= 4096 and home.align % 4096 == 0
    assert "O_DIRECT" in home.describe() and home.path.stat().st_size == 0  # the probe left nothing
    n, a = (10 << 20) + 5, home.align  # an unaligned length

    def aligned() -> torch.Tensor:
        raw = torch.empty(n + a, dtype=torch.uint8)
        return raw[-raw.data_ptr() % a :][:n]

    src = aligned()
    src.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    off = home.allocate(n)
    assert off % a == 0
    home.write(off, src)
    out = aligned()
    home.read(off, out)
    assert torch.equal(out, src)
    assert home.bytes_direct >= 2 * (10 << 20) and home.bytes_buffered <= 2 * home.align, home.describe()
    home.close()


def test_a_filesystem_refusing_o_direct_gets_buffered_io(tmp_path, monkeypatch):
    refuse_o_direct(monkeypatch)
    home = DiskHome(tmp_path)
    assert home.io_mode == "buffered" and "EINVAL" in home.why, home.describe()
    data = torch.arange(5000, dtype=torch.uint8)
    home.write(home.allocate(5000), data)
    assert home.bytes_direct == 0 and home.bytes_buffered == 5000
    home.close()


def test_buffered_only_when_asked(tmp_path):
    home = DiskHome(tmp_path, direct=False)
    assert home.io_mode == "buffered" and home.pieces(0, 0, 1 << 20) == [(0, 1 << 20, False)]
    home.close()


def test_only_aligned_blocks_with_aligned_memory_go_direct(tmp_path):
    home = DiskHome(tmp_path, direct=False)
    home._dfd, a = -1, home.align  # pieces() only asks whether there is a direct descriptor: the split is arithmetic
    assert home.pieces(0, 0, 3 * a) == [(0, 3 * a, True)]
    assert home.pieces(10, 10, 3 * a) == [(0, a - 10, False), (a - 10, 3 * a - 10, True), (3 * a - 10, 3 * a, False)]
    assert home.pieces(0, 8, 3 * a) == [(0, 3 * a, False)]  # memory can never meet the file's alignment
    assert home.pieces(a - 1, a - 1, a) == [(0, a, False)]  # no whole block inside
    assert home.pieces(0, a, 100) == [(0, 100, False)]
    home._dfd = None
    home.close()


def test_a_direct_write_refused_at_run_time_is_redone_buffered(tmp_path, monkeypatch):
    home = DiskHome(tmp_path)
    if home.io_mode != "O_DIRECT":
        home.close()
        pytest.skip(f"{tmp_path} does not take O_DIRECT here: {home.why}")
    real, dfd = os.pwrite, home._dfd

    def pwrite(fd, data, offset):
        if fd == dfd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    src = torch.randint(0, 256, (3 * home.align + 7,), dtype=torch.uint8)
    off = home.allocate(src.numel())
    home.write(off, src)
    out = torch.empty_like(src)
    home.read(off, out)
    assert torch.equal(out, src) and home.bytes_buffered >= src.numel()
    home.close()


@pytest.mark.parametrize("direct", [True, False])
def test_odd_sizes_offsets_and_addresses_round_trip_bit_exactly(tmp_path, direct):
    home = DiskHome(tmp_path, direct=direct)
    a = home.align
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (8 * a + 4 * a,), dtype=torch.uint8, generator=gen)
    base = home.allocate(16 * a)
    for n in (1, 7, a - 1, a, a + 1, 2 * a - 3, 5 * a + 11):
        for at in (0, 1, 64, a - 1, a, a + 64):
            for shift in (0, 3, at % a):  # memory at, and off, the file offset's alignment
                src = pool[shift : shift + n]
                home.write(base + at, src)
                out = torch.zeros(n + 2 * a, dtype=torch.uint8)[(shift + 5) % a :][:n]
                home.read(base + at, out)
                assert torch.equal(out, src), (n, at, shift)
    home.close()


def _odd_model():
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.ps = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(n).to(dt), requires_grad=dt.is_floating_point)
        for n, dt in [
            (1, torch.float32),
            (3, torch.bfloat16),
            (1023, torch.float32),
            (4097, torch.bfloat16),
            (1, torch.float64),
            (100_003, torch.float32),
            (5, torch.float16),
            (70_001, torch.bfloat16),
        ]
    )
    m.register_buffer("count", torch.tensor([7], dtype=torch.int64))
    m.register_buffer("odd", torch.arange(13, dtype=torch.uint8))
    return m


@pytest.mark.parametrize("window", [16 << 10, 1 << 20])
def test_tiny_and_odd_tensors_round_trip_bit_exactly_in_both_modes(tmp_path, io_mode, window):
    model = _odd_model()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = ModelState(model, disk_dir=tmp_path / "disk", disk_window_bytes=window)
    state.offload(to="disk")
    assert core_of(state).disk_home.io_mode == io_mode and io_mode in (state.describe_disk() or ""), (
        state.describe_disk()
    )
    snap = state.snapshot(tag="s", placement="disk")
    assert_same(snap.tensors(), capture(state))
    state.onload()
    got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert_same(got, want)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    state.offload(to="disk")
    state.restore(snap)
    state.onload()
    assert_same({k: v.detach().clone() for k, v in model.state_dict().items()}, want)
    if io_mode == "buffered":
        assert core_of(state).disk_home.bytes_direct == 0
    state.close()


def test_training_with_disk_moves_is_bit_identical_in_both_modes(tmp_path, io_mode):
    model, opt, state = _state(tmp_path, disk_window_bytes=48 << 10)
    ref_model, ref_opt = make()
    warm(ref_model, ref_opt)
    for step in range(2):
        assert train_step(model, opt, step) == train_step(ref_model, ref_opt, step)
        state.offload(["params", "optim"], to="disk")
        assert core_of(state).disk_home.io_mode == io_mode
        state.onload()
    assert_same(live(model, opt), live(ref_model, ref_opt))
    if io_mode == "O_DIRECT":
        assert core_of(state).disk_home.bytes_direct > 0, core_of(state).disk_home.describe()
