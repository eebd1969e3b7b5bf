"""Failures on either side end the run with that error within seconds; Ctrl-C stops cleanly; stalls are reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from raises import raises_kind
from rl.rlkit import tiny

from stateshift.errors import RunError
from stateshift.train.launch import run
from stateshift.train.rollout import KVRollouter
from stateshift.train.trainer import Trainer


class Boom(RuntimeError):
    pass


def _rollout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stateshift-rollout" and t.is_alive()]


@pytest.mark.parametrize("after_calls", [0, 3, 9])
def test_rollouter_that_raises_ends_the_run_with_that_error(tmp_path, monkeypatch, after_calls):
    calls = {"n": 0}
    real = KVRollouter.generate

    def flaky(self, wave):
        if threading.current_thread().name != "stateshift-rollout":
            return real(self, wave)  # held-out evaluation on the trainer thread
        calls["n"] += 1
        if calls["n"] > after_calls:
            raise Boom(f"rollouter died at call {calls['n']}")
        return real(self, wave)

    monkeypatch.setattr(KVRollouter, "generate", flaky)
    t0 = time.monotonic()
    with pytest.raises(Boom, match="rollouter died"):
        run(tiny(tmp_path, "trainer.steps=50"))
    assert time.monotonic() - t0 < 15  # warm-up and set-up included; the failure itself reaches the trainer in < 0.1 s
    assert not _rollout_threads()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"].startswith("failed (rollout): Boom")


def test_trainer_that_raises_stops_the_rollout_thread(tmp_path, monkeypatch):
    real = Trainer.update
    calls = {"n": 0}

    def flaky(self, batch, timer, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Boom("trainer died")
        return real(self, batch, timer, **kw)

    monkeypatch.setattr(Trainer, "update", flaky)
    with pytest.raises(Boom, match="trainer died"):
        run(tiny(tmp_path, "trainer.steps=50"))
    assert not _rollout_threads()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"].startswith("failed (trainer): Boom") and summary["ledger"]["trained"] == 2 * 4


def test_hung_rollouter_is_reported_then_stopped(tmp_path, monkeypatch):
    """A rollouter that never returns: the watchdog reports queue depth and versions, then RunError("stall") ends the run."""

    real = KVRollouter.generate

    def hang(self, wave):
        if threading.current_thread().name != "stateshift-rollout":
            return real(self, wave)
        for _ in range(400):  # ~20 s at most, so the daemon thread ends on its own after the test
            if self.paused:
                return False
            time.sleep(0.05)
        return False

    monkeypatch.setattr(KVRollouter, "generate", hang)
    t0 = time.monotonic()
    with raises_kind(RunError, "stall", match="nothing moved") as info:
        run(tiny(tmp_path, "trainer.steps=5", "run.watchdog_s=0.5", "run.stall_timeout_s=2"))
    assert time.monotonic() - t0 < 15
    assert "queue=0" in str(info.value) and "trainer_version=0" in str(info.value)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["watchdog_reports"] and "waiting for 4 groups from the queue" in summary["watchdog_reports"][0]


def _train_cmd(out, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "stateshift.cli",
        "train",
        "trainer.steps=100000",
        "warmup.steps=5",
        "task.heldout_size=20",
        "model.width=32",
        "model.heads=2",
        "trainer.batch_prompts=4",
        "rollout.n=4",
        "run.progress=lines",
        "run.plot=false",
        "run.tensorboard=false",
        "run.eval_every=1000000",
        "run.torch_threads=1",
        f"run.out_dir={out}",
        *overrides,
    ]


def _start_until_steps(cmd: list[str], out, steps: int = 2, timeout: float = 300) -> subprocess.Popen:
    """Start ``stateshift train`` and return once ``steps`` records are in its metrics.jsonl (RL runs: the signal
    then lands in the loop, not in start-up, however slow the machine); a thread drains its stderr."""
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    lines: list[str] = []
    drain = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    drain.start()
    proc.err_lines, proc.drain = lines, drain  # type: ignore[attr-defined]
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stopped(proc, 5)
            raise AssertionError(f"no {steps} steps: {''.join(lines)[-3000:]}")
        time.sleep(0.05)
    return proc


def _stopped(proc: subprocess.Popen, timeout: float) -> str:
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc.drain.join(10)  # type: ignore[attr-defined]
    return "".join(proc.err_lines)  # type: ignore[attr-defined]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_stops_cleanly(tmp_path, sig, code):
    """SIGINT (or SIGTERM) to ``stateshift train`` once RL steps: exit code 128 + the signal within seconds,
    summary.json written, no traceback."""
    out = tmp_path / "run"
    proc = _start_until_steps(_train_cmd(out), out)
    t0 = time.monotonic()
    proc.send_signal(sig)
    err = _stopped(proc, 60)
    assert proc.returncode == code, err[-3000:]
    assert time.monotonic() - t0 < 30  # (well under 1 s on an idle machine: the next step boundary or wait)
    assert "Traceback" not in err and "interrupted" in err and "Exception ignored" not in err
    assert json.loads((out / "summary.json").read_text())["status"].startswith("interrupted at step")


def test_second_ctrl_c_stops_even_a_stuck_stop(tmp_path):
    """A run whose stop hangs (here: the rollout side never stops) still ends on a second Ctrl-C, summary written."""
    out = tmp_path / "run"
    hook = "import stateshift.train.executors.inprocess as m, time; m.InProcessRollouts.stop = lambda *a, **k: time.sleep(1e9)"
    cmd = [
        sys.executable,
        "-c",
        f"{hook}; import sys; from stateshift.cli import main; sys.exit(main(sys.argv[1:]))",
        *_train_cmd(out)[3:],
    ]
    proc = _start_until_steps(cmd, out)
    proc.send_signal(signal.SIGINT)
    time.sleep(2)
    assert proc.poll() is None  # stuck in the stop
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    err = _stopped(proc, 60)
    assert proc.returncode == 130, err[-3000:]
    assert time.monotonic() - t0 < 30
    assert json.loads((out / "summary.json").read_text())["status"].startswith("interrupted at step")


def test_two_runs_cannot_share_a_run_directory(tmp_path):
    from stateshift.errors import RunError
    from stateshift.train.launch import _lock_run_dir

    (tmp_path / "run").mkdir()
    held = _lock_run_dir(tmp_path / "run")  # as a running `stateshift train` holds it
    try:
        with raises_kind(RunError, "run_dir_busy", match="in use by another"):
            run(tiny(tmp_path, "trainer.steps=1"))
    finally:
        held.close()
    assert run(tiny(tmp_path, "trainer.steps=1")).steps == 1  # free again


def test_stop_signals_call_listeners_first_then_raise():
    """First signal with a listener: only the listener (no exception); with none: ``KeyboardInterrupt``, remembered
    for a listener registered later; the second raises; the handlers are restored on leaving."""
    from stateshift.train.control import RunControl, StopSignals, on_stop_signal

    before = signal.getsignal(signal.SIGINT)
    control = RunControl()
    with StopSignals() as signals, on_stop_signal(control.interrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (the handler runs at the next bytecode)
        assert control.interrupted and control.stopping and signals.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            control.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before
    late = RunControl()
    with StopSignals():
        with pytest.raises(KeyboardInterrupt):  # nothing listens: start-up
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        with on_stop_signal(late.interrupt):
            assert late.interrupted  # told at once
    assert not on_stop_signal(RunControl().interrupt).signals  # not installed: Ctrl-C is Python's again
