"""``stateshift train`` on one GPU: the thread executor against the rollouter in a process of its own (and Ray,
where it runs), for the Megatron and FSDP2 families with param offload and pi_old, at two model sizes.

    python3 benchmarks/train_executors_bench.py [key=value ...] --out DIR [--steps 60] [--smoke]
                    [--executors inprocess process] [--families megatron fsdp2] [--sizes default large]

(``key=value`` config overrides for every run come first: the list options would take them otherwise.)

``--executors`` items: ``inprocess``, ``process`` (weights through the executor's own shared-memory file),
``process+auto`` / ``process+cuda_ipc`` / ``process+shared_host`` (through the weight-sync library),
``ray`` (needs Ray on the machine).

One row per run (each in its own process: Megatron's global state and CUDA errors cannot leak into the next):
``executor``, ``family``, ``size``, ``model_params``, ``steps``, ``steps_per_s``, ``samples_per_s``,
``trainer_idle_ratio``, ``rollout_idle_ratio``, ``sync_s`` (the trainer's seconds per weight sync: snapshot,
hand-over, until the rollouter took them), ``pause_s`` (the rollouter's seconds per sync spent copying the
weights in, not generating), the trainer's and the rollouter process's peak GPU memory. Every run has the same
length (``--steps`` trainer steps after a short warm-up) and the same config otherwise: the default task,
``run.device=cuda``, ``trainer.param_offload=true``, ``trainer.old_logprob=pi_old``, staleness 0.1, partial
rollout, no evaluation during RL. Throughput is read at the last step (``samples_per_s`` counts every sample
the rollouter generated per second of RL wall time).

Sizes: ``default`` is the task's default model; ``large`` is ``model.width=1024 model.layers=8`` (~100M
parameters). Writes ``<out>/<date>-<card>-train-executors.json`` and ``.png`` (``...-train-executors-<sizes>``
when ``--sizes`` names some of them, e.g. ``-default``) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

COMMON = [
    "run.device=cuda",
    "trainer.param_offload=true",
    "trainer.old_logprob=pi_old",
    "run.progress=none",
    "run.tensorboard=false",
    "run.plot=false",
    "run.eval_every=100000",
    "warmup.steps=30",
    "task.heldout_size=50",
    "async_training.staleness_threshold=0.1",
]
SIZES: dict[str, list[str]] = {
    "default": [],
    "large": ["model.width=1024", "model.layers=8", "model.heads=16", "trainer.lr=5e-4", "warmup.lr=5e-4"],
}
FAMILIES = {"megatron": ["model.family=megatron"], "fsdp2": ["model.family=fsdp2"]}
#: bytes per parameter of each family's trainer params (Megatron: bf16; FSDP2 here: fp32)
PARAM_BYTES = {"megatron": 2, "fsdp2": 4}


def child(name: str, run_dir: Path, extra: list[str]) -> None:
    """One run (``name`` = ``executor/family/size``) -> ``run_dir/result.json``."""
    from stateshift.train.config import resolve
    from stateshift.train.launch import run

    executor, family, size = name.split("/")
    executor, _, transport = executor.partition("+")
    cfg = resolve(
        None,
        [
            *COMMON,
            *FAMILIES[family],
            *SIZES[size],
            f"executor={executor}",
            *extra,
            *([f"rollout.weight_transport={transport}"] if transport else []),
            f"run.out_dir={run_dir}",
        ],
    )
    res = run(cfg)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "result.json").write_text(
        json.dumps({"name": name, "summary": res.summary, "last": recs[-1], "steps": res.steps})
    )


def row(name: str, result: dict[str, Any]) -> dict[str, Any]:
    executor, family, size = name.split("/")
    executor, _, transport = executor.partition("+")
    s, last = result["summary"], result["last"]
    syncs = max(s["sync"]["syncs"], 1)
    wall = last["wall_s"]
    return {
        "executor": executor,
        "weight_transport": transport or ("builtin" if executor == "process" else None),
        "family": family,
        "size": size,
        "model_params": s["sync"]["param_bytes"] // PARAM_BYTES[family],
        "steps": result["steps"],
        "steps_per_s": round(result["steps"] / wall, 3),
        "samples_per_s": round(last["samples_per_s"], 1),
        "trainer_idle_ratio": round(last["trainer_idle_ratio"], 3),
        "rollout_idle_ratio": round(last["rollout_idle_ratio"], 3),
        "sync_s": round(s["time_split_s"]["sync"] / syncs, 4),
        "pause_s": round(s["sync"]["rollouter_copy_s"] / syncs, 4),
        "trainer_gpu_peak_bytes": s["memory"].get("device_peak_allocated_bytes"),
        "rollout_gpu_peak_bytes": s["memory"].get("rollout_device_peak_allocated_bytes"),
        "status": s["status"],
        "wall_s": round(wall, 2),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["family"], r["size"]) for r in rows})
    executors = sorted({_label(r) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(executors), 1)
    for i, ex in enumerate(executors):
        vals = [next((r for r in rows if (r["family"], r["size"], _label(r)) == (*g, ex)), None) for g in groups]
        xs = [j + i * width for j in range(len(groups))]
        axes[0].bar(xs, [v["samples_per_s"] if v else 0 for v in vals], width, label=ex)
        axes[1].bar(xs, [v["trainer_idle_ratio"] if v else 0 for v in vals], width, label=ex)
    for ax, title in zip(axes, ("samples / s", "trainer idle ratio"), strict=True):
        ax.set_xticks(
            [j + width * (len(executors) - 1) / 2 for j in range(len(groups))], [f"{f}\n{s}" for f, s in groups]
        )
        ax.set_title(title)
        ax.legend()
    fig.suptitle("stateshift train on one GPU: rollouter on a thread vs in its own process")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _label(r: dict[str, Any]) -> str:
    return r["executor"] + (f"+{r['weight_transport']}" if r["weight_transport"] not in (None, "builtin") else "")


def table(rows: list[dict[str, Any]]) -> str:
    keys = [
        "executor",
        "weight_transport",
        "family",
        "size",
        "model_params",
        "samples_per_s",
        "steps_per_s",
        "trainer_idle_ratio",
        "rollout_idle_ratio",
        "sync_s",
        "pause_s",
        "status",
    ]
    lines = [" | ".join(keys)]
    lines += [" | ".join(str(r[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--executors",
        nargs="+",
        default=["inprocess", "process", "process+auto"],
        help="inprocess, process (its own shared-memory file), process+TRANSPORT (the weight-sync "
        "library: auto, shared_host, cuda_ipc), ray",
    )
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--smoke", action="store_true", help="3 steps per run: checks the path, no figures")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.overrides)
        return
    steps = 3 if args.smoke else args.steps
    rows, failed = [], {}
    device = _device_name()
    slug = "cpu" if device == "cpu" else ("h100" if "H100" in device else "h200" if "H200" in device else "gpu")
    stem = f"{datetime.date.today():%Y-%m-%d}-{slug}-train-executors"
    if set(args.sizes) != set(SIZES):  # (a run of some sizes does not overwrite the day's run of the others)
        stem += "-" + "-".join(args.sizes)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for family in args.families:
                for ex in args.executors:
                    name = f"{ex}/{family}/{size}"
                    run_dir = Path(tmp) / name.replace("/", "-")
                    cmd = [
                        sys.executable,
                        __file__,
                        "--child",
                        name,
                        str(run_dir),
                        f"trainer.steps={steps}",
                        *args.overrides,
                    ]
                    t0 = time.perf_counter()
                    proc = subprocess.run(cmd, text=True, capture_output=True, check=False, timeout=600)
                    print(f"{name}: exit {proc.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
                    if proc.returncode != 0:
                        failed[name] = (proc.stdout + proc.stderr)[-3000:]
                        print(failed[name], flush=True)
                    else:
                        rows.append(row(name, json.loads((run_dir / "result.json").read_text())))
                        print(json.dumps(rows[-1]), flush=True)
                    (args.out / f"{stem}.json").write_text(
                        json.dumps(  # after every run: a cut-off run keeps the rest
                            {
                                "benchmark": "train_executors",
                                "device": device,
                                "steps": steps,
                                "overrides": args.overrides,
                                "common": COMMON,
                                "sizes": SIZES,
                                "rows": rows,
                                "failed": failed,
                            },
                            indent=1,
                        )
                    )
    print(table(rows))
    if rows:
        plot(rows, args.out / f"{stem}.png")
    if failed:
        sys.exit(1)


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
