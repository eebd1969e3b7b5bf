"""Adversarial regressions for the disk tier: failures at awkward moments change nothing and lose nothing."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from helpers import assert_same, capture, live, make, warm

from stateshift import DiskTierError, ModelState


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
    with pytest.raises(DiskTierError, match="full"):
        state.snapshot(tag="pi_old", placement="disk")
    monkeypatch.undo()
    assert not old.released and state.snapshots.find("pi_old", None) is old
    assert_same(old.tensors(), want)

