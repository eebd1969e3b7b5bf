"""Liveness: one condition variable, one stop flag, the first error, bounded waits, a watchdog.

Every wait in the async loop goes through ``RunControl.wait_for``: it waits
in slices of at most ``SLICE_S`` seconds and, between slices, raises if the
run is stopping -- the other side failed (its error is re-raised here, the
same exception object) or the user pressed Ctrl-C -- so no thread can wait
forever for a thread that is gone. The same condition guards the queue and
the weight channel, so one ``notify_all`` wakes whoever waits for either.

The watchdog thread reads ``last_progress`` (set by ``progress()`` whenever a
group is generated, a step is trained or weights are synced): after
``watchdog_s`` without progress it prints what each side is waiting for, the
queue depth and the versions; after ``stall_timeout_s`` it stops the run with
``RunError("stall")``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..errors import RunError

SLICE_S = 0.05


class RunControl:
    """Shared by the trainer thread, the rollout thread and the watchdog."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.failed_side = ""
        self._stopping = False
        self.last_progress = time.monotonic()
        #: what each side is doing now ("waiting for ...", "generating", ...), for the watchdog
        self.doing: dict[str, str] = {}
        self.on_stop: list[Callable[[], None]] = []

    @property
    def stopping(self) -> bool:
        return self._stopping

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def fail(self, side: str, error: BaseException) -> None:
        """Record the first error and stop everything (later errors are consequences)."""
        with self.cond:
            if self.error is None:
                self.error, self.failed_side = error, side
        self.stop()

    def stop(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        for fn in self.on_stop:
            fn()

    def check(self) -> None:
        """Raise the other side's error (or ``RunError("stopped")``) if the run is stopping."""
        if self._stopping:
            if self.error is not None:
                raise self.error
            raise RunError("stopped", "the run was stopped")

    def wait_for(self, ready: Callable[[], bool], side: str, what: str) -> None:
        """Wait (holding ``cond`` between checks) until ``ready()``; raise as ``check`` does when stopping.

        Call with ``cond`` held; ``ready`` is evaluated under it.
        """
        self.doing[side] = f"waiting for {what}"
        try:
            while not ready():
                self.check()
                self.cond.wait(SLICE_S)
            self.check()
        finally:
            self.doing[side] = "working"


class Watchdog:
    """A daemon thread that reports (and, past the stall timeout, stops) a run where nothing moves."""

    def __init__(self, control: RunControl, describe: Callable[[], str], *, report_s: float, stall_s: float,
                 stream: TextIO | None = None) -> None:
        self.control = control
        self.describe = describe
        self.report_s = report_s
        self.stall_s = stall_s
        self.stream = stream or sys.stderr
        self.reports: list[str] = []
        self._thread = threading.Thread(target=self._run, name="stateshift-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def _run(self) -> None:
        reported_at = 0.0
        while not self.control.stopping:
            time.sleep(min(1.0, self.report_s / 4))
            idle = time.monotonic() - self.control.last_progress
            if idle >= self.stall_s:
                self.control.fail("watchdog", RunError("stall", f"nothing moved for {idle:.0f} s: {self.describe()}"))
                return
            if idle >= self.report_s and time.monotonic() - reported_at >= self.report_s:
                reported_at = time.monotonic()
                line = f"[watchdog] nothing moved for {idle:.0f} s: {self.describe()}"
                self.reports.append(line)
                print(line, file=self.stream, flush=True)

    def join(self, timeout: float = 2.0) -> None:
        self._thread.join(timeout)


def describe_sides(control: RunControl, extra: dict[str, Any]) -> str:
    sides = ", ".join(f"{k}: {v}" for k, v in sorted(control.doing.items()))
    return f"{sides}; " + ", ".join(f"{k}={v}" for k, v in extra.items())
