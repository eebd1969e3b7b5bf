"""Resume never loses history: ``metrics.jsonl`` is appended to, records after the checkpoint are dropped by an
atomic rewrite, and a resume killed in its first seconds (twice in a row) keeps every record up to the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rl.rlkit import tiny

from stateshift.train.metrics import MetricsLog


def _lines(k: int) -> str:
    return json.dumps({"step": k, "loss": 0.5}) + "\n"


def test_resume_keeps_the_file_when_nothing_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_lines(k) for k in (1, 2, 3)))
    inode = path.stat().st_ino
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=3)
    try:
        assert path.read_text() == "".join(_lines(k) for k in (1, 2, 3))  # before anything is flushed
        assert path.stat().st_ino == inode  # appended to, not replaced
        log.log({"step": 4, "loss": 0.25})
        assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    finally:
        log.close()


def test_resume_drops_later_records_atomically(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_lines(k) for k in (1, 2, 3, 4, 5)) + '{"step": 6, "lo')
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=3)
    try:
        assert path.read_text() == "".join(_lines(k) for k in (1, 2, 3))  # before anything is flushed
        assert not [p for p in os.listdir(tmp_path) if p != "metrics.jsonl"]  # no temporary left
    finally:
        log.close()


COMMON = [
    "async_training.trigger_parameter_sync_step=2",
    "async_training.staleness_threshold=0",
    "run.checkpoint_every=2",
]


def _kill_early(out: Path, original: str, limit_s: float) -> None:
    """``stateshift train --resume out`` killed (SIGKILL) as soon as ``metrics.jsonl`` differs from ``original``
    -- or after ``limit_s`` of the run -- whichever comes first."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stateshift.cli", "train", "--resume", str(out), "trainer.steps=8"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        t0, started = time.monotonic(), None
        while time.monotonic() - t0 < 60 and proc.poll() is None:
            if started is None and (out / "run.lock").exists():  # the run has begun (it takes the lock first)
                started = time.monotonic()
            if (out / "metrics.jsonl").read_text() != original or (started and time.monotonic() - started > limit_s):
                break
            time.sleep(0.005)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stderr.close()


@pytest.mark.slow
def test_resume_killed_in_its_first_seconds_twice_keeps_every_record(tmp_path):
    from stateshift.train.launch import run

    first = run(tiny(tmp_path, "trainer.steps=5", *COMMON))
    out = first.out_dir
    (out / "run.lock").unlink()
    original = (out / "metrics.jsonl").read_text()
    assert [json.loads(line)["step"] for line in original.splitlines()] == [1, 2, 3, 4, 5]
    for _attempt in range(2):
        _kill_early(out, (out / "metrics.jsonl").read_text(), limit_s=8.0)
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps[:4] == [1, 2, 3, 4] and steps == sorted(steps), steps
    resumed = run(tiny(tmp_path, "trainer.steps=8", *COMMON), resume=out)
    assert resumed.summary["status"] == "finished"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
