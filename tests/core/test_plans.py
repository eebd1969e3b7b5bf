"""Cached copy plans (issue 10): a verb on an unchanged group reuses its plan; any change of the
layout or of the slot set gets a new one; the device-memory option on a machine without CUDA."""

from __future__ import annotations

import logging

import torch
from helpers import assert_same, capture, make, warm

from stateshift import ModelState


def _plans(state, group="params"):
    """The engine's plans of a group by slot subset (plans for the disk tier's windows left out)."""
    return {subset: p for (subset, chunk), p in state._groups[group].plans.items() if chunk is None}


def test_a_verb_on_an_unchanged_group_reuses_its_plan():
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    want = capture(state)
    state.offload("params")
    first = dict(_plans(state))
    assert None in first  # the whole group, planned once
    state.onload("params")
    state.offload("params")
    assert _plans(state)[None] is first[None]
    state.onload("params")
    assert_same(capture(state), want)


def test_a_layout_change_invalidates_the_plans():
    model, opt = make()
    state = ModelState(model, opt)
    state.offload("params")
    state.onload("params")
    old = _plans(state)[None]
    model.extra = torch.nn.Linear(3, 3)  # a new parameter: new slots, new layout
    state.offload("params")
    assert _plans(state)[None] is not old
    assert len(_plans(state)[None].runs) >= 1
    state.onload("params")
    names = {m.name for s in state.slots("params") for m in s.info.members}
    assert "extra.weight" in names


def test_a_plan_is_never_reused_for_another_set_of_tensors():
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    want = capture(state)
    state.offload("params", only=lambda n: n.startswith("blocks.0."))
    part = [k for k in _plans(state) if k is not None]
    assert len(part) == 1
    state.offload("params")  # the rest: another subset, another plan
    assert len([k for k in _plans(state) if k is not None]) == 2
    idx = {i for k in _plans(state) if k is not None for i in k}
    assert idx == set(range(len(state._groups["params"].slots)))
    state.onload()
    assert_same(capture(state), want)


def test_replaced_parameter_gets_a_new_plan_and_its_own_values():
    model, opt = make()
    state = ModelState(model, None)
    state.offload("params")
    state.onload("params")
    old = _plans(state)[None]
    new = torch.nn.Parameter(torch.full_like(model.ln_f.weight, 3.0))
    model.ln_f.weight = new
    state.offload("params")
    assert _plans(state)[None] is not old
    state.onload("params")
    assert torch.equal(model.ln_f.weight, torch.full_like(new, 3.0))


def test_free_device_memory_is_accepted_and_a_no_op_on_the_cpu():
    for flag in (True, False):
        model, opt = make()
        warm(model, opt)
        state = ModelState(model, opt, free_device_memory=flag)
        want = capture(state)
        state.offload()
        state.drop("grads")
        state.onload()
        want = {k: (torch.zeros_like(v) if k.endswith(".grad") else v) for k, v in want.items()}
        assert_same(capture(state), want)
        assert state.free_device_memory is flag


def test_transfers_count_their_bytes_and_time():
    model, opt = make()
    state = ModelState(model, opt)
    t = state.offload("params")
    assert t.total_bytes == state.nbytes("params")
    assert t.seconds() >= 0.0
    back = state.onload("params")
    assert back.total_bytes == state.nbytes("params")


def test_verbs_log_under_the_stateshift_logger(caplog):
    model, opt = make()
    state = ModelState(model, opt)
    with caplog.at_level(logging.DEBUG, logger="stateshift"):
        state.offload("params")
        state.onload("params")
    assert any(r.name == "stateshift" and "offload" in r.getMessage() for r in caplog.records)


def test_address_stable_is_accepted_and_a_no_op_with_a_warning_on_the_cpu():
    import pytest

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: tests/gpu/test_address_stable_gpu.py covers the real mode")
    model, opt = make()
    warm(model, opt)
    with pytest.warns(UserWarning, match="no effect on a machine without CUDA"):
        state = ModelState(model, opt, address_stable=True)
    want = capture(state)
    state.offload()
    state.onload()
    assert_same(capture(state), want)


def test_staged_runs_copy_in_the_widest_word_every_size_allows():
    """Multi-tensor copies of a staged run move 8-, 4- or 2-byte words when every slot and gap of the run
    allows it, bytes otherwise; the values round-trip bit for bit through every verb either way."""
    from stateshift.core.transfer import plan

    def word(sizes: list[int]) -> torch.dtype:
        offsets = [sum((n + 63) // 64 * 64 for n in sizes[:i]) for i in range(len(sizes))]
        p = plan(offsets, sizes, [True] * len(sizes), lambda i: torch.empty(sizes[i], dtype=torch.uint8))
        (run,) = p.runs
        return run.word

    assert word([64, 128, 8]) is torch.int64
    assert word([64, 12, 8]) is torch.int32  # 12 bytes: a gap of 52 after it, 4 divides both
    assert word([6, 64]) is torch.int16
    assert word([64, 3]) is torch.uint8
    g = torch.Generator().manual_seed(0)
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(n, generator=g).to(dt))
        for n, dt in [(7, torch.bfloat16), (5, torch.float32), (3, torch.float64), (9, torch.bfloat16), (1, torch.float16)] * 20
    )
    state = ModelState(model)
    want = [p.detach().clone() for p in model]
    snap = state.snapshot("params", tag="w")
    with torch.no_grad():
        for p in model:
            p.mul_(-3)
    state.restore(snap)
    state.offload()
    state.onload()
    for p, w in zip(model, want, strict=True):
        assert torch.equal(p, w)
