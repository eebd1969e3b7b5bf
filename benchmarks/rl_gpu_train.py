"""``stateshift train`` on one GPU: Megatron-core and FSDP2 policies with offload, and synchronous vs fully-async
time to accuracy -> one result file (JSON + PNG) and a printed table.

    python3 benchmarks/rl_gpu_train.py --out DIR [--budget-s 40] [--seeds 2] [--model medium] [--threshold 0.3]
                                       [--smoke] [--runs NAME ...] [key=value ...]

Runs (each in its own process, so a CUDA error or Megatron's global state cannot leak into the next):

- ``megatron-sync``: synchronous on-policy GRPO -- staleness 0, one step per sync, no partial rollout: the
  rollouter generates exactly one step's groups with the current weights, then waits for the trainer;
- ``megatron-async-0.1`` / ``megatron-async-0.5``: fully-async, staleness 0.1 / 0.5, partial rollout on,
  4 steps per sync (verl's defaults otherwise);
- ``fsdp2-async-0.1``: the FSDP2 policy, fully-async at staleness 0.1, with param, grad and optimizer offload.

Each mode runs ``--seeds`` times (``run.seed`` 0, 1, ...; FSDP2 once: it is the backend check, not part of the
sync/async comparison), named ``<mode>/s<seed>``. ``--model`` picks the model shape, the same for every run
(``MODELS``: ``tiny`` is the default task model, 0.2 MB; ``medium`` 512 wide x 4 layers, ~13M params;
``large`` 1024 x 8, ~100M params), and with it one learning rate for every run. ``--threshold`` is the held-out
accuracy fixed before the runs: each run's wall time to first reach it (evaluations excluded), per seed and the
median per mode; the highest threshold every Megatron run reached is reported too. Time to a threshold is
read at evaluations (``run.eval_every`` steps), so it is quantised to that many steps.

All: ``run.device=cuda``, ``trainer.param_offload=true``, ``trainer.old_logprob=pi_old`` (bypass off), the
default task and model shape unless overridden, a wall budget per run (``run.max_wall_s``) and an early stop
at ``run.stop_accuracy``. Time to accuracy is read off the held-out evaluations (every ``run.eval_every``
steps); the evaluations' own time is subtracted. ``--smoke`` runs each for a few steps (checks the path, no
accuracy claims). The JSON follows docs/design/result-format.md: one entry per run under ``"runs"``.
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
    "run.progress=lines",
    "run.tensorboard=false",
    "run.plot=false",
    "run.eval_every=25",
    "run.stop_accuracy=0.9",
]
#: model shapes (the same for every run of a call) and the one learning rate each is trained with
MODELS: dict[str, list[str]] = {
    "tiny": ["model.width=64", "model.layers=2", "model.heads=4"],
    "medium": ["model.width=512", "model.layers=4", "model.heads=8", "trainer.lr=1e-3", "warmup.lr=1e-3"],
    "large": ["model.width=1024", "model.layers=8", "model.heads=16", "trainer.lr=5e-4", "warmup.lr=5e-4"],
}
SYNC = [
    "async_training.staleness_threshold=0",
    "async_training.trigger_parameter_sync_step=1",
    "async_training.partial_rollout=false",
]
RUNS: dict[str, list[str]] = {
    "megatron-sync": ["model.family=megatron", *SYNC],
    "megatron-async-0.1": ["model.family=megatron", "async_training.staleness_threshold=0.1"],
    "megatron-async-0.5": ["model.family=megatron", "async_training.staleness_threshold=0.5"],
    "fsdp2-async-0.1": [
        "model.family=fsdp2",
        "async_training.staleness_threshold=0.1",
        "trainer.grad_offload=true",
        "trainer.optimizer_offload=true",
    ],
}
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: modes run once whatever --seeds says (a backend check, not part of the sync/async comparison)
ONE_SEED = ("fsdp2-async-0.1",)


# --------------------------------------------------------------------------- one run (child process)


def naive_swap_s(params: dict[str, Any], device: str, repeat: int = 5) -> float:
    """What a user writes for one pi_old swap without stateshift: stash the live weights to the host
    (``.cpu()`` per tensor), load pi_old from host copies (``.to(device)`` per tensor), and back; median seconds."""
    import torch

    host = {n: t.cpu() for n, t in params.items()}
    live = {n: t.to(device) for n, t in host.items()}
    times = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        stash = {n: t.cpu() for n, t in live.items()}
        for n, t in live.items():
            t.copy_(host[n].to(device))
        for n, t in live.items():
            t.copy_(stash[n].to(device))
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def split_name(name: str) -> tuple[str, int]:
    """``"megatron-sync/s1"`` -> ``("megatron-sync", 1)``."""
    mode, _, seed = name.partition("/s")
    return mode, int(seed or 0)


def child(name: str, run_dir: Path, extra: list[str]) -> None:
    if os.environ.get("STATESHIFT_MCORE_DEVICE") == "cpu":  # a CPU rehearsal (tests, development)
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from megatron_bench import patch_megatron_for_cpu

        patch_megatron_for_cpu()
    from stateshift.train.config import resolve
    from stateshift.train.launch import run

    mode, seed = split_name(name)
    cfg = resolve(None, [*COMMON, *RUNS[mode], f"run.seed={seed}", *extra, f"run.out_dir={run_dir}"])
    res = run(cfg, return_params=True)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {
        "name": name,
        "summary": res.summary,
        "records": recs,
        "heldout_accuracy_start": res.heldout_accuracy_start,
        "heldout_accuracy_end": res.heldout_accuracy_end,
        "steps": res.steps,
        "wall_s": res.wall_s,
        "naive_pi_old_swap_s": naive_swap_s(res.params or {}, cfg.run.device),
    }
    (run_dir / "result.json").write_text(json.dumps(out))


# --------------------------------------------------------------------------- the report (parent)


def time_to(
    curve: list[tuple[int, float, float]], start_acc: float, thresholds: tuple[float, ...] = THRESHOLDS
) -> dict[str, float | None]:
    """Seconds of RL (evaluations excluded) until the held-out accuracy first reaches each threshold."""
    out: dict[str, float | None] = {}
    for th in sorted(set(thresholds)):
        hit = 0.0 if start_acc >= th else next((t for _, t, acc in curve if acc >= th), None)
        out[f"{th:g}"] = None if hit is None else round(hit, 2)
    return out


def idle_breakdown(recs: list[dict[str, Any]], split: dict[str, float], trigger: int) -> dict[str, float]:
    """Where the idle time went (seconds). Trainer: waiting for samples, split by when -- the first step (the
    queue filling), the first step after each sync (the rollouter had used its staleness budget and was paused
    until the new weights came), other steps (the rollouter slower than the trainer). Rollouter: wall time not
    generating (paused by the staleness rule, waiting for a version, or in a weight-sync handshake)."""
    prev, first, after_sync, other = 0.0, 0.0, 0.0, 0.0
    for x in recs:
        w, prev = x["time_wait_s_total"] - prev, x["time_wait_s_total"]
        if x["step"] == 1:
            first += w
        elif (x["step"] - 1) % trigger == 0:
            after_sync += w
        else:
            other += w
    wall = recs[-1]["wall_s"] if recs else 0.0
    return {
        "trainer_wait_first_step_s": round(first, 3),
        "trainer_wait_after_sync_s": round(after_sync, 3),
        "trainer_wait_other_steps_s": round(other, 3),
        "sync_handshake_s": round(split.get("sync", 0.0), 3),
        "eval_s": round(split.get("eval", 0.0), 3),
        "rollout_idle_s": round(max(wall - split.get("generate", 0.0), 0.0), 3),
    }


def verbs_fraction_of_step(summary: dict[str, Any], records: list[dict[str, Any]]) -> float | None:
    """stateshift's verbs' host seconds (``summary["verbs_s"]``: offload, onload, snapshots, pi_old swaps, release)
    over the trainer's step time (the sum of the metrics records' ``step_s``, waits included); None: no steps.

    Host seconds: how long the trainer thread was inside a verb, including any wait for its copies in it. A
    prefetched onload (``trainer.prefetch``) counts the time to issue it (``onload.<group>``) plus the copy time
    that was not hidden (``prefetch_wait.<group>``: the compute stream's stall at the wait, from events, plus any
    time the host blocked for it): copy time hidden behind compute is not counted. An onload or offload without prefetch waits for its copies, and so also for
    the compute enqueued before it that its copies are ordered after (the copy stream waits for the compute stream)."""
    step_s = sum(x["step_s"] for x in records)
    return summary["verbs_s"] / step_s if step_s else None


def per_run(r: dict[str, Any], threshold: float) -> dict[str, Any]:
    s, recs = r["summary"], r["records"]
    cfg = s["config"]
    steps = max(r["steps"], 1)
    step_s = sum(x["step_s"] for x in recs)
    wait = s["time_split_s"]["wait"]
    curve = [
        (x["step"], x["wall_s"] - x["time_eval_s_total"], x["heldout_accuracy"])
        for x in recs
        if x.get("heldout_accuracy") is not None
    ]
    last = recs[-1] if recs else {}
    verbs = s["verbs_s"]
    split = {k: v / steps for k, v in s["time_split_s"].items()}
    mode, seed = split_name(r["name"])
    t_split = s["time_split_s"]
    return {
        "name": r["name"],
        "mode": mode,
        "seed": seed,
        "backend": cfg["model"]["family"],
        "device": cfg["run"]["device"],
        "param_offload": cfg["trainer"]["param_offload"],
        "grad_offload": cfg["trainer"]["grad_offload"],
        "optimizer_offload": cfg["trainer"]["optimizer_offload"],
        "old_logprob_mode": cfg["trainer"]["old_logprob"],
        "prefetch": cfg["trainer"].get("prefetch"),
        "freed_memory": cfg["trainer"].get("freed_memory"),
        "staleness_threshold": cfg["async_training"]["staleness_threshold"],
        "trigger_parameter_sync_step": cfg["async_training"]["trigger_parameter_sync_step"],
        "partial_rollout": cfg["async_training"]["partial_rollout"],
        "model": {k: cfg["model"][k] for k in ("width", "layers", "heads")},
        "param_bytes": s["sync"]["param_bytes"],
        "status": s["status"],
        "steps": r["steps"],
        "wall_s": round(r["wall_s"], 1),
        "heldout_accuracy_start": r["heldout_accuracy_start"],
        "heldout_accuracy_end": r["heldout_accuracy_end"],
        "heldout_curve": [[st, round(t, 2), acc] for st, t, acc in curve],
        "time_to_accuracy_s": time_to(curve, r["heldout_accuracy_start"], (*THRESHOLDS, threshold)),
        "time_to_threshold_s": time_to(curve, r["heldout_accuracy_start"], (threshold,))[f"{threshold:.1f}"],
        "lr": cfg["trainer"]["lr"],
        "entropy_coef": cfg["trainer"]["entropy_coef"],
        "time_split_per_step_s": {k: round(v, 5) for k, v in split.items()},
        "trainer_idle_ratio": last.get("trainer_idle_ratio"),
        "rollout_idle_ratio": last.get("rollout_idle_ratio"),
        "trainer_wait_s": round(wait, 2),
        "rollout_busy_s": round(s["time_split_s"]["generate"], 2),
        "idle": idle_breakdown(recs, t_split, cfg["async_training"]["trigger_parameter_sync_step"]),
        "bytes_moved_per_step": {
            "offload": s["offload"]["bytes_per_step"],
            "pi_old": s["pi_old"]["bytes_per_step"],
            "sync_to_rollouter": s["sync"]["rollouter_copy_bytes"] / steps,
        },
        "offload": s["offload"],
        "pi_old": s["pi_old"],
        "sync": s["sync"],
        "memory": s["memory"],
        "pool": s["pool"],
        "ledger": s["ledger"],
        "stateshift_verbs_s": round(verbs, 3),
        "stateshift_verbs_fraction_of_step": verbs_fraction_of_step(s, recs),
        "stateshift_verbs_fraction_of_busy_trainer": verbs / (step_s - wait) if step_s > wait else None,
        "naive_pi_old_swap_s": r["naive_pi_old_swap_s"],
        "pi_old_swap_s_mean": s["offload"]["seconds"].get("swap.pi_old", 0.0) / max(s["pi_old"]["swaps"], 1),
        "pi_old_same_version_max_abs_diff": max(
            (x.get("pi_old_same_version_max_abs_diff", 0.0) for x in recs), default=None
        ),
        "samples_per_s": last.get("samples_per_s"),
    }


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def comparison(runs: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """Sync vs async over the Megatron runs: each run's wall time to ``threshold`` (fixed before the runs) and the
    median per mode (a mode counts as reaching it only if every seed did), the speedup of each async mode's
    median over sync's; the same at the highest threshold every Megatron run reached; idle ratios per mode."""
    mg = [r for r in runs if r["backend"] == "megatron"]
    modes = sorted({r["mode"] for r in mg})

    def at(th: float) -> dict[str, Any]:
        key = f"{th:g}"
        per = {m: {f"s{r['seed']}": r["time_to_accuracy_s"].get(key) for r in mg if r["mode"] == m} for m in modes}
        med = {
            m: (_median([t for t in v.values() if t is not None]) if all(t is not None for t in v.values()) else None)
            for m, v in per.items()
        }
        sync = med.get("megatron-sync")
        return {
            "target": th,
            "seconds_per_seed": per,
            "median_s": med,
            "speedup_vs_sync": {m: (round(sync / v, 3) if sync and v else None) for m, v in med.items()},
        }

    out: dict[str, Any] = {"threshold": at(threshold)}
    common = [th for th in THRESHOLDS if mg and all(r["time_to_accuracy_s"].get(f"{th:g}") is not None for r in mg)]
    out["highest_common"] = (
        at(common[-1])
        if common
        else {"target": None, "note": "no accuracy threshold was reached by every Megatron run"}
    )
    out["idle_ratio_median"] = {
        m: {
            "trainer": _median([r["trainer_idle_ratio"] or 0.0 for r in mg if r["mode"] == m]),
            "rollouter": _median([r["rollout_idle_ratio"] or 0.0 for r in mg if r["mode"] == m]),
        }
        for m in modes
    }
    out["verbs_fraction_median"] = {
        m: _median([r["stateshift_verbs_fraction_of_step"] or 0.0 for r in runs if r["mode"] == m])
        for m in sorted({r["mode"] for r in runs})
    }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.8))
    colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r["mode"] for r in result["runs"]))}
    for r in result["runs"]:
        pts = [(0.0, r["heldout_accuracy_start"]), *((t, acc) for _, t, acc in r["heldout_curve"])]
        ax[0].plot(
            *zip(*pts, strict=True),
            marker="o",
            ms=3,
            label=r["name"],
            color=colours[r["mode"]],
            ls=("-", "--", ":", "-.")[r["seed"] % 4],
        )
    th = result["comparison"]["threshold"]["target"]
    ax[0].axhline(th, color="grey", lw=0.8, ls="--")
    ax[0].set(
        xlabel="seconds of RL (evaluations excluded)",
        ylabel="held-out exact match (greedy)",
        ylim=(0, 1),
        title="time to accuracy, one H200",
    )
    ax[0].legend(fontsize=7)
    names = [r["name"] for r in result["runs"]]
    phases = ("generate", "old_logprob", "update", "sync", "offload", "wait")
    left = [0.0] * len(names)
    for ph in phases:
        vals = [r["time_split_per_step_s"].get(ph, 0.0) * 1e3 for r in result["runs"]]
        ax[1].barh(names, vals, left=left, label=ph)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax[1].set(xlabel="ms per trainer step (generate: rollout thread, overlapping)", title="time split per step")
    ax[1].legend(fontsize=8)
    fig.suptitle(f"stateshift train on {result['machine']} ({result['stateshift']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'run':24} {'steps':>6} {'acc0':>5} {'acc':>5} {'wall':>6} {'t->target':>9} {'tr idle':>7} {'ro idle':>7} "
        f"{'verbs%':>6} {'ms/step gen/old/upd/sync/off/wait':>36}"
    )
    lines = [head]
    for r in result["runs"]:
        sp = r["time_split_per_step_s"]
        t = r["time_to_threshold_s"]
        frac = r["stateshift_verbs_fraction_of_step"]
        lines.append(
            f"{r['name']:24} {r['steps']:6d} {r['heldout_accuracy_start']:5.2f} {r['heldout_accuracy_end']:5.2f} "
            f"{r['wall_s']:6.1f} {t if t is not None else '-':>9} {r['trainer_idle_ratio'] or 0:7.2f} "
            f"{r['rollout_idle_ratio'] or 0:7.2f} {100 * (frac or 0):6.2f} "
            + "/".join(
                f"{1e3 * sp.get(k, 0):.1f}" for k in ("generate", "old_logprob", "update", "sync", "offload", "wait")
            )
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default=f"{datetime.date.today():%Y-%m-%d}-h200-train")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="modes")
    p.add_argument("--seeds", type=int, default=2, help="runs per mode (run.seed 0..N-1; FSDP2: one)")
    p.add_argument("--model", default="medium", choices=list(MODELS), help="model shape and its learning rate")
    p.add_argument(
        "--threshold",
        type=float,
        default=0.3,
        help="held-out accuracy whose time to first reach is compared (fixed before the runs)",
    )
    p.add_argument("--budget-s", type=float, default=40.0, help="RL wall seconds per run (run.max_wall_s)")
    p.add_argument("--smoke", action="store_true", help="a few steps per run: the path, not the numbers")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.child:
        child(args.child, args.run_dir, args.overrides)
        return
    extra = [*MODELS[args.model], f"run.max_wall_s={args.budget_s}", *args.overrides]
    if args.smoke:
        extra += ["trainer.steps=12", "warmup.steps=20", "run.eval_every=4", "task.heldout_size=100"]
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _harness import git_sha, write_json

    work = Path(tempfile.mkdtemp(prefix="rl-gpu-"))
    result: dict[str, Any] = {
        "machine": f"1x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU",
        "torch": torch.__version__,
        "stateshift": git_sha(),
        "date": f"{datetime.date.today()}",
        "command": "python3 benchmarks/rl_gpu_train.py " + " ".join(sys.argv[1:]),
        "smoke": args.smoke,
        "model_preset": args.model,
        "threshold": args.threshold,
        "seeds": args.seeds,
        "budget_s": args.budget_s,
        "runs": [],
        "failures": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    names = [f"{mode}/s{seed}" for mode in args.runs for seed in range(1 if mode in ONE_SEED else args.seeds)]
    t_all = time.perf_counter()
    print(
        f"{len(names)} runs of {args.budget_s:g} s of RL each (+ start, warm-up, evaluations): {', '.join(names)}",
        flush=True,
    )
    for k, name in enumerate(names):
        run_dir = work / name.replace("/", "-")
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--out", str(run_dir), "--child", name, "--run-dir", str(run_dir), *extra]
        try:
            proc = subprocess.run(cmd, text=True, capture_output=True, check=False, timeout=args.budget_s + 120)
            code, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, err = "timeout", str(exc.stderr or "")
        print(
            f"== [{k + 1}/{len(names)}] {name}: exit {code} in {time.perf_counter() - t0:.0f} s "
            f"({time.perf_counter() - t_all:.0f} s so far)",
            flush=True,
        )
        print("\n".join(err.splitlines()[-6:]), flush=True)
        if code != 0:
            result["failures"][name] = err[-3000:]
        else:
            result["runs"].append(per_run(json.loads((run_dir / "result.json").read_text()), args.threshold))
            r = result["runs"][-1]
            print(
                f"   steps {r['steps']}, held-out {r['heldout_accuracy_start']:.3f} -> {r['heldout_accuracy_end']:.3f}, "
                f"t->{args.threshold:g}: {r['time_to_threshold_s']}, idle trainer/rollouter "
                f"{r['trainer_idle_ratio'] or 0:.2f}/{r['rollout_idle_ratio'] or 0:.2f}, "
                f"verbs {100 * (r['stateshift_verbs_fraction_of_step'] or 0):.1f}% of step time",
                flush=True,
            )
        result["comparison"] = comparison(result["runs"], args.threshold)
        write_json(args.out / f"{args.name}.json", result)  # after each run, whole: a kill keeps some
        if result["runs"]:
            plot(result, args.out / f"{args.name}.png")  # (and its plot)
    print(table(result))
    print(json.dumps(result["comparison"], indent=1))
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
