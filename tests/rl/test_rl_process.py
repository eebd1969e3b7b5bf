"""executor=process: the rollouter in a spawned process, against the thread executor and under failures.

- the same losses, weights, trained groups and per-step records as ``executor=inprocess`` (staleness 0, fixed seeds);
- a rollouter process SIGKILLed mid-generation and mid-weight-copy: reported within seconds (which pid, which
  signal), restarted with the newest weights, the run finishes, the ledger balances, no group trained twice;
- a rollouter that raises ends the run with its exception; past ``rollout.max_restarts`` a death ends it;
- a hung rollouter: the watchdog reports both sides, then ``RunError("stall")``;
- resume from a checkpoint equals the uninterrupted run; nothing left in /dev/shm, no process left behind.

Every run spawns a rollouter process (a torch import, a few seconds on a loaded 2-core machine): ``slow``.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from raises import raises_kind
from rl.process_hooks import Boom
from rl.rlkit import tiny

from stateshift.errors import RunError
from stateshift.train.executors.process_child import HOOK_ENV
from stateshift.train.launch import run

pytestmark = pytest.mark.slow

#: a schedule that does not depend on timing (staleness 0), pi_old with param and optimizer offload, checkpoints
DETERMINISTIC = [
    "trainer.steps=8",
    "async_training.trigger_parameter_sync_step=2",
    "async_training.staleness_threshold=0",
    "trainer.optimizer_offload=true",
    "run.checkpoint_every=4",
]
#: per-step metrics that measure time or depend on how far the rollouter got when the trainer looked
TIMING = {
    "step_s",
    "wall_s",
    "queue_depth",
    "samples_per_s",
    "trainer_idle_ratio",
    "rollout_idle_ratio",
    "offload_verb_s_total",
    "offload_bytes_total",
    "pi_old_bytes_total",
}
LIVELY = ["run.watchdog_s=2", "run.stall_timeout_s=30"]


def _shm() -> set[str]:
    """This process's weight files and shared pool blocks (after a collection: a finished run's pool is garbage)."""
    gc.collect()
    return {
        n
        for n in os.listdir("/dev/shm")
        if n.startswith((f"stateshift-weights-{os.getpid()}-", f"stateshift-pool-{os.getpid()}-"))
    }


@pytest.fixture(autouse=True)
def clean_up(monkeypatch, tmp_path):
    """Hooks for the rollouter process; afterwards: no rollouter process alive, no shared memory left."""
    monkeypatch.setenv(HOOK_ENV, "rl.process_hooks:install")
    monkeypatch.setenv("STATESHIFT_TEST_DIR", str(tmp_path))
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "")
    yield
    alive = [p for p in multiprocessing.active_children() if p.name.startswith("stateshift-rollouter")]
    for p in alive:
        p.kill()
    assert not alive, alive
    assert not _shm()


def _comparable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in TIMING and not k.startswith("time_")}


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _kill_when(tmp_path: Path, marker: str, after_s: float = 0.0) -> dict:
    """A thread that SIGKILLs the first rollouter process that writes ``marker`` (after ``after_s``)."""
    killed: dict = {}

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = sorted(tmp_path.glob(f"{marker}-*"))
            if found:
                time.sleep(after_s)
                pid = int(found[0].name.rsplit("-", 1)[1])
                killed.update(pid=pid, at=time.time())
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    return killed


def _no_group_twice(result) -> None:
    uids = result.trained_uids
    assert len(uids) == len(set(uids)) == result.summary["ledger"]["trained"]


@pytest.mark.parametrize("transport", ["builtin", "shared_host"])
def test_process_executor_equals_the_thread_executor(tmp_path, transport):
    """Weights through the executor's own shared-memory file, or through the weight-sync library."""
    thread = run(tiny(tmp_path / "thread", *DETERMINISTIC), return_params=True)
    proc = run(
        tiny(tmp_path / "process", "executor=process", f"rollout.weight_transport={transport}", *DETERMINISTIC),
        return_params=True,
    )
    assert proc.summary["rollout"]["executor"] == "process" and thread.summary["rollout"]["executor"] == "inprocess"
    assert proc.losses == thread.losses  # exact float equality
    assert proc.trained_uids == thread.trained_uids
    # the weight-sync library publishes from the trainer's state: the loop takes no host snapshot for it
    assert ("snapshot.sync" in proc.summary["offload"]["seconds"]) is (transport == "builtin")
    assert "snapshot.sync" in thread.summary["offload"]["seconds"]
    assert proc.params is not None and thread.params is not None
    for name, t in thread.params.items():
        assert torch.equal(proc.params[name], t), name
    assert [_comparable(r) for r in _records(proc.out_dir)] == [_comparable(r) for r in _records(thread.out_dir)]
    last = proc.steps // 2  # what the rollouter made after the final sync depends on when it was stopped
    pv, tv = (({v: n for v, n in r.summary["ledger"]["by_version"].items() if int(v) < last}) for r in (proc, thread))
    assert pv == tv == {str(v): 8 for v in range(last)}


def test_continuous_batching_in_a_rollouter_process_equals_it_on_the_thread(tmp_path):
    """``rollout.batching=continuous`` on the long-tail task: the ``ContinuousWorker`` in the rollouter process makes
    the same groups as on the thread (staleness 0: a schedule that does not depend on timing)."""
    common = [
        "task.name=longtail",
        "task.max_terms=4",
        "task.warmup_max_terms=2",
        "rollout.max_new_tokens=28",
        "rollout.batching=continuous",
        "trainer.steps=6",
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0",
    ]
    thread = run(tiny(tmp_path / "thread", *common), return_params=True)
    proc = run(tiny(tmp_path / "process", "executor=process", *common), return_params=True)
    assert proc.summary["rollout"]["executor"] == "process" and thread.summary["rollout"]["executor"] == "inprocess"
    assert proc.losses == thread.losses and proc.trained_uids == thread.trained_uids
    assert proc.params is not None and thread.params is not None
    assert all(torch.equal(proc.params[k], v) for k, v in thread.params.items())
    assert [r["rows_by_length"] for r in _records(proc.out_dir)] == [
        r["rows_by_length"] for r in _records(thread.out_dir)
    ]


def test_shared_host_weights_are_published_from_the_trainers_own_shared_pool(tmp_path):
    """``auto`` on the CPU is ``shared_host``: the trainer's ``ModelState`` gets a shared pool, so a version is
    published from its own memory (the publisher would warn of one more host copy otherwise); ``builtin`` and the
    thread executor keep the state's private pool."""
    from stateshift.core.engine import core_of
    from stateshift.train.config import resolve
    from stateshift.train.executors.weights import resolved_transport, trainer_pool

    for overrides, transport, shared in (
        (["executor=process"], "shared_host", True),
        (["executor=process", "rollout.weight_transport=builtin"], "builtin", False),
        (["executor=inprocess"], "shared_host", False),
    ):
        cfg = resolve(None, overrides)
        assert resolved_transport(cfg) == transport
        assert (trainer_pool(cfg) is not None) == shared, overrides
    pools = []
    real = core_of

    def watch(state):
        pools.append(real(state).pool)
        return real(state)

    import stateshift.rl.sync.publisher as publisher

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("error")  # "the state's HostPool is not shared" would fail the run
        mp.setattr(publisher, "core_of", watch)
        res = run(
            tiny(
                tmp_path, "executor=process", "trainer.steps=4", "async_training.trigger_parameter_sync_step=2", *LIVELY
            )
        )
    assert res.summary["status"] == "finished"
    assert pools and all(p.shared for p in pools)


def test_rollouter_killed_mid_generation_is_restarted(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "slow")
    killed = _kill_when(tmp_path, "generating", after_s=0.3)
    res = run(
        tiny(tmp_path, "executor=process", "trainer.steps=10", "async_training.trigger_parameter_sync_step=2", *LIVELY)
    )
    assert res.summary["status"] == "finished" and res.steps == 10
    (restart,) = res.summary["rollout"]["restarts"]
    assert restart["pid"] == killed["pid"] and restart["why"] == "killed by SIGKILL"
    assert restart["detected_at"] - killed["at"] < 3.0  # the server thread sees the pipe close at once (load: slack)
    assert restart["successor_pid"] not in (None, killed["pid"])
    assert f"rollouter process {killed['pid']} died: killed by SIGKILL" in capfd.readouterr().err
    _no_group_twice(res)


def test_a_successor_that_dies_before_it_is_ready_is_one_more_death_replaced_in_turn(tmp_path, monkeypatch):
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "die_on_restart")
    killed = _kill_when(tmp_path, "generating", after_s=0.3)
    res = run(tiny(tmp_path, "executor=process", "trainer.steps=6", *LIVELY))
    assert res.summary["status"] == "finished"
    first, second = res.summary["rollout"]["restarts"]
    assert first["pid"] == killed["pid"] and first["successor_pid"] == second["pid"]
    assert second["why"] == "exit status 3 before it was ready" and second["successor_pid"] is not None
    _no_group_twice(res)


@pytest.mark.parametrize("transport", ["builtin", "shared_host"])
def test_rollouter_killed_mid_weight_copy_is_restarted_and_sent_the_weights_again(tmp_path, monkeypatch, transport):
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "slow_copy")
    killed = _kill_when(tmp_path, "copying")
    res = run(
        tiny(
            tmp_path,
            "executor=process",
            f"rollout.weight_transport={transport}",
            "trainer.steps=6",
            "async_training.trigger_parameter_sync_step=2",
            "async_training.staleness_threshold=0",
            *LIVELY,
        ),
        return_params=True,
    )
    assert res.summary["status"] == "finished" and res.steps == 6
    (restart,) = res.summary["rollout"]["restarts"]
    assert restart["pid"] == killed["pid"] and restart["weights_version"] == 1
    _no_group_twice(res)
    by_version = res.summary["ledger"]["by_version"]
    assert by_version["0"] == by_version["1"] == by_version["2"] == 8  # each version trained its share, none lost


def test_past_max_restarts_a_death_ends_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "slow")
    killed = _kill_when(tmp_path, "generating", after_s=0.2)
    with raises_kind(
        RunError, "rollout_died", match=r"killed by SIGKILL -- after 0 restarts \(rollout.max_restarts=0\)"
    ):
        run(tiny(tmp_path, "executor=process", "trainer.steps=200", "rollout.max_restarts=0", *LIVELY))
    assert killed
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"].startswith("failed (rollout): RunError")


def test_rollouter_that_raises_ends_the_run_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "raise")
    with pytest.raises(Boom, match="rollouter failed at call 4") as info:
        run(tiny(tmp_path, "executor=process", "trainer.steps=200", *LIVELY))
    assert any("raised in the rollouter process" in n and "process_hooks.py" in n for n in info.value.__notes__)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"].startswith("failed (rollout): Boom") and summary["rollout"]["restarts"] == []


def test_hung_rollouter_process_is_reported_with_both_sides_then_stopped(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "hang")
    t0 = time.monotonic()
    with raises_kind(RunError, "stall"):
        run(tiny(tmp_path, "executor=process", "trainer.steps=5", "run.watchdog_s=1", "run.stall_timeout_s=4"))
    assert time.monotonic() - t0 < 40  # set-up, 4 s of stall, 10 s for the stuck process before it is killed
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("[watchdog]"))
    assert "rollout: generating 4 prompts at v0 (pid" in line and "trainer: waiting for 4 groups" in line


def test_a_late_pause_does_not_stall_the_rollouter_process(tmp_path, monkeypatch):
    """The handshake race of ``test_rl_handshake.py`` inside the rollouter process: the pause for a sync comes
    only after the rollouter could have taken the weights and resumed; the run still finishes."""
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "late_pause")
    res = run(
        tiny(
            tmp_path,
            "executor=process",
            "trainer.steps=4",
            "async_training.trigger_parameter_sync_step=1",
            "async_training.staleness_threshold=0",
            "run.watchdog_s=1",
            "run.stall_timeout_s=6",
        )
    )
    assert res.summary["status"] == "finished" and res.summary["ledger"]["trained"] == 16


def test_a_rollouter_process_slower_to_start_than_the_stall_timeout_is_not_a_stall(tmp_path, monkeypatch):
    monkeypatch.setenv("STATESHIFT_TEST_MODE", "slow_start")
    res = run(tiny(tmp_path, "executor=process", "trainer.steps=2", "run.watchdog_s=1", "run.stall_timeout_s=3"))
    assert res.summary["status"] == "finished"


def test_resume_equals_uninterrupted(tmp_path):
    common = [
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0",
        "run.checkpoint_every=2",
        "trainer.optimizer_offload=true",
    ]
    full = run(tiny(tmp_path / "a", "trainer.steps=6", *common), return_params=True)  # the thread executor
    first = run(tiny(tmp_path / "b", "executor=process", "trainer.steps=5", *common))
    assert (first.out_dir / "checkpoints" / "latest").read_text() == "step-4"
    resumed = run(
        tiny(tmp_path / "b", "executor=process", "trainer.steps=6", *common), resume=first.out_dir, return_params=True
    )
    assert first.losses[:4] + resumed.losses == full.losses
    assert resumed.params is not None and full.params is not None
    for name, t in full.params.items():
        assert torch.equal(resumed.params[name], t), name


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _running_in_group(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are not zombies (``/proc/<pid>/stat``: state, then group)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(pid))
    return out


def test_ctrl_c_stops_trainer_and_rollouter_process(tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does): exit code 130, summary written, the
    rollouter process gone too, no traceback from either."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "stateshift.cli",
        "train",
        "executor=process",
        "trainer.steps=400",
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
    ]
    env = {k: v for k, v in os.environ.items() if k != HOOK_ENV}
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # wait until RL steps (the rollouter process is up then)
            if line.startswith("step "):
                break
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert time.monotonic() - t0 < 30  # (about 1 s on an idle machine; generous under load)
        assert "Traceback" not in err and "interrupted" in err and "Exception ignored" not in err
        assert json.loads((out / "summary.json").read_text())["status"].startswith("interrupted at step")
        deadline = time.monotonic() + 5  # nobody left in its process group: the rollouter process ended too
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(proc.pid), subprocess.run(
            ["ps", "-o", "pid,pgid,args", "-g", str(proc.pid)], capture_output=True, text=True
        ).stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("transport", ["builtin", "auto"])
def test_trainer_process_killed_outright_takes_the_rollouter_with_it_and_its_files_are_reclaimed(tmp_path, transport):
    """SIGKILL to the trainer's process alone: the rollouter process sees its pipes close and ends within
    seconds; the shared-memory files left behind (``builtin``: the weight file; ``auto``, here ``shared_host``:
    the trainer's shared pool blocks) are removed by the next publisher or shared pool (their process is gone)."""
    from stateshift.core.pool import HostPool
    from stateshift.train.executors.weights import HostWeightPublisher

    prefix = "stateshift-weights-" if transport == "builtin" else "stateshift-pool-"
    cmd = [
        sys.executable,
        "-m",
        "stateshift.cli",
        "train",
        "executor=process",
        f"rollout.weight_transport={transport}",
        "trainer.steps=400",
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
        f"run.out_dir={tmp_path / 'run'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != HOOK_ENV}
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("step "):
                break
        mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"{prefix}{proc.pid}-")]
        assert len(mine) == 1 if transport == "builtin" else mine
        os.kill(proc.pid, signal.SIGKILL)
        # the trainer stays a zombie (not yet reaped: alive to every sweeper, ours and other test processes')
        # until its files are seen to outlive it
        deadline = time.monotonic() + 10
        while _running_in_group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running_in_group(proc.pid)  # the rollouter process ended on its own
        assert all(os.path.exists(f"/dev/shm/{n}") for n in mine)  # nobody removed them: their process was killed
        proc.wait(10)
        if transport == "builtin":
            HostWeightPublisher({"w": torch.zeros(3)}, 0).close()
        else:
            HostPool(shared=True)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in mine)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
