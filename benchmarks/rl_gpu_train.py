"""``stateshift train`` on one GPU: Megatron-core and FSDP2 policies with offload, and synchronous vs fully-async
time to accuracy -> one result file (JSON + PNG) and a printed table.

    python3 benchmarks/rl_gpu_train.py --out DIR [--budget-s 100] [--smoke] [--runs NAME ...] [key=value ...]

Runs (each in its own process, so a CUDA error or Megatron's global state cannot leak into the next):

- ``megatron-sync``: synchronous on-policy GRPO -- staleness 0, one step per sync, no partial rollout: the
  rollouter generates exactly one step's groups with the current weights, then waits for the trainer;
- ``megatron-async-0.1`` / ``megatron-async-0.5``: fully-async, staleness 0.1 / 0.5, partial rollout on,
  4 steps per sync (verl's defaults otherwise);
- ``fsdp2-async-0.1``: the FSDP2 policy, fully-async at staleness 0.1, with param, grad and optimizer offload.

All: ``run.device=cuda``, ``trainer.param_offload=true``, ``trainer.old_logprob=pi_old`` (bypass off), the
default task and model shape unless overridden, a wall budget per run (``run.max_wall_s``) and an early stop
at ``run.stop_accuracy``. Time to accuracy is read off the held-out evaluations (every ``run.eval_every``
steps); the evaluations' own time is subtracted. ``--smoke`` runs each for a few steps (checks the path, no
accuracy claims). The JSON follows docs/results.md: one entry per run under ``"runs"``.
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

COMMON = ["run.device=cuda", "trainer.param_offload=true", "trainer.old_logprob=pi_old", "run.progress=lines",
          "run.tensorboard=false", "run.plot=false", "run.eval_every=50", "run.stop_accuracy=0.9"]
SYNC = ["async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
        "async_training.partial_rollout=false"]
RUNS: dict[str, list[str]] = {
    "megatron-sync": ["model.family=megatron", *SYNC],
    "megatron-async-0.1": ["model.family=megatron", "async_training.staleness_threshold=0.1"],
    "megatron-async-0.5": ["model.family=megatron", "async_training.staleness_threshold=0.5"],
    "fsdp2-async-0.1": ["model.family=fsdp2", "async_training.staleness_threshold=0.1", "trainer.grad_offload=true",
                        "trainer.optimizer_offload=true"],
}
THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


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


def child(name: str, run_dir: Path, extra: list[str]) -> None:
    if os.environ.get("STATESHIFT_MCORE_DEVICE") == "cpu":  # a CPU rehearsal (tests, development)
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from megatron_bench import patch_megatron_for_cpu

        patch_megatron_for_cpu()
    from stateshift.rl.config import resolve
    from stateshift.rl.loop import run

    cfg = resolve(None, [*COMMON, *RUNS[name], *extra, f"run.out_dir={run_dir}"])
    res = run(cfg, return_params=True)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {"name": name, "summary": res.summary, "records": recs, "heldout_accuracy_start": res.heldout_accuracy_start,
           "heldout_accuracy_end": res.heldout_accuracy_end, "steps": res.steps, "wall_s": res.wall_s,
           "naive_pi_old_swap_s": naive_swap_s(res.params or {}, cfg.run.device)}
    (run_dir / "result.json").write_text(json.dumps(out))


# --------------------------------------------------------------------------- the report (parent)


def time_to(curve: list[tuple[int, float, float]], start_acc: float) -> dict[str, float | None]:
    """Seconds of RL (evaluations excluded) until the held-out accuracy first reaches each threshold."""
    out: dict[str, float | None] = {}
    for th in THRESHOLDS:
        hit = 0.0 if start_acc >= th else next((t for _, t, acc in curve if acc >= th), None)
        out[f"{th:.1f}"] = None if hit is None else round(hit, 2)
    return out


def per_run(r: dict[str, Any]) -> dict[str, Any]:
    s, recs = r["summary"], r["records"]
    cfg = s["config"]
    steps = max(r["steps"], 1)
    step_s = sum(x["step_s"] for x in recs)
    wait = s["time_split_s"]["wait"]
    curve = [(x["step"], x["wall_s"] - x["time_eval_s_total"], x["heldout_accuracy"]) for x in recs
             if x.get("heldout_accuracy") is not None]
    last = recs[-1] if recs else {}
    verbs = s["verbs_s"]
    split = {k: v / steps for k, v in s["time_split_s"].items()}
    return {
        "name": r["name"], "backend": cfg["model"]["family"], "device": cfg["run"]["device"],
        "param_offload": cfg["trainer"]["param_offload"], "grad_offload": cfg["trainer"]["grad_offload"],
        "optimizer_offload": cfg["trainer"]["optimizer_offload"], "old_logprob_mode": cfg["trainer"]["old_logprob"],
        "staleness_threshold": cfg["async_training"]["staleness_threshold"],
        "trigger_parameter_sync_step": cfg["async_training"]["trigger_parameter_sync_step"],
        "partial_rollout": cfg["async_training"]["partial_rollout"],
        "model": {k: cfg["model"][k] for k in ("width", "layers", "heads")}, "param_bytes": s["sync"]["param_bytes"],
        "status": s["status"], "steps": r["steps"], "wall_s": round(r["wall_s"], 1),
        "heldout_accuracy_start": r["heldout_accuracy_start"], "heldout_accuracy_end": r["heldout_accuracy_end"],
        "heldout_curve": [[st, round(t, 2), acc] for st, t, acc in curve],
        "time_to_accuracy_s": time_to(curve, r["heldout_accuracy_start"]),
        "time_split_per_step_s": {k: round(v, 5) for k, v in split.items()},
        "trainer_idle_ratio": last.get("trainer_idle_ratio"), "rollout_idle_ratio": last.get("rollout_idle_ratio"),
        "trainer_wait_s": round(wait, 2), "rollout_busy_s": round(s["time_split_s"]["generate"], 2),
        "bytes_moved_per_step": {"offload": s["offload"]["bytes_per_step"], "pi_old": s["pi_old"]["bytes_per_step"],
                                 "sync_to_rollouter": s["sync"]["rollouter_copy_bytes"] / steps},
        "offload": s["offload"], "pi_old": s["pi_old"], "sync": s["sync"], "memory": s["memory"],
        "pool": s["pool"], "ledger": s["ledger"],
        "stateshift_verbs_s": round(verbs, 3),
        "stateshift_verbs_fraction_of_step": verbs / step_s if step_s else None,
        "stateshift_verbs_fraction_of_busy_trainer": verbs / (step_s - wait) if step_s > wait else None,
        "naive_pi_old_swap_s": r["naive_pi_old_swap_s"],
        "pi_old_swap_s_mean": s["offload"]["seconds"].get("swap.pi_old", 0.0) / max(s["pi_old"]["swaps"], 1),
        "pi_old_same_version_max_abs_diff": max((x.get("pi_old_same_version_max_abs_diff", 0.0) for x in recs),
                                                default=None),
        "samples_per_s": last.get("samples_per_s"),
    }


def comparison(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Sync vs async: the highest threshold every Megatron run reached, and each run's time to it."""
    mg = [r for r in runs if r["backend"] == "megatron"]
    common = [th for th in (f"{t:.1f}" for t in THRESHOLDS) if all(r["time_to_accuracy_s"][th] is not None for r in mg)]
    if not mg or not common:
        return {"target": None, "note": "no accuracy threshold was reached by every Megatron run"}
    th = common[-1]
    times = {r["name"]: r["time_to_accuracy_s"][th] for r in mg}
    sync = times.get("megatron-sync")
    return {"target": float(th), "seconds": times,
            "speedup_vs_sync": {k: (sync / v if sync and v else None) for k, v in times.items()}}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in result["runs"]:
        pts = [(0.0, r["heldout_accuracy_start"]), *((t, acc) for _, t, acc in r["heldout_curve"])]
        ax[0].plot(*zip(*pts, strict=True), marker="o", ms=3, label=r["name"])
    ax[0].set(xlabel="seconds of RL (evaluations excluded)", ylabel="held-out exact match (greedy)", ylim=(0, 1),
              title="time to accuracy, one H200")
    ax[0].legend()
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
    head = f"{'run':22} {'steps':>6} {'acc0':>5} {'acc':>5} {'wall':>6} {'t->target':>9} {'tr idle':>7} {'ro idle':>7} " \
           f"{'verbs%':>6} {'ms/step gen/old/upd/sync/off/wait':>36}"
    lines = [head]
    target = result["comparison"].get("target")
    for r in result["runs"]:
        sp = r["time_split_per_step_s"]
        t = r["time_to_accuracy_s"].get(f"{target:.1f}") if target else None
        frac = r["stateshift_verbs_fraction_of_step"]
        lines.append(f"{r['name']:22} {r['steps']:6d} {r['heldout_accuracy_start']:5.2f} {r['heldout_accuracy_end']:5.2f} "
                     f"{r['wall_s']:6.1f} {t if t is not None else '-':>9} {r['trainer_idle_ratio'] or 0:7.2f} "
                     f"{r['rollout_idle_ratio'] or 0:7.2f} {100 * (frac or 0):6.2f} "
                     + "/".join(f"{1e3 * sp.get(k, 0):.1f}" for k in ("generate", "old_logprob", "update", "sync",
                                                                      "offload", "wait")))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default=f"{datetime.date.today():%Y-%m-%d}-h200-train")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--budget-s", type=float, default=100.0, help="RL wall seconds per run (run.max_wall_s)")
    p.add_argument("--smoke", action="store_true", help="a few steps per run: the path, not the numbers")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.child:
        child(args.child, args.run_dir, args.overrides)
        return
    extra = [f"run.max_wall_s={args.budget_s}", *args.overrides]
    if args.smoke:
        extra += ["trainer.steps=12", "warmup.steps=20", "run.eval_every=4", "task.heldout_size=100"]
    import torch

    from stateshift.bench import git_sha

    work = Path(tempfile.mkdtemp(prefix="rl-gpu-"))
    result: dict[str, Any] = {
        "machine": f"1x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU",
        "torch": torch.__version__, "stateshift": git_sha(), "date": f"{datetime.date.today()}",
        "command": "python3 benchmarks/rl_gpu_train.py " + " ".join(sys.argv[1:]), "smoke": args.smoke,
        "runs": [], "failures": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.runs:
        run_dir = work / name
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--out", str(run_dir), "--child", name, "--run-dir", str(run_dir), *extra]
        try:
            proc = subprocess.run(cmd, text=True, capture_output=True, check=False, timeout=args.budget_s + 120)
            code, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, err = "timeout", str(exc.stderr or "")
        print(f"== {name}: exit {code} in {time.perf_counter() - t0:.0f} s", flush=True)
        print("\n".join(err.splitlines()[-6:]), flush=True)
        if code != 0:
            result["failures"][name] = err[-3000:]
        else:
            result["runs"].append(per_run(json.loads((run_dir / "result.json").read_text())))
        result["comparison"] = comparison(result["runs"])
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))  # after each run: a kill keeps some
    if result["runs"]:
        plot(result, args.out / f"{args.name}.png")
    print(table(result))
    print(json.dumps(result["comparison"], indent=1))
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
