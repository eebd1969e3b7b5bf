"""The README's main job: `stateshift bench` on a tiny built-in model, JSON in the format of docs/design/result-format.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stateshift.cli import main

OPS = {"snapshot", "restore", "offload", "onload", "swap", "pi_old_cycle", "save", "load", "async_save_blocking"}


def test_bench_writes_design_format(tmp_path, capsys):
    from stateshift import __version__

    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
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
            "--json",
            str(out),
        ]
    )
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
    # no provenance from the library (benchmarks/verbs_bench.py records the commit and the host)
    assert data["stateshift"] == __version__ and data["host"] == {}
    assert data["model"]["params"] > 0 and "full_state" in data and "pool" in data


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--width", "30", "--heads", "4"], "divisible"),
        (["bench", "--seq", "0"], "--seq must be > 0"),
        (["bench", "--repeat", "0"], ">= 1"),
    ],
)
def test_bench_rejects_bad_sizes(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_runs():
    result = subprocess.run([sys.executable, "-m", "stateshift.cli", "bench", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--json" in result.stdout and "--width" in result.stdout
    assert "--plot" not in result.stdout and "--small" not in result.stdout  # benchmarks/verbs_bench.py has those


# ----------------------------------------------------------------------------- bad input, before any work (issue 13, item 14)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "foo"], "is not a device"),
        (["--device", "meta"], "only 'cpu' and 'cuda'"),
        (["--minibatches", "0"], "--minibatches must be >= 1"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--json", "/proc/no/such/dir/out.json"], "cannot write"),
    ],
)
def test_bad_bench_arguments_fail_at_once_naming_the_argument(capsys, args, message):
    rc = main(["bench", "--no-progress", *args])
    err = capsys.readouterr()
    assert rc == 2 and message in err.err
    assert "ratio" not in err.out  # nothing ran


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(capsys):
    rc = main(["bench", "--layers", "1", "--width", "32", "--vocab", "64", "--seq", "8", "--repeat", "1"])
    err = capsys.readouterr().err
    assert rc == 0 and "\r" not in err and "[1/" in err


def test_version_and_python_dash_m():
    for cmd in (
        [sys.executable, "-m", "stateshift", "--version"],
        [sys.executable, "-m", "stateshift.cli", "--version"],
    ):
        out = subprocess.run(cmd, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith("stateshift "), out
