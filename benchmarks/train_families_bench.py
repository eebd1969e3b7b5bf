"""``stateshift train`` per model family on one GPU: builtin, megatron, fsdp2 and hf on the default task, param
offload on, ``pi_old`` mode, several seeds each -> held-out accuracy at the start and end of every run, the share
of step time stateshift's verbs take, and two checks of them (JSON + PNG, a printed table).

    python3 benchmarks/train_families_bench.py [key=value ...] [--out DIR] [--seeds 3] [--steps 300] [--budget-s 15]
                                               [--families builtin megatron fsdp2 hf]
    python3 benchmarks/train_families_bench.py --small --out /tmp/fam    # a toy size on the CPU (checks the path)
    python3 benchmarks/train_families_bench.py --combine A.json B.json --out DIR   # calls that ran some families each

(``key=value`` config overrides for every run come first: the list options would take them otherwise.)

Every run: ``stateshift train`` with ``run.device=cuda``, ``trainer.param_offload=true``,
``trainer.old_logprob=pi_old``, the default task (addition) and model shape (width 64, 2 layers, 4 heads), the
default warm-up (400 steps), ``run.seed`` 0..N-1, ``trainer.steps=--steps`` (the learning-rate schedule decays
over these) and ``run.max_wall_s=--budget-s`` (a cap: a slower family ends earlier, its ``status`` says so). Each
run is a subprocess of its own (Megatron's and FSDP2's process-global state, CUDA errors cannot leak into the
next). Family ``hf``: a Llama-shaped transformers model of the same size, the task's vocabulary, randomly
initialised from a ``config.json`` this script writes (no network; the warm-up teaches it like the others).

Per run (``"runs"``): ``family``, ``seed``, ``heldout_accuracy_start`` (after the warm-up),
``heldout_accuracy_end``, ``stateshift_verbs_fraction_of_step`` (``rl_gpu_train.verbs_fraction_of_step``: the
verbs' host seconds over the sum of the trainer's step times), steps, wall time, status, the held-out curve.
``"checks"`` (``checks()``), reported as they come out: per family, the smallest rise (end - start) over its seeds
exceeds twice the spread (max - min) of its final accuracies; per run, the verbs fraction is below 0.05. A family
with a failed or missing run fails its check.

GPU time at the defaults (an estimate, not measured yet): 12 runs x (about 10 s of process start and imports, the
rollouter's own process with ``executor=auto`` on CUDA, a few seconds of warm-up, at most 15 s of RL, the
evaluations), 5 to 8 minutes; the result file is rewritten after every run, so a call cut short keeps the runs
it finished. ``--small``: ``run.device=cpu``, a smaller model, 2 seeds, 20 RL steps: the path and the checks'
arithmetic, no accuracy claims (Megatron on the CPU through the test patch, ``STATESHIFT_MCORE_DEVICE=cpu``;
about 1.5 minutes on 2 cores). Writes ``<out>/<date>-<h100|h200>-train-families.json`` and ``.png``
(``--small``: ``<date>-cpu-small-train-families``).

How long is long enough: the default builtin run on a shared 2-core CPU went 0.20 -> 0.36 held-out in 300 steps
(the schedule over 300) and 0.20 -> 0.56 in 600, the hf family's Llama 0.135 -> 0.23 in 300 (one seed each);
2,000 steps gave 0.17 -> 0.96-0.98 over three seeds (``2026-12-03-cpu-train.json``). At 300 steps the rise check
may well fail on noise between seeds; ``--steps 600 --budget-s 35`` is the next size, about twice the GPU time:
run it as two calls of two families each (``--families builtin megatron``, then ``--families fsdp2 hf``, each
``--out`` its own directory) and merge the two files with ``--combine``. ``--jobs N`` runs N at once: these models
are small and the runs host-bound, so N runs share one GPU and the machine's cores, each slower than alone (give
each fewer threads, ``run.torch_threads=2``); the file records ``jobs``.
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
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "src", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from rl_gpu_train import verbs_fraction_of_step  # noqa: E402

FAMILIES = ("builtin", "megatron", "fsdp2", "hf")
COMMON = [
    "trainer.param_offload=true",
    "trainer.old_logprob=pi_old",
    "run.progress=none",
    "run.tensorboard=false",
    "run.plot=false",
]
GPU = ["run.device=cuda", "run.eval_every=50"]
SMALL = [
    "run.device=cpu",
    "run.torch_threads=1",
    "model.width=32",
    "model.heads=2",
    "warmup.steps=30",
    "warmup.batch_size=32",
    "task.heldout_size=50",
    "trainer.batch_prompts=4",
    "rollout.n=4",
    "rollout.max_concurrent_prompts=4",
    "run.eval_every=10",
]
#: the hf family's model: the built-in's size (width 64, 2 layers, 4 heads; --small: width 32, 2 heads)
HF_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32,
}
#: the two criteria: a family's smallest rise > RISE_FACTOR x the spread of its finals; verbs below VERBS_MAX
RISE_FACTOR = 2.0
VERBS_MAX = 0.05


def make_hf_dir(path: Path, small: bool = False) -> Path:
    """A local Hugging Face model directory for ``model.family=hf``: a Llama ``config.json`` (no weights: the run
    initialises it from the config with its seed) over the addition task's vocabulary.

    Args:
        path: the directory to write.
        small: the ``--small`` shape (width 32, 2 heads).

    Returns:
        ``path``.
    """
    import transformers

    from stateshift.train.build import build_task
    from stateshift.train.config import resolve

    vocab = build_task(resolve(None, [])).vocab_size
    shape = {
        **HF_SHAPE,
        **(
            {"hidden_size": 32, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
            if small
            else {}
        ),
    }
    transformers.LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **shape).save_pretrained(path)
    return path


def child(name: str, run_dir: Path, overrides: list[str]) -> None:
    """One run (``name`` = ``family/s<seed>``) -> ``run_dir/result.json``: summary, metrics records, start and end."""
    if os.environ.get("STATESHIFT_MCORE_DEVICE") == "cpu":  # --small: Megatron on the CPU through the test patch
        from megatron_bench import patch_megatron_for_cpu

        patch_megatron_for_cpu()
    from stateshift.train.config import resolve
    from stateshift.train.launch import run

    family, seed = split_name(name)
    cfg = resolve(None, [*COMMON, f"model.family={family}", f"run.seed={seed}", *overrides, f"run.out_dir={run_dir}"])
    res = run(cfg)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "result.json").write_text(
        json.dumps(
            {
                "name": name,
                "summary": res.summary,
                "records": recs,
                "steps": res.steps,
                "wall_s": res.wall_s,
                "heldout_accuracy_start": res.heldout_accuracy_start,
                "heldout_accuracy_end": res.heldout_accuracy_end,
            }
        )
    )


def split_name(name: str) -> tuple[str, int]:
    """``"fsdp2/s1"`` -> ``("fsdp2", 1)``."""
    family, _, seed = name.partition("/s")
    return family, int(seed)


def per_run(r: dict[str, Any]) -> dict[str, Any]:
    """The result file's entry for one run's ``result.json``."""
    s, recs = r["summary"], r["records"]
    family, seed = split_name(r["name"])
    last = recs[-1] if recs else {}
    trainer = s.get("config", {}).get("trainer", {})
    return {
        "name": r["name"],
        "family": family,
        "seed": seed,
        "steps": r["steps"],
        "wall_s": round(r["wall_s"], 2),
        "heldout_accuracy_start": r["heldout_accuracy_start"],
        "heldout_accuracy_end": r["heldout_accuracy_end"],
        "rise": round(r["heldout_accuracy_end"] - r["heldout_accuracy_start"], 4),
        "stateshift_verbs_s": round(s["verbs_s"], 4),
        "stateshift_verbs_fraction_of_step": verbs_fraction_of_step(s, recs),
        # per verb and group (a prefetched onload: onload.<group> to issue it, prefetch_wait.<group> waited for)
        "stateshift_verbs_s_by_verb": {k: round(v, 4) for k, v in s.get("offload", {}).get("seconds", {}).items()},
        "prefetch": trainer.get("prefetch"),
        "freed_memory": trainer.get("freed_memory"),
        "trainer_idle_ratio": last.get("trainer_idle_ratio"),
        "executor": s.get("rollout", {}).get("executor"),
        "param_bytes": s["sync"]["param_bytes"],
        "status": s["status"],
        "heldout_curve": [[x["step"], x["heldout_accuracy"]] for x in recs if x.get("heldout_accuracy") is not None],
    }


def checks(runs: list[dict[str, Any]], families: list[str], seeds: int) -> dict[str, Any]:
    """The two criteria over the runs that finished, pass or fail as they come out.

    Args:
        runs: ``per_run`` entries (``family``, ``seed``, ``heldout_accuracy_start`` / ``_end``,
            ``stateshift_verbs_fraction_of_step``).
        families: the families asked for (one with no run, or fewer than ``seeds``, fails its check).
        seeds: runs asked for per family.

    Returns:
        ``{"rise_vs_spread": {family: {...}}, "verbs_fraction": {name: {...}}, "all_pass": bool}``.
    """
    rise: dict[str, Any] = {}
    for fam in families:
        mine = [r for r in runs if r["family"] == fam]
        rises = [r["heldout_accuracy_end"] - r["heldout_accuracy_start"] for r in mine]
        ends = [r["heldout_accuracy_end"] for r in mine]
        smallest, spread = (min(rises), max(ends) - min(ends)) if mine else (None, None)
        complete = len(mine) == seeds and seeds >= 2
        rise[fam] = {
            "seeds": len(mine),
            "smallest_rise": _r(smallest),
            "spread_of_final": _r(spread),
            "pass": bool(complete and smallest is not None and smallest > RISE_FACTOR * spread),
        }
        if not complete:
            rise[fam]["note"] = f"{len(mine)} of {seeds} runs finished (at least 2 needed)"
    verbs = {
        r["name"]: {
            "fraction": _r(r["stateshift_verbs_fraction_of_step"], 5),
            "pass": r["stateshift_verbs_fraction_of_step"] is not None
            and r["stateshift_verbs_fraction_of_step"] < VERBS_MAX,
        }
        for r in runs
    }
    return {
        "criteria": f"per family: smallest rise (end - start) > {RISE_FACTOR:g} x spread (max - min) of the final "
        f"accuracies; per run: stateshift_verbs_fraction_of_step < {VERBS_MAX:g}",
        "rise_vs_spread": rise,
        "verbs_fraction": verbs,
        "all_pass": all(v["pass"] for v in rise.values())
        and len(verbs) == len(families) * seeds
        and all(v["pass"] for v in verbs.values()),
    }


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def plot(result: dict[str, Any], path: Path) -> None:
    """Held-out accuracy per step of every run (colour: family) and each run's verbs fraction against 0.05."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.6))
    colours = {f: f"C{i}" for i, f in enumerate(FAMILIES)}
    for r in result["runs"]:
        pts = [
            (0, r["heldout_accuracy_start"]),
            *(tuple(p) for p in r["heldout_curve"]),
            (r["steps"], r["heldout_accuracy_end"]),
        ]
        ax[0].plot(
            *zip(*pts, strict=True),
            marker="o",
            ms=3,
            color=colours.get(r["family"], "k"),
            ls=("-", "--", ":", "-.")[r["seed"] % 4],
            label=r["name"],
        )
    ax[0].set(
        xlabel="trainer step",
        ylabel="held-out exact match (greedy)",
        ylim=(0, 1),
        title="held-out accuracy (step 0: after the warm-up)",
    )
    ax[0].legend(fontsize=7, ncol=2)
    names = [r["name"] for r in result["runs"]]
    ax[1].barh(
        names,
        [100 * (r["stateshift_verbs_fraction_of_step"] or 0) for r in result["runs"]],
        color=[colours.get(r["family"], "k") for r in result["runs"]],
    )
    ax[1].axvline(100 * VERBS_MAX, color="grey", ls="--", lw=0.8)
    ax[1].set(xlabel="stateshift verbs, % of trainer step time", title=f"verbs vs the {100 * VERBS_MAX:g}% line")
    ok = "all checks pass" if result["checks"]["all_pass"] else "checks: not all pass"
    fig.suptitle(f"stateshift train per family on {result['machine']}, param offload, pi_old ({ok})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict[str, Any]) -> str:
    """The runs, one line each, then the checks."""
    lines = [f"{'run':12} {'steps':>6} {'wall':>6} {'acc0':>6} {'acc':>6} {'rise':>6} {'verbs%':>7} status"]
    for r in result["runs"]:
        lines.append(
            f"{r['name']:12} {r['steps']:6d} {r['wall_s']:6.1f} {r['heldout_accuracy_start']:6.3f} "
            f"{r['heldout_accuracy_end']:6.3f} {r['rise']:6.3f} "
            f"{100 * (r['stateshift_verbs_fraction_of_step'] or 0):7.2f} {r['status']}"
        )
    c = result["checks"]
    for fam, v in c["rise_vs_spread"].items():
        spread = v["spread_of_final"]
        lines.append(
            f"{fam:9} smallest rise {v['smallest_rise']} vs 2 x spread "
            f"{'-' if spread is None else round(2 * spread, 3)} (spread {spread}): "
            f"{'pass' if v['pass'] else 'FAIL'} {v.get('note', '')}"
        )
    bad = [n for n, v in c["verbs_fraction"].items() if not v["pass"]]
    lines.append(f"verbs < {VERBS_MAX:g} of step time: {'pass' if not bad else 'FAIL in ' + ', '.join(bad)}")
    lines.append(f"all checks pass: {c['all_pass']}")
    return "\n".join(lines)


def run_one(
    name: str, work: Path, overrides: list[str], timeout_s: float, env: dict[str, str]
) -> tuple[dict[str, Any] | None, str]:
    """``name`` in a subprocess under ``work``: (its ``per_run`` entry or None, the tail of its output)."""
    run_dir = work / name.replace("/", "-")
    cmd = [sys.executable, __file__, "--child", name, str(run_dir), *overrides]
    try:
        proc = subprocess.run(cmd, text=True, capture_output=True, check=False, timeout=timeout_s, env=env)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
    if code != 0:
        return None, f"exit {code}: {out[-3000:]}"
    return per_run(json.loads((run_dir / "result.json").read_text())), out[-600:]


#: fields of a result file that belong to the call that wrote it (``combine`` keeps each call's in ``parts``; the
#: top-level ``command`` joins them)
PER_CALL = ("command", "stateshift", "steps", "budget_s", "jobs", "settings")


def combine(paths: list[Path], out: Path) -> dict[str, Any]:
    """Result files of calls that ran different families (``--families``, to stay under a per-call time limit) as
    one: their runs and failures together, the checks recomputed over them, written to ``out`` under the first
    file's name (with its PNG).

    Args:
        paths: result files of this script with the same seeds (each call's ``PER_CALL`` fields are kept in
            ``parts``; where the calls differ, the top-level field is ``None``).
        out: the directory to write the combined file to.

    Returns:
        The combined result.

    Raises:
        SystemExit: a run (family and seed) is in more than one file.
    """
    parts = [json.loads(p.read_text()) for p in paths]
    result = {**parts[0], "command": " + ".join(p["command"] for p in parts), "runs": [], "failures": {}}
    result["parts"] = [
        {"families": sorted({r["family"] for r in p["runs"]}), **{k: p.get(k) for k in PER_CALL}} for p in parts
    ]
    for k in PER_CALL:  # a field the calls disagree on is only in "parts", never one call's value for all
        if k != "command" and len({json.dumps(p.get(k)) for p in parts}) > 1:
            result[k] = None
    names = [r["name"] for p in parts for r in p["runs"]] + [n for p in parts for n in p["failures"]]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise SystemExit(f"combine: {', '.join(twice)} in more than one file; drop one first")
    for p in parts:
        result["runs"] += p["runs"]
        result["failures"].update(p["failures"])
    done = {r["family"] for r in result["runs"]} | {n.split("/")[0] for n in result["failures"]}
    result["checks"] = checks(result["runs"], [f for f in FAMILIES if f in done], max(p["seeds"] for p in parts))
    result["all_checks_pass"] = result["checks"]["all_pass"]
    out.mkdir(parents=True, exist_ok=True)
    from _harness import write_json

    write_json(out / paths[0].name, result)
    if result["runs"]:
        plot(result, (out / paths[0].name).with_suffix(".png"))
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--seeds", type=int, default=None, help="runs per family, run.seed 0..N-1 (default 3; --small 2)")
    ap.add_argument("--steps", type=int, default=None, help="trainer.steps (default 300; --small 20)")
    ap.add_argument("--budget-s", type=float, default=15.0, help="run.max_wall_s: seconds of RL per run at most")
    ap.add_argument("--small", action="store_true", help="a toy size on the CPU: the path, not the numbers")
    ap.add_argument(
        "--jobs", type=int, default=1, help="runs at once (they share the GPU and the cores: each runs slower)"
    )
    ap.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="merge result files of calls that ran different --families into one under --out, and exit",
    )
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    args.seeds = args.seeds or (2 if args.small else 3)
    args.steps = args.steps or (20 if args.small else 300)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]), args.overrides)
        return 0
    if args.combine:
        print(table(combine(args.combine, args.out)))
        return 0
    import torch
    from _harness import git_sha, write_json

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.small else "cpu"
    slug = "cpu-small" if args.small else "h100" if "H100" in device else "h200" if "H200" in device else "gpu"
    stem = f"{datetime.date.today():%Y-%m-%d}-{slug}-train-families"
    work = Path(tempfile.mkdtemp(prefix="train-families-"))
    hf_dir = make_hf_dir(work / "hf-model", small=args.small)
    base = [*(SMALL if args.small else GPU), f"trainer.steps={args.steps}", f"run.max_wall_s={args.budget_s}"]
    env = dict(os.environ, **({"STATESHIFT_MCORE_DEVICE": "cpu"} if args.small else {}))
    result: dict[str, Any] = {
        "machine": f"1x {device}" if device != "cpu" else "cpu",
        "torch": torch.__version__,
        "stateshift": git_sha(),
        "date": f"{datetime.date.today()}",
        "command": "python3 benchmarks/train_families_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "small": args.small,
        "seeds": args.seeds,
        "steps": args.steps,
        "budget_s": args.budget_s,
        "jobs": args.jobs,
        "settings": [*COMMON, *base, *args.overrides],
        "hf_model": HF_SHAPE,
        "all_checks_pass": False,
        "runs": [],
        "failures": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    names = [f"{fam}/s{seed}" for fam in args.families for seed in range(args.seeds)]
    t_all = time.perf_counter()

    def launch(name: str) -> tuple[dict[str, Any] | None, str, float]:
        extra = [f"model.hf_path={hf_dir}"] if name.startswith("hf/") else []
        t0 = time.perf_counter()
        entry, tail = run_one(name, work, [*base, *extra, *args.overrides], args.budget_s + 240, env)
        return entry, tail, time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is a subprocess: threads only wait
        futures = {pool.submit(launch, name): name for name in names}
        for k, future in enumerate(as_completed(futures)):
            name = futures[future]
            entry, tail, took = future.result()
            print(
                f"== [{k + 1}/{len(names)}] {name}: {'ok' if entry else 'FAILED'} in {took:.0f} s "
                f"({time.perf_counter() - t_all:.0f} s so far)",
                flush=True,
            )
            if entry is None:
                result["failures"][name] = tail
                print(tail, flush=True)
            else:
                result["runs"].append(entry)
                frac = 100 * (entry["stateshift_verbs_fraction_of_step"] or 0)
                print(
                    f"   {entry['steps']} steps, held-out {entry['heldout_accuracy_start']:.3f} -> "
                    f"{entry['heldout_accuracy_end']:.3f}, verbs {frac:.2f}% of step time, {entry['status']}",
                    flush=True,
                )
            result["runs"].sort(key=lambda r: names.index(r["name"]))
            result["checks"] = checks(result["runs"], args.families, args.seeds)
            result["all_checks_pass"] = result["checks"]["all_pass"]
            write_json(args.out / f"{stem}.json", result)  # after every run, whole: a cut keeps the rest
    if result["runs"]:
        plot(result, args.out / f"{stem}.png")
    print(table(result))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
