"""``run(cfg)``: the entry point of ``stateshift train`` -- lock the run directory, pick the executor, run.

``executor=inprocess`` / ``process`` (and ``rollout.batching=continuous``) run the loop here
(``loop.train_here``) with their rollout side; ``executor=ray`` runs it in a trainer actor
(``executors/ray.py`` starts it; ``executors/ray_trainer.py``, its body, imports ``loop`` itself).
This module sits above the loop and every executor, so none of them imports its caller.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from ..errors import RunError
from .config import TrainConfig
from .executors.inprocess import InProcessRollouts
from .loop import RolloutsFactory, RunResult, train_here


def run(
    cfg: TrainConfig, *, resume: Path | None = None, stream: TextIO | None = None, return_params: bool = False
) -> RunResult:
    """Train ``cfg`` (or continue the run in ``resume``); ``loop``'s module docstring gives the shape.

    The run directory is locked for the duration (``RunError("run_dir_busy")`` if another run holds it).
    ``executor=ray``: ``ConfigError`` (key ``executor``) at once if Ray is not installed; the trainer's
    lines then come through Ray's log forwarding (prefixed with the actor), not ``stream``.
    """
    out = Path(resume) if resume is not None else Path(cfg.run.out_dir)
    if cfg.executor == "ray":
        from .executors.ray_common import require_ray

        require_ray()
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock_run_dir(out)
    try:
        if cfg.executor == "ray":
            from .executors.ray import run_on_ray

            return run_on_ray(cfg, out, resume is not None, return_params)
        return train_here(cfg, out, resume is not None, stream or sys.stderr, return_params, _rollouts_of(cfg))
    finally:
        lock.close()


def _rollouts_of(cfg: TrainConfig) -> RolloutsFactory:
    """The rollout side ``cfg.executor`` names (``ray`` is run by ``run_on_ray`` instead)."""
    if cfg.executor == "process":  # (its rollouter process reads rollout.batching itself)
        from .executors.process import ProcessRollouts

        return ProcessRollouts
    if cfg.rollout.batching == "continuous":
        from .continuous import ContinuousInProcessRollouts

        return ContinuousInProcessRollouts
    return InProcessRollouts


def _lock_run_dir(out: Path) -> Any:
    """An exclusive lock on ``out/run.lock`` (released by the OS when the process ends, even on a crash)."""
    import fcntl

    handle = (out / "run.lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise RunError("run_dir_busy", path=out) from None
    return handle
