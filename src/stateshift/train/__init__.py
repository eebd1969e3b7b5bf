"""``stateshift train``: the fully-asynchronous RL trainer application, built on ``stateshift.rl``.

    from stateshift.train import resolve, run
    result = run(resolve(None, ["trainer.steps=200"]))   # built-in task, async GRPO, pi_old while offloaded

Config, loop, rollout side, queue, executors, policies, tasks, checkpoints of a run. Nothing in the
library (``core``, ``backends``, ``checkpoint``, ``rl``, ``integrations``) imports this package.
Design: ``docs/rl.md``.
"""

from .config import TrainConfig, resolve
from .launch import run
from .loop import RunResult
from .queue import SampleQueue
from .rollout import Group, KVRollouter, Rollouter, Wave
from .trainer import Trainer

__all__ = [
    "Group",
    "KVRollouter",
    "Rollouter",
    "RunResult",
    "SampleQueue",
    "Trainer",
    "TrainConfig",
    "Wave",
    "resolve",
    "run",
]
