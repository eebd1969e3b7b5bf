"""The queue service: a rollouter that dies loses nothing (its prompts are generated again), and a group it
delivers after its death was handled is refused, so nothing is trained twice; the ledger balances throughout."""

from __future__ import annotations

import torch

from stateshift.train.config import AsyncConfig
from stateshift.train.executors.base import WorkerReport
from stateshift.train.executors.hub import QueueHub
from stateshift.train.rollout import Group
from stateshift.train.tasks.addition import AdditionTask


def _hub(**cfg) -> QueueHub:
    return QueueHub(AsyncConfig(**{"staleness_threshold": 1.0, **cfg}), 4, AdditionTask(), seed=7)


def _groups(pairs, version: int = 0) -> list[Group]:
    t = torch.zeros(2, 3, dtype=torch.long)
    return [
        Group(
            uid=uid,
            item=item,
            prompt=(1,),
            tokens=t,
            mask=torch.ones(2, 3, dtype=torch.bool),
            logprobs=torch.zeros(2, 3),
            versions=torch.full((2, 3), version),
            rewards=torch.zeros(2),
            exact=torch.zeros(2, dtype=torch.bool),
            finished=torch.ones(2, dtype=torch.bool),
        )
        for uid, item in pairs
    ]


def _take_all(hub: QueueHub) -> list[int]:
    got = hub.take(hub.queue.depth(), 0)
    hub.trained(len(got))
    return [g.uid for g in got]


def test_a_dead_rollouters_prompts_go_to_its_successor_and_are_counted_once():
    hub = _hub()
    first = hub.start(0, 0, 4)
    second = hub.start(0, 0, 4)
    hub.put(0, _groups(first), WorkerReport())
    assert hub.owner_died(0) == 4  # the second wave was in flight
    assert hub.start(0, 0, 4) == []  # a dead owner gets nothing (a late request of the dead process)
    again = hub.start(1, 0, 3)  # orphans first, at most `want` at a time, same uids and prompts
    assert again == second[:3] and hub.start(1, 0, 3) == second[3:]
    hub.put(1, _groups(second), WorkerReport())
    assert sorted(_take_all(hub)) == list(range(8))
    led = hub.close()
    assert led["admitted"] == led["generated"] == led["trained"] == 8 and led["regenerated"] == 4
    assert not led["discarded"]


def test_a_late_put_of_a_dead_rollouter_is_refused():
    hub = _hub()
    wave = hub.start(0, 0, 4)
    hub.owner_died(0)  # its groups were on their way when the trainer saw it die
    hub.put(0, _groups(wave), WorkerReport())
    assert hub.queue.depth() == 0 and hub.stats().refused == 4
    hub.put(1, _groups(hub.start(1, 0, 4)), WorkerReport())  # the successor's are taken
    assert sorted(_take_all(hub)) == [g for g, _ in wave]
    assert hub.close()["trained"] == 4


def test_a_put_of_prompts_never_handed_out_is_refused():
    hub = _hub()
    hub.start(0, 0, 2)
    hub.put(0, _groups([(5, None)]), WorkerReport())  # uid 5 was never admitted
    hub.put(1, _groups([(0, None)]), WorkerReport())  # uid 0 belongs to owner 0
    assert hub.stats().refused == 2 and hub.queue.running == 2


def test_prompts_continue_the_same_sequence_after_a_death():
    a, b = _hub(), _hub()
    a.start(0, 0, 4)
    a.owner_died(0)
    a.start(1, 0, 4)  # the orphans
    b.start(0, 0, 4)
    assert a.start(1, 1, 4) == b.start(0, 1, 4)  # the next new prompts: same uids, same problems


def test_orphans_survive_a_capture(tmp_path):
    hub = _hub()
    wave = hub.start(0, 0, 4)
    hub.owner_died(0)
    part = hub.on_sync(1, WorkerReport(), capture=True)
    assert part is not None and part["orphans"] == tuple(wave)
    from stateshift.train.executors.base import RolloutCapture
    from stateshift.train.sidecar import read_sidecar, write_sidecar

    write_sidecar(
        tmp_path,
        step=1,
        version=1,
        extra={},
        capture=RolloutCapture(version=1, sample_rng=torch.Generator().get_state(), wave=None, **part),
    )
    other = _hub()
    other.restore(read_sidecar(tmp_path).capture)
    assert other.start(0, 1, 8) == wave  # handed out first after the resume
    other.put(0, _groups(wave), WorkerReport())
    assert sorted(_take_all(other)) == [u for u, _ in wave] and other.close()["trained"] == 4


def test_take_waits_for_a_put_from_another_thread():
    import threading
    import time

    hub = _hub()
    wave = hub.start(0, 0, 4)
    timer = threading.Timer(0.1, lambda: hub.put(0, _groups(wave), WorkerReport()))
    timer.start()
    t0 = time.monotonic()
    got = hub.take(4, 0, wait_s=5.0)
    assert len(got) == 4 and time.monotonic() - t0 < 2.0
    assert hub.take(1, 0, wait_s=0.05) == []  # bounded: returns empty when nothing comes
