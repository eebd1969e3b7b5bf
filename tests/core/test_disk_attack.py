"""Adversarial regressions for the disk tier: failures at awkward moments change nothing and lose nothing."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from helpers import assert_same, capture, live, make, warm
from raises import raises_kind

from stateshift import DiskError, ModelState
from stateshift.core.engine import core_of


@pytest.fixture(autouse=True, params=["direct", "buffered"])
def io_mode(request):
    """Every test in both I/O modes (``O_DIRECT`` where the filesystem takes it, and buffered as asked by
    ``STATESHIFT_DISK_DIRECT=0``); set outside ``monkeypatch``, whose ``undo()`` the tests call."""
    old = os.environ.get("STATESHIFT_DISK_DIRECT")
    os.environ["STATESHIFT_DISK_DIRECT"] = "1" if request.param == "direct" else "0"
    yield request.param
    if old is None:
        del os.environ["STATESHIFT_DISK_DIRECT"]
    else:
        os.environ["STATESHIFT_DISK_DIRECT"] = old


def _state(tmp_path, **kw):
    model, opt = make()
    warm(model, opt)
    return model, opt, ModelState(model, opt, disk_dir=tmp_path / "disk", disk_window_bytes=1 << 16, **kw)


def _fail_pwrite(monkeypatch, at: int = 1, err: int = errno.ENOSPC) -> list[int]:
    """``os.pwrite`` fails with ``err`` from its ``at``-th call on."""
    real, calls = os.pwrite, [0]

    def pwrite(fd, data, offset):
        calls[0] += 1
        if calls[0] >= at:
            raise OSError(err, os.strerror(err))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return calls


def test_a_failing_disk_snapshot_keeps_the_snapshot_it_would_replace(tmp_path, monkeypatch):
    """Regression: snapshot(tag, placement="disk") released the old snapshot under the same tag before
    writing the new one, so a full disk lost pi_old."""
    model, opt, state = _state(tmp_path)
    old = state.snapshot(tag="pi_old", placement="disk")
    want = old.tensors()
    _fail_pwrite(monkeypatch, at=2)
    with raises_kind(DiskError, "tier", match="full"):
        state.snapshot(tag="pi_old", placement="disk")
    monkeypatch.undo()
    assert not old.released and core_of(state).snapshots.find("pi_old", None) is old
    assert_same(old.tensors(), want)


@pytest.mark.parametrize(
    ("placement", "at"), [("disk", 1), ("disk", 2), ("disk", 3), ("disk", 5), ("host", 1), ("host", 2)]
)
def test_a_restore_into_slots_on_disk_that_fails_changes_nothing(tmp_path, monkeypatch, placement, at):
    """Regression: restore wrote a snapshot's values straight over the disk region of slots on disk, so a
    write failing part way (a full disk, EIO) left some slots with the snapshot's values and some with
    their own, in the first groups of the snapshot all of them."""
    model, opt, state = _state(tmp_path)
    snap = state.snapshot(["params", "optim"], tag="s", placement=placement)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    for s in opt.state.values():
        s["exp_avg"].add_(1)
    state.offload(["params", "optim"], to="disk")
    want, residency = capture(state), state.residency()
    calls = _fail_pwrite(monkeypatch, at=at, err=errno.EIO)
    _fails_at(lambda: state.restore(snap), calls, at, "the restore writes")
    monkeypatch.undo()
    assert state.residency() == residency
    assert_same(capture(state), want)
    state.restore(snap)  # and the restore works once the disk does
    state.onload()
    got = capture(state)
    assert_same({k: got[k] for k in snap.tensors()}, snap.tensors())


def _fails_at(verb, calls: list[int], at: int, what: str) -> None:
    """``verb()`` raises ``DiskError`` (kind ``"tier"``) once the faked call fails (its ``at``-th); if the verb makes fewer
    calls than that, it must not have failed, and the case does not apply (skipped, saying why)."""
    try:
        verb()
    except DiskError as e:
        assert e.kind == "tier", e
        return
    assert calls[0] < at, f"{what} {calls[0]} times and did not fail"
    pytest.skip(f"{what} fewer than {at} times")


def _fail_preadv(monkeypatch, at: int = 1, err: int = errno.EIO) -> list[int]:
    """``os.preadv`` fails with ``err`` from its ``at``-th call on."""
    real, calls = os.preadv, [0]

    def preadv(fd, buffers, offset, *args):
        calls[0] += 1
        if calls[0] >= at:
            raise OSError(err, os.strerror(err))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


@pytest.mark.parametrize("stash", ["host", "device"])
@pytest.mark.parametrize("at", [1, 2, 3, 6])
def test_swapped_from_a_disk_snapshot_whose_read_fails_changes_nothing(tmp_path, monkeypatch, stash, at):
    """Regression: an I/O error reading a disk snapshot on entering swapped() left the resident slots
    partly overwritten with the snapshot's values (their stash was dropped) and raised a bare OSError."""
    model, opt, state = _state(tmp_path)
    snap = state.snapshot(["params", "optim"], tag="s", placement="disk")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    state.offload("optim", only=lambda name: "blocks.0." in name)  # a mix: some slots offloaded
    want, residency = capture(state), state.residency()
    calls = _fail_preadv(monkeypatch, at=at)

    def swap() -> None:
        with state.swapped(snap, stash=stash):
            pass

    _fails_at(swap, calls, at, "entering the swap reads")
    monkeypatch.undo()
    assert state.residency() == residency
    assert_same(capture(state), want)
    with state.swapped(snap, stash=stash):  # and the swap works once the disk does
        got = capture(state)
        assert_same({k: got[k] for k in snap.tensors()}, snap.tensors())
    assert_same(capture(state), want)


@pytest.mark.parametrize("at", [1, 2, 4])
def test_an_onload_whose_disk_read_fails_changes_nothing(tmp_path, monkeypatch, at):
    """Regression: a read error while onloading from disk raised a bare OSError and left the slots'
    storage re-grown (device memory taken) while they stayed on disk."""
    model, opt, state = _state(tmp_path)
    want = live(model, opt)
    state.offload("grads")
    state.offload(["params", "optim"], to="disk")
    residency = state.residency()
    calls = _fail_preadv(monkeypatch, at=at)
    with raises_kind(DiskError, "tier", match="reading the disk home"):
        state.onload()
    assert calls[0] >= at
    monkeypatch.undo()
    assert state.residency() == residency
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # released again
    state.onload()
    assert_same(live(model, opt), want)


@pytest.mark.parametrize("at", [1, 2, 5])
def test_a_relayout_whose_disk_read_fails_loses_nothing(tmp_path, monkeypatch, at):
    """Regression: a relayout (a new parameter) reads the values on disk back into a home of the new
    layout; a read failing part way had already switched the group to the new layout, so the slots still
    on disk were then looked up in a new region of the new layout's size: their values were lost."""
    model, opt, state = _state(tmp_path)
    want = capture(state, ["params"])
    state.offload("params", to="disk")
    model.extra = torch.nn.Linear(64, 64)  # a new parameter (more than a disk block): the layout changes
    calls = _fail_preadv(monkeypatch, at=at)
    with raises_kind(DiskError, "tier"):
        state.onload("params")
    assert calls[0] >= at
    monkeypatch.undo()
    state.onload("params")
    got = capture(state, ["params"])
    assert_same({k: got[k] for k in want}, want)


def test_a_stale_disk_home_left_under_this_process_id_is_swept_but_live_ones_are_kept(tmp_path):
    """Regression: sweep_stale never removed a file named with this process's pid, so a disk home left by
    a killed process whose pid this one reuses (a restarted container: the trainer gets the same small
    pid each time) stayed on disk for ever, one more per restart. A file of this pid that no live disk
    home of this process owns is stale."""
    import socket

    from stateshift.core.disk import DiskHome, sweep_stale

    d = tmp_path / "d"
    live_home = DiskHome(d)
    host = socket.gethostname().replace("-", "_")
    stale = d / f"stateshift-{host}-{os.getpid()}-0123456789ab.disk"
    stale.write_bytes(b"values of the previous run")
    other = DiskHome(d)  # a second live home of this process in the same directory: kept
    assert not stale.exists()
    assert live_home.path.exists() and other.path.exists()
    assert sweep_stale(d) == []
    live_home.close()
    other.close()


@pytest.mark.parametrize("window", [0, -5])
def test_a_staging_window_of_no_bytes_is_refused_up_front(tmp_path, window):
    """Regression: disk_window_bytes=0 was accepted and the first disk offload failed inside the copy
    planning with 'range() arg 3 must not be zero' (a negative one with a pool error)."""
    model, opt = make()
    with pytest.raises(ValueError, match="disk_window_bytes"):
        ModelState(model, opt, disk_dir=tmp_path / "d", disk_window_bytes=window)
