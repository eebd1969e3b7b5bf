"""The trainer actor's body: ``loop.train_here`` (the same loop as in process) with ``RayRollouts`` as its rollout side.

A plain class, made an actor with ``ray.remote(cls)`` by the driver (``ray.py``). Only the driver calls its methods.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from ..control import RunControl
from ..loop import train_here
from .base import RolloutCapture
from .ray_actors import enter
from .ray_common import INTERRUPTED
from .ray_rollouts import RayRollouts


class TrainerActor:
    """The trainer: runs ``loop.train_here`` with the rollouter and the queue as actors of the same placement group."""

    def __init__(self, cwd: str) -> None:
        enter(cwd)
        self.control: RunControl | None = None
        self.interrupted = False

    def pid(self) -> int:
        return os.getpid()

    def run(
        self, cfg: TrainConfig, out: str, resume: bool, return_params: bool, pg: Any, specs: list[dict[str, float]]
    ) -> Any:
        """The run (a ``RunResult``), or ``INTERRUPTED`` after ``interrupt()``; errors propagate to the driver."""

        def rollouts(
            cfg: TrainConfig, task: Any, lm: Any, control: RunControl, *, version: int, capture: RolloutCapture | None
        ) -> RayRollouts:
            self.control = control
            if self.interrupted:
                raise KeyboardInterrupt
            return RayRollouts(
                cfg, task, lm, control, version=version, capture=capture, pg=pg, specs=specs, stream=sys.stderr
            )

        try:
            return train_here(cfg, Path(out), resume, sys.stderr, return_params, rollouts)
        except KeyboardInterrupt:
            return INTERRUPTED

    def interrupt(self) -> None:
        """Ctrl-C at the driver: the loop stops at its next wait, as ``KeyboardInterrupt`` does in process."""
        self.interrupted = True
        if self.control is not None:
            self.control.fail("driver", KeyboardInterrupt())
