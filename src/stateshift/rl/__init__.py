"""RL on top of ``ModelState``: the fully-asynchronous trainer (``stateshift train``) and the pi_old cycle.

    from stateshift.rl import resolve, run
    result = run(resolve(None, ["trainer.steps=200"]))   # built-in task, async GRPO, pi_old while offloaded

Design: ``docs/guide/rl.md``.
"""

from .config import ConfigError, TrainConfig, resolve
from .control import StallError
from .loop import RunResult, run
from ..backends.base import Rebuild
from .pi_old import CycleStats, PiOldCycle, default_groups, find_rebuild
from .queue import SampleQueue
from .rollout import Group, KVRollouter, Rollouter, Wave, WeightSyncError
from .trainer import Trainer

__all__ = [
    "ConfigError",
    "CycleStats",
    "Group",
    "KVRollouter",
    "PiOldCycle",
    "Rebuild",
    "Rollouter",
    "RunResult",
    "SampleQueue",
    "StallError",
    "Trainer",
    "TrainConfig",
    "Wave",
    "WeightSyncError",
    "default_groups",
    "find_rebuild",
    "resolve",
    "run",
]
