"""Where the rollout side runs: ``inprocess`` (a thread of the trainer's process, the default) or ``ray``.

``ray.py`` imports Ray; it is imported only for ``executor=ray``, so nothing here needs Ray installed.
"""

from .base import RolloutCapture, Rollouts, RolloutStats
from .inprocess import InProcessRollouts, RolloutWorker

__all__ = ["InProcessRollouts", "RolloutCapture", "RolloutStats", "RolloutWorker", "Rollouts"]
