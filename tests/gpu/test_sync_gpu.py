"""Weight sync on a CUDA machine (run there: tests/gpu/run_gpu_suite.sh): a receiver in another process
on the same GPU reads device weights through CUDA IPC and shared pinned host memory, bit for bit; an
offloaded publish through a shared pool moves no byte from the device; NCCL broadcast on two GPUs."""

from __future__ import annotations

import os

import pytest
import torch
from rl.sync_kit import ask, model, receiver_main, same, start, start_many, step, stop, values

from stateshift import ModelState
from stateshift.core.engine import core_of
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


def test_cuda_ipc_publishes_a_model_without_buffers():
    """An empty published group (no buffers) has nothing to share: its part carries no IPC handle."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16)).cuda()
    state = ModelState(m, pool=HostPool(shared=True))
    pub = WeightPublisher(state, transport="cuda_ipc", name="ipc-nobuf")
    procs = []
    try:
        proc, conn = start(receiver_main, pub.handle().to_json(), "g2", "cuda")
        procs.append(proc)
        pub.publish(1).wait(60)
        version, got, _ = ask(conn, ("load", 1))
        assert version == 1 and same(got, values(m))
    finally:
        stop(procs)
        pub.close()
        state.close()
        state.pool.trim()


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
