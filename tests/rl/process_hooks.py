"""Patches a test installs inside a rollouter process (``executor=process``), by ``STATESHIFT_TEST_ROLLOUT_PROCESS_HOOK``.

``install`` reads ``STATESHIFT_TEST_MODE`` and ``STATESHIFT_TEST_DIR`` (where markers go, for the test to see
what the rollouter process is doing):

- ``slow``: every ``generate`` call takes >= 50 ms; a marker ``generating-<pid>`` once it generates;
- ``slow_copy``: the first process to copy weights of a version >= 1 writes ``copying-<pid>`` and sleeps 3 s
  inside the copy (in the middle of its tensors), so a test can kill it there;
- ``raise``: the 4th ``generate`` call raises ``Boom``;
- ``hang``: ``generate`` never returns on its own (it ignores pauses; ends after 60 s);
- ``slow_start``: the process takes 4 s more to start;
- ``die_on_restart``: as ``slow``; the second process to start exits (status 3) before it is ready;
- ``late_pause``: a pause asked for by the thread that posts weight updates (the ``ctl`` thread) first waits
  up to 0.5 s for the rollouter to resume (the interleaving of ``test_rl_handshake.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class Boom(RuntimeError):
    pass


def _mark(name: str) -> None:
    Path(os.environ["STATESHIFT_TEST_DIR"], f"{name}-{os.getpid()}").touch()


def _once(name: str) -> bool:
    try:
        fd = os.open(os.path.join(os.environ["STATESHIFT_TEST_DIR"], name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def install() -> None:
    from stateshift.train.rollout import KVRollouter

    mode = os.environ.get("STATESHIFT_TEST_MODE", "")
    if mode == "slow_start":
        time.sleep(4)
    if mode == "die_on_restart":
        if not _once("first-start") and _once("second-died"):
            os._exit(3)
        mode = "slow"
    generate, update = KVRollouter.generate, KVRollouter.update_weights
    calls = {"n": 0}

    def slow(self, wave):
        _mark("generating")
        time.sleep(0.05)
        return generate(self, wave)

    def slow_copy(self, weights, version):
        def pairs():
            for i, pair in enumerate(weights):
                if i == 1 and version >= 1 and _once("copy-once"):
                    _mark("copying")
                    time.sleep(3)
                yield pair

        return update(self, pairs(), version)

    def boom(self, wave):
        calls["n"] += 1
        if calls["n"] >= 4:
            raise Boom(f"rollouter failed at call {calls['n']}")
        return generate(self, wave)

    def hang(self, wave):
        _mark("hanging")
        time.sleep(60)
        return generate(self, wave)

    pause, resume = KVRollouter.pause, KVRollouter.resume
    resumed = __import__("threading").Event()

    def late_pause(self):
        if __import__("threading").current_thread().name == "stateshift-rollout-ctl":
            resumed.clear()
            resumed.wait(0.5)
        pause(self)

    def resume_marked(self):
        resume(self)
        resumed.set()

    if mode == "late_pause":
        KVRollouter.pause, KVRollouter.resume = late_pause, resume_marked
    patches = {
        "slow": ("generate", slow),
        "slow_copy": ("update_weights", slow_copy),
        "raise": ("generate", boom),
        "hang": ("generate", hang),
    }
    if mode in patches:
        name, fn = patches[mode]
        setattr(KVRollouter, name, fn)
