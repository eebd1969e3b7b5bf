"""Host pool, snapshot store, copy-engine run planning, copy-on-write homes."""

from __future__ import annotations

import pytest
import torch
from helpers import capture, make, one_torch_thread, warm

from stateshift import ModelState
from stateshift.core.engine import core_of
from stateshift.core.pool import HostPool
from stateshift.core.snapshot import SnapshotStore
from stateshift.core.transfer import CopyEngine, plan


def test_pool_exact_sizes_and_reuse():
    pool = HostPool(pin=False)
    a = pool.acquire(3 * 1024 * 1024 + 7)
    assert a.data.numel() == a.nbytes == 3 * 1024 * 1024 + 7
    pool.release(a)
    b = pool.acquire(3 * 1024 * 1024 + 7)
    assert b is a
    s = pool.stats
    assert (s.allocations, s.reuses, s.held_bytes, s.in_use_bytes) == (1, 1, a.nbytes, a.nbytes)
    c = pool.acquire(100)  # a different size is a new block, never a slice of a larger one
    assert c is not a and pool.stats.held_bytes == a.nbytes + 100


def _resident_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """(pages of [ptr, ptr + nbytes) in memory, pages in all), from ``mincore``."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = ptr - ptr % page
    pages = -(-(ptr + nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), pages


def test_a_new_pinned_block_is_faulted_in_before_it_is_registered(monkeypatch):
    """cudaHostRegister faults pages in on one thread; the pool touches a large new block first on threads of
    its own (the first offload of a state pins every home). Registered here is a fake that counts what was
    resident. The touch must not depend on torch's thread count: the RL loop runs torch on one thread, and
    a touch through torch there was slower than none (found by the review)."""
    from stateshift.core import pool as pool_mod

    seen = []
    monkeypatch.setattr(pool_mod, "_cuda_register", lambda ptr, n: seen.append(_resident_pages(ptr, n)))
    monkeypatch.setattr(pool_mod, "_cuda_unregister", lambda ptr: None)
    monkeypatch.setattr(pool_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    pool = HostPool(pin=False)
    pool.pinned = True  # as on a CUDA machine
    big = 2 * pool_mod.TOUCH_MIN_BYTES + 3 * 4096 + 5  # two parts, the last one short
    with one_torch_thread():
        block = pool.acquire(big)
    assert block.pinned and seen[0][0] == seen[0][1], seen
    assert torch.count_nonzero(block.data) == 0
    pool.acquire(8 << 20)  # one part: left to the driver
    assert seen[1][0] < seen[1][1] // 4, seen
    unpinned = HostPool(pin=False).acquire(big)  # never pinned: not touched (the pages come as they are written)
    assert _resident_pages(unpinned.data.data_ptr(), big)[0] < big // 4096 // 4


def test_pool_trim_and_budget_frees_idle_blocks():
    pool = HostPool(pin=False, budget_bytes=3 << 20)
    a = pool.acquire(2 << 20)
    pool.release(a)
    b = pool.acquire(1 << 20)
    assert pool.stats.held_bytes == 3 << 20
    pool.release(b)
    c = pool.acquire((2 << 20) + 1)  # must free idle blocks to fit
    assert pool.stats.held_bytes <= 3 << 20 and pool.stats.frees >= 1
    pool.release(c)
    assert pool.trim() == c.nbytes or pool.stats.idle_bytes == 0
    assert pool.stats.held_bytes == pool.stats.in_use_bytes


def test_pool_refcount_shares_blocks():
    pool = HostPool(pin=False)
    a = pool.acquire(64)
    pool.retain(a)
    assert a.shared
    pool.release(a)
    assert not a.shared and pool.stats.in_use_bytes == 64
    pool.release(a)
    assert pool.stats.in_use_bytes == 0


def test_second_snapshot_allocates_nothing():
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)

    def cycle(v: int) -> None:
        state.snapshot(tag="pi_old", version=v)
        if v > 0:
            state.release(core_of(state).snapshots.get("pi_old", v - 1))
        state.snapshot(tag="ref")  # same key: replaced, its memory reused

    cycle(0)
    cycle(1)
    allocations = core_of(state).pool.stats.allocations
    for v in range(2, 6):
        cycle(v)
    assert core_of(state).pool.stats.allocations == allocations
    assert core_of(state).pool.stats.reuses > 0


def test_store_versions_and_lookup():
    model, opt = make()
    state = ModelState(model, opt)
    for v in (1, 3, 2):
        state.snapshot(tag="pi_old", version=v)
    state.snapshot(tag="ref")
    assert core_of(state).snapshots.get("pi_old").version == 3
    assert core_of(state).snapshots.get("pi_old", 1).version == 1
    assert core_of(state).snapshots.get("ref").version is None
    assert len(core_of(state).snapshots) == 4
    store = SnapshotStore()
    try:
        store.get("nothing")
    except KeyError as e:
        assert "nothing" in str(e)
    else:
        raise AssertionError("expected KeyError")


def test_snapshot_of_offloaded_group_is_zero_copy_and_detaches_on_write():
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    state.offload("params")
    home = core_of(state).groups["params"].home
    snap = state.snapshot("params", tag="cow")
    assert snap.parts[0].host is home and home.shared
    values = snap.tensors()
    state.onload("params")
    with torch.no_grad():
        model.tok.weight.mul_(2)
    state.offload("params")  # writes the home: must take a block of its own
    assert core_of(state).groups["params"].home is not home
    got = snap.tensors()
    assert all(torch.equal(values[k], got[k]) for k in values)


def test_restore_into_offloaded_group_is_a_pointer_copy():
    model, opt = make()
    state = ModelState(model, opt)
    snap = state.snapshot("params", tag="p")
    state.offload("params")
    state.restore(snap)
    assert core_of(state).groups["params"].home is snap.parts[0].host
    assert torch.equal(capture(state, ["params"])["tok.weight"], snap.tensors()["tok.weight"])


def _offsets(sizes, gap=0):
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n + gap
    return offsets


def _plan(sizes, offsets, **kw):
    views = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    return plan(offsets, sizes, [True] * len(sizes), views.__getitem__, **kw)


def test_copy_engine_coalesces_small_neighbours():
    sizes = [10, 20, 5000, 30, 40, 990, 999, 999, 999, 999]
    runs = _plan(sizes, _offsets(sizes), small=1000, chunk=4000).runs
    # a large item moves alone, in chunks of at most `chunk` bytes; a staged run stops at `chunk` bytes
    assert [len(r.items) for r in runs] == [2, 1, 1, 5, 2]
    assert [(r.offset, r.nbytes) for r in runs[1:3]] == [(0, 4000), (4000, 1000)] and runs[1].items == runs[
        2
    ].items == (2,)
    spaced = _plan([10, 10, 10], _offsets([10, 10, 10], gap=5000), small=1000, chunk=4000).runs
    assert [len(r.items) for r in spaced] == [1, 1, 1]  # too far apart to share one staged copy


def test_copy_engine_host_copies():
    engine = CopyEngine(torch.device("cpu"))
    pairs = [(torch.zeros(5, dtype=torch.uint8), torch.arange(5, dtype=torch.uint8))]
    engine.copy(pairs).wait()
    assert pairs[0][0].tolist() == [0, 1, 2, 3, 4]


def test_staged_runs_never_span_another_item():
    """A device-to-host run writes its whole host span: it must not cover an item outside the run.

    Regression: Adam's ``step`` (a CPU tensor, copied host-to-host) sat between
    small CUDA tensors in the optim arena and was overwritten by the staged span.
    """
    from stateshift.core.layout import Layout
    from stateshift.core.slot import MemberInfo, SlotInfo

    sizes = [4, 4096, 4, 100, 64, 4, 1, 2048, 63, 65]
    infos = tuple(
        SlotInfo(f"t{i}", "optim", n, (MemberInfo(f"t{i}", (n,), "uint8", (1,), 0),)) for i, n in enumerate(sizes)
    )
    layout = Layout.build(infos)
    moving = [i for i, n in enumerate(sizes) if n != 4]  # the 4-byte items are copied elsewhere
    for run in _plan(sizes, list(layout.offsets), indices=moving).runs:
        for i in range(len(sizes)):
            if i not in moving:
                assert not (run.start <= layout.offsets[i] < run.end), f"run [{run.start}, {run.end}) covers item {i}"


@pytest.mark.parametrize("to_arena", [True, False])
def test_staged_move_copies_exactly(to_arena):
    """Staged runs (split + multi-tensor copy) on the CPU: every item exact, nothing else written."""
    from stateshift.core.layout import Layout
    from stateshift.core.slot import MemberInfo, SlotInfo

    g = torch.Generator().manual_seed(0)
    sizes = [int(x) for x in torch.randint(1, 3000, (60,), generator=g)] + [5000, 7]
    infos = tuple(
        SlotInfo(f"t{i}", "g", n, (MemberInfo(f"t{i}", (n,), "uint8", (1,), 0),)) for i, n in enumerate(sizes)
    )
    layout = Layout.build(infos)
    arena = torch.randint(0, 256, (layout.total,), dtype=torch.uint8, generator=g)
    before = arena.clone()
    devs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    dev_before = [t.clone() for t in devs]
    skip = set(range(0, len(sizes), 7))  # items not in this batch must stay untouched
    regions = layout.regions(arena)
    engine = CopyEngine(torch.device("cpu"), small_bytes=4096, chunk_bytes=20000)
    p = engine.plan(
        layout.offsets, sizes, [True] * len(sizes), devs.__getitem__, [i for i in range(len(sizes)) if i not in skip]
    )
    assert any(len(r.items) > 1 for r in p.runs)
    (engine.to_arena if to_arena else engine.from_arena)(p, arena).wait()
    for i in range(len(sizes)):
        if i in skip:
            assert torch.equal(regions[i], before[layout.offsets[i] : layout.offsets[i] + sizes[i]]), i
            assert torch.equal(devs[i], dev_before[i]), i
        elif to_arena:
            assert torch.equal(regions[i], dev_before[i]), i
        else:
            assert torch.equal(devs[i], regions[i]), i


def test_a_block_is_still_made_when_no_thread_can_start(monkeypatch):
    """The touch is an optimisation: where no thread can start (interpreter shutdown raises RuntimeError),
    the block is made and registered as before."""
    from stateshift.core import pool as pool_mod

    class NoThreads:
        def __init__(self, *a, **k):
            raise RuntimeError("can't create new thread at interpreter shutdown")

    registered = []
    monkeypatch.setattr(pool_mod, "ThreadPoolExecutor", NoThreads)
    monkeypatch.setattr(pool_mod, "_cuda_register", lambda ptr, n: registered.append(n))
    monkeypatch.setattr(pool_mod, "_cuda_unregister", lambda ptr: None)
    monkeypatch.setattr(pool_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    pool = HostPool(pin=False)
    pool.pinned = True
    block = pool.acquire(2 * pool_mod.TOUCH_MIN_BYTES)
    assert block.pinned and registered == [2 * pool_mod.TOUCH_MIN_BYTES]
