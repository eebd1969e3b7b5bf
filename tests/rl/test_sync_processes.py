"""Weight sync across processes (``spawn``ed, with timeouts; every child killed and every /dev/shm file
removed at the end): receivers in other processes read each version bit for bit; a receiver SIGKILLed
while it reads is reclaimed and named while the others go on; a publisher SIGKILLed inside a publish
leaves receivers on the last whole version."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch
from raises import raises_kind
from rl.sync_kit import (
    SPAWN,
    ask,
    model,
    publisher_main,
    receiver_main,
    same,
    shm_files,
    start,
    start_many,
    step,
    stop,
    values,
    wait_for,
)

from stateshift import ModelState
from stateshift.core.engine import core_of
from stateshift.core.pool import HostPool
from stateshift.rl.sync import SyncError, WeightPublisher, WeightReceiver
from stateshift.rl.sync.mailbox import Mailbox

pytestmark = pytest.mark.slow


def test_receivers_in_other_processes_read_whole_versions_and_a_killed_one_is_reclaimed():
    m = model(0)
    state = ModelState(m, pool=HostPool(shared=True))
    pub = WeightPublisher(state, name="p", ack_timeout_s=20, poll_s=0.02)
    procs = []
    try:
        (p0, c0), (p1, c1) = (
            start(receiver_main, pub.handle().to_json(), "r0", None),
            start(receiver_main, pub.handle().to_json(), "r1", None),
        )
        procs += [p0, p1]
        pub.publish(1).wait(10)
        for c in (c0, c1):
            version, got, receipt = ask(c, ("load", 1))
            assert version == 1 and same(got, values(m)) and receipt.nbytes == pub._live[1].nbytes
        assert ask(c1, ("hold", 1)) == ("holding", 1)
        os.kill(p1.pid, signal.SIGKILL)  # mid-read: it holds version 1
        step(m, 1)
        state.offload()
        pub.publish(2).wait(10)
        wait_for(lambda: pub.lost)
        assert [(e.receiver, e.version, e.cause) for e in pub.lost] == [("r1", 1, "died")]
        version, got, _ = ask(c0, ("load", 2))
        state.onload()
        assert version == 2 and same(got, values(m))
        version, pairs, devices = ask(c0, ("pairs", 2))  # receive(): views of the shared memory itself
        assert version == 2 and devices == ["cpu"] and same(pairs, values(m))
        wait_for(lambda: sorted(pub._live) == [2])  # version 1 is freed once nobody holds it
        assert ask(c0, ("stop",)) == ("bye",)
    finally:
        stop(procs)
        pub.close()
        state.close()
        core_of(state).pool.trim()
    assert shm_files(os.getpid()) == []


@pytest.fixture
def dying_publisher():
    """A publisher process that published version 1; yields (process, its handle, its pipe)."""
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=publisher_main, args=(child, 60.0), daemon=True)
    proc.start()
    try:
        first = ask(parent, None)
        assert first[0] == "ready"
        yield proc, first[1], parent
    finally:
        stop([proc])
        for f in shm_files(proc.pid):
            os.unlink(f)


def test_a_publisher_killed_inside_a_publish_leaves_receivers_on_the_last_whole_version(dying_publisher):
    proc, handle, conn = dying_publisher
    rx = WeightReceiver(handle, name="r", timeout_s=10)
    try:
        want = values(model(0))
        target = model(3)
        assert rx.load_into(target) == 1 and same(values(target), want)
        assert ask(conn, ("publish2",)) == ("enqueued",)  # its bytes are written, its listing delayed 60 s
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert rx.latest_version() == 1 and not rx.publisher_alive()
        target = model(4)
        assert rx.load_into(target) == 1 and same(values(target), want)
        t0 = time.monotonic()
        with raises_kind(SyncError, "timeout") as err:
            rx.load_into(target, min_version=2, timeout=30)
        assert not err.value.publisher_alive and time.monotonic() - t0 < 5  # not the whole timeout: it is gone
        assert same(values(target), want)
    finally:
        rx.close()


def test_a_publisher_started_after_one_died_leaves_that_ones_receivers_on_their_last_whole_version(dying_publisher):
    """Another publisher starting on the machine removes what dead publishers left, but not the files of one
    whose receivers still run: they stay on its last whole version and time out typed."""
    proc, handle, conn = dying_publisher
    rx = WeightReceiver(handle, name="r", timeout_s=10)
    other_state = other = None
    try:
        want = values(model(0))
        assert rx.load_into(model(3)) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        other_state = ModelState(model(9), pool=HostPool(shared=True))  # a shared pool removes dead ones' blocks
        other = WeightPublisher(other_state, name="other")  # and a publisher dead ones' mailboxes
        target = model(4)
        assert rx.load_into(target) == 1 and same(values(target), want)
        with raises_kind(SyncError, "timeout") as err:
            rx.load_into(target, min_version=2, timeout=30)
        assert not err.value.publisher_alive
    finally:
        rx.close()
        if other is not None:
            other.close()
        if other_state is not None:
            other_state.close()
    assert Mailbox.remove_stale(rx.handle.directory)  # and once nobody reads them, they go
    HostPool(shared=True)
    assert glob.glob(f"/dev/shm/stateshift-pool-{proc.pid}-*") == []


def test_a_broadcast_receiver_times_out_typed_and_then_reads_the_next_version_whole():
    m = model(0)
    state = ModelState(m)
    pub = WeightPublisher(state, transport="broadcast", name="bt", broadcast_receivers=1, ack_timeout_s=60)
    procs = []
    try:
        ((p, c),) = start_many(receiver_main, [(pub.handle().to_json(), "b0", None)])
        procs.append(p)
        kind, waited = ask(c, ("within", 1, 1.0))  # nothing published: its timeout, not the group's
        assert kind == "timeout" and waited < 5, (kind, waited)
        pub.publish(1)
        version, got = ask(c, ("within", 1, 30.0))  # the broadcast it waited on before is the one that arrives
        assert version == 1 and same(got, values(m))
        assert ask(c, ("within", 2, 0.5))[0] == "timeout"
        step(m, 2)
        pub.publish(2)
        version, got = ask(c, ("within", 2, 30.0))
        assert version == 2 and same(got, values(m))
        pub.close()
        kind, waited = ask(c, ("within", 3, 30.0))  # its group ended: said at once, not at the timeout
        assert kind == "broadcast" and waited < 10, (kind, waited)
    finally:
        stop(procs)
        pub.close()
        state.close()


def test_gloo_broadcast_sends_each_receiver_whole_versions_in_buckets():
    m = model(0)
    state = ModelState(m)
    pub = WeightPublisher(
        state, transport="broadcast", name="bc", broadcast_receivers=2, bucket_bytes=4096, ack_timeout_s=60
    )
    procs = []
    try:
        started = start_many(
            receiver_main, [(pub.handle().to_json(), "b0", None), (pub.handle().to_json(), "b1", None)]
        )
        procs += [p for p, _ in started]
        first = pub.publish(1)
        for _, c in started:  # a collective: every receiver reads at once
            c.send(("load", 1))
        for _, c in started:
            version, got, receipt = ask(c, None)
            assert version == 1 and same(got, values(m)) and receipt.transport == "broadcast"
        assert first.wait(10).visible
        step(m, 3)
        want = values(m)
        state.offload()  # from offloaded params this time
        pub.publish(2)
        for _, c in started:
            c.send(("load", 2))
        for _, c in started:
            version, got, _ = ask(c, None)
            assert version == 2 and same(got, want)
        os.kill(started[1][0].pid, signal.SIGKILL)  # a receiver dies: the group breaks, the publisher says so
        started[1][0].join(10)
        with raises_kind(SyncError, "receiver_lost"):
            pub.publish(3).wait(60)
        assert [(e.receiver, e.version, e.cause) for e in pub.lost] == [("broadcast group", 3, "died")]
        with raises_kind(SyncError, "failed"):
            pub.publish(4)
    finally:
        pub.close()
        stop(procs)
        state.close()


def _fsdp2_rank(rank: int, world: int) -> tuple[bool, int]:
    """Each rank publishes its FSDP2 shards and loads them into a second model sharded the same way; returns
    (every value equal, its pid: the files it made are named by it)."""
    from backends.test_fsdp2 import Net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = Net()
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    src, dst = build(0), build(1)
    state = ModelState(src, pool=HostPool(shared=True))
    pub = WeightPublisher(state, name=f"fsdp2-{rank}")
    rx = WeightReceiver(pub.handle(), name="self")
    try:
        pub.publish(1).wait(30)
        assert rx.load_into(dst) == 1
        pairs = zip([*src.parameters(), *src.buffers()], [*dst.parameters(), *dst.buffers()], strict=True)
        equal = all(torch.equal(getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)) for a, b in pairs)
        return equal, os.getpid()
    finally:
        rx.close()
        pub.close()
        state.close()
        core_of(state).pool.trim()  # ranks leave through os._exit: no finalizer would remove the pool's files


def test_fsdp2_shards_load_into_a_model_sharded_the_same_way():
    from dist_harness import run_distributed

    results = run_distributed(_fsdp2_rank, world_size=2, timeout=120)
    assert [equal for equal, _ in results] == [True, True]
    # only the ranks' own files (named by their pids): tests on another worker make theirs meanwhile
    assert [f for _, pid in results for f in shm_files(pid)] == []
