"""Weights from the trainer to the rollouter: a versioned host snapshot and a handshake.

In process (``executors/inprocess.py``) the rollout thread reads the trainer's
snapshot in place, as described below. Under Ray (``executors/ray.py``) the
trainer copies the snapshot into Ray's object store (``ray.put``: it may be
released right after) and calls the rollouter actor with the reference and
the version; inside the actor the same ``WeightChannel`` handshake hands the
weights from the call's thread to the generating thread at a token boundary.
In a rollouter process (``executors/process.py``) the trainer writes the
weights into shared memory and sends the version on a pipe; the process's
control thread posts them on the same ``WeightChannel``.

The trainer thread takes ``state.snapshot(tag="sync", version=v, placement="host")``
(zero-copy when the params are offloaded: it shares their pinned home,
copy-on-write) and posts it here; posting pauses the rollouter, whose
in-flight generation returns at the next token boundary (partial rollout).
The rollout thread waits for the snapshot's copies (``snapshot.wait()``),
copies ``snapshot.views()`` into its own model by name, moves to version
``v`` and acknowledges. Only then does the trainer release the snapshot: a
snapshot's memory goes back to the pool on release and may be reused, so it
must outlive every reader (the handshake is what guarantees that). The
trainer is the only thread that calls verbs on its ``ModelState``; the
rollout thread only reads a snapshot the trainer keeps alive for it.

A handshake rather than handing the rollouter its own copy: a copy costs a
full host copy of the weights per sync; the handshake costs the rollouter's
time to reach a token boundary (a few ms here), measured as ``sync_s``.

The acknowledgement can carry a ``RolloutCapture`` (asked for at checkpoint
steps): the rollout thread's whole state at the moment it took the weights,
read on its own thread while the trainer waits -- so queue, ledger, wave in
flight and random states are one consistent picture.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from stateshift import Snapshot

from .control import RunControl


@dataclass(eq=False)
class WeightUpdate:
    """One sync: the weights (``(name, tensor)`` pairs, read on the rollout thread), their version, the answer."""

    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    version: int
    capture: bool = False
    posted_at: float = field(default_factory=time.perf_counter)
    acked: bool = False
    captured: Any = None
    #: seconds the rollout thread spent copying the weights in
    copy_s: float = 0.0

    @staticmethod
    def of_snapshot(snap: Snapshot, version: int, *, capture: bool = False) -> WeightUpdate:
        """Weights read in place from ``snap`` (after ``snap.wait()``); keep it alive until the update is acked."""
        return WeightUpdate(lambda: snap.wait().views(), version, capture=capture)


class WeightChannel:
    """At most one update in flight; ``pending`` and the rollouter's pause flag change only under ``control.cond``.

    Why the pause is never lost nor left behind: ``post`` pauses the rollouter *before* it makes the update
    visible, and the rollout thread clears the pause in ``ack`` under the same lock, right after it emptied
    ``pending``. So a pause is set only while an update is (about to be) pending, and cleared only when none
    is: a pause that landed after the rollouter took the weights and resumed would stop it for good (every
    ``generate`` would return after its prefill, no group made, until the watchdog's ``RunError("stall")``).
    """

    def __init__(self, control: RunControl, pause: Any) -> None:
        self.control = control
        self._pause = pause
        self.pending: WeightUpdate | None = None

    def post(self, update: WeightUpdate, *, interrupt: bool) -> None:
        """Trainer thread: hand over ``update``; ``interrupt`` pauses generation in flight (partial rollout)."""
        with self.control.cond:
            assert self.pending is None, "one weight update at a time"
            if interrupt:
                self._pause()  # before the update is visible: the rollouter cannot take it and resume first
            self.pending = update
            self.control.cond.notify_all()

    def wait_acked(self, update: WeightUpdate) -> None:
        """Trainer thread: bounded wait until the rollouter took the weights (raises if the run stops)."""
        with self.control.cond:
            self.control.wait_for(lambda: update.acked, "trainer", f"the rollouter to take weights v{update.version}")

    def take(self) -> WeightUpdate | None:
        """Rollout thread: the pending update, if any (it stays pending until ``ack``)."""
        with self.control.cond:
            return self.pending

    def ack(self, update: WeightUpdate, captured: Any = None, *, resume: Callable[[], None] | None = None) -> None:
        """Rollout thread: done reading the update's weights; ``resume`` (the rollouter's) is called under the lock,
        once nothing is pending, so that no ``post`` can pause in between and see its pause cleared."""
        with self.control.cond:
            update.captured = captured
            update.acked = True
            self.pending = None
            if resume is not None and not self.control.stopping:  # (a stopping run keeps the pause ``stop`` set)
                resume()
            self.control.progress()
            self.control.cond.notify_all()
