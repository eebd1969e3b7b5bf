"""RL building blocks another framework imports: the pi_old cycle, weight sync, the losses.

    from stateshift.rl import PiOldCycle            # pi_old while the model's params are offloaded
    from stateshift.rl.sync import WeightPublisher  # weights to rollout processes
    from stateshift.rl import algo                  # GRPO advantages, the clipped PPO loss

The ``stateshift train`` application built on them is ``stateshift.train``. Design: ``docs/guide/rl.md``.
"""

from ..backends.base import Rebuild
from .pi_old import CycleStats, PiOldCycle, default_groups, find_rebuild

__all__ = [
    "CycleStats",
    "PiOldCycle",
    "Rebuild",
    "default_groups",
    "find_rebuild",
]
