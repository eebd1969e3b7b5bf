"""Cached copy plans (issue 10): a verb on an unchanged group reuses its plan; any change of the
layout or of the slot set gets a new one; the device-memory option on a machine without CUDA."""

from __future__ import annotations

import logging

import torch
from helpers import assert_same, capture, make, warm

from stateshift import ModelState
from stateshift.core.engine import core_of


def _plans(state, group="params"):
    """The engine's plans of a group by slot subset (plans for the disk tier's windows left out)."""
    return {subset: p for (subset, chunk), p in core_of(state).groups[group].plans.items() if chunk is None}


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
    names = {m.name for s in core_of(state).slots("params") for m in s.info.members}
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
    assert idx == set(range(len(core_of(state).groups["params"].slots)))
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
        for n, dt in [
            (7, torch.bfloat16),
            (5, torch.float32),
            (3, torch.float64),
            (9, torch.bfloat16),
            (1, torch.float16),
        ]
        * 20
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


def test_a_staged_run_without_gaps_moves_in_one_call_and_makes_no_view_per_slot(monkeypatch):
    """A staged run whose slots fill it (no padding between them) is gathered by one ``cat`` and scattered
    by one ``split_with_sizes_copy``: a verb makes no Python view per slot (2000 small slots made 2000
    per verb); a run with gaps still splits its span. Values round-trip bit for bit either way."""
    from stateshift.core import transfer
    from stateshift.core.transfer import plan

    def run_of(sizes: list[int]) -> transfer.Run:
        offsets = [sum((n + 63) // 64 * 64 for n in sizes[:i]) for i in range(len(sizes))]
        (run,) = plan(offsets, sizes, [True] * len(sizes), lambda i: torch.empty(sizes[i], dtype=torch.uint8)).runs
        return run

    assert run_of([64, 128, 256]).counts == (8, 16, 32)  # int64 words
    assert run_of([64, 12, 8]).counts is None  # a gap after the 12 bytes: split, then copy
    views = []
    real = transfer.Run.views
    monkeypatch.setattr(transfer.Run, "views", lambda self, span: views.append(self) or real(self, span))
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(512, dtype=torch.bfloat16)) for _ in range(300))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(i)
    want = [p.detach().clone() for p in model.parameters()]
    state = ModelState(model)
    snap = state.snapshot("params", tag="a")
    with torch.no_grad():
        for p in model.parameters():
            p.neg_()
    state.restore(snap)
    state.offload("params")
    state.onload("params")
    state.offload("params", only=lambda n: n.endswith(("1", "3")))  # a subset: its own plan, still no gaps
    state.onload("params")
    assert views == []
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.equal(p, w)


def test_group_residency_helpers_agree_with_a_loop_over_the_slots():
    """The loop-free answers verbs ask first (``by_residency``, ``offloaded``, ``releasable``) agree with a
    plain loop over the slots, in every mix of residencies an offload, a drop and an onload make."""
    from stateshift.core.slot import Residency

    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    gs = core_of(state).groups["params"]

    def check() -> None:
        loop = {r: [i for i, s in enumerate(gs.slots) if s.residency is r] for r in Residency}
        assert gs.by_residency() == loop
        some = list(range(0, len(gs.slots), 2))
        assert gs.by_residency(some) == {r: [i for i in some if i in loop[r]] for r in Residency}
        assert gs.offloaded() == sorted(loop[Residency.HOST] + loop[Residency.DROPPED] + loop[Residency.DISK])
        assert gs.releasable(None) == loop[Residency.DEVICE]
        assert gs.count(Residency.HOST) == len(loop[Residency.HOST])

    check()
    state.offload("params", only=lambda n: n.startswith("blocks.0."))
    check()
    state.drop("params", only=lambda n: n.startswith("blocks.1."))
    check()
    state.offload("params")
    check()
    state.onload("params")
    check()


def test_regrow_all_gives_memory_only_to_storages_without_it():
    """``regrow_all`` re-grows released storages and leaves one that holds its memory alone (a resize to
    the same size would move it to new memory); ``release_all`` releases each."""
    from stateshift.core.slot import regrow_all, release_all

    model = torch.nn.ParameterList(torch.nn.Parameter(torch.full((16,), float(i))) for i in range(3))
    state = ModelState(model)
    slots = core_of(state).slots("params")
    kept = slots[1].storage.data_ptr()
    release_all([slots[0], slots[2]])
    assert [s.storage.nbytes() for s in slots] == [0, 64, 0]
    regrow_all(slots)
    assert [s.storage.nbytes() for s in slots] == [64, 64, 64]
    assert slots[1].storage.data_ptr() == kept
    assert torch.equal(model[1], torch.full((16,), 1.0))


def test_storage_keys_agree_with_storage_key_for_views_and_released_storages():
    """The bulk listing of storage keys (``torch._C._storage_id`` where this torch has it) gives what
    ``storage_key`` gives, for views, offsets, tied tensors and storages released to 0 bytes."""
    from stateshift.core.slot import storage_key, storage_keys

    base = torch.arange(64, dtype=torch.float32)
    other = torch.zeros(8)
    tensors = [base, base[3:], base.view(8, 8), base.view(8, 8).t(), other, other[:0]]
    released = torch.ones(4)
    released.untyped_storage().resize_(0)
    tensors.append(released)
    keys = storage_keys(tensors)
    assert keys == [storage_key(t) for t in tensors]
    assert keys[0] == keys[1] == keys[2] == keys[3] != keys[4] == keys[5]


def test_larger_small_slots_are_scattered_through_views_and_no_run_mixes_devices(monkeypatch):
    """A staged run of slots averaging ``FUSED_SCATTER_BELOW`` or more is scattered by a split and a
    multi-tensor copy (one ``split_with_sizes_copy`` was slower there on the H200), gathered by one ``cat``;
    values round-trip either way. A plan never stages slots of two devices together (``cat`` needs one)."""
    from stateshift.core import transfer
    from stateshift.core.transfer import FUSED_SCATTER_BELOW, plan

    big = FUSED_SCATTER_BELOW  # average slot size at the threshold: not fused on the way in
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.full((big // 4,), float(i))) for i in range(6))
    want = [p.detach().clone() for p in model]
    state = ModelState(model)
    snap = state.snapshot("params", tag="v")
    views = []
    real = transfer.Run.views
    monkeypatch.setattr(transfer.Run, "views", lambda self, span: views.append(self) or real(self, span))
    state.snapshot("params", tag="w")
    assert views == []  # out: one cat
    with torch.no_grad():
        for p in model:
            p.zero_()
    state.restore(snap)
    assert len(views) == 1  # in: through views
    for p, w in zip(model, want, strict=True):
        assert torch.equal(p, w)
    sizes = [64] * 4
    p = plan(
        [0, 64, 128, 192],
        sizes,
        [False] * 4,
        lambda i: torch.empty(64, dtype=torch.uint8),
        devices=["a", "a", "b", "b"],
    )
    assert [r.items for r in p.runs] == [(0, 1), (2, 3)]


def _released_slots_with_old_views(n_bytes: list[int]):
    """Slots (storage + byte view cached the way ``Slot.bytes`` caches it) whose storage was then released
    by someone else (as Megatron's ``offload_to_cpu`` does: ``storage().resize_(0)``)."""
    storages = [torch.arange(n, dtype=torch.uint8).untyped_storage() for n in n_bytes]
    views = [torch.empty(0, dtype=torch.uint8).set_(s, 0, (n,), (1,)) for s, n in zip(storages, n_bytes, strict=True)]
    for s in storages:
        s.resize_(0)
    return storages, views


def test_an_onload_resolves_each_run_only_after_its_storage_came_back():
    """Copies into storages released outside stateshift, through a plan first used there, with byte views
    made while they were held (the onload after Megatron's own ``offload_to_cpu``): run k's views are made
    after ``before(run k)`` re-grew its storage, never those of later runs (a chunk sliced out of a
    released storage's view fails: ``setStorage ... out of bounds for storage of size 0``)."""
    from stateshift.core.transfer import CopyEngine

    sizes = [64, 48]  # both larger than `small`, so each slot moves in chunks
    storages, views = _released_slots_with_old_views(sizes)
    engine = CopyEngine(None, small_bytes=8, chunk_bytes=16)
    p = engine.plan([0, 64], sizes, [True, True], views.__getitem__)
    assert len(p.runs) == 4 + 3 and all(r.sizes is None for r in p.runs)
    arena = torch.arange(112, dtype=torch.uint8) + 1

    def before(run):
        for i in run.items:
            if storages[i].nbytes() != sizes[i]:
                storages[i].resize_(sizes[i])

    engine._host_runs(
        p, list(range(len(p.runs))), arena, False, before
    )  # the chunked runs, as the PCIe path moves them
    assert torch.equal(views[0], arena[:64]) and torch.equal(views[1], arena[64:])
