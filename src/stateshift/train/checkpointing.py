"""Checkpoints of an RL run: the trainer's state through ``stateshift.checkpoint``, the rest in a sidecar.

A checkpoint is taken right after a weight sync (``run.checkpoint_every`` is
a multiple of ``trigger_parameter_sync_step``), when the rollout thread has
just handed over a consistent ``RolloutCapture``: the groups queued, the wave
in flight with its kept tokens, the ledger, the staleness counter and both
random states. ``step-<k>/`` holds

- ``state/``: params and optimizer state (``checkpoint.save``: from any
  residency, atomic, checksummed);
- ``rl_state.bin``: the sidecar -- step, version, the capture, held-out
  accuracy at the start of RL -- in a typed, versioned, SHA-256-checked format
  that is never unpickled (``sidecar.py``), written to a temporary name, then
  renamed. It is written after ``state/``, so a step directory with one is whole.

``latest`` (a text file) names the newest complete one; it is written last,
so a crash mid-save leaves the previous checkpoint as the one resumed. It is
read as a plain ``step-<n>`` name of a real directory inside the run (no
``/``, no ``..``, no symbolic link).

Resuming (``resume_checkpoint``) loads the checkpoint ``latest`` names into a
fresh trainer (whose optimizer state is created first with
``init_optimizer_state``), the sidecar verified before anything is parsed or
changed; if it is damaged or incomplete, the next older one kept
(``run.keep_checkpoints``), with a one-line warning naming each skipped. The
rollouter then gets a copy of those weights (the version the capture was
taken at) and continues the wave from the capture; with fixed seeds and a
deterministic schedule (e.g. ``staleness_threshold=0``) the resumed run
equals an uninterrupted one.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stateshift.checkpoint import init_optimizer_state, load, save
from stateshift.checkpoint.commit import describe_os_error, read_latest, write_durable
from stateshift.errors import CheckpointError, LayoutError

from ..errors import show
from .executors.base import RolloutCapture
from .sidecar import SIDECAR, encode, read_sidecar
from .trainer import Trainer

__all__ = ["SIDECAR", "Resumed", "latest_checkpoint", "load_checkpoint", "resume_checkpoint", "save_checkpoint"]

_STEP_NAME = re.compile(r"step-[0-9]{1,18}")


@dataclass
class Resumed:
    """A checkpoint loaded into a trainer: where, its step and version, the rollout side's capture, extras."""

    step: int
    version: int
    capture: RolloutCapture | None
    extra: dict[str, Any]
    path: Path | None = None


def _groups(trainer: Trainer) -> tuple[str, ...]:
    return tuple(g for g in ("params", "optim") if g in trainer.state.groups and trainer.state.nbytes(g))


def save_checkpoint(
    root: Path, step: int, trainer: Trainer, capture: RolloutCapture, extra: dict[str, Any], keep: int
) -> Path:
    """Write ``root/step-<step>`` and point ``root/latest`` at it; keep the newest ``keep``.

    Safe to kill at any moment: ``latest`` moves last (atomically), so it names the previous complete
    checkpoint until this one is whole. A ``step-<n>`` with ``n >= step`` can only be what a killed
    run left after the checkpoint it was resumed from (``latest`` names an older step, and the run
    directory is locked to this run), so it is removed before the save instead of failing on it.
    """
    path = root / f"step-{step}"
    sidecar = encode(step, trainer.version, capture, extra)  # what it cannot hold fails before anything is written
    for stale in _steps(root):
        if int(stale.name[5:]) >= step:
            shutil.rmtree(stale)
    trainer.prefetcher.settle()  # (none is in flight between steps) the save reads every group
    save(trainer.state, path / "state", _groups(trainer), tag="rl", version=trainer.version)
    write_durable(path / SIDECAR, sidecar)
    write_durable(root / "latest", path.name.encode())
    done = [p for p in _steps(root) if (p / SIDECAR).exists()]
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _steps(root: Path) -> list[Path]:
    """``root/step-<n>`` directories by ``n``."""
    found = (p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(root: Path) -> Path:
    """The checkpoint ``root/latest`` names: a plain ``step-<n>`` name inside ``root``, not a symbolic link.

    Raises:
        CheckpointError("not_found"): no ``latest`` (no checkpoint was saved). CheckpointError("corrupt"): ``latest`` holds
            anything but such a name. CheckpointError("read"): an OS error reading it.
    """
    root = Path(os.path.abspath(root))
    try:
        named = read_latest(root)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError("read", describe_os_error(e), path=root / "latest", errno=e.errno) from e
    if named is None:
        raise CheckpointError(
            "not_found", "no 'latest' file: no checkpoint was saved (was run.checkpoint_every set?)", path=root
        )
    if not _STEP_NAME.fullmatch(named.name):
        raise CheckpointError(
            "corrupt",
            f"names {show(named.name)}, not a step-<n> checkpoint of this "
            "run; write the name of one (e.g. step-4) into it",
            path=root / "latest",
        )
    return named


def load_checkpoint(path: Path, trainer: Trainer) -> Resumed:
    """Load the checkpoint ``path`` into ``trainer`` (params resident, as built) and return its sidecar.

    The sidecar is read and verified first (``sidecar.read_sidecar``: SHA-256 before any parsing, never
    unpickled), then ``state/`` is loaded (every tensor's crc32 verified before the model changes).

    Raises:
        CheckpointError: a missing, damaged or incomplete checkpoint (the message names the file); the trainer's
            values are then unchanged (its optimizer state may have been created).
    """
    path = Path(os.path.abspath(path))
    if path.is_symlink() or (path / "state").is_symlink():
        raise CheckpointError(
            "corrupt", "is (or holds) a symbolic link; a checkpoint holds only its own files", path=path
        )
    if not path.is_dir():
        raise CheckpointError("not_found", "no such checkpoint directory", path=path)
    side = read_sidecar(path)
    init_optimizer_state(trainer.optimizer)
    load(trainer.state, path / "state")
    trainer.version = side.version
    return Resumed(step=side.step, version=side.version, capture=side.capture, extra=side.extra, path=path)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:600]


def resume_checkpoint(root: Path, trainer: Trainer, warn: Callable[[str], None]) -> Resumed:
    """Load the newest intact checkpoint under ``root`` into ``trainer``: the one ``latest`` names, else (damaged,
    incomplete, missing) the newest older one kept, calling ``warn`` with one line for each skipped.

    Checkpoints newer than ``latest`` are never used: a run killed before ``latest`` moved may have left one.

    Raises:
        CheckpointError("not_found"): no ``latest``, or no checkpoint is intact (one line naming each and why).
        CheckpointError("corrupt"): ``latest`` is not a plain step name.
    """
    latest = latest_checkpoint(root)
    newest = int(latest.name[5:])
    candidates = [latest, *(p for p in reversed(_steps(Path(root))) if int(p.name[5:]) < newest)]
    skipped: list[str] = []
    for path in candidates:
        try:
            resumed = load_checkpoint(path, trainer)
        except (CheckpointError, LayoutError) as e:  # (a LayoutError: it does not fit the model)
            skipped.append(f"{path.name} ({_one_line(e)})")
            continue
        for what in skipped:
            warn(f"warning: skipped checkpoint {what}; resuming from {path.name}")
        return resumed
    raise CheckpointError(
        "not_found",
        f"none of its checkpoints is intact: {'; '.join(skipped)}. Start a new run "
        "(without --resume), or put back an intact step-<n> from a copy",
        path=root,
    )
