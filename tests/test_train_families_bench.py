"""benchmarks/train_families_bench.py: the two checks it reports, its hf model directory, and its --small path."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    """``benchmarks/train_families_bench.py`` as a module (``benchmarks/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "train_families_bench", ROOT / "benchmarks" / "train_families_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(family: str, seed: int, start: float, end: float, verbs: float | None = 0.01) -> dict:
    return {
        "name": f"{family}/s{seed}",
        "family": family,
        "seed": seed,
        "heldout_accuracy_start": start,
        "heldout_accuracy_end": end,
        "stateshift_verbs_fraction_of_step": verbs,
    }


def test_checks_pass_when_every_rise_beats_twice_the_spread_and_verbs_stay_under_five_percent(bench):
    runs = [_run("builtin", s, 0.2, end) for s, end in enumerate((0.90, 0.95, 0.92))]
    c = bench.checks(runs, ["builtin"], 3)
    assert c["rise_vs_spread"]["builtin"] == {"seeds": 3, "smallest_rise": 0.7, "spread_of_final": 0.05, "pass": True}
    assert c["all_pass"] and all(v["pass"] for v in c["verbs_fraction"].values())


def test_a_rise_not_above_twice_the_spread_fails_its_family_only(bench):
    runs = [_run("hf", s, 0.2, end) for s, end in enumerate((0.3, 0.5, 0.4))]  # smallest rise 0.1, spread 0.2
    runs += [_run("builtin", s, 0.2, 0.9) for s in range(3)]
    c = bench.checks(runs, ["builtin", "hf"], 3)
    assert not c["rise_vs_spread"]["hf"]["pass"] and c["rise_vs_spread"]["builtin"]["pass"]
    assert not c["all_pass"]
    tied = bench.checks([_run("hf", s, 0.0, 0.4 if s else 0.2) for s in range(2)], ["hf"], 2)  # 0.2 > 2 x 0.2: no
    assert not tied["rise_vs_spread"]["hf"]["pass"]


def test_verbs_at_or_above_five_percent_or_unknown_fail_their_run(bench):
    runs = [_run("fsdp2", 0, 0.2, 0.9, 0.049), _run("fsdp2", 1, 0.2, 0.9, 0.05), _run("fsdp2", 2, 0.2, 0.9, None)]
    c = bench.checks(runs, ["fsdp2"], 3)
    assert [v["pass"] for v in c["verbs_fraction"].values()] == [True, False, False]
    assert c["rise_vs_spread"]["fsdp2"]["pass"] and not c["all_pass"]


def test_a_family_with_a_missing_run_fails(bench):
    c = bench.checks([_run("megatron", s, 0.2, 0.9) for s in range(2)], ["megatron", "hf"], 3)
    assert not c["rise_vs_spread"]["megatron"]["pass"] and "2 of 3 runs" in c["rise_vs_spread"]["megatron"]["note"]
    assert c["rise_vs_spread"]["hf"] == {
        "seeds": 0,
        "smallest_rise": None,
        "spread_of_final": None,
        "pass": False,
        "note": "0 of 3 runs finished (at least 2 needed)",
    }
    assert not c["all_pass"]


def test_verbs_fraction_is_the_verbs_seconds_over_the_summed_step_times(bench):
    r = {
        "name": "builtin/s1",
        "summary": {
            "verbs_s": 0.3,
            "sync": {"param_bytes": 10},
            "status": "finished",
            "rollout": {"executor": "process"},
        },
        "records": [
            {"step": 1, "step_s": 2.0},
            {"step": 2, "step_s": 4.0, "heldout_accuracy": 0.5, "trainer_idle_ratio": 0.1},
        ],
        "steps": 2,
        "wall_s": 6.5,
        "heldout_accuracy_start": 0.2,
        "heldout_accuracy_end": 0.5,
    }
    e = bench.per_run(r)
    assert e["stateshift_verbs_fraction_of_step"] == pytest.approx(0.05)
    assert (e["family"], e["seed"], e["rise"], e["heldout_curve"], e["executor"]) == (
        "builtin",
        1,
        0.3,
        [[2, 0.5]],
        "process",
    )


def test_hf_model_directory_loads_with_the_tasks_vocabulary(bench, tmp_path):
    from stateshift.train.build import load_hf

    path = bench.make_hf_dir(tmp_path / "m", small=True)
    model = load_hf(str(path), 14, seed=0, positions=13)
    assert model.config.hidden_size == 32 and model.config.vocab_size >= 14


@pytest.mark.slow
def test_small_mode_writes_runs_and_checks(bench, tmp_path):
    """Two builtin runs on the CPU (each its own process): the result file has both runs and the checks."""
    code = bench.main(["--small", "--families", "builtin", "--seeds", "2", "--steps", "4", "--out", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("*-cpu-small-train-families.json")
    data = json.loads(path.read_text())
    assert [r["name"] for r in data["runs"]] == ["builtin/s0", "builtin/s1"] and not data["failures"]
    for r in data["runs"]:
        assert r["steps"] == 4 and r["stateshift_verbs_fraction_of_step"] > 0 and r["status"] == "finished"
    assert (
        set(data["checks"]["rise_vs_spread"]) == {"builtin"} and data["all_checks_pass"] == data["checks"]["all_pass"]
    )
    assert path.with_suffix(".png").exists()


def test_combine_merges_two_calls_and_recomputes_the_checks(bench, tmp_path):
    def part(name: str, families: list[str], runs: list[dict], failures: dict) -> Path:
        path = tmp_path / name / "2030-01-01-h100-train-families.json"
        path.parent.mkdir()
        path.write_text(
            json.dumps(
                {
                    "machine": "1x H100",
                    "command": f"call {name}",
                    "seeds": 2,
                    "runs": runs,
                    "failures": failures,
                    "checks": bench.checks(runs, families, 2),
                }
            )
        )
        return path

    a = part(
        "a", ["builtin"], [{**_run("builtin", s, 0.2, 0.9), "steps": 5, "heldout_curve": []} for s in range(2)], {}
    )
    b = part("b", ["hf"], [{**_run("hf", 0, 0.2, 0.9), "steps": 5, "heldout_curve": []}], {"hf/s1": "exit 1"})
    merged = bench.combine([a, b], tmp_path / "out")
    assert [r["name"] for r in merged["runs"]] == ["builtin/s0", "builtin/s1", "hf/s0"]
    assert (
        merged["checks"]["rise_vs_spread"]["builtin"]["pass"] and not merged["checks"]["rise_vs_spread"]["hf"]["pass"]
    )
    assert merged["command"] == "call a + call b" and not merged["all_checks_pass"]
    assert (
        json.loads((tmp_path / "out" / a.name).read_text()) == merged
        and (tmp_path / "out" / a.name).with_suffix(".png").exists()
    )


def test_combine_keeps_each_calls_steps_where_the_calls_differ(bench, tmp_path):
    def part(name: str, family: str, steps: int) -> Path:
        path = tmp_path / name / "2030-01-01-h100-train-families.json"
        path.parent.mkdir()
        runs = [{**_run(family, s, 0.2, 0.9), "steps": steps, "heldout_curve": []} for s in range(2)]
        fields = {"command": f"call {name}", "seeds": 2, "steps": steps, "budget_s": 400.0, "jobs": 3}
        path.write_text(json.dumps({**fields, "machine": "1x H100", "stateshift": name, "runs": runs, "failures": {}}))
        return path

    merged = bench.combine([part("a", "builtin", 3000), part("b", "hf", 2000)], tmp_path / "out")
    assert merged["steps"] is None and merged["stateshift"] is None and merged["budget_s"] == 400.0
    assert [(p["families"], p["steps"], p["stateshift"]) for p in merged["parts"]] == [
        (["builtin"], 3000, "a"),
        (["hf"], 2000, "b"),
    ]


def test_combine_refuses_a_run_two_calls_both_made(bench, tmp_path):
    paths = []
    for name in ("a", "b"):
        path = tmp_path / name / "2030-01-01-h100-train-families.json"
        path.parent.mkdir()
        runs = [{**_run("builtin", 0, 0.2, 0.9), "steps": 5, "heldout_curve": []}]
        path.write_text(json.dumps({"machine": "1x H100", "command": name, "seeds": 1, "runs": runs, "failures": {}}))
        paths.append(path)
    with pytest.raises(SystemExit, match="builtin/s0"):
        bench.combine(paths, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_table_prints_twice_the_spread_the_check_compares_with(bench):
    runs = [
        {**_run("builtin", s, 0.172, end), "steps": 2000, "wall_s": 250.0, "status": "finished"}
        for s, end in enumerate((0.994, 0.598, 0.98))
    ]
    for r in runs:
        r["rise"] = r["heldout_accuracy_end"] - r["heldout_accuracy_start"]
    checks = bench.checks(runs, ["builtin", "hf"], 3)
    text = bench.table({"runs": runs, "checks": checks})
    assert "builtin   smallest rise 0.426 vs 2 x spread 0.792 (spread 0.396): FAIL" in text
    assert "hf        smallest rise None vs 2 x spread - (spread None): FAIL" in text
