"""The trainer parks (offloads) its state only when it is about to wait for samples, not after every update:
two updates back to back keep the params on the device, and the queue being ahead means no offload at all."""

from __future__ import annotations

import random

from rlkit import parked_trainer, tiny

from stateshift.train.control import RunControl
from stateshift.train.executors.base import take_in_slices
from stateshift.train.rollout import Wave
from stateshift.train.trainer import Batch


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_updates_back_to_back_move_no_params(tmp_path):
    cfg = tiny(
        tmp_path,
        "trainer.param_offload=true",
        "trainer.old_logprob=pi_old",
        "async_training.trigger_parameter_sync_step=4",
    )
    task, policy, trainer, rollouter = parked_trainer(cfg)
    items = [task.sample(random.Random(i)) for i in range(cfg.trainer.batch_prompts)]
    for _ in range(3):
        wave = Wave.start(
            list(range(len(items))), items, [task.prompt(i) for i in items], cfg.rollout.n, rollouter.sampling
        )
        assert rollouter.generate(wave)
        trainer.update(Batch.of(wave.groups(task.score), task.pad_token), lambda name: _Null())
        assert trainer.state.residency()["params"]["host"] == 0  # still resident: the next update needs them
    m = trainer.meter.nbytes
    assert m.get("onload.params", 0) == trainer.state.nbytes("params")  # once, before the first update
    assert m.get("offload.params", 0) == trainer.state.nbytes("params")  # once, by the park() above
    assert trainer.cycle.stats.swaps == 2  # pi_old swapped over the resident params for updates 2 and 3
    trainer.park()
    assert trainer.state.residency()["params"]["device"] == 0


def test_take_parks_only_when_it_would_wait():
    calls: list[str] = []
    queue = ["g1", "g2", "g3"]

    def fetch(need: int, wait_s: float) -> list:
        calls.append(f"fetch {need} {wait_s:g}")
        if len(queue) < need:
            queue.extend(["g4", "g5"])  # arrives during a bounded wait
            return []
        out = queue[:need]
        del queue[:need]
        return out

    parks: list[int] = []
    assert take_in_slices(RunControl(), 2, fetch, on_wait=lambda: parks.append(1)) == ["g1", "g2"]
    assert parks == [] and calls == ["fetch 2 0"]  # queued already: no park, no wait
    calls.clear()
    assert take_in_slices(RunControl(), 2, fetch, on_wait=lambda: parks.append(1)) == ["g3", "g4"]
    assert parks == [1] and calls[0] == "fetch 2 0" and calls[1].startswith("fetch 2 0.05")
