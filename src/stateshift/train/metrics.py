"""What a run reports: a progress display, JSONL per step, TensorBoard (if installed), curves at the end.

``metrics.jsonl`` has one JSON object per trainer step (keys in
``docs/guide/rl.md``); ``summary.json`` the run's totals (ledger, time split, bytes,
held-out accuracy before and after); ``curves.png`` reward and accuracy,
held-out accuracy, the per-token staleness histogram and the time split.
The display is a one-line bar rewritten in place on a terminal, plain lines
(every ~5% of the run) when stderr is not one.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigError

#: the phases of the time split, in plot order
PHASES = ("generate", "old_logprob", "update", "sync", "offload", "wait")


class Progress:
    """A progress bar on a terminal, plain lines otherwise, or nothing ("none")."""

    def __init__(self, total: int, mode: str, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = max(total, 1)
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.mode = ("bar" if tty else "lines") if mode == "auto" else mode
        self.every = max(1, self.total // 20)
        self.t0 = time.monotonic()

    def update(self, step: int, rec: dict[str, Any]) -> None:
        if self.mode == "none":
            return
        held = rec.get("heldout_accuracy")
        text = (
            f"step {step}/{self.total} reward {rec['reward']:.3f} acc {rec['accuracy']:.3f}"
            + (f" heldout {held:.3f}" if held is not None else "")
            + f" v{rec['version']} queue {rec['queue_depth']} {time.monotonic() - self.t0:.0f}s"
        )
        if self.mode == "bar":
            done = int(30 * step / self.total)
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {text}", end="", file=self.stream, flush=True)
        elif step % self.every == 0 or step == self.total or held is not None:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.mode == "bar":
            print(file=self.stream, flush=True)


def _record(path: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        rec = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # (not UTF-8, not JSON, an integer of more digits than Python reads)
        raise ConfigError("metrics_log", "not JSON", path=path, line=number) from None
    if not isinstance(rec, dict) or type(rec.get("step")) is not int:
        raise ConfigError("metrics_log", "not a step record (an object with an integer 'step')", path=path, line=number)
    tokens = rec.get("staleness_tokens", {})
    try:
        ok = isinstance(tokens, dict) and all(type(v) is int and int(k) >= 0 for k, v in tokens.items())
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError("metrics_log", "'staleness_tokens' is not versions -> token counts", path=path, line=number)
    return rec


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a last line cut short (its writer was killed inside the write) is
    dropped -- its step comes after any checkpoint, so it is trained again. A bad line elsewhere (not UTF-8, not
    JSON, not a step record) is ``ConfigError("metrics_log")`` naming it."""
    lines = [(i + 1, line) for i, line in enumerate(path.read_bytes().splitlines()) if line.strip()]
    out = [_record(path, i, line) for i, line in lines[:-1]]
    try:
        out += [_record(path, i, line) for i, line in lines[-1:]]
    except ConfigError:  # (of kind "metrics_log": all that _record raises)
        pass
    return out


def _keep_until(path: Path, step: int) -> list[dict[str, Any]]:
    """The records of ``path`` up to ``step``; if it holds more (records after a checkpoint, a last line cut short),
    it is rewritten with only those, atomically (temporary file, fsync, rename): a kill at any moment leaves
    either the old file or the new one, never fewer records up to ``step``."""
    from stateshift.checkpoint.commit import write_durable

    text = path.read_bytes()
    records = read_records(path)
    kept = [r for r in records if r["step"] <= step]
    cut_short = bool(text) and not text.endswith(b"\n")
    if len(kept) < len(records) or cut_short or len(records) < len(text.splitlines()):
        write_durable(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    missing = sorted(set(range(1, step)) - {r["step"] for r in kept})  # (step's own: a kill before its record)
    if missing:
        warnings.warn(
            f"{path}: no record of steps {_spans(missing)} (the log was cut or edited): the training state is whole, "
            "those steps' metrics stay missing",
            stacklevel=3,
        )
    return kept


def _spans(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` (sorted) as ``"3-5, 9"``, the first eight runs."""
    runs: list[list[int]] = []
    for k in steps:
        if runs and runs[-1][1] == k - 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return ", ".join(text[:8]) + (", ..." if len(text) > 8 else "")


class MetricsLog:
    """Appends step records to ``metrics.jsonl`` (and TensorBoard); keeps what the plot needs."""

    def __init__(self, out_dir: Path, *, tensorboard: bool, resume_step: int | None = None) -> None:
        """A new log, or (``resume_step``) the existing one without the records after that step, appended to.

        The records after a checkpoint's step come from the interrupted run and are trained again after resuming;
        they are dropped by an atomic rewrite (``_keep_until``), so those up to the step are never lost, whenever
        the process is killed. Each record is flushed as it is logged.
        """
        self.path = out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        if resume_step is not None and self.path.exists():
            self.records = _keep_until(self.path, resume_step)
            self._file = self.path.open("a")
        else:
            self._file = self.path.open("w")
        self.staleness: Counter[int] = Counter()
        for r in self.records:
            self.staleness.update({int(k): v for k, v in r.get("staleness_tokens", {}).items()})
        self.tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional: JSONL has everything
                self.tb = None

    def log(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        self.staleness.update({int(k): v for k, v in rec.get("staleness_tokens", {}).items()})
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        self._file.close()
        if self.tb is not None:
            self.tb.close()


def plot_curves(
    records: list[dict[str, Any]],
    staleness: Counter[int],
    time_split: dict[str, float],
    path: Path,
    title: str = "",
    heldout_ends: tuple[tuple[int, float], tuple[int, float]] | None = None,
) -> str | None:
    """Write the curves PNG; returns why not (matplotlib missing) or ``None``.

    ``heldout_ends``: (step, accuracy) after the warm-up and after RL, drawn with the periodic evaluations.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install -e '.[rl]' for curves.png"
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    steps = [r["step"] for r in records]
    ax[0, 0].plot(steps, [r["reward"] for r in records], label="reward", lw=0.8)
    ax[0, 0].plot(steps, [r["accuracy"] for r in records], label="train accuracy (exact)", lw=0.8)
    ax[0, 0].set(xlabel="trainer step", title="rollout reward and accuracy")
    ax[0, 0].legend()
    held = [(r["step"], r["heldout_accuracy"]) for r in records if r.get("heldout_accuracy") is not None]
    if heldout_ends is not None:
        held = [heldout_ends[0], *held, heldout_ends[1]]
    if held:
        ax[0, 1].plot(*zip(*held, strict=True), marker="o")
    ax[0, 1].set(xlabel="trainer step", ylabel="exact match", title="held-out accuracy (greedy)", ylim=(0, 1))
    keys = sorted(staleness)
    ax[1, 0].bar([str(k) for k in keys], [staleness[k] for k in keys])
    ax[1, 0].set(xlabel="versions behind the trainer", ylabel="tokens trained", title="per-token staleness")
    phases = [p for p in PHASES if p in time_split]
    ax[1, 1].barh(phases, [time_split[p] for p in phases])
    ax[1, 1].set(xlabel="seconds (trainer thread; generate: rollout thread)", title="time split")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
