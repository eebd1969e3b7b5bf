"""``stateshift clean``: the shared-memory files of killed processes go; a live process's, a live receiver's
publisher's and anything not ours stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from stateshift.cli import main
from stateshift.rl.sync.mailbox import Mailbox

DEAD = 999_999_999  # no such process id (above pid_max)


def _files(d, pid):
    names = [
        f"stateshift-pool-{pid}-ab12-0",
        f"stateshift-pool-{pid}-ab12-1",
        f"stateshift-sync-{pid}-cd34.json",
        f"stateshift-sync-{pid}-cd34.lock",
        f"stateshift-sync-{pid}-cd34-v3.json",
        f"stateshift-weights-{pid}-ef56",
    ]
    for n in names:
        (d / n).write_bytes(b"x" * 1000)
    return set(names)


def test_clean_removes_the_files_of_dead_processes_only(tmp_path, capsys):
    dead = _files(tmp_path, DEAD)
    live = _files(tmp_path, 1)  # pid 1 lives
    (tmp_path / "stateshift-pool-notapid").write_bytes(b"x")
    (tmp_path / "someone-elses-file").write_bytes(b"x")

    assert main(["clean", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(f"would remove {n}" in out for n in dead) and "6 stale files" in out and "6,000 bytes" in out
    assert {p.name for p in tmp_path.iterdir()} >= dead  # a dry run removes nothing

    assert main(["clean", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(f"removed {n}" in out for n in dead) and "6 stale files" in out
    assert {p.name for p in tmp_path.iterdir()} == live | {"stateshift-pool-notapid", "someone-elses-file"}
    assert main(["clean", str(tmp_path)]) == 0
    assert "0 stale files" in capsys.readouterr().out


def test_clean_keeps_a_dead_publisher_s_files_while_a_receiver_reads_them(tmp_path, capsys):
    dead = _files(tmp_path, DEAD)
    box = Mailbox(str(tmp_path), f"stateshift-sync-{DEAD}-cd34")
    fd = box.hold_alive("rx0")  # a live receiver of the dead publisher
    try:
        assert main(["clean", str(tmp_path)]) == 0
        kept = {p.name for p in tmp_path.iterdir()}
        assert kept == (dead - {f"stateshift-weights-{DEAD}-ef56"}) | {f"stateshift-sync-{DEAD}-cd34.r.rx0.alive"}
    finally:
        os.close(fd)
    capsys.readouterr()
    assert main(["clean", str(tmp_path)]) == 0  # the receiver is gone: everything goes
    assert not list(tmp_path.iterdir())


def test_clean_after_a_sigkilled_publisher(tmp_path, capsys):
    """A publisher process SIGKILLed while its version is published leaves pool blocks and a mailbox; clean
    removes every one of them."""
    code = textwrap.dedent(
        f"""
        import sys, torch
        from stateshift import ModelState
        from stateshift.core.pool import HostPool
        from stateshift.rl.sync import WeightPublisher
        model = torch.nn.Linear(64, 64)
        state = ModelState(model, pool=HostPool(shared=True, shm_dir={str(tmp_path)!r}))
        pub = WeightPublisher(state, transport="shared_host", directory={str(tmp_path)!r})
        pub.publish(1).wait(30)
        print("published", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "published"
        left = {p.name for p in tmp_path.iterdir()}
        assert any(n.startswith("stateshift-pool-") for n in left) and any(n.endswith(".json") for n in left)
        assert main(["clean", str(tmp_path)]) == 0  # alive: nothing goes
        assert {p.name for p in tmp_path.iterdir()} == left
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    capsys.readouterr()
    assert main(["clean", str(tmp_path)]) == 0
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_clean_refuses_what_is_not_a_directory(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_bytes(b"")
    assert main(["clean", str(f)]) == 2
    assert "not a readable directory" in capsys.readouterr().err


def test_a_file_named_with_an_impossible_process_id_is_stale_not_a_crash(tmp_path, capsys):
    """A name with a process id no process can have (past a C long) made the liveness check raise
    ``OverflowError``: every shared pool's start-up sweep in that directory crashed with it."""
    from stateshift.core.pool import HostPool

    odd = tmp_path / "stateshift-pool-99999999999999999999999-ab-1"
    odd.write_bytes(b"x")
    pool = HostPool(shared=True, shm_dir=str(tmp_path))  # its start-up sweep
    assert not odd.exists()
    pool.trim()
    odd.write_bytes(b"x")
    assert main(["clean", str(tmp_path)]) == 0 and not odd.exists()
