"""Where the rollout side runs: ``inprocess`` (a thread of the trainer's process, the default)."""

from .inprocess import RolloutCapture, RolloutWorker, ThreadExecutor

__all__ = ["RolloutCapture", "RolloutWorker", "ThreadExecutor"]
