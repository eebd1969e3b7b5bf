"""RL helpers built on ``ModelState``: the pi_old cycle of fully-asynchronous PPO."""

from ..backends.base import Rebuild
from .pi_old import CycleStats, PiOldCycle, default_groups, find_rebuild

__all__ = ["CycleStats", "PiOldCycle", "Rebuild", "default_groups", "find_rebuild"]
