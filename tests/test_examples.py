"""Every example in ``examples/`` runs as a user would run it: in a fresh process, through its ``run()``."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


#: what the test reads of a ``RunResult`` (a train example's ``run()``); an example returning a dict gives it whole
RUN_RESULT = (
    "{'start': r.heldout_accuracy_start, 'end': r.heldout_accuracy_end, 'steps': r.steps, "
    "'status': r.summary['status']} if not isinstance(r, dict) else r"
)


def run_example(name: str, call: str, tmp_path: Path, timeout: float = 300) -> dict:
    """``examples/<name>.py``'s ``call`` (an expression of ``run(...)``) in a subprocess; what it returns, as JSON."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(EXAMPLES)!r}); import {name} as ex\n"
        f"r = ex.{call}\n"
        f"print('RESULT ' + json.dumps({RUN_RESULT}))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_every_example_exposes_run():
    for path in EXAMPLES.glob("*.py"):
        assert "\ndef run(" in path.read_text(), path.name


@pytest.mark.slow
def test_train_on_files_runs_end_to_end(tmp_path):
    got = run_example("train_on_files", f"run({str(tmp_path / 'out')!r}, steps=4)", tmp_path)
    assert got["status"] == "finished" and got["steps"] == 4
    assert (tmp_path / "out" / "run" / "summary.json").is_file() and (
        tmp_path / "out" / "model" / "model.safetensors"
    ).is_file()


@pytest.mark.slow
def test_train_on_files_raises_heldout_reward_over_three_seeds(tmp_path):
    """Held-out reward (exact match, greedy) after RL minus after the warm-up, for seeds 0, 1, 2: the smallest rise
    is above twice the spread (population standard deviation) of the final scores."""
    with ThreadPoolExecutor(3) as pool:  # three processes at once (each run is deterministic for its seed)
        runs = list(
            pool.map(
                lambda s: run_example("train_on_files", f"run({str(tmp_path / str(s))!r}, seed={s})", tmp_path),
                range(3),
            )
        )
    rises = [r["end"] - r["start"] for r in runs]
    spread = statistics.pstdev(r["end"] for r in runs)
    assert min(rises) > 2 * spread, (runs, rises, spread)


def test_weight_sync_example_loads_exactly_what_was_published(tmp_path):
    got = run_example("weight_sync", "run(versions=4, device='cpu')", tmp_path, timeout=120)
    assert got["transport"] == "shared_host" and got["exact"]
    assert got["loaded"] and set(got["loaded"]) <= set(got["published"]) and "3" in got["loaded"]


def test_pi_old_example_checks_every_verb_bit_for_bit(tmp_path):
    got = run_example("pi_old", "run(device='cpu')", tmp_path, timeout=120)
    assert got.pop("groups") == ["buffers", "grads", "optim", "params"]
    assert got == {
        "offloaded": True,
        "onload_exact": True,
        "grads_dropped": True,
        "grads_zero_filled": True,
        "swapped_exact": True,
        "back_after_swap": True,
        "restore_exact": True,
    }
