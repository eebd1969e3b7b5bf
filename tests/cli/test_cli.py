"""The README's main job: `stateshift bench` on a tiny built-in model, JSON in the format of docs/design/result-format.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stateshift.cli import main

OPS = {"snapshot", "restore", "offload", "onload", "swap", "pi_old_cycle", "save", "load", "async_save_blocking"}


def test_bench_writes_design_format(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--layers", "1", "--hidden", "32", "--vocab", "64", "--seq", "8", "--repeat", "1",
               "--small-tensors", "50", "--small-numel", "64", "--no-progress", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ratio" in printed and "pinned pool" in printed
    data = json.loads(out.read_text())
    assert {"machine", "torch", "stateshift", "ceilings", "rows"} <= data.keys()
    assert data["ceilings"]["host_memcpy_gbps"] > 0
    assert {r["op"] for r in data["rows"]} <= OPS
    assert {"snapshot", "restore", "offload", "onload", "swap", "pi_old_cycle"} <= {r["op"] for r in data["rows"]}
    for row in data["rows"]:
        assert {"backend", "op", "residency", "device", "bytes", "seconds", "gbps", "ratio"} <= row.keys()
        assert row["bytes"] > 0 and row["seconds"] > 0 and row["ratio"] > 0
    assert len({r["note"] for r in data["rows"] if "50 tensors" in r["note"]}) > 0


@pytest.mark.parametrize("argv, message", [
    (["bench", "--hidden", "30", "--heads", "4"], "divisible"),
    (["bench", "--repeat", "0"], ">= 1"),
])
def test_bench_rejects_bad_sizes(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("small", "want"), [(None, [(2000, 512 << 10), (20000, 16 << 10)]), (["none"], []),
                                            (["10x4KiB"], [(10, 4 << 10)])])
def test_small_cases_on_cuda(monkeypatch, small, want):
    """On CUDA two small cases are the default; ``--small none`` runs the large-model rows only."""
    import argparse

    import torch

    from stateshift.cli import bench as cli_bench

    sub = argparse.ArgumentParser().add_subparsers()
    cli_bench.add_parser(sub)
    args = sub.choices["bench"].parse_args([x for spec in small or [] for x in ("--small", spec)])
    monkeypatch.setattr(cli_bench, "_device", lambda spec: torch.device("cuda"))
    cli_bench._check_args(args)
    assert args.small_cases == want


def test_help_runs():
    result = subprocess.run([sys.executable, "-m", "stateshift.cli", "bench", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--json" in result.stdout


# ----------------------------------------------------------------------------- bad input, before any work (issue 13, item 14)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "foo"], "is not a device"),
        (["--device", "meta"], "only 'cpu' and 'cuda'"),
        (["--small-tensors", "-1"], "--small-tensors must be >= 0"),
        (["--small-numel", "0"], "--small-numel must be >= 1"),
        (["--small", "3y"], "COUNTxSIZE"),
        (["--small", "none", "--small", "10x4KiB"], "--small none cannot be given with other"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--json", "/proc/no/such/dir/out.json"], "cannot write"),
    ],
)
def test_bad_bench_arguments_fail_at_once_naming_the_argument(capsys, args, message):
    rc = main(["bench", "--no-progress", *args])
    err = capsys.readouterr()
    assert rc == 2 and message in err.err
    assert "ratio" not in err.out  # nothing ran


def test_plot_without_matplotlib_fails_before_running(monkeypatch, capsys, tmp_path):
    from helpers import block_import

    block_import(monkeypatch, "matplotlib")
    rc = main(["bench", "--no-progress", "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr()
    assert rc == 2 and "stateshift[bench]" in err.err and "ratio" not in err.out


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(capsys):
    rc = main(["bench", "--layers", "1", "--hidden", "32", "--vocab", "64", "--seq", "8", "--repeat", "1"])
    err = capsys.readouterr().err
    assert rc == 0 and "\r" not in err and "[1/" in err


def test_version_and_python_dash_m():
    for cmd in ([sys.executable, "-m", "stateshift", "--version"], [sys.executable, "-m", "stateshift.cli", "--version"]):
        out = subprocess.run(cmd, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith("stateshift "), out
