"""Checkpoints of an RL run: the trainer's state through ``stateshift.checkpoint``, the rest in a sidecar.

A checkpoint is taken right after a weight sync (``run.checkpoint_every`` is
a multiple of ``trigger_parameter_sync_step``), when the rollout thread has
just handed over a consistent ``RolloutCapture``: the groups queued, the wave
in flight with its kept tokens, the ledger, the staleness counter and both
random states. ``step-<k>/`` holds

- ``state/``: params and optimizer state (``checkpoint.save``: from any
  residency, atomic, checksummed);
- ``rl_state.pt``: the sidecar -- step, version, the capture, held-out
  accuracy at the start of RL -- written to a temporary name, then renamed.

``latest`` (a text file) names the newest complete one; it is written last,
so a crash mid-save leaves the previous checkpoint as the one resumed.
Resuming loads ``state/`` into a fresh trainer (whose optimizer state is
created first with ``init_optimizer_state``), gives the rollouter a copy of
those weights (the version the capture was taken at) and continues the wave
from the capture; with fixed seeds and a deterministic schedule (e.g.
``staleness_threshold=0``) the resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stateshift.checkpoint import init_optimizer_state, load, save
from stateshift.checkpoint.commit import replacing, write_durable

from .executors.base import RolloutCapture
from .trainer import Trainer


@dataclass
class Resumed:
    step: int
    version: int
    capture: RolloutCapture
    extra: dict[str, Any]


def _groups(trainer: Trainer) -> tuple[str, ...]:
    return tuple(g for g in ("params", "optim") if g in trainer.state.groups and trainer.state.nbytes(g))


def save_checkpoint(root: Path, step: int, trainer: Trainer, capture: RolloutCapture, extra: dict[str, Any],
                    keep: int) -> Path:
    """Write ``root/step-<step>`` and point ``root/latest`` at it; keep the newest ``keep``.

    Safe to kill at any moment: ``latest`` moves last (atomically), so it names the previous complete
    checkpoint until this one is whole. A ``step-<n>`` with ``n >= step`` can only be what a killed
    run left after the checkpoint it was resumed from (``latest`` names an older step, and the run
    directory is locked to this run), so it is removed before the save instead of failing on it.
    """
    path = root / f"step-{step}"
    for stale in _steps(root):
        if int(stale.name[5:]) >= step:
            shutil.rmtree(stale)
    save(trainer.state, path / "state", _groups(trainer), tag="rl", version=trainer.version)
    sidecar = {"step": step, "version": trainer.version, "capture": capture, "extra": extra}
    with replacing(path / "rl_state.pt") as tmp:
        torch.save(sidecar, tmp)
    write_durable(root / "latest", path.name.encode())
    done = [p for p in _steps(root) if (p / "rl_state.pt").exists()]
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _steps(root: Path) -> list[Path]:
    """``root/step-<n>`` directories by ``n``."""
    found = (p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(root: Path) -> Path:
    marker = root / "latest"
    if not marker.is_file():
        raise FileNotFoundError(f"no checkpoint under {root} (no 'latest' file): was run.checkpoint_every set?")
    return root / marker.read_text().strip()


def load_checkpoint(path: Path, trainer: Trainer) -> Resumed:
    """Load ``path`` into ``trainer`` (params resident, as built) and return the sidecar."""
    sidecar = torch.load(path / "rl_state.pt", weights_only=False)  # our own file: dataclasses and tensors
    init_optimizer_state(trainer.optimizer)
    load(trainer.state, path / "state")
    trainer.version = int(sidecar["version"])
    return Resumed(step=int(sidecar["step"]), version=trainer.version, capture=sidecar["capture"],
                   extra=dict(sidecar["extra"]))
