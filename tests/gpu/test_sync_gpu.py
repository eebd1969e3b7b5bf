"""Weight sync on a CUDA machine (run there: tests/gpu/run_gpu_suite.sh): a receiver in another process
on the same GPU reads device weights through CUDA IPC and shared pinned host memory, bit for bit; an
offloaded publish through a shared pool moves no byte from the device; NCCL broadcast on two GPUs."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from rl.sync_kit import (
    ask,
    mapper_main,
    model,
    model_without_buffers,
    receiver_main,
    receiver_without_buffers_main,
    same,
    start,
    start_many,
    step,
    stop,
    values,
)

from stateshift import ModelState
from stateshift.core.engine import core_of
from stateshift.core.layout import dtype_of
from stateshift.core.pool import HostPool
from stateshift.rl.sync import WeightPublisher

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _round_trip(pub, state, m, device: str, conns) -> None:
    """Versions 1 and 2 (after a step) read by every receiver in ``conns``, bit for bit."""
    pub.publish(1).wait(60)
    for c in conns:
        version, got, receipt = ask(c, ("load", 1))
        assert version == 1 and same(got, values(m)) and receipt.pause_s > 0
    step(m, 1)
    pub.publish(2).wait(60)
    for c in conns:
        version, got, _ = ask(c, ("load", 2))
        assert version == 2 and same(got, values(m))


def test_cuda_ipc_receiver_on_the_same_gpu_reads_device_weights_bit_for_bit():
    m = model(0).cuda()
    state = ModelState(m)
    pub = WeightPublisher(state, name="ipc")
    assert pub.transport == "cuda_ipc"  # auto: every published slot is resident on a CUDA device
    procs = []
    try:
        proc, conn = start(receiver_main, pub.handle().to_json(), "g0", "cuda")
        procs.append(proc)
        _round_trip(pub, state, m, "cuda", [conn])
        assert ask(conn, ("stop",)) == ("bye",)
    finally:
        stop(procs)
        pub.close()
        state.close()


def test_cuda_ipc_versions_read_by_several_receivers_are_freed_in_the_publisher():
    """Three receivers each open every version twice (``load_into``, then ``receive()``): the publisher's device
    memory stays flat. torch's IPC count once wrapped on a second open of a share and kept every version's
    arena in the publisher for good (a 6 GB model ran an H100 out of memory after a few versions)."""
    m = model(0).cuda()
    state = ModelState(m)
    pub = WeightPublisher(state, transport="cuda_ipc", name="ipc-many")
    procs = []
    try:
        started = start_many(receiver_main, [(pub.handle().to_json(), f"m{i}", "cuda") for i in range(3)])
        procs = [p for p, _ in started]
        nbytes, allocated = 0, []
        for v in range(1, 9):
            step(m, v)
            nbytes = pub.publish(v).wait(60).nbytes
            for _, conn in started:
                version, got, _ = ask(conn, ("load", v))
                assert version == v and same(got, values(m))
                version, pairs, _ = ask(conn, ("pairs", v))
                assert version == v and same(pairs, values(m))
            deadline = time.monotonic() + 10
            while len(pub._live) > 1 and time.monotonic() < deadline:  # the publisher's thread unlists the old ones
                time.sleep(0.02)
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
        grown = allocated[-1] - allocated[1]
        assert grown < nbytes, f"{grown} bytes more after 6 versions of {nbytes} bytes: {allocated}"
    finally:
        stop(procs)
        pub.close()
        state.close()


def test_cuda_ipc_shares_of_one_segment_open_beside_each_other_whatever_their_sizes():
    """A block freed and handed, larger, to a later share at the same offset of the same segment opens while
    the older, smaller mapping is still held in the receiving process, and reads the new bytes. torch's
    ``rebuild_cuda_tensor`` cache found the old storage under the same (segment, offset) key: a
    ``RuntimeError`` for two receivers in one process."""
    from stateshift.rl.sync import cuda_ipc

    torch.cuda.empty_cache()
    del_me = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # one segment, cached once freed
    del del_me
    proc, conn = start(mapper_main)
    try:
        small = torch.full((16 << 20,), 3, dtype=torch.uint8, device="cuda")
        first = cuda_ipc.share(small)
        torch.cuda.synchronize()
        assert ask(conn, ("open", first)) == 3 * (16 << 20)
        del small
        large = torch.full((32 << 20,), 5, dtype=torch.uint8, device="cuda")
        second = cuda_ipc.share(large)
        torch.cuda.synchronize()
        key = lambda ipc: (ipc["handle"], ipc["storage_offset_bytes"])  # noqa: E731
        assert key(second) == key(first) and second["storage_size_bytes"] > first["storage_size_bytes"]
        assert ask(conn, ("open", second)) == 5 * (32 << 20)
        conn.send(("stop",))
    finally:
        stop([proc])


def test_cuda_ipc_publishes_a_model_without_buffers():
    """An empty published group (no buffers) has nothing to share: its part carries no IPC handle."""
    m = model_without_buffers(0).cuda()
    state = ModelState(m, pool=HostPool(shared=True))
    pub = WeightPublisher(state, transport="cuda_ipc", name="ipc-nobuf")
    procs = []
    try:
        proc, conn = start(receiver_without_buffers_main, pub.handle().to_json(), "g2", "cuda")
        procs.append(proc)
        pub.publish(1).wait(60)
        version, got, _ = ask(conn, ("load", 1))
        assert version == 1 and same(got, values(m))
    finally:
        stop(procs)
        pub.close()
        state.close()
        core_of(state).pool.trim()


def test_shared_host_from_offloaded_params_moves_no_device_byte_and_loads_on_the_gpu():
    m = model(0).cuda()
    state = ModelState(m, pool=HostPool(shared=True))
    state.offload()
    pub = WeightPublisher(state, name="sh")
    assert pub.transport == "shared_host"  # auto: params offloaded
    procs = []
    try:
        proc, conn = start(receiver_main, pub.handle().to_json(), "g1", "cuda")
        procs.append(proc)
        first = pub.publish(1).wait(60)
        assert first.d2h_bytes == 0 and first.copied_bytes == 0
        state.onload()
        version, got, _ = ask(conn, ("load", 1))
        assert version == 1 and same(got, values(m))
        step(m, 2)
        resident = pub.publish(2).wait(60)  # resident params: one D2H into the shared pool
        assert resident.d2h_bytes > 0
        version, got, _ = ask(conn, ("load", 2))
        assert version == 2 and same(got, values(m))
        version, pairs, devices = ask(conn, ("pairs", 2))  # receive(): staged on the receiver's GPU
        assert version == 2 and devices == ["cuda:0"] and same(pairs, values(m))
    finally:
        stop(procs)
        pub.close()
        state.close()
        core_of(state).pool.trim()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"stateshift-pool-{os.getpid()}-")]


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_broadcast_to_a_receiver_on_another_gpu_is_bit_for_bit():
    m = model(0).cuda(0)
    state = ModelState(m)
    pub = WeightPublisher(state, transport="broadcast", name="nccl", broadcast_receivers=1, bucket_bytes=1 << 16)
    procs = []
    try:
        ((proc, conn),) = start_many(receiver_main, [(pub.handle().to_json(), "n1", "cuda:1")])
        procs.append(proc)
        pub.publish(1)
        version, got, _ = ask(conn, ("load", 1))
        assert version == 1 and same(got, values(m))
    finally:
        pub.close()
        stop(procs)
        state.close()


def test_the_fused_copy_lands_every_tensor_bit_for_bit_beside_those_it_cannot_take():
    """One arena on the GPU holding tensors of every kind (whole words or not, aligned to 8 bytes or only to
    their dtype, contiguous or not, big and small), copied into separate targets: bit for bit, with the
    fused kernel taking exactly the whole-word aligned contiguous ones -- three times, the later two by the
    kept plan, over new bytes (the last: NaNs with a payload, which a copy through float would lose)."""
    pytest.importorskip("triton")
    from stateshift.rl.sync import copyplan
    from stateshift.rl.sync.manifest import Manifest, PartEntry, TensorEntry

    g = torch.Generator().manual_seed(0)
    kinds = [
        (torch.bfloat16, (4096, 2048)),
        (torch.float32, (7, 3)),
        (torch.bfloat16, (3,)),
        (torch.uint8, (13,)),
        (torch.int64, (5, 5)),
        (torch.float32, (300, 1000)),
        (torch.bfloat16, (2048, 5504)),
    ]
    entries, offset = [], 0
    for i, (dtype, shape) in enumerate(kinds * 3):
        size = dtype.itemsize
        offset += size * int(torch.randint(0, 4, (1,), generator=g))  # aligned to the dtype only, at times
        offset = -(-offset // size) * size
        stride = torch.empty(shape).stride()
        if i % 5 == 4 and len(shape) == 2:  # column-major in the arena
            stride = (1, shape[0])
        entries.append(TensorEntry(f"t{i}", str(dtype).removeprefix("torch."), shape, stride, offset))
        offset += math.prod(shape) * size
    arena = torch.randint(0, 256, (offset,), dtype=torch.uint8, generator=g).cuda()
    manifest = Manifest(1, "cuda_ipc", (PartEntry("params", offset, tuple(entries)),))
    targets = {t.name: torch.zeros(t.shape, dtype=dtype_of(t.dtype), device="cuda") for t in entries}
    plans = copyplan.Plans()
    for round in range(3):  # the seeded bytes, then new bytes by the kept plan, then NaNs with a payload
        if round == 1:
            arena.random_(0, 256)
        if round == 2:
            arena[: arena.numel() // 2 * 2].view(torch.int16).fill_(-74)  # 0xFFB6 in every 2-byte float
        assert plans.copy(manifest, [arena], targets, False) == sum(t.nbytes for t in entries)
        for t in entries:
            want = t.view(arena).reshape(-1).view(torch.uint8)
            assert torch.equal(targets[t.name].reshape(-1).view(torch.uint8), want), t
    (plan,) = plans._plans.values()
    taken = sum(len(f.words) for f in plan.fused)
    expected = sum(copyplan._fusable(t, arena.data_ptr() + t.offset, targets[t.name], arena.device) for t in entries)
    assert plans.built == 1 and taken == expected and 0 < taken < len(entries)
    for t in list(targets.values())[:3]:
        t.zero_()
    assert plans.copy(manifest, [arena], targets, False) and torch.equal(
        list(targets.values())[0].reshape(-1).view(torch.uint8), entries[0].view(arena).reshape(-1).view(torch.uint8)
    )
