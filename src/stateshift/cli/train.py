"""``stateshift train``: the fully-asynchronous RL trainer from the command line."""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..train.config import field_docs, resolve


def _epilog() -> str:
    lines = ["config keys (set with key=value, or in a YAML file of the same sections):", ""]
    for key, default, doc in field_docs():
        lines.append(f"  {key} = {default!r}")
        lines += textwrap.wrap(doc, 96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="fully-async RL (GRPO, pi_old while offloaded) on a built-in task (3-digit addition, long-tail sums), CPU or GPU",
        description=textwrap.fill(
            "Supervised warm-up on easy (no-carry) problems, then fully-asynchronous GRPO: a rollouter samples "
            "with the weights it was last sent while the trainer updates; every trigger_parameter_sync_step steps "
            "the weights go to the rollouter from a host snapshot and a new pi_old cycle starts. Prints held-out "
            "accuracy before and after RL; writes config.yaml, metrics.jsonl, summary.json and curves.png to "
            "run.out_dir. With no arguments: the built-in default (pi_old mode, param offload on). task.name=longtail: "
            "responses of 14 to 448 tokens set by the prompt, best with rollout.batching=continuous and "
            "rollout.max_new_tokens=448; async_training.mode=sync: the same algorithm without overlap (the baseline). "
            "executor=inprocess (the default on the CPU): the rollouter is a thread of this process. "
            "executor=process (the default with run.device=cuda): the rollouter is a process of its own, on "
            "rollout.device or the trainer's device, sent weights by the weight-sync library (rollout.weight_transport: "
            "auto takes cuda_ipc on the trainer's GPU, else shared host memory); one that dies is "
            "reported and restarted (rollout.max_restarts). executor=ray (pip install "
            "'stateshift[ray]'): trainer, rollouter and queue are Ray actors in one placement group (CPU bundles, "
            "GPU bundles where the cluster has GPUs; the ray.* keys); the weights go to the rollouter by object "
            "reference with their version; a rollouter actor that dies is reported and restarted from the last "
            "weights sent (ray.max_rollout_restarts), no sample lost or trained twice; if the trainer actor dies, "
            "continue with --resume DIR from the latest checkpoint (run.checkpoint_every).",
            96,
        ),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.lr=1e-3 rollout.n=8"
    )
    p.add_argument("--config", type=Path, default=None, help="a YAML file of config sections (overrides apply on top)")
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="continue the run in DIR (its config.yaml and latest checkpoint, or the newest intact one kept, "
        "with a warning naming each skipped; overrides apply on top). DIR runs no code of its own: a reward.fn "
        "it names to import must be named again on the command line",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """Run ``stateshift train``; 0 on success, 2 for a fault the user can fix (a bad config, a damaged or missing
    checkpoint, a run directory that cannot be used: one line naming the file and what to do), 130 on Ctrl-C (143 on
    SIGTERM: either stops the run at its next step, summary written; a second forces it), 1 when
    the run failed (a ``RunError("trainer_died")`` as one line naming the checkpoint to resume from, other errors with their
    traceback)."""
    import yaml

    from ..train import config as config_mod

    config_path = args.config
    if args.resume is not None and args.config is not None:
        print(
            "error: --resume uses the run's own config.yaml; give changes as key=value, not --config", file=sys.stderr
        )
        return 2
    if args.resume is not None:
        config_path = args.resume / "config.yaml"
        if not config_path.is_file():
            print(
                f"error: --resume {args.resume}: no config.yaml there (is it the run.out_dir of a run?)",
                file=sys.stderr,
            )
            return 2
    try:
        cfg = resolve(config_path, args.overrides)
    except (ConfigError, OSError, yaml.YAMLError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.resume is not None and ":" in cfg.reward.fn and not _names(args.overrides, "reward.fn"):
        print(  # a run directory from anywhere runs no code: only the command line may name code to import
            f"error: --resume {args.resume}: its config.yaml names code to import (reward.fn={cfg.reward.fn}); "
            f"resume with reward.fn={cfg.reward.fn} on the command line to run it",
            file=sys.stderr,
        )
        return 2
    if args.print_config:
        print(yaml.safe_dump(config_mod.as_dict(cfg), sort_keys=False), end="")
        return 0
    return _run(cfg, args.resume)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


#: OS errors about the run directory itself, with what to do
_DIR_FAULTS = {
    PermissionError: "check its permissions, or choose another run.out_dir",
    FileExistsError: "run.out_dir (or --resume DIR) must be a directory",
    NotADirectoryError: "run.out_dir (or --resume DIR) must be a directory",
    IsADirectoryError: "a file of the run directory is a directory: remove it or choose another run.out_dir",
    FileNotFoundError: "check the path (run.out_dir, or --resume DIR)",
}


def _names(overrides: list[str], key: str) -> bool:
    """Whether one of the ``key=value`` ``overrides`` sets ``key``."""
    return any(text.partition("=")[0].strip() == key for text in overrides)


def _run(cfg: Any, resume: Path | None) -> int:
    from ..errors import CheckpointError, LayoutError, RunError
    from ..train.control import StopSignals
    from ..train.launch import run

    summary = Path(resume if resume is not None else cfg.run.out_dir) / "summary.json"
    before = _stat(summary)
    signals = StopSignals()
    try:
        with signals:  # Ctrl-C / SIGTERM: the run stops at its next step or wait, summary written (control.py)
            run(cfg, resume=resume)
    except KeyboardInterrupt:
        wrote = _stat(summary) not in (None, before)
        signum = signals.signum or signal.SIGINT
        by = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
        print(
            f"\ninterrupted{by}: the rollout side was stopped; "
            + (
                f"{summary} says where the run was"
                if wrote
                else "it stopped before the run started (no summary.json written)"
            ),
            file=sys.stderr,
        )
        return 128 + signum
    except (CheckpointError, LayoutError, ConfigError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except RunError as exc:
        if exc.kind == "run_dir_busy":
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            return 2
        if exc.kind != "trainer_died":
            raise
        print(f"error: {exc}", file=sys.stderr)  # no summary.json from a dead trainer: the message says how to go on
        return 1
    except tuple(_DIR_FAULTS) as exc:
        advice = next(text for cls, text in _DIR_FAULTS.items() if isinstance(exc, cls))
        print(f"error: {exc.filename or ''}: {exc.strerror or _one_line(exc)}; {advice}", file=sys.stderr)
        return 2
    return 0


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
