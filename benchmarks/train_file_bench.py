"""Three seeds of ``examples/train_on_files.py`` (task.name=file, a tiny HF model, exact match) -> JSON + PNG.

    PYTHONPATH=src .venv/bin/python benchmarks/train_file_bench.py [--seeds 0 1 2] \
        [--out benchmarks/results/2026-12-05-cpu-train-file] [--runs runs/bench-train-file]

Each seed runs the example as a user would, in a fresh process
(``python examples/train_on_files.py <dir> <seed>``), so every seed starts from
the same interpreter state and the result of a seed is the same on every run
on one machine (the example sets ``async_training.staleness_threshold=0``).
The JSON holds, per seed, held-out reward (exact match, greedy; the reward is 0
or 1, so it is the held-out accuracy) after the supervised warm-up (start),
at each evaluation, and after RL (end); training reward per step; wall time;
seconds spent in the reward; and whether the smallest rise exceeds twice the
spread of the final scores, as their population standard deviation (what
``tests/test_examples.py`` asserts) and as max - min. Wall times depend on what else the
machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_on_files as example  # noqa: E402


def _git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_seed(seed: int, runs: Path) -> dict:
    """The example for ``seed`` in a fresh process; its numbers from ``summary.json`` and ``metrics.jsonl``."""
    out = runs / f"seed-{seed}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_on_files.py"), str(out), str(seed)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    summary = json.loads((out / "run" / "summary.json").read_text())
    recs = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return {
        "seed": seed,
        "heldout_reward_start": summary["heldout_accuracy_start"],
        "heldout_reward_end": summary["heldout_accuracy_end"],
        "heldout_curve": [[r["step"], r["heldout_accuracy"]] for r in recs if r.get("heldout_accuracy") is not None],
        "train_reward": [round(r["reward"], 4) for r in recs],
        "wall_s_process": round(wall, 1),
        "reward_s_total": round(recs[-1]["time_reward_s_total"], 3),
        "reward_zeroed_total": recs[-1]["reward_zeroed_total"],
        "steps": len(recs),
        "status": summary["status"],
    }


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in result["seeds"]:
        pts = [(0, s["heldout_reward_start"]), *map(tuple, s["heldout_curve"]), (s["steps"], s["heldout_reward_end"])]
        ax[0].plot(*zip(*pts, strict=True), marker="o", ms=3, label=f"seed {s['seed']} ({s['wall_s_process']:.0f} s)")
        ax[1].plot(range(1, s["steps"] + 1), s["train_reward"], lw=1, label=f"seed {s['seed']}")
    ax[0].set(
        xlabel="trainer step",
        ylabel="held-out reward (exact match, greedy)",
        ylim=(0, 1),
        title="held-out reward: after warm-up (step 0) and during RL",
    )
    ax[1].set(
        xlabel="trainer step",
        ylabel="mean reward of the step's samples",
        ylim=(0, 1),
        title="training reward (sampled, temperature 1)",
    )
    ax[0].legend()
    ax[1].legend()
    fig.suptitle(f"examples/train_on_files.py, 3 seeds, on {result['machine']} ({result['stateshift']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="benchmarks/results/2026-12-05-cpu-train-file")
    p.add_argument("--runs", default="runs/bench-train-file", help="where each seed's model, data and run go")
    args = p.parse_args()
    seeds = [run_seed(s, Path(args.runs)) for s in args.seeds]
    rises = [s["heldout_reward_end"] - s["heldout_reward_start"] for s in seeds]
    ends = [s["heldout_reward_end"] for s in seeds]
    result = {
        "machine": f"CPU ({platform.processor() or platform.machine()}), 1 torch thread per side, "
        "2 cores shared with other work",
        "stateshift": _git_sha(),
        "command": "python examples/train_on_files.py <dir> <seed>",
        "settings": example.SETTINGS,
        "data": {"operands": example.OPERANDS, "template": example.TEMPLATE, "heldout": "1 pair in 5"},
        "seeds": seeds,
        "rises": rises,
        "smallest_rise": min(rises),
        "spread_of_final_std": statistics.pstdev(ends),
        "rise_exceeds_twice_std": min(rises) > 2 * statistics.pstdev(ends),
        "spread_of_final_range": max(ends) - min(ends),
        "rise_exceeds_twice_range": min(rises) > 2 * (max(ends) - min(ends)),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    _plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("rise", "smallest", "spread"))}, indent=1))


if __name__ == "__main__":
    main()
