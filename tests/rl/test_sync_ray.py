"""Weight sync between Ray actors: the publisher's ``SyncHandle`` travels by object reference from the
actor that publishes to the actor that receives (shared_host, on a local Ray instance of 2 CPUs)."""

from __future__ import annotations

import os

import pytest
import torch
from rl.sync_kit import model, same, values

from stateshift.core.engine import core_of

ray = pytest.importorskip("ray", reason="the Ray test needs ray (the test extra installs it)")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote(num_cpus=1)
class Trainer:
    def __init__(self) -> None:
        from stateshift import ModelState
        from stateshift.core.pool import HostPool
        from stateshift.rl.sync import WeightPublisher

        torch.set_num_threads(1)
        self.model = model(0)
        self.state = ModelState(self.model, pool=HostPool(shared=True))
        self.pub = WeightPublisher(self.state, name="ray-trainer")

    def handle(self):
        return self.pub.handle()

    def publish(self, version: int) -> dict[str, torch.Tensor]:
        self.pub.publish(version).wait(30)
        return values(self.model)

    def close(self) -> None:
        self.pub.close()
        self.state.close()
        core_of(self.state).pool.trim()


@ray.remote(num_cpus=1)
class Rollouter:
    def __init__(self, handle) -> None:
        from stateshift.rl.sync import WeightReceiver

        torch.set_num_threads(1)
        self.rx = WeightReceiver(handle, name="ray-rollouter", timeout_s=30)
        self.model = model(7)

    def load(self, min_version: int) -> tuple[int, dict[str, torch.Tensor]]:
        return self.rx.load_into(self.model, min_version=min_version), values(self.model)

    def close(self) -> None:
        self.rx.close()


def test_a_handle_sent_by_object_reference_lets_one_actor_receive_what_another_published():
    trainer = Trainer.remote()
    handle_ref = trainer.handle.remote()  # never fetched here: it goes to the other actor as a reference
    rollouter = Rollouter.remote(handle_ref)
    try:
        want = ray.get(trainer.publish.remote(1), timeout=120)
        version, got = ray.get(rollouter.load.remote(1), timeout=120)
        assert version == 1 and same(got, want)
        ray.get(rollouter.close.remote(), timeout=60)
        ray.get(trainer.close.remote(), timeout=60)
    finally:
        ray.kill(rollouter)
        ray.kill(trainer)
