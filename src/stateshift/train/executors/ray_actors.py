"""The bodies of the Ray actors: plain classes, made actors with ``ray.remote(cls)`` where they are started.

- ``TrainerActor`` (``ray_trainer.py``, which imports the loop and this
  module) runs the trainer's loop with ``RayRollouts`` as its rollout side.
- ``RolloutActor`` is one rollouter incarnation: its own model copy, built
  from the config alone (``policies.build_rollout_lm``: no trainer model, no
  optimizer) and loaded with the weights it is given, and the same
  ``RolloutWorker`` loop as the in-process rollout thread, reaching the queue
  actor through ``RemoteQueuePort``. Its ``run`` call lasts as long as it
  generates; weight updates arrive on another of the actor's threads
  (``max_concurrency``) and are handed to the generating thread at a token
  boundary by the same ``WeightChannel`` handshake as in process.
- ``HubActor`` is the queue actor: ``hub.QueueHub`` itself (its methods take its own lock).

Each registers the tensor wire format (``wire.py``) before it sends anything.

Only the owning process calls an actor's methods: the driver the trainer's,
the trainer the rollouter's and the queue's; the rollouter the queue's.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from ..build import build_task
from ..config import TrainConfig
from ..control import RunControl
from ..handshake import WeightUpdate
from ..policies import build_rollout_lm
from ..rollout import Group
from .base import RolloutCapture, SyncOutcome, WorkerReport, rollout_seed
from .hub import QueueHub
from .inprocess import RolloutWorker
from .wire import use_wire_format


def enter(cwd: str) -> None:
    """Relative paths of the config (run.out_dir, model.hf_path) mean what they meant to the driver."""
    if os.path.isdir(cwd):
        os.chdir(cwd)


class RemoteQueuePort:
    """``QueuePort`` over the queue actor (every call waits for its answer)."""

    def __init__(self, hub: Any) -> None:
        self.hub = hub

    def start(self, owner: int, version: int, want: int, wait_s: float) -> list[tuple[int, Any]]:
        return ray.get(self.hub.start.remote(owner, version, want, wait_s))

    def put(self, owner: int, groups: list[Group], report: WorkerReport) -> None:
        ray.get(self.hub.put.remote(owner, groups, report))

    def on_sync(self, owner: int, report: WorkerReport, capture: bool) -> dict[str, Any] | None:
        return ray.get(self.hub.on_sync.remote(owner, report, capture))


class HubActor(QueueHub):
    """The queue actor: ``QueueHub`` (its methods take its own lock), sending tensors in the wire format."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        use_wire_format()
        super().__init__(*args, **kwargs)


class RolloutActor:
    """One rollouter incarnation (``owner``), started with the weights ``version`` it was last sent."""

    def __init__(
        self,
        cfg: TrainConfig,
        weights: dict[str, torch.Tensor],
        version: int,
        owner: int,
        hub: Any,
        capture: RolloutCapture | None,
        cwd: str,
    ) -> None:
        enter(cwd)
        use_wire_format()
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        task = build_task(cfg)
        self.control = RunControl()
        self.worker = RolloutWorker.build(
            cfg,
            task,
            build_rollout_lm(cfg, task),
            RemoteQueuePort(hub),
            self.control,
            version=version,
            owner=owner,
            seed=rollout_seed(cfg, owner),
        )
        self.rollouter = self.worker.rollouter
        self.rollouter.update_weights(weights.items(), version)
        self.rollouter.copy_bytes, self.rollouter.copy_seconds = 0, 0.0  # count syncs only, as in process
        self.control.on_stop.append(self.rollouter.pause)
        if capture is not None:
            self.worker.restore(capture)

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> None:
        """Generate until ``stop()``; raises what ended the loop otherwise (the trainer reports it)."""
        self.worker.run()
        err = self.control.error
        if err is not None:
            raise err

    def update_weights(
        self, weights: dict[str, torch.Tensor], version: int, capture: bool, interrupt: bool
    ) -> SyncOutcome:
        """Hand ``weights`` to the generating thread; returns once it copied them in (bounded waits)."""
        return self.worker.hand_over(
            WeightUpdate(lambda: weights.items(), version, capture=capture), interrupt=interrupt
        )

    def stop(self) -> None:
        self.control.stop()
