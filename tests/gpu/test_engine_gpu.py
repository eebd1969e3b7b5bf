"""CUDA checks of the copy engine's planned paths (issue 10): staged runs through the staging ring,
chunked large slots, both directions at once (``exchange``), memory handed back to the driver.

Small engine sizes force many runs, so the ring of staging buffers wraps many times and every chunk
boundary is crossed; values are compared bit for bit with copies read straight from the tensors.
"""

from __future__ import annotations

import pytest
import torch

from stateshift import ModelState
from stateshift.core.engine import core_of
from stateshift.core.transfer import CopyEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _mixed(seed: int = 0) -> torch.nn.ParameterList:
    g = torch.Generator(device="cuda").manual_seed(seed)
    sizes = [1 + (i * 7919) % 9000 for i in range(600)] + [3_000_000, 1_234_567] + [17, 1, 64] * 50
    return torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n, device="cuda", generator=g)) for n in sizes)


def _state(model, small: int = 16 << 10, chunk: int = 256 << 10, **kw) -> ModelState:
    state = ModelState(model, **kw)
    core_of(state).engine = CopyEngine(core_of(state).engine.device, small_bytes=small, chunk_bytes=chunk)
    return state


def _values(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model]


def _same(model, values) -> None:
    for i, (p, v) in enumerate(zip(model, values, strict=True)):
        assert torch.equal(p, v), f"tensor {i} differs"


@pytest.mark.parametrize("placement", ["host", "device"])
def test_every_verb_through_many_staged_runs_and_chunks(placement):
    model = _mixed()
    state = _state(model)
    want = _values(model)
    plan = core_of(state).groups["params"].plan(core_of(state).engine, list(range(len(model))))
    assert (
        sum(r.sizes is not None for r in plan.runs) > 10
        and sum(r.sizes is None and r.offset > 0 for r in plan.runs) > 10
    )
    snap = state.snapshot("params", tag="s", placement=placement)
    with torch.no_grad():
        for p in model:
            p.mul_(-2)
    changed = _values(model)
    state.restore(snap)
    _same(model, want)
    for _ in range(3):
        state.offload()
        state.onload()
    _same(model, want)
    with torch.no_grad():
        for p, c in zip(model, changed, strict=True):
            p.copy_(c)
    for stash in ("host", "device"):
        with state.swapped(snap, stash=stash):
            _same(model, want)
        _same(model, changed)


def test_exchange_of_host_stash_and_host_snapshot_is_exact_under_concurrent_compute():
    model = _mixed(1)
    state = _state(model)
    old = _values(model)
    snap = state.snapshot("params", tag="old")
    with torch.no_grad():
        for p in model:
            p.add_(1.5)
    cur = _values(model)
    for _ in range(5):
        with state.swapped(snap, stash="host"):
            sums = [p.sum() for p in model]  # compute right after the async swap
            for _, o, s in zip(model, old, sums, strict=True):
                assert torch.equal(s, o.sum())
        _same(model, cur)
        with torch.no_grad():  # a write right after the exit must not be undone by a late copy
            model[0].add_(0)
    _same(model, cur)


def test_offload_hands_memory_back_to_the_driver_and_the_option_keeps_it():
    for free in (True, False):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(64 << 20, device="cuda")) for _ in range(4))
        state = ModelState(model, free_device_memory=free)
        tracked = state.nbytes()
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        reserved_before = torch.cuda.memory_reserved()
        state.offload()
        torch.cuda.synchronize()
        gain = torch.cuda.mem_get_info()[0] - free_before
        reserved_drop = reserved_before - torch.cuda.memory_reserved()
        if free:
            assert gain >= 0.9 * tracked and reserved_drop >= 0.9 * tracked, (gain, reserved_drop, tracked)
        else:
            assert reserved_drop < 0.1 * tracked, reserved_drop
        state.onload()
        assert all(torch.all(p == 0) for p in model)
        state.close()
        del model, state


def test_device_placed_copies_on_two_streams_are_ordered_with_compute():
    """Device-to-device runs alternate between the current stream and a side stream: the side stream's
    copies must read the values as of the call (after a slow kernel still running on the current stream)
    and compute enqueued after the call must wait for them, in both directions."""
    g = torch.Generator(device="cuda").manual_seed(3)
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(1 << 20, device="cuda", generator=g)) for _ in range(24)
    )
    state = ModelState(model)
    want = [v + 1 for v in _values(model)]
    torch.cuda._sleep(50_000_000)  # the current stream stays busy while the copies are enqueued
    with torch.no_grad():
        for p in model:
            p.add_(1)  # enqueued before the snapshot: the snapshot must hold it
    snap = state.snapshot("params", tag="d", placement="device")
    with torch.no_grad():
        for p in model:
            p.mul_(0)  # enqueued right after: must not reach the snapshot
    state.restore(snap)
    _same(model, want)
    with torch.no_grad():
        for p in model:
            p.fill_(3)
    torch.cuda._sleep(50_000_000)
    state.restore(snap)
    sums = [p.sum() for p in model]  # read right after the restore: must see the restored values
    for s, w in zip(sums, want, strict=True):
        assert torch.equal(s, w.sum())


def test_verbs_inside_a_callers_stream_leave_it_current_and_ordered():
    """The engine switches streams with ``torch.cuda.set_stream`` (``transfer._On``), not
    ``torch.cuda.stream``: called inside the user's own stream context, every verb must give that stream
    back as the current one, read the values that stream wrote before the call, and be waited for by
    what it enqueues after."""
    g = torch.Generator(device="cuda").manual_seed(4)
    model = _mixed(4)
    state = _state(model)
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        torch.cuda._sleep(20_000_000)
        with torch.no_grad():
            for p in model:
                p.add_(1)
        want = _values(model)
        for placement in ("host", "device"):
            snap = state.snapshot("params", tag=placement, placement=placement)
            assert torch.cuda.current_stream() == user
            with torch.no_grad():
                for p in model:
                    p.copy_(torch.randn(p.shape, device="cuda", generator=g))
            state.restore(snap)
            assert torch.cuda.current_stream() == user
            sums = [p.sum() for p in model]  # on the user's stream, right after the restore
            for s, w in zip(sums, want, strict=True):
                assert torch.equal(s, w.sum())
        state.offload()
        state.onload()
        assert torch.cuda.current_stream() == user
        with state.swapped(core_of(state).snapshots.get("host"), stash="host"):
            assert torch.cuda.current_stream() == user
        assert torch.cuda.current_stream() == user
        _same(model, want)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
