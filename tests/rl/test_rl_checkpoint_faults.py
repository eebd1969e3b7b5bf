"""Checkpoints of a run survive a process killed at any moment: the previous one stays loadable, and a
resumed run writes over what the killed one left unfinished."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time

import pytest
from raises import raises_kind
from rl.rlkit import tiny

from stateshift.train.checkpointing import SIDECAR
from stateshift.train.launch import run

COMMON = [
    "async_training.trigger_parameter_sync_step=2",
    "async_training.staleness_threshold=0",
    "run.checkpoint_every=2",
]


def test_resume_rewrites_a_step_the_killed_run_left_behind(tmp_path):
    """Killed after step-6 was written but before ``latest`` moved: the resumed run reaches step 6 again.

    (Regression: the second save of step-6 raised FileExistsError -- checkpoints are never overwritten --
    and the resumed run died at its first checkpoint.)
    """
    first = run(tiny(tmp_path, "trainer.steps=6", *COMMON))
    root = first.out_dir / "checkpoints"
    (root / "latest").write_text("step-4")  # as if SIGKILLed between the sidecar and the pointer
    resumed = run(tiny(tmp_path, "trainer.steps=8", *COMMON), resume=first.out_dir)
    assert resumed.summary["status"] == "finished" and resumed.steps == 8
    assert (root / "latest").read_text().strip() == "step-8"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-6", "step-8"]  # keep_checkpoints=2


def test_resume_rewrites_a_half_written_step(tmp_path):
    """Killed inside the save of step-6 (its state/ committed, no sidecar yet): resumed, step 6 is saved anew."""
    first = run(tiny(tmp_path, "trainer.steps=6", *COMMON))
    root = first.out_dir / "checkpoints"
    (root / "latest").write_text("step-4")
    (root / "step-6" / SIDECAR).unlink()
    shutil.rmtree(root / "step-6" / "state" / "params", ignore_errors=True)
    resumed = run(tiny(tmp_path, "trainer.steps=6", *COMMON), resume=first.out_dir)
    assert resumed.summary["status"] == "finished"
    assert (root / "latest").read_text().strip() == "step-6" and (root / "step-6" / SIDECAR).is_file()


def test_resume_drops_a_metrics_line_cut_short_by_the_kill(tmp_path):
    """A run killed inside the write of a step's record: the resumed log keeps the records up to the checkpoint."""
    import json

    from stateshift.errors import ConfigError
    from stateshift.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": k, "loss": 0.5}) + "\n" for k in (1, 2, 3)) + '{"step": 4, "lo')
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=2)
    log.close()
    assert [r["step"] for r in log.records] == [1, 2]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    path.write_text('{"step": 1, "lo\n{"step": 2}\n')  # not the last line: the file is damaged, not cut short
    with raises_kind(ConfigError, "metrics_log", match="line 1: not JSON"):
        MetricsLog(tmp_path, tensorboard=False, resume_step=2)
    path.write_text('[1]\n{"step": 2}\n')
    with raises_kind(ConfigError, "metrics_log", match="line 1: not a step record"):
        MetricsLog(tmp_path, tensorboard=False, resume_step=2)


def test_resume_says_which_steps_a_cut_metrics_log_lost(tmp_path):
    """A log cut in the middle of step 3 while the checkpoint is at step 8: steps 3-7 have no record. The resume
    goes on (the training state is whole) and says which; the record of the checkpoint's own step may be missing
    without a word (a kill between the checkpoint and its record)."""
    import json
    import warnings

    from stateshift.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": k}) + "\n" for k in (1, 2)) + '{"step": 3, "lo')
    with pytest.warns(UserWarning, match="steps 3-7"):
        MetricsLog(tmp_path, tensorboard=False, resume_step=8).close()
    path.write_text("".join(json.dumps({"step": k}) + "\n" for k in range(1, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MetricsLog(tmp_path, tensorboard=False, resume_step=8).close()


# A child that saves RL checkpoints of a ~3M-parameter policy (params and Adam state, params offloaded as in a run)
# in a loop, every value set to the step number first, and says when each save begins and ends.
CHILD = r"""
import sys, time, torch
from pathlib import Path
from stateshift.checkpoint import init_optimizer_state
from stateshift.train.checkpointing import save_checkpoint
from stateshift.train.config import resolve
from stateshift.train.build import build_policy, build_task
from stateshift.train.trainer import Trainer

cfg = resolve(None, ["model.width=256", "model.layers=4"])
trainer = Trainer(build_policy(cfg, build_task(cfg)), cfg.trainer, temperature=1.0)
init_optimizer_state(trainer.optimizer)
root = Path(sys.argv[1])
for step in range(1, 1000):
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.fill_(step)
        for st in trainer.optimizer.state.values():
            for v in st.values():
                v.fill_(step)
    trainer.park()
    print("begin", step, flush=True)
    t0 = time.perf_counter()
    save_checkpoint(root, step, trainer, None, {"step": step}, keep=2)
    print("end", step, time.perf_counter() - t0, flush=True)
    trainer.unpark("params")
"""


def _saves_until(proc, step: int) -> list[float]:
    """Read the child's lines until save ``step`` began; the durations of the saves before it."""
    durations = []
    for line in proc.stdout:
        kind, k, *rest = line.split()
        if kind == "end":
            durations.append(float(rest[0]))
        elif int(k) == step:
            return durations
    raise AssertionError(f"the child ended before save {step}: {proc.stderr.read()}")


@pytest.mark.slow
def test_sigkill_inside_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from stateshift.train.build import build_policy, build_task
    from stateshift.train.checkpointing import latest_checkpoint, load_checkpoint
    from stateshift.train.config import resolve
    from stateshift.train.trainer import Trainer

    rng = random.Random(20261203)
    inside = []
    for attempt in range(2):
        root = tmp_path / f"attempt-{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            durations = _saves_until(proc, 3)
            time.sleep(rng.uniform(0.0, 0.8) * min(durations))  # a random moment inside save 3
            proc.kill()
            rest = proc.stdout.read()
        finally:
            proc.kill()
            proc.wait()
        path = latest_checkpoint(root)
        step = int(path.name[5:])
        # Killed inside save 3: the previous checkpoint (2) is the latest. Killed after save 3 committed:
        # 3, whether or not the child printed its "end" line before the kill (a race the test must allow).
        assert step == 3 if "end 3 " in rest else step in (2, 3), (path, rest)
        inside.append(step == 2)
        cfg = resolve(None, ["model.width=256", "model.layers=4"])
        trainer = Trainer(build_policy(cfg, build_task(cfg)), cfg.trainer, temperature=1.0)
        resumed = load_checkpoint(path, trainer)  # verifies every tensor's checksum
        assert resumed.step == step and resumed.extra == {"step": step}
        assert all(bool((p == step).all()) for p in trainer.model.parameters())
        assert all(bool((v == step).all()) for st in trainer.optimizer.state.values() for v in st.values())
    assert any(inside), "no kill landed inside a save: the test did not test anything"
