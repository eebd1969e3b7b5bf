"""benchmarks/verbs_bench.py: ``stateshift bench`` plus the provenance, plot and many-small-tensors probe of a result file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vb():
    """``benchmarks/verbs_bench.py`` as a module (``benchmarks/`` on the path for its ``_harness``)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import verbs_bench

    return verbs_bench


def test_a_small_run_writes_the_result_format_with_its_provenance_and_small_cases(vb, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = vb.main(
        [
            "--layers",
            "1",
            "--width",
            "32",
            "--vocab",
            "64",
            "--seq",
            "8",
            "--repeat",
            "1",
            "--no-progress",
            "--small-tensors",
            "50",
            "--small-numel",
            "64",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "r.png"),
        ]
    )
    assert rc == 0 and "ratio" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"machine", "host", "torch", "stateshift", "ceilings", "rows", "model", "full_state", "pool"} <= data.keys()
    assert {"cpu", "python_us"} <= data["host"].keys() and data["stateshift"]
    assert any("50 tensors" in r["note"] and r["case"] == "small-128B" for r in data["rows"])
    assert (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("small", "want"), [(None, [(2000, 512 << 10), (20000, 16 << 10)]), (["none"], []), (["10x4KiB"], [(10, 4 << 10)])]
)
def test_small_cases_on_cuda(vb, small, want):
    """On CUDA two small cases are the default; ``--small none`` runs the large-model rows only."""
    args = vb.parser().parse_args([x for spec in small or [] for x in ("--small", spec)])
    assert vb.small_cases(args, on_cuda=True) == want
    assert vb.small_cases(args, on_cuda=False) == [c for c in want if small]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--small-tensors", "-1"], "--small-tensors >= 0"),
        (["--small-numel", "0"], "--small-numel must be >= 1"),
        (["--small", "3y"], "COUNTxSIZE"),
        (["--small", "none", "--small", "10x4KiB"], "--small none cannot be given with other"),
        (["--repeat", "0"], "--repeat must be >= 1"),
    ],
)
def test_bad_arguments_fail_at_once_naming_the_argument(vb, capsys, args, message):
    rc = vb.main(["--no-progress", *args])
    err = capsys.readouterr()
    assert rc == 2 and message in err.err and "ratio" not in err.out


def test_plot_without_matplotlib_fails_before_running(vb, monkeypatch, capsys, tmp_path):
    from helpers import block_import

    block_import(monkeypatch, "matplotlib")
    rc = vb.main(["--no-progress", "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr()
    assert rc == 2 and "stateshift[bench]" in err.err and "ratio" not in err.out


def test_many_small_is_count_parameters_of_the_size_given(vb):  # vb: benchmarks/ on the path
    import _harness

    model = _harness.ManySmall(3, 1024)
    assert [p.numel() * p.element_size() for p in model.parameters()] == [1024] * 3
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
