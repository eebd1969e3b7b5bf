"""Writers racing on one checkpoint path, and what a killed writer leaves behind.

Two processes saving to the same new path at once (two ranks both calling ``save(...,
distributed=False)``, or a restarted job racing the old one) must end in one checkpoint that loads
and verifies, the other writer failing with a typed error -- never a success reported for a
checkpoint no load accepts. A writer killed between committing a checkpoint and renaming the new
``latest`` into place leaves a ``.latest.tmp-<hex>`` file: a later save removes it, and never the
live temporary file of a writer still at work.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch
from helpers import SRC, TESTS, capture, make
from raises import raises_kind

from stateshift import ModelState
from stateshift.checkpoint import load, save, verify
from stateshift.errors import CheckpointError

ROUNDS = 100

# One writer: reads a round number per line, saves its model (seed argv[3]) to <root>/r<round>, prints the outcome.
_WRITER = r"""
import sys
sys.path[:0] = sys.argv[1:3]
import torch
torch.set_num_threads(1)
from helpers import make
from stateshift import ModelState
from stateshift.checkpoint import save
from stateshift.errors import StateShiftError
root, seed = sys.argv[4], int(sys.argv[3])
state = ModelState(make("cpu", seed=seed)[0])  # (untrained: the same values as the test's, whatever its threads)
print("ready", flush=True)
for line in sys.stdin:
    path = f"{root}/r{int(line)}"
    try:
        save(state, path, distributed=False, update_latest=True)
        print("ok", flush=True)
    except (StateShiftError, FileExistsError) as e:
        print("typed", type(e).__name__, str(e).replace(chr(10), " "), flush=True)
    except BaseException as e:
        print("untyped", type(e).__name__, str(e).replace(chr(10), " "), flush=True)
"""


def _params(seed: int) -> dict[str, torch.Tensor]:
    return capture(ModelState(make("cpu", seed=seed)[0]), ["params"])


def test_two_concurrent_writers_to_one_path_leave_a_loadable_checkpoint_or_a_typed_error(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, TESTS, SRC, str(seed), str(tmp_path)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        for seed in (1, 2)
    ]
    watchdog = threading.Timer(120, lambda: [p.kill() for p in procs])
    watchdog.start()
    outcomes: list[list[str]] = []
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        for i in range(ROUNDS):
            for p in procs:
                p.stdin.write(f"{i}\n")
            outcomes.append([p.stdout.readline().strip() for p in procs])
    finally:
        watchdog.cancel()
        for p in procs:
            p.stdin.close()
            p.kill()
            p.wait(10)
    assert len(outcomes) == ROUNDS, "a writer died"
    expected = {0: _params(1), 1: _params(2)}
    state = ModelState(make("cpu", seed=3)[0])
    for i, pair in enumerate(outcomes):
        assert all(o == "ok" or o.startswith("typed ") for o in pair), (i, pair)
        winners = [w for w, o in enumerate(pair) if o == "ok"]
        assert len(winners) == 1, (i, pair)  # one checkpoint at the path: exactly one writer made it
        verify(tmp_path / f"r{i}")
        load(state, tmp_path / f"r{i}", "params")
        got = capture(state, ["params"])
        assert all(torch.equal(got[k], expected[winners[0]][k]) for k in got), (i, pair)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n], "a temporary file or directory was left"


def test_a_dead_writers_latest_leftover_is_removed_by_the_next_save(tmp_path):
    state = ModelState(*make("cpu"))
    save(state, tmp_path / "step-1", update_latest=True)
    leftover = tmp_path / ".latest.tmp-0123abcd"  # what a SIGKILL before the pointer's rename leaves
    leftover.write_text("step-2\n")
    save(state, tmp_path / "step-2", update_latest=False)
    assert not leftover.exists()
    leftover.write_text("step-3\n")
    save(state, tmp_path / "step-3", update_latest=True)
    assert not leftover.exists() and (tmp_path / "latest").read_text() == "step-3\n"
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_live_writers_latest_temporary_file_is_kept(tmp_path):
    state = ModelState(*make("cpu"))
    live = tmp_path / ".latest.tmp-89abcdef"
    with open(live, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a writer at work holds its temporary file locked
        save(state, tmp_path / "step-1", update_latest=True)
        assert live.exists()
    save(state, tmp_path / "step-2", update_latest=True)
    assert not live.exists()


def test_a_live_writers_temporary_directory_is_kept_and_a_dead_ones_removed(tmp_path):
    state = ModelState(*make("cpu"))
    dead, live = tmp_path / ".ck.tmp-000000000001", tmp_path / ".ck.tmp-000000000002"
    dead.mkdir()
    live.mkdir()
    (live / "params.safetensors").write_bytes(b"being written")
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        save(state, tmp_path / "ck")
        assert live.exists() and (live / "params.safetensors").exists() and not dead.exists()
    finally:
        os.close(fd)
    verify(tmp_path / "ck")


def test_a_second_writer_finding_the_path_taken_at_its_rename_fails_typed(tmp_path, monkeypatch):
    from stateshift.checkpoint import commit as commit_mod
    from stateshift.checkpoint.directory import write_checkpoint
    from stateshift.checkpoint.format import Record

    state = ModelState(make("cpu")[0])
    real = commit_mod._rename

    def racing(tmp: Path, final: Path) -> None:  # another writer completes the path just before this one renames
        monkeypatch.setattr(commit_mod, "_rename", real)
        write_checkpoint(
            final,
            {"x.safetensors": [Record.from_tensor("x", torch.arange(3.0))]},
            backend="other",
            layout={"format": "other"},
        )
        real(tmp, final)

    monkeypatch.setattr(commit_mod, "_rename", racing)
    with raises_kind(CheckpointError, "write", match="another writer"):
        save(state, tmp_path / "ck", update_latest=True)
    assert verify(tmp_path / "ck").backend == "other"
    assert not (tmp_path / "latest").exists()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
