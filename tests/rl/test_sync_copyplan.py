"""A receiver's copy plans (``rl/sync/copyplan.py``): built once per layout, arenas and target, rebuilt when
any of them changes; the fused kernel's tables address every byte of every tensor it takes (checked on the
CPU by carrying out the tables with ``memmove``: the kernel itself runs in tests/gpu/test_sync_gpu.py)."""

from __future__ import annotations

import ctypes
import json
import random

import pytest
import torch
from raises import raises_kind
from rl.sync_kit import model, same, step, values

from stateshift import ModelState
from stateshift.core.engine import core_of
from stateshift.core.layout import dtype_of
from stateshift.core.pool import HostPool
from stateshift.errors import LayoutError
from stateshift.rl.sync import SyncError, WeightPublisher, WeightReceiver, copyplan
from stateshift.rl.sync.manifest import Manifest, PartEntry, TensorEntry


def _odd_model(seed: int = 0) -> torch.nn.Module:
    """``sync_kit.model`` plus tensors the kernel cannot take whole: 6 bytes (3 bf16), 4 bytes (1 fp32)."""
    m = model(seed)
    m.add_module("odd", torch.nn.Linear(2, 3).to(torch.bfloat16))  # bias: 3 bf16 = 6 bytes
    m.add_module("one", torch.nn.Linear(1, 1))  # 4 bytes each
    return m


@pytest.fixture
def trainer():
    m = _odd_model(0)
    state = ModelState(m, pool=HostPool(shared=True))
    pub = WeightPublisher(state, name="plans", ack_timeout_s=0.5, poll_s=0.01)
    yield m, pub
    pub.close()
    state.close()
    core_of(state).pool.trim()


def _published(m: torch.nn.Module, pub: WeightPublisher, version: int) -> None:
    step(m, version)
    pub.publish(version).wait(5)


def test_loads_into_the_same_target_reuse_its_plans(trainer):
    m, pub = trainer
    rx = WeightReceiver(pub.handle(), name="r")
    target = _odd_model(9)
    copy, blocks = rx._plans.copy, []

    def seen(manifest, arenas, *rest):
        blocks.append(tuple(a.data_ptr() for a in arenas))
        return copy(manifest, arenas, *rest)

    rx._plans.copy = seen
    for v in range(1, 9):
        _published(m, pub, v)
        assert rx.load_into(target, min_version=v) == v and same(values(target), values(m))
    # one plan per block the versions alternate between (two, or three when a release lands after the next
    # snapshot was placed), none for a block seen before
    assert rx._plans.built == len(set(blocks)) <= copyplan.MAX_PLANS and len(blocks) == 8
    rx.close()


def test_a_replaced_target_tensor_gets_a_new_plan_and_the_new_tensor_gets_the_weights(trainer):
    m, pub = trainer
    rx = WeightReceiver(pub.handle(), name="r")
    target = _odd_model(9)
    _published(m, pub, 1)
    rx.load_into(target)
    old = target[0].weight
    target[0].weight = torch.nn.Parameter(torch.zeros_like(old))  # a new tensor at a new address
    _published(m, pub, 2)
    assert rx.load_into(target, min_version=2) == 2 and same(values(target), values(m))
    assert rx._plans.built == 2 and not torch.equal(old, target[0].weight)
    other = _odd_model(8)  # another target: its own plan
    assert rx.load_into(other, min_version=2) == 2 and same(values(other), values(m))
    assert rx._plans.built == 3
    rx.close()


@pytest.mark.parametrize(
    "reshape",
    [
        pytest.param(lambda t: t.view(-1), id="same-address-other-shape"),
        pytest.param(lambda t: t.view(torch.int32), id="same-address-other-dtype"),
    ],
)
def test_a_target_reshaped_at_the_same_address_is_checked_again_and_refused(trainer, reshape):
    m, pub = trainer
    rx = WeightReceiver(pub.handle(), name="r")
    target = dict(values(_odd_model(9)))
    for v in range(1, 5):  # a plan for each block the versions alternate between
        _published(m, pub, v)
        rx.load_into(target, min_version=v)
    built = rx._plans.built
    name = next(n for n, t in target.items() if t.dim() == 2 and t.dtype == torch.float32)
    target[name] = reshape(target[name])  # every address the plans hold still matches
    before = {n: t.clone() for n, t in target.items()}
    for v in (5, 6):
        _published(m, pub, v)
        with raises_kind(LayoutError, "mismatch") as e:
            rx.load_into(target, min_version=v)
        assert e.value.tensor == name
        assert all(torch.equal(before[n], t) for n, t in target.items())  # refused before any byte was copied
    assert rx._plans.built == built  # nothing was planned for the refused target
    rx.close()


def test_a_delta_load_plans_its_changed_tensors_and_keeps_no_plan(tmp_path):
    m = _odd_model(0)
    state = ModelState(m, pool=HostPool(shared=True))
    pub = WeightPublisher(state, name="delta", delta=True, ack_timeout_s=0.5, poll_s=0.01)
    rx = WeightReceiver(pub.handle(), name="r")
    target = _odd_model(9)
    try:
        pub.publish(1).wait(5)
        rx.load_into(target, delta=True)
        with torch.no_grad():
            m[0].weight.add_(1)
        pub.publish(2).wait(5)
        rx.load_into(target, min_version=2, delta=True)
        assert rx.last_receipt.copied_bytes == m[0].weight.nbytes and same(values(target), values(m))
        assert rx._plans.built == 2 and len(rx._plans._plans) == 1  # the full load's plan only
    finally:
        rx.close()
        pub.close()
        state.close()
        core_of(state).pool.trim()


def _carry_out(fused: copyplan.Fused, seen: list[int]) -> None:
    """What the kernel does, chunk by chunk, with ``memmove`` on host addresses."""
    src, dst, words = fused.src_ptrs.tolist(), fused.dst_ptrs.tolist(), fused.words.tolist()
    for t, start in zip(fused.chunk_tensor.tolist(), fused.chunk_start.tolist(), strict=True):
        n = min(copyplan.CHUNK, words[t] - start)
        assert n > 0
        ctypes.memmove(dst[t] + start * 8, src[t] + start * 8, n * 8)
    seen.append(len(words))


@pytest.fixture
def carried_out(monkeypatch) -> list[int]:
    """The fused path on host tensors: its device condition lifted, its kernel carried out by ``memmove``,
    chunks of 4 words so that tensors span many. Returns the number of tensors of each launch."""
    seen: list[int] = []
    monkeypatch.setattr(copyplan, "CHUNK", 4)
    monkeypatch.setattr(copyplan, "fused_kernel", lambda: _carry_out)
    monkeypatch.setattr(copyplan, "_fusable", lambda t, at, dst, dev: copyplan.whole_words(t, at, dst))
    monkeypatch.setattr(copyplan.Fused, "launch", lambda self: _carry_out(self, seen))
    return seen


def test_the_fused_tables_address_every_byte_of_every_tensor_they_take(trainer, carried_out):
    """Bit for bit, with the odd-sized tensors copied the other way in the same load."""
    m, pub = trainer
    rx = WeightReceiver(pub.handle(), name="r")
    target = _odd_model(9)
    for v in (1, 2):
        _published(m, pub, v)
        assert rx.load_into(target, min_version=v) == v and same(values(target), values(m))
    odd = [k for k, t in m.state_dict().items() if t.nbytes % 8]
    assert odd and carried_out == [len(m.state_dict()) - len(odd)] * 2
    rx.close()


def test_a_target_restrided_in_place_is_not_copied_as_if_contiguous(trainer, carried_out):
    """Same address, same names and shapes: only the strides changed. The key sees it (the plan built for
    the contiguous tensor would have copied its bytes in the wrong order)."""
    m, pub = trainer
    rx = WeightReceiver(pub.handle(), name="r")
    target = _odd_model(9)
    for v in (1, 2, 3, 4):  # a plan for each block the versions alternate between
        _published(m, pub, v)
        rx.load_into(target, min_version=v)
    built = rx._plans.built
    w = target[2].weight  # bf16 [512, 48]
    at = w.data_ptr()
    w.data = w.data.as_strided((512, 48), (1, 512))  # the same storage, column-major
    assert w.data_ptr() == at and not w.is_contiguous()
    _published(m, pub, 5)
    assert rx.load_into(target, min_version=5) == 5 and same(values(target), values(m))
    assert rx._plans.built == built + 1
    rx.close()


@pytest.mark.parametrize("seed", range(5))
def test_the_chunk_table_covers_every_word_once(seed):
    rng = random.Random(seed)
    words = [rng.choice([0, 1, 3, 7, 8, 9, 64, 1000]) for _ in range(rng.randint(1, 30))]
    chunk = rng.choice([1, 4, 8, 100])
    index, start = copyplan.chunk_table(torch.tensor(words, dtype=torch.int64), chunk)
    hit = [[0] * w for w in words]
    for t, s in zip(index.tolist(), start.tolist(), strict=True):
        assert 0 <= s < words[t]
        for k in range(s, min(s + chunk, words[t])):
            hit[t][k] += 1
    assert all(h == [1] * w for h, w in zip(hit, words, strict=True))


@pytest.mark.parametrize(
    ("entry", "src_at", "dst", "ok"),
    [
        (TensorEntry("w", "float32", (4, 2), (2, 1), 0), 64, torch.empty(4, 2), True),
        (TensorEntry("w", "float32", (3,), (1,), 0), 64, torch.empty(3), False),  # 12 bytes: not whole words
        (TensorEntry("w", "float32", (4, 2), (2, 1), 0), 68, torch.empty(4, 2), False),  # source misaligned
        (TensorEntry("w", "float32", (4, 2), (1, 4), 0), 64, torch.empty(4, 2), False),  # source column-major
        (TensorEntry("w", "float32", (4, 2), (2, 1), 0), 64, torch.empty(2, 4).t(), False),  # target transposed
        (TensorEntry("w", "float32", (4, 2), (2, 1), 0), 64, torch.empty(9)[1:].view(4, 2), False),  # misaligned
        (TensorEntry("w", "float32", (1, 4), (99, 1), 0), 64, torch.empty(1, 4), True),  # a stride of a 1-dim
    ],
)
def test_the_kernel_takes_only_contiguous_aligned_whole_words(entry, src_at, dst, ok):
    assert copyplan.whole_words(entry, src_at, dst) is ok


def _raw(offset: object, aggregate: object = 0) -> bytes:
    part = {"group": "params", "size": 64, "file": None, "ipc": None, "offset": 0}
    part["tensors"] = json.dumps([["w", "float32", [4], [1], offset, aggregate], ["v", "float32", [2], [1], 16, 0]])
    return json.dumps({"version": 1, "transport": "shared_host", "parts": [part]}).encode()


def test_the_multi_tensor_copy_moves_bits_so_a_nan_payload_survives(monkeypatch):
    """On CUDA ``_foreach_copy_`` of bfloat16 goes through float and gives back the canonical NaN (seen on an
    H100: 0xFFB6 landed as 0x7FFF); the batch copies integers of the same size instead."""
    entries = [
        TensorEntry("a", "bfloat16", (3,), (1,), 0),
        TensorEntry("b", "float16", (2, 2), (1, 2), 6),
        TensorEntry("c", "float32", (3,), (1,), 16),
        TensorEntry("d", "bool", (5,), (1,), 28),
    ]
    arena = torch.empty(40, dtype=torch.uint8)
    arena[:28].view(torch.int16).fill_(-74)  # 0xFFB6: a bfloat16 and a float16 NaN with a payload
    arena[16:28].view(torch.int32).fill_(-1)  # 0xFFFFFFFF: a float32 NaN with a payload
    arena[28:].fill_(1)
    manifest = Manifest(1, "shared_host", (PartEntry("params", 40, tuple(entries)),))
    targets = {t.name: torch.zeros(t.shape, dtype=dtype_of(t.dtype)) for t in entries}
    seen: list[torch.dtype] = []
    foreach_copy = torch._foreach_copy_

    def recorded(dsts, srcs, **kw):
        seen.extend(t.dtype for t in (*dsts, *srcs))
        return foreach_copy(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", recorded)
    copyplan.Plans().copy(manifest, [arena], targets, False)
    assert seen and not any(d.is_floating_point for d in seen)
    for t in entries:
        assert torch.equal(copyplan.bits(targets[t.name]), copyplan.bits(t.view(arena))), t.name


def test_a_repeated_layout_parses_to_the_same_entries_and_a_lookalike_is_still_refused():
    first = Manifest.parse(_raw(32), "m")
    assert Manifest.parse(_raw(32), "m").parts[0].tensors is first.parts[0].tensors
    assert Manifest.parse(_raw(40), "m").parts[0].tensors[0].offset == 40
    Manifest.parse(_raw(32), "m")
    for bad in (_raw(32.0), _raw(32, False)):  # equal to the last entries (32.0 == 32, False == 0), not entries
        with raises_kind(SyncError, "mailbox"):
            Manifest.parse(bad, "m")
