"""The trainer-to-rollouter weight handshake (``train/handshake.py``) under adversarial interleavings."""

from __future__ import annotations

import threading

from rl.rlkit import tiny

from stateshift.train.control import RunControl
from stateshift.train.handshake import WeightChannel, WeightUpdate
from stateshift.train.launch import run
from stateshift.train.rollout import KVRollouter


def test_a_pause_that_lands_after_the_rollouter_resumed_does_not_stall_the_run(tmp_path, monkeypatch):
    """The trainer's pause for a sync arrives only after the rollout thread took the weights and resumed.

    Forced interleaving: a pause asked for by the trainer thread first waits (up to 0.5 s) for the rollouter to
    resume. Were the pause sent after the update is published, the rollouter would take the weights, resume,
    and then be paused for good: every ``generate`` returns after its prefill, no group is made, and the
    watchdog ends the run with ``RunError("stall")``. Sent under the channel's lock before publishing, the wait times
    out (the rollouter cannot see the update yet) and the run finishes.
    """
    resumed = threading.Event()
    real_pause, real_resume = KVRollouter.pause, KVRollouter.resume
    trainer_thread = threading.current_thread()

    def late_pause(self):
        if threading.current_thread() is trainer_thread:
            resumed.clear()
            resumed.wait(0.5)
        real_pause(self)

    def resume(self):
        real_resume(self)
        resumed.set()

    monkeypatch.setattr(KVRollouter, "pause", late_pause)
    monkeypatch.setattr(KVRollouter, "resume", resume)
    cfg = tiny(
        tmp_path,
        "trainer.steps=4",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=0",
        "async_training.partial_rollout=true",
        "run.watchdog_s=1",
        "run.stall_timeout_s=4",
    )
    result = run(cfg)
    assert result.summary["status"] == "finished" and result.steps == 4
    assert result.summary["ledger"]["trained"] == 4 * 4


def test_the_pause_is_cleared_only_when_no_update_is_pending():
    """Rollout side: after an ack the rollouter resumes; a pause posted with a new update stays until it is taken."""
    control = RunControl()
    state = {"paused": False}
    channel = WeightChannel(control, lambda: state.__setitem__("paused", True))
    first = WeightUpdate(list, 1)
    channel.post(first, interrupt=True)
    assert state["paused"] and channel.take() is first  # paused before the update was visible
    channel.ack(first, resume=lambda: state.__setitem__("paused", False))
    assert not state["paused"] and channel.take() is None
    second = WeightUpdate(list, 2)
    channel.post(second, interrupt=True)
    assert state["paused"]
