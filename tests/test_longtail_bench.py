"""benchmarks/longtail_bench.py: thresholds and the comparison, merging split calls, and the warm-up file."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    """``benchmarks/longtail_bench.py`` as a module (``benchmarks/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("longtail_bench", ROOT / "benchmarks" / "longtail_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(bench, seed: int, curve: list[tuple[float, int, float]]) -> dict:
    r = {"seed": seed, "curve": curve, "staleness_tokens": {"0": 10}}
    r["to_threshold"] = bench.to_thresholds(r)
    return r


def _file(bench, path: Path, seeds: list[int], budget: float = 10.0, speed: float = 2.0) -> Path:
    """A result file of ``seeds``: sync reaches 0.1 at 8 s, each async arm at 8 / speed s."""
    arms = {
        "sync": [_run(bench, s, [(0.0, 0, 0.0), (8.0, 80, 0.1)]) for s in seeds],
        **{
            a: [_run(bench, s, [(0.0, 0, 0.0), (8.0 / speed, 40, 0.1)]) for s in seeds]
            for a in ("async-0.25", "async-0.5")
        },
    }
    head = {
        "device": "cpu (toy size)",
        "budget_s": budget,
        "overrides": ["task.name=longtail"],
        "arms_overrides": bench.ARMS,
        "thresholds": list(bench.THRESHOLDS),
        "seeds_asked": len(seeds),
        "total_s": 1.0,
        "command": f"python3 benchmarks/longtail_bench.py --first-seed {seeds[0]}",
    }
    path.write_text(json.dumps(bench.summary(arms, [{"seed": 0}], budget, head)))
    return path


def test_comparison_takes_the_highest_threshold_every_sync_seed_reached_and_counts_a_censored_async_run_as_the_budget(
    bench,
):
    sync = [_run(bench, s, [(0.0, 0, 0.0), (4.0, 40, 0.12), (8.0, 80, 0.21)]) for s in range(3)]
    sync[2] = _run(bench, 2, [(0.0, 0, 0.0), (4.0, 40, 0.12)])  # never reaches 0.2
    fast = [_run(bench, s, [(0.0, 0, 0.0), (2.0, 30, 0.15)]) for s in range(2)] + [_run(bench, 2, [(0.0, 0, 0.0)])]
    c = bench.comparison({"sync": sync, "async-0.5": fast}, budget_s=10.0)
    assert c["threshold"] == 0.1
    assert c["sync_median_s"] == 4.0
    assert c["async_median_s"] == 2.0 and c["async_censored"] == 1
    assert c["speedup_median"] == 2.0


def test_combine_merges_calls_that_ran_some_seeds_each(bench, tmp_path):
    a = _file(bench, tmp_path / "2026-12-07-h100-train-longtail.json", [0, 1, 2])
    b = _file(bench, tmp_path / "2026-12-07-h100-train-longtail-from-seed3.json", [3, 4])
    bench.combine([a, b], tmp_path / "out")
    merged = json.loads((tmp_path / "out" / a.name).read_text())
    assert [r["seed"] for r in merged["arms"]["sync"]] == [0, 1, 2, 3, 4]
    assert merged["seeds_done"] == 5 and merged["seeds_asked"] == 5
    assert merged["comparison"]["seeds"] == 5 and merged["comparison"]["speedup_median"] == 2.0
    assert merged["command"] == [f"python3 benchmarks/longtail_bench.py --first-seed {s}" for s in (0, 3)]


@pytest.mark.parametrize("why", ["budget", "seed"])
def test_combine_refuses_files_of_other_settings_or_a_seed_run_twice(bench, tmp_path, why):
    a = _file(bench, tmp_path / "a.json", [0, 1])
    b = _file(bench, tmp_path / "b.json", [1] if why == "seed" else [2], budget=20.0 if why == "budget" else 10.0)
    with pytest.raises(SystemExit, match="budget_s differs" if why == "budget" else "seed run twice"):
        bench.combine([a, b], tmp_path / "out")
    assert not (tmp_path / "out" / "a.json").exists()


def test_warm_start_writes_the_warmup_once_and_reads_it_back(bench, tmp_path, monkeypatch):
    calls = []

    def warm(overrides, seed, target, every):
        calls.append(seed)
        return {"w": torch.arange(4.0)}, {"seed": seed, "warmup_steps": 500, "warmup_curve": [(500, 0.1, 0.25)]}

    monkeypatch.setattr(bench, "warm_weights", warm)
    path = tmp_path / "warm.pt"
    w1, r1 = bench.warm_start([], 0, None, path)
    w2, r2 = bench.warm_start([], 0, None, path)
    assert calls == [0]
    assert torch.equal(w2["w"], w1["w"]) and r2["warmup_steps"] == 500 and r2["read_from"] == "warm.pt"
    assert [f.name for f in tmp_path.iterdir()] == ["warm.pt"]
    with pytest.raises(SystemExit, match="other settings"):
        bench.warm_start(["task.max_terms=32"], 0, None, path)
    with pytest.raises(SystemExit, match="other settings"):  # measured at other steps: stopped elsewhere
        bench.warm_start([], 0, None, path, every=100)
    assert calls == [0]


def test_warm_start_killed_while_writing_leaves_no_file_to_read_back(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "warm_weights", lambda o, seed, t, every: ({"w": torch.zeros(2)}, {"seed": seed}))

    def killed(obj, f):
        Path(f).write_bytes(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # the kill, half-way through the write

    monkeypatch.setattr(bench.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        bench.warm_start([], 0, None, tmp_path / "warm.pt")
    assert not (tmp_path / "warm.pt").exists()


class _Boom:
    def __reduce__(self):
        return (print, ("a pickled call ran",))


def test_warm_start_refuses_a_file_that_would_run_code(bench, tmp_path):
    path = tmp_path / "warm.pt"
    with path.open("wb") as f:
        pickle.dump({"weights": {}, "record": _Boom()}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        bench.warm_start([], 0, None, path)


def test_comparison_skips_thresholds_the_warmup_already_reached(bench):
    """Every arm starts where the warm-up left it: a threshold reached at 0 s times nothing."""
    sync = [_run(bench, s, [(0.0, 0, 0.32), (6.0, 60, 0.36)]) for s in range(2)]
    fast = [_run(bench, s, [(0.0, 0, 0.32), (3.0, 30, 0.36)]) for s in range(2)]
    c = bench.comparison({"sync": sync, "async-0.5": fast}, budget_s=10.0)
    assert c["threshold"] == 0.35 and c["speedup_median"] == 2.0
    flat = [_run(bench, s, [(0.0, 0, 0.32), (6.0, 60, 0.32)]) for s in range(2)]
    assert bench.comparison({"sync": flat, "async-0.5": fast}, budget_s=10.0)["threshold"] is None


def test_trace_keeps_the_named_metrics_of_every_step_rounded(bench):
    recs = [{"step": 1, "reward": 0.123456789, "entropy": 2.0, "other": 5}, {"step": 2, "wall_s": 1.5}]
    t = bench.trace(recs)
    assert t["keys"] == list(bench.TRACE_KEYS) and len(t["rows"]) == 2
    first = dict(zip(t["keys"], t["rows"][0], strict=True))
    assert first["step"] == 1 and first["reward"] == 0.1235 and first["entropy"] == 2.0 and first["wall_s"] is None
    assert "other" not in t["keys"]
    json.dumps(t)  # the result file is JSON


def test_a_result_killed_while_being_written_keeps_the_last_whole_one(bench, tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    bench.write_json(path, {"seeds_done": 1})
    real = Path.write_text

    def killed(self, text, *a, **k):
        real(self, text[: len(text) // 2])
        raise KeyboardInterrupt  # the call's time limit, half-way through the write

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        bench.write_json(path, {"seeds_done": 2, "runs": list(range(100))})
    monkeypatch.setattr(Path, "write_text", real)
    assert json.loads(path.read_text()) == {"seeds_done": 1}


def test_a_seed_starts_only_if_the_longest_so_far_would_end_by_the_stop(bench):
    assert bench.fits(None, 1e9, [100.0]) and bench.fits(400.0, 1e9, [])  # no stop; the first seed always starts
    assert bench.fits(400.0, 250.0, [120.0, 150.0]) and not bench.fits(400.0, 251.0, [120.0, 150.0])


def test_stop_by_ends_between_seeds_with_the_file_and_its_plot_whole(bench, tmp_path, monkeypatch):
    clock = [0.0]
    record = {"seed": 0, "warmup_steps": 1, "warmup_s": 1.0, "warmup_loss": 0.1, "heldout_accuracy": 0.0}

    def run_arm(overrides, seed, weights, budget, snap, out, start):
        clock[0] += 50.0  # three arms: 150 s a seed
        curve = [(0.0, 0, 0.0), (5.0, 40, 0.1)]
        return {"seed": seed, "curve": curve, "steps": 3, "trainer_idle_ratio": 0.5, "staleness_tokens": {"0": 1}}

    monkeypatch.setattr(bench, "time", type("T", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(bench, "warm_start", lambda *a: ({}, {**record, "heldout_accuracy_by_length": {}}))
    monkeypatch.setattr(bench, "run_arm", run_arm)
    monkeypatch.setattr(bench, "start_accuracy", lambda *a: 0.0)
    argv = [
        "longtail_bench.py",
        "--small",
        "--one-warmup",
        "--seeds",
        "5",
        "--stop-by-s",
        "400",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(bench.sys, "argv", argv)
    bench.main()
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert data["seeds_done"] == 2 and data["stopped"].startswith("before seed 2")  # 300 s + 150 > 400
    assert path.with_suffix(".png").exists() and data["comparison"]["seeds"] == 2


@pytest.mark.slow
def test_an_arm_evaluates_only_its_snapshots_and_starts_at_the_accuracy_measured_once(bench, tmp_path, monkeypatch):
    """The loop's own evaluations at the start and the end of RL do not run in an arm: the start is the accuracy
    measured once on the same weights (the held-out set is fixed, the evaluation greedy), the end is the last
    snapshot's."""
    base = [*bench.COMMON, *bench.SMALL]
    cfg = bench.resolve(None, [*base, "warmup.steps=0"])
    weights = bench.build_policy(cfg, bench.build_task(cfg)).model.state_dict()
    start = bench.start_accuracy(base, weights)
    evaluated = []
    real = bench.heldout_accuracy

    def counted(*a, **k):
        evaluated.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(bench, "heldout_accuracy", counted)
    monkeypatch.setattr(bench.loop_mod, "heldout_accuracy", counted)
    r = bench.run_arm([*base, "trainer.steps=3"], 0, weights, 60.0, 0.0, tmp_path / "arm", start)
    assert r["steps"] == 3 and r["curve"][0] == (0.0, 0, start)
    assert len(evaluated) == len(r["curve"]) - 1 == 3  # one per snapshot (one a step here), none in the loop
    assert bench.loop_mod.heldout_accuracy is counted  # (restored after the run)
    assert bench.loop_mod.AsyncLoop.final_heldout.__name__ == "final_heldout"
