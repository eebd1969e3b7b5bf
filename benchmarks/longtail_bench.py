"""Synchronous vs fully-async on the long-tail task, paired seeds, time to fixed held-out accuracy thresholds.

    python3 benchmarks/longtail_bench.py --one-warmup --budget-s 15 --snap-s 5   # one GPU (the 2026-12-07 result)
    python3 benchmarks/longtail_bench.py --small --out /tmp/lt           # a toy size on the CPU (checks the path)
    python3 benchmarks/longtail_bench.py --combine A.json B.json --out DIR   # calls that ran some seeds each

Arms (``ARMS``), the same algorithm and hyperparameters in each (``COMMON``: pi_old mode, 4 steps per sync,
continuous batching, the lr schedule and defaults of ``stateshift train``); only ``async_training`` differs:

- ``sync``: ``async_training.mode=sync`` -- each version's 4 steps of groups are generated first (staleness 0),
  then trained on with the same 4 clipped updates per version as async;
- ``async-0.25`` / ``async-0.5``: fully-async, staleness 0.25 / 0.5, partial rollout on.

The supervised warm-up runs once per seed, or once for all seeds with ``--one-warmup`` (the seeds then vary RL
only), and every arm of a seed starts RL from that same checkpoint (``warmup.steps=0`` with the warmed-up
weights loaded into the built policy). The warm-up runs ``warmup.steps`` at most, in chunks of
``--warmup-every`` (500) with one optimizer, measuring held-out accuracy after each (out of its time);
``--warmup-target`` stops it once that accuracy is reached (RL then starts part-way up the warm-up's rise).
``--warmup-file`` keeps the one warm-up in a file (read back with ``weights_only``), so that a second call
(``--first-seed 3``) starts from the same weights; ``--combine`` merges the calls' files.

Wall time counts from the start of RL; evaluation is out of band: every ``--snap-s`` seconds of RL the trainer's
weights are copied to host (the copy's time is not counted), and the copies are evaluated on the held-out set
after the run. The curve starts at the warm-up's held-out accuracy, measured once per warm-up (``start_accuracy``):
``stateshift train``'s own evaluations before and after RL are left out of each run (the same number again, and
the last copy's). ``THRESHOLDS`` are fixed here, before any run: per arm and seed the wall time and the samples
trained to first reach each (``null``: censored, the run ended first -- reported, not dropped), and the medians.
``"comparison"``: the highest threshold above the start that every sync seed reached, with the sync and
async-0.5 median times and their ratio (a censored async run counts as the budget).

The GPU shape (``GPU``), from runs of the toy size on the CPU: rotary positions (attention then sees offsets
only: a term's copy sits ``7 * max_terms`` tokens after it at every length); no label smoothing in the warm-up
(with 0.1, sampling at temperature 1 spread about 0.1 of each token's mass over wrong digits: 8 sampled
responses of a 2-term problem were right 0.3-0.5 of the time where the greedy one was always right, and RL
lowered held-out accuracy); warm-up learning rate 3e-3 (the sums are learnt suddenly, after 1,000-1,750 steps
at the toy size; later at 1e-3); RL learning rate 3e-4.

Writes ``benchmarks/results/<date>-<h100|h200>-train-longtail.json`` (``-from-seed<N>`` with ``--first-seed``;
after every seed: ``seeds_done`` of ``seeds_asked``, so a run cut short keeps what it finished) and its ``.png``
(``--out`` elsewhere; ``--small`` writes ``<date>-cpu-small-train-longtail`` there); ``--stop-by-s`` ends it
between seeds, saying why in ``"stopped"``, before a call's time limit would cut a seed. Each run keeps a
``trace`` of its trainer's per-step metrics (``TRACE_KEYS``: training reward, entropy, clip fraction, staleness,
learning rate, ...). The warm-up record
has its curve of (steps, loss, held-out accuracy) and its held-out accuracy by answer length (in tokens: 7 per
term). The entropy target is per token: 0.05 nats here (responses of up to 448 tokens) against the addition
task's default 0.7 (``trainer.entropy_target``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "src", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from _harness import git_sha, write_json, write_whole  # noqa: E402

from stateshift.train import loop as loop_mod  # noqa: E402
from stateshift.train.build import build_policy, build_task  # noqa: E402
from stateshift.train.config import resolve  # noqa: E402
from stateshift.train.launch import run  # noqa: E402
from stateshift.train.report import length_bucket  # noqa: E402
from stateshift.train.warmup import heldout_accuracy, supervised_warmup  # noqa: E402

#: held-out accuracy thresholds, fixed before the runs
THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.8, 0.9)
COMMON = [
    "task.name=longtail",
    "rollout.batching=continuous",
    "trainer.old_logprob=pi_old",
    "async_training.trigger_parameter_sync_step=4",
    "async_training.partial_rollout=true",
    "run.eval_every=1000000",
    "run.progress=none",
    "run.tensorboard=false",
    "run.plot=false",
]
GPU = [
    "run.device=cuda",
    "run.torch_threads=0",
    "model.width=128",
    "model.layers=4",
    "model.heads=4",
    "model.positions=rotary",
    "task.max_terms=64",
    "task.warmup_max_terms=16",
    "rollout.max_new_tokens=448",
    "task.heldout_size=512",  # one greedy batch, as 128 was; a problem is 0.002 (0.008 at 128: one sd at 0.4 was 0.043)
    "rollout.n=8",
    "rollout.max_concurrent_prompts=32",
    "trainer.batch_prompts=16",
    "trainer.lr=3e-4",
    "trainer.steps=400",
    "warmup.steps=5000",
    "trainer.entropy_target=0.05",
    "warmup.lr=3e-3",
    "warmup.batch_size=64",
    "warmup.label_smoothing=0.0",
]
SMALL = [
    "run.device=cpu",
    "run.torch_threads=1",
    "model.width=32",
    "model.heads=2",
    "task.max_terms=6",
    "task.warmup_max_terms=3",
    "rollout.max_new_tokens=42",
    "task.heldout_size=32",
    "rollout.n=4",
    "rollout.max_concurrent_prompts=4",
    "trainer.batch_prompts=4",
    "trainer.steps=40",
    "warmup.steps=30",
    "warmup.batch_size=16",
    "warmup.label_smoothing=0.0",
    "model.positions=rotary",
    "trainer.entropy_target=0.05",
]
ARMS: dict[str, list[str]] = {
    "sync": ["async_training.mode=sync", "async_training.staleness_threshold=0"],
    "async-0.25": ["async_training.staleness_threshold=0.25"],
    "async-0.5": ["async_training.staleness_threshold=0.5"],
}


def accuracy_by_length(lm: Any, task: Any, items: list[Any], max_new_tokens: int) -> tuple[float, dict[str, Any]]:
    """Held-out accuracy of ``items``, overall and by answer length (in the buckets of the runs'
    ``accuracy_by_length``): one greedy pass over each bucket, the overall figure their weighted sum."""
    buckets: dict[str, list[Any]] = {}
    for p in items:
        buckets.setdefault(length_bucket(len(p.answer)), []).append(p)
    by_length, exact = {}, 0.0
    for name, bucket in sorted(buckets.items(), key=lambda kv: len(kv[1][0].answer)):
        acc = heldout_accuracy(lm, task, max_new_tokens, items=bucket)
        by_length[name] = {"problems": len(bucket), "accuracy": acc}
        exact += acc * len(bucket)
    return exact / len(items), by_length


def warm_weights(
    overrides: list[str], seed: int, target: float | None = None, every: int = 500
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The seed's supervised warm-up: (weights on the host, its record).

    Runs ``warmup.steps`` at most, in chunks of ``every`` steps with one optimizer throughout; after each chunk the
    held-out accuracy is measured in one greedy pass (its time is not counted in ``warmup_s``) and, once it reaches
    ``target``, the warm-up stops there. The record: seconds, steps run, last loss, the curve of (steps, loss,
    held-out accuracy), and the held-out accuracy at the end overall and by answer length (``accuracy_by_length``,
    measured once: a greedy pass per length bucket runs up to about 940 decode steps in all, one pass over every
    problem 448, and on the GPU a step costs about the same at any batch)."""
    cfg = resolve(None, [*overrides, f"run.seed={seed}"])
    task = build_task(cfg)
    policy = build_policy(cfg, task)
    stepper = policy.warmup_stepper(cfg.warmup.lr)
    items = task.heldout()
    curve: list[tuple[int, float, float]] = []
    done, secs, loss = 0, 0.0, float("nan")
    while done < cfg.warmup.steps:
        n = min(every, cfg.warmup.steps - done)
        out = supervised_warmup(
            policy.lm, task, dataclasses.replace(cfg.warmup, steps=n), seed=seed * 1_000_003 + done, stepper=stepper
        )
        done, secs, loss = done + n, secs + out["warmup_s"], out["warmup_loss"]
        accuracy = heldout_accuracy(policy.lm, task, cfg.rollout.max_new_tokens, items=items)
        curve.append((done, loss, accuracy))
        print(f"  warm-up step {done}: loss {loss:.3f}, held-out {accuracy:.3f}", flush=True)
        if target is not None and accuracy >= target:
            break
    accuracy, by_length = accuracy_by_length(policy.lm, task, items, cfg.rollout.max_new_tokens)
    record = {
        "seed": seed,
        "warmup_s": secs,
        "warmup_steps": done,
        "warmup_target": target,
        "warmup_loss": loss,
        "warmup_curve": curve,
        "heldout_accuracy": accuracy,
        "heldout_accuracy_by_length": by_length,
    }
    return {k: v.detach().cpu().clone() for k, v in policy.model.state_dict().items()}, record


def warm_start(
    overrides: list[str], seed: int, target: float | None, path: Path | None, every: int = 500
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``warm_weights``, or its result read back from ``path`` when that file exists (written there otherwise):
    a later call (the seeds of a second GPU call) starts RL from the same weights. Read with
    ``torch.load(weights_only=True)``: tensors, numbers and strings only, no code.

    Raises:
        SystemExit: the file's warm-up ran with other settings (``overrides``, seed, target or ``every``)."""
    if path is not None and path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        made = saved["record"].get("made_with")
        if made != {"overrides": overrides, "seed": seed, "target": target, "every": every}:
            raise SystemExit(f"{path}: its warm-up ran with other settings ({made}); not this run's")
        return saved["weights"], {**saved["record"], "read_from": path.name}
    weights, record = warm_weights(overrides, seed, target, every)
    record["made_with"] = {"overrides": overrides, "seed": seed, "target": target, "every": every}
    if path is not None:  # whole or absent: a call killed while writing leaves no half file to be read back
        write_whole(path, lambda part: torch.save({"weights": weights, "record": record}, part))
    return weights, record


class Snapshots:
    """Patches ``AsyncLoop.train_step``: after a step that ends ``every_s`` past the last copy, the trainer's weights
    go to host with the RL wall time and samples trained so far; the copy's own time is moved out of the clock."""

    def __init__(self, every_s: float) -> None:
        self.every_s, self.taken, self.last = every_s, [], 0.0
        self.original = loop_mod.AsyncLoop.train_step

    def __enter__(self) -> Snapshots:
        snaps = self

        def train_step(loop: Any) -> dict[str, Any]:
            rec = snaps.original(loop)
            wall = time.perf_counter() - loop.t_start
            if wall - snaps.last >= snaps.every_s or not snaps.taken:
                t0 = time.perf_counter()
                snap = loop.trainer.sync_snapshot()
                weights = {k: v.clone() for k, v in snap.tensors().items()}
                loop.trainer.release(snap)
                samples = (loop.step + 1) * loop.cfg.trainer.batch_prompts * loop.cfg.async_training.require_batches
                snaps.taken.append((wall, samples * loop.cfg.rollout.n, weights))
                snaps.last = wall
                loop.t_start += time.perf_counter() - t0  # the copy is not RL time
            return rec

        loop_mod.AsyncLoop.train_step = train_step  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        loop_mod.AsyncLoop.train_step = self.original  # type: ignore[method-assign]


#: per-step metrics each run keeps (``trace``): what explains a curve that rises and falls
TRACE_KEYS = (
    "step",
    "wall_s",
    "reward",
    "accuracy",
    "response_length",
    "entropy",
    "entropy_coef",
    "clip_fraction",
    "kl_current_proximal",
    "staleness_mean",
    "lr",
    "zero_advantage_groups",
)


def trace(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's ``metrics.jsonl`` records cut to ``TRACE_KEYS``, a row per trainer step (4 significant digits; a
    key a record lacks is ``None``)."""

    def cut(v: Any) -> Any:
        return float(f"{v:.4g}") if isinstance(v, float) else v

    return {"keys": list(TRACE_KEYS), "rows": [[cut(r.get(k)) for k in TRACE_KEYS] for r in recs]}


def start_accuracy(overrides: list[str], weights: dict[str, torch.Tensor]) -> float:
    """The held-out accuracy of ``weights``: where every arm and seed that starts RL from them starts. The held-out
    set is fixed (independent of the seed) and the evaluation greedy, so one measurement serves them all."""
    cfg = resolve(None, [*overrides, "warmup.steps=0"])
    task = build_task(cfg)
    policy = build_policy(cfg, task)
    policy.model.load_state_dict(weights)
    return heldout_accuracy(policy.lm, task, cfg.rollout.max_new_tokens)


def run_arm(
    overrides: list[str],
    seed: int,
    weights: dict[str, torch.Tensor],
    budget_s: float,
    snap_s: float,
    out: Path,
    start: float,
) -> dict[str, Any]:
    """One RL run from ``weights``; its curve of (wall s, samples, held-out accuracy), evaluated after the run.

    ``start``: the held-out accuracy of ``weights`` (``start_accuracy``). The run's own evaluations at the start
    and the end of RL (both out of its wall time) are left out: the first is ``start`` again, the second is
    the last snapshot's evaluation (the run's summary says ``NaN`` for it)."""
    cfg = resolve(
        None, [*overrides, f"run.seed={seed}", "warmup.steps=0", f"run.max_wall_s={budget_s}", f"run.out_dir={out}"]
    )

    def policy_from_warmup(c: Any, task: Any) -> Any:
        policy = build_policy(c, task)
        policy.model.load_state_dict(weights)
        return policy

    real = loop_mod.heldout_accuracy

    def known(*a: Any, **k: Any) -> float:  # the loop's first evaluation (the start); any later one is measured
        loop_mod.heldout_accuracy = real
        return start

    def not_measured(_: Any) -> float:  # the loop's evaluation at the end of RL
        return float("nan")

    originals = loop_mod.build_policy, real, loop_mod.AsyncLoop.final_heldout
    loop_mod.build_policy, loop_mod.heldout_accuracy = policy_from_warmup, known
    loop_mod.AsyncLoop.final_heldout = not_measured  # type: ignore[method-assign]
    try:
        with Snapshots(snap_s) as snaps:
            result = run(cfg)
    finally:
        loop_mod.build_policy, loop_mod.heldout_accuracy, loop_mod.AsyncLoop.final_heldout = originals
    task = build_task(cfg)
    lm = build_policy(cfg, task).lm
    curve = [(0.0, 0, result.heldout_accuracy_start)]
    for wall, samples, w in snaps.taken:
        lm.module.load_state_dict(w)
        curve.append((wall, samples, heldout_accuracy(lm, task, cfg.rollout.max_new_tokens)))
    s = result.summary
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = recs[-1] if recs else {}
    return {
        "seed": seed,
        "curve": curve,
        "executor": cfg.executor,  # as resolved: 'auto' is 'process' with run.device=cuda
        "steps": result.steps,
        "rl_wall_s": last.get("wall_s", 0.0),
        "trainer_idle_ratio": last.get("trainer_idle_ratio"),
        "rollout_idle_ratio": last.get("rollout_idle_ratio"),
        "rollout_row_occupancy": last.get("rollout_row_occupancy"),
        "staleness_tokens": s["staleness_tokens"],
        "response_length_mean": statistics.fmean(r["response_length"] for r in recs) if recs else None,
        "heldout_accuracy_start": result.heldout_accuracy_start,
        "status": s["status"],
        "trace": trace(recs),
    }


def to_thresholds(run: dict[str, Any]) -> dict[str, Any]:
    """Per threshold: the first (wall s, samples) whose evaluation reached it, or ``None`` (censored)."""
    out = {}
    for th in THRESHOLDS:
        hit = next(((w, n) for w, n, acc in run["curve"] if acc >= th), None)
        out[str(th)] = {"time_s": hit[0] if hit else None, "samples": hit[1] if hit else None}
    return out


def medians(runs: list[dict[str, Any]], budget_s: float) -> dict[str, Any]:
    """Median time and samples per threshold over seeds (a censored run counts as the budget; ``censored`` says how
    many were)."""
    out = {}
    for th in THRESHOLDS:
        hits = [r["to_threshold"][str(th)] for r in runs]
        times = [h["time_s"] if h["time_s"] is not None else budget_s for h in hits]
        samples = [h["samples"] for h in hits if h["samples"] is not None]
        out[str(th)] = {
            "median_time_s": statistics.median(times),
            "censored": sum(h["time_s"] is None for h in hits),
            "median_samples_reached": statistics.median(samples) if samples else None,
        }
    return out


def comparison(arms: dict[str, list[dict[str, Any]]], budget_s: float, fast: str = "async-0.5") -> dict[str, Any]:
    """The highest threshold every sync seed reached during RL (above every sync run's accuracy at the start: one
    the warm-up already reached times nothing); the sync and ``fast`` median times to it and their ratio."""
    start = max(r["curve"][0][2] for r in arms["sync"])
    reached = [
        th
        for th in THRESHOLDS
        if th > start and all(r["to_threshold"][str(th)]["time_s"] is not None for r in arms["sync"])
    ]
    if not reached:
        return {
            "threshold": None,
            "seeds": len(arms["sync"]),
            "sync_median_s": None,
            "async_median_s": None,
            "speedup_median": None,
            "note": "no threshold above the start was reached by every sync seed",
        }
    th = max(reached)
    sync = medians(arms["sync"], budget_s)[str(th)]["median_time_s"]
    fast_m = medians(arms[fast], budget_s)[str(th)]
    return {
        "threshold": th,
        "seeds": len(arms["sync"]),
        "arm": fast,
        "sync_median_s": sync,
        "async_median_s": fast_m["median_time_s"],
        "async_censored": fast_m["censored"],
        "speedup_median": sync / fast_m["median_time_s"] if fast_m["median_time_s"] else None,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = {"sync": "tab:blue", "async-0.25": "tab:orange", "async-0.5": "tab:green"}
    for arm, runs in result["arms"].items():
        for i, r in enumerate(runs):
            w, _, acc = zip(*r["curve"], strict=True)
            ax[0].plot(w, acc, color=colors.get(arm), alpha=0.6, label=arm if i == 0 else None)
        m = result["medians"][arm]
        ax[1].plot(
            THRESHOLDS, [m[str(t)]["median_time_s"] for t in THRESHOLDS], marker="o", color=colors.get(arm), label=arm
        )
        stale: dict[int, int] = {}
        for r in runs:
            for k, v in r["staleness_tokens"].items():
                stale[int(k)] = stale.get(int(k), 0) + v
        ax[2].bar(
            [k + 0.25 * list(colors).index(arm) for k in stale],
            list(stale.values()),
            width=0.25,
            color=colors.get(arm),
            label=arm,
        )
    ax[0].set(xlabel="RL wall s (evaluation out of band)", ylabel="held-out accuracy", title="per seed")
    ax[1].set(xlabel="threshold", ylabel="median s to reach (censored = budget)", title="time to threshold")
    ax[2].set(xlabel="versions behind", ylabel="tokens trained", title="staleness")
    for a in ax:
        a.legend()
    fig.suptitle(f"long-tail task, {result['device']}: {json.dumps(result['comparison'])[:120]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(
    arms: dict[str, list[dict[str, Any]]], warm: list[dict[str, Any]], budget: float, head: dict[str, Any]
) -> dict[str, Any]:
    """The result file: ``head`` (device, settings), the warm-ups, the runs (in full per arm, and a line each in
    ``runs``: held-out accuracy at the start and at the last evaluation), medians and the comparison."""
    lines = [
        {
            "name": f"{arm}/s{r['seed']}",
            "seed": r["seed"],
            "steps": r.get("steps"),
            "wall_s": r.get("rl_wall_s"),
            "heldout_accuracy_start": r["curve"][0][2],
            "heldout_accuracy_end": r["curve"][-1][2],
            "trainer_idle_ratio": r.get("trainer_idle_ratio"),
            "status": r.get("status"),
            "executor": r.get("executor"),
        }
        for arm, rs in arms.items()
        for r in rs
    ]
    return {
        **head,
        "seeds_done": len(arms["sync"]),
        "runs": lines,
        "warmup": warm,
        "arms": arms,
        "medians": {a: medians(rs, budget) for a, rs in arms.items()},
        "comparison": comparison(arms, budget),
    }


def fits(stop_by_s: float | None, elapsed_s: float, seed_s: list[float]) -> bool:
    """Whether a seed started ``elapsed_s`` after the start would end by ``stop_by_s``, judged by the longest of
    the seeds so far (``seed_s``); the first seed, with nothing to judge by, always starts."""
    return stop_by_s is None or not seed_s or elapsed_s + max(seed_s) <= stop_by_s


def combine(paths: list[Path], out: Path) -> None:
    """Merge result files of calls that ran some seeds each (the same settings) into one, named by the first."""
    parts = [json.loads(p.read_text()) for p in paths]
    first = parts[0]
    for p, part in zip(paths[1:], parts[1:], strict=True):
        for key in ("device", "budget_s", "overrides", "arms_overrides", "thresholds", "warmup_target", "warmup_every"):
            if part.get(key) != first.get(key):
                raise SystemExit(f"{p}: {key} differs from {paths[0]}'s; not one experiment")
    arms = {a: [r for part in parts for r in part["arms"][a]] for a in ARMS}
    seeds = [r["seed"] for r in arms["sync"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"seed run twice among {paths}: {sorted(seeds)}")
    warm = [w for part in parts for w in part["warmup"]]
    head = {
        k: v for k, v in first.items() if k not in ("seeds_done", "runs", "warmup", "arms", "medians", "comparison")
    }
    head.update(seeds_asked=sum(p["seeds_asked"] for p in parts), combined_from=[p.name for p in paths])
    head["command"] = [p.get("command") for p in parts]  # each call's own
    head["total_s"] = sum(p.get("total_s", 0.0) for p in parts)
    result = summary(arms, warm, first["budget_s"], head)
    out.mkdir(parents=True, exist_ok=True)
    name = paths[0].stem
    write_json(out / f"{name}.json", result)
    plot(result, out / f"{name}.png")
    print(json.dumps(result["comparison"], indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a toy size on the CPU")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0, help="run seeds first..first+seeds-1 (split over calls)")
    ap.add_argument("--budget-s", type=float, default=None, help="RL wall seconds per run (default 15 GPU, 20 small)")
    ap.add_argument("--snap-s", type=float, default=None, help="seconds between weight copies (default budget / 6)")
    ap.add_argument(
        "--one-warmup",
        action="store_true",
        help="one warm-up (seed 0) for every seed's arms: the seeds then vary RL only (default: a warm-up per seed)",
    )
    ap.add_argument(
        "--warmup-target",
        type=float,
        default=None,
        help="stop the warm-up once its held-out accuracy (measured every --warmup-every steps) reaches this",
    )
    ap.add_argument(
        "--warmup-every",
        type=int,
        default=500,
        help="warm-up steps between held-out measurements (default 500; smaller stops nearer --warmup-target)",
    )
    ap.add_argument(
        "--warmup-file",
        type=Path,
        default=None,
        help="with --one-warmup: read the warm-up from this file if it exists, else write it there",
    )
    ap.add_argument(
        "--stop-by-s",
        type=float,
        default=None,
        help="start a seed only if it would end within this many seconds of the start, judged by the longest "
        "seed so far (the first seed always starts): a call's time limit then ends it between seeds",
    )
    ap.add_argument("--combine", nargs="+", type=Path, default=None, help="merge result files of split calls")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    args = ap.parse_intermixed_args()  # key=value overrides may come before or after the options
    if args.combine:
        combine(args.combine, args.out)
        return
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    if args.warmup_every < 1:
        ap.error("--warmup-every must be at least 1")
    if args.warmup_file is not None and not args.one_warmup:
        ap.error("--warmup-file needs --one-warmup")
    base = [*COMMON, *(SMALL if args.small else GPU), *args.overrides]
    budget = args.budget_s or (20.0 if args.small else 15.0)
    snap = args.snap_s or budget / 6
    device = "cpu (toy size)" if args.small else torch.cuda.get_device_name(0)
    tag = "cpu-small" if args.small else next((g.lower() for g in ("H100", "H200") if g in device), "gpu")
    name = f"{datetime.date.today().isoformat()}-{tag}-train-longtail"
    if args.first_seed:
        name += f"-from-seed{args.first_seed}"
    args.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    arms: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    warm: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="longtail_bench_"))
    head = {
        "benchmark": "longtail_bench",
        "device": device,
        "torch": torch.__version__,
        "stateshift": git_sha(),
        "command": " ".join(["python3", "benchmarks/longtail_bench.py", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "thresholds": list(THRESHOLDS),
        "budget_s": budget,
        "snapshot_every_s": snap,
        "overrides": base,
        "arms_overrides": ARMS,
        "one_warmup": args.one_warmup,
        "warmup_target": args.warmup_target,
        "warmup_every": args.warmup_every,
        "seeds_asked": args.seeds,
    }
    result: dict[str, Any] = {}
    weights: dict[str, torch.Tensor] = {}
    seed_s: list[float] = []  # each seed's arms, the warm-up left out

    def save() -> dict[str, Any]:  # the file, written whole: a run cut short keeps the seeds it finished
        done = summary(arms, warm, budget, {**head, "total_s": time.perf_counter() - t_all})
        write_json(args.out / f"{name}.json", done)
        return done

    for seed in range(args.first_seed, args.first_seed + args.seeds):
        if not fits(args.stop_by_s, time.perf_counter() - t_all, seed_s):
            head["stopped"] = f"before seed {seed}: it would end past --stop-by-s {args.stop_by_s:g}"
            result = save()
            print(f"stopped {head['stopped']} (longest seed so far {max(seed_s):.0f} s)", flush=True)
            break
        if not args.one_warmup or not warm:
            weights, record = warm_start(
                base, 0 if args.one_warmup else seed, args.warmup_target, args.warmup_file, args.warmup_every
            )
            warm.append(record)
            print(
                f"warm-up (seed {record['seed']}): {record['warmup_steps']} steps, {record['warmup_s']:.0f} s, loss "
                f"{record['warmup_loss']:.3f}, held-out accuracy {record['heldout_accuracy']:.3f} (by answer tokens: "
                + ", ".join(f"{k} {v['accuracy']:.2f}" for k, v in record["heldout_accuracy_by_length"].items())
                + ")",
                flush=True,
            )
            start = start_accuracy(base, weights)
        t_seed = time.perf_counter()
        for arm, extra in ARMS.items():
            r = run_arm([*base, *extra], seed, weights, budget, snap, work / f"{arm}-s{seed}", start)
            r["to_threshold"] = to_thresholds(r)
            arms[arm].append(r)
            print(
                f"seed {seed} {arm}: {r['steps']} steps, accuracy {r['curve'][0][2]:.3f} -> "
                f"{max(c[2] for c in r['curve']):.3f} (best), idle trainer {r['trainer_idle_ratio']}",
                flush=True,
            )
        seed_s.append(time.perf_counter() - t_seed)
        result = save()  # after every seed, with the plot
        plot(result, args.out / f"{name}.png")
    print(json.dumps(result["comparison"], indent=1))
    print(f"wrote {args.out / name}.json/.png in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
