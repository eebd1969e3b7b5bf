"""``stateshift train`` answers common faults with one line naming the file and what to do (exit 2), and Ctrl-C
at any moment with exit 130 and the ``summary.json`` it says it wrote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rl.rlkit import TINY

from stateshift.cli import main
from stateshift.train.checkpointing import SIDECAR

COMMON = [
    *TINY,
    "async_training.trigger_parameter_sync_step=2",
    "async_training.staleness_threshold=0",
    "run.checkpoint_every=2",
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *COMMON, "trainer.steps=4", f"run.out_dir={out}"]) == 0
    return out


@pytest.fixture
def run_dir(finished, tmp_path, capsys) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    capsys.readouterr()
    return out


def _every_step(out: Path, damage) -> None:
    for step in sorted((out / "checkpoints").glob("step-*")):
        damage(step)


def _one_error_line(capsys, *names: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "damage, names",
    [
        (
            lambda s: (s / SIDECAR).write_bytes((s / SIDECAR).read_bytes()[:77]),
            [SIDECAR, "step-4", "step-2", "truncated"],
        ),
        (lambda s: (s / SIDECAR).write_bytes(b""), [SIDECAR, "step-4", "step-2"]),
        (lambda s: shutil.rmtree(s / "state"), ["state", "step-4", "step-2"]),
        (lambda s: (s / SIDECAR).unlink(), [SIDECAR, "step-4"]),
    ],
    ids=["truncated sidecar", "empty sidecar", "no state", "no sidecar"],
)
def test_resume_without_an_intact_checkpoint_is_one_line_exit_2(run_dir, capsys, damage, names):
    _every_step(run_dir, damage)
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 2
    line = _one_error_line(capsys, *names)
    assert "new run" in line  # what to do


def test_resume_with_a_bad_latest_pointer_is_one_line_exit_2(run_dir, capsys):
    (run_dir / "checkpoints" / "latest").write_text("../../etc")
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 2
    _one_error_line(capsys, "latest")
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 2
    _one_error_line(capsys, "checkpoint_every")


def test_out_dir_that_is_a_file_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "taken").write_text("x")
    assert main(["train", *COMMON, "trainer.steps=2", f"run.out_dir={tmp_path / 'taken'}"]) == 2
    _one_error_line(capsys, "taken")


def test_unwritable_run_directory_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    import stateshift.train.launch as launch

    def refuse(out: Path):
        raise PermissionError(13, "Permission denied", str(out / "run.lock"))

    monkeypatch.setattr(launch, "_lock_run_dir", refuse)
    assert main(["train", *COMMON, "trainer.steps=2", f"run.out_dir={tmp_path / 'r'}"]) == 2
    _one_error_line(capsys, "run.lock", "Permission denied")


@pytest.mark.parametrize("value", [".inf", "nan", "-.inf"])
def test_non_finite_learning_rate_is_one_line_exit_2(tmp_path, capsys, value):
    assert main(["train", *COMMON, f"trainer.lr={value}", f"run.out_dir={tmp_path / 'r'}"]) == 2
    _one_error_line(capsys, "trainer.lr")
    (tmp_path / "c.yaml").write_text(f"trainer:\n  lr: {value}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), f"run.out_dir={tmp_path / 'r'}"]) == 2
    _one_error_line(capsys, "trainer.lr")


@pytest.mark.parametrize("where", ["supervised_warmup", "heldout_accuracy", "build_policy"])
def test_ctrl_c_during_start_up_exits_130_with_a_summary(tmp_path, capsys, monkeypatch, where):
    import stateshift.train.loop as loop

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, where, interrupt)
    out = tmp_path / "r"
    assert main(["train", *COMMON, "trainer.steps=2", f"run.out_dir={out}"]) == 130
    assert "summary.json" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"].startswith("interrupted during start-up") and summary["steps"] == 0


def test_ctrl_c_while_loading_the_checkpoint_exits_130_with_a_summary(run_dir, capsys, monkeypatch):
    import stateshift.train.loop as loop

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "resume_checkpoint", interrupt)
    (run_dir / "summary.json").unlink()
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 130
    assert "summary.json" in capsys.readouterr().err
    assert json.loads((run_dir / "summary.json").read_text())["status"].startswith("interrupted during start-up")


@pytest.mark.parametrize(
    "damage",
    [
        lambda rec: b"{oops",
        lambda rec: json.dumps({**rec, "staleness_tokens": "abc"}).encode(),
        lambda rec: json.dumps({**rec, "staleness_tokens": {"x": 1}}).encode(),
        lambda rec: json.dumps(rec).encode()[:-1] + b', "note": "\xff"}',
        lambda rec: json.dumps(rec).encode()[:-1] + b', "big": ' + b"9" * 5000 + b"}",
    ],
    ids=["not JSON", "staleness not a mapping", "staleness key not a number", "not UTF-8", "a 5000-digit number"],
)
def test_damaged_metrics_log_is_one_line_exit_2_and_changes_nothing(run_dir, capsys, damage):
    lines = (run_dir / "metrics.jsonl").read_bytes().splitlines()
    bad = damage(json.loads(lines[1]))
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join([lines[0], bad, *lines[2:]]) + b"\n")
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 2
    _one_error_line(capsys, "metrics.jsonl", "line 2")
    assert {p: p.read_bytes() for p in files} == files  # summary.json and config.yaml as they were


def test_a_run_directory_that_names_code_runs_none_on_resume_unless_the_command_names_it(run_dir, capsys, tmp_path):
    """``--resume DIR`` reads ``DIR/config.yaml``: a directory from anywhere whose config names a reward function
    to import gets it imported only when the command line names it too."""
    marker = tmp_path / "RAN"
    module = tmp_path / "evil_reward.py"
    module.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef fn(response, sample):\n    return 0.0\n")
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("fn: exact_match", "fn: evil_reward:fn"))
    assert "evil_reward:fn" in config.read_text()
    before = config.read_bytes()
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 2
    line = _one_error_line(capsys, "reward.fn", "evil_reward:fn")
    assert "import" in line and not marker.exists() and config.read_bytes() == before


def test_a_refused_resume_leaves_the_run_directory_as_it_was(run_dir, capsys):
    """A resume refused by the checkpoint (here: no intact one) changes no file of the run (config.yaml was
    rewritten with the refused overrides first)."""
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    _every_step(run_dir, lambda s: (s / SIDECAR).unlink())
    files = {p: b for p, b in files.items() if p.exists()}
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6", "trainer.lr=0.5"]) == 2
    _one_error_line(capsys)
    assert {p: p.read_bytes() for p in files} == files
