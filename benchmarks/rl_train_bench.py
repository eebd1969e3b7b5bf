"""Three seeds of the default ``stateshift train`` run on this machine -> one result file (JSON + PNG).

    .venv/bin/python benchmarks/rl_train_bench.py [--seeds 0 1 2] [--out benchmarks/results/2026-12-03-cpu-train]

Each seed is the default run (``stateshift train run.seed=S``; extra ``key=value``
overrides apply to all). The JSON holds, per seed, held-out accuracy after the
supervised warm-up (start) and after RL (end) and the wall time; the time split,
ledger, and the bytes offload and pi_old moved per step of the first seed; and
whether the smallest rise exceeds twice the spread (max - min) of the final
accuracies. Wall times depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from stateshift.train.config import as_dict, resolve
from stateshift.train.launch import run


def _git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _curves(out_dir: Path) -> list[tuple[int, float]]:
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["heldout_accuracy"]) for r in recs if r.get("heldout_accuracy") is not None]


def _plot(result: dict, curves: dict[int, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in result["seeds"]:
        pts = [(0, s["heldout_accuracy_start"]), *curves[s["seed"]], (result["steps"], s["heldout_accuracy_end"])]
        ax[0].plot(*zip(*pts, strict=True), marker="o", ms=3, label=f"seed {s['seed']} ({s['wall_s']:.0f} s)")
    ax[0].set(
        xlabel="trainer step",
        ylabel="held-out exact match (greedy)",
        ylim=(0, 1),
        title="default run: held-out accuracy, 3 seeds",
    )
    ax[0].legend()
    split = result["time_split_s"]
    ax[1].barh(list(split), list(split.values()))
    ax[1].set(
        xlabel="seconds",
        title=f"time split, seed {result['seeds'][0]['seed']} (generate: rollout thread; others: trainer thread)",
    )
    fig.suptitle(f"stateshift train on {result['machine']} ({result['stateshift']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="benchmarks/results/2026-12-03-cpu-train")
    p.add_argument("--runs", default="runs/bench-train", help="where each seed's run directory goes")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    seeds, curves, first = [], {}, None
    for seed in args.seeds:
        cfg = resolve(
            None, [*args.overrides, f"run.seed={seed}", f"run.out_dir={args.runs}/seed-{seed}", "run.progress=lines"]
        )
        t0 = time.perf_counter()
        res = run(cfg)
        seeds.append(
            {
                "seed": seed,
                "heldout_accuracy_start": res.heldout_accuracy_start,
                "heldout_accuracy_end": res.heldout_accuracy_end,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
        curves[seed] = _curves(res.out_dir)
        first = first or (res, cfg)
    assert first is not None
    res, cfg = first
    s = res.summary
    rises = [x["heldout_accuracy_end"] - x["heldout_accuracy_start"] for x in seeds]
    ends = [x["heldout_accuracy_end"] for x in seeds]
    result = {
        "machine": f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} torch threads, "
        "2 cores shared with other work",
        "torch": torch.__version__,
        "stateshift": _git_sha(),
        "command": "stateshift train " + " ".join(args.overrides),
        "steps": cfg.trainer.steps,
        "seeds": seeds,
        "smallest_rise": min(rises),
        "spread_of_final": max(ends) - min(ends),
        "rise_exceeds_twice_spread": min(rises) > 2 * (max(ends) - min(ends)),
        "time_split_s": {k: round(v, 2) for k, v in s["time_split_s"].items()},
        "offload_bytes_per_step": s["offload"]["bytes_per_step"],
        "offload": s["offload"],
        "pi_old_bytes_per_step": s["pi_old"]["bytes_per_step"],
        "pi_old": s["pi_old"],
        "sync": s["sync"],
        "ledger": s["ledger"],
        "staleness_tokens": s["staleness_tokens"],
        "config": as_dict(cfg),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    _plot(result, curves, out.with_suffix(".png"))
    print(
        json.dumps(
            {k: result[k] for k in ("seeds", "smallest_rise", "spread_of_final", "rise_exceeds_twice_spread")}, indent=1
        )
    )


if __name__ == "__main__":
    main()
