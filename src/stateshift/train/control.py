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

Ctrl-C and SIGTERM (``StopSignals``, installed by ``stateshift train``): the
signal handler only calls ``RunControl.interrupt`` -- a flag, no lock, no
exception raised at whatever bytecode the main thread was running -- and the
loop stops at its next step boundary or wait slice with ``KeyboardInterrupt``,
as it stops on the other side's error: rollout side stopped, summary written.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
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

    def interrupt(self) -> None:
        """Ctrl-C: stop as ``fail`` does, with ``KeyboardInterrupt`` as the error (unless one came first).

        Called from a signal handler (``StopSignals``), which runs between two bytecodes of the main thread, maybe
        while it holds ``cond``: so this takes no lock and calls no ``on_stop``; every wait sees the flag within one
        slice (``wait_for``, ``check``), and ``Rollouts.stop`` calls ``stop`` (and so ``on_stop``) on the way out.
        """
        if self.error is None:
            self.error, self.failed_side = KeyboardInterrupt(), "user"
        self._stopping = True

    @property
    def interrupted(self) -> bool:
        """Whether the run is stopping because of Ctrl-C (``interrupt``)."""
        return isinstance(self.error, KeyboardInterrupt)

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

    def __init__(
        self,
        control: RunControl,
        describe: Callable[[], str],
        *,
        report_s: float,
        stall_s: float,
        stream: TextIO | None = None,
    ) -> None:
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
        if self._thread.ident is not None:  # (not started: the run stopped before its first step)
            self._thread.join(timeout)


def describe_sides(control: RunControl, extra: dict[str, Any]) -> str:
    sides = ", ".join(f"{k}: {v}" for k, v in sorted(control.doing.items()))
    return f"{sides}; " + ", ".join(f"{k}={v}" for k, v in extra.items())


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM as a request to stop the run (``stateshift train`` installs it around the run).

    Python's own Ctrl-C raises ``KeyboardInterrupt`` at whatever bytecode the main thread runs when the signal
    lands: inside a ``weakref.finalize`` callback or a ``__del__`` it is printed ("Exception ignored in") and lost,
    and the run goes on; between two steps of a cleanup it leaves that cleanup half done. Here instead:

    - the first signal, while a listener is registered (``listen``: the loop registers ``RunControl.interrupt``,
      the Ray driver a flag it polls), only calls the listeners; the run stops at its next step boundary or wait;
    - the first signal while nothing listens (start-up: building, warm-up) raises ``KeyboardInterrupt`` there, as
      Python does (``StartUp`` writes the summary); it is remembered, so a listener registered later is called
      at once (an exception lost in a finalizer still stops the run);
    - the second raises ``KeyboardInterrupt`` wherever the process is (the cleanup's ``finally`` blocks still run);
    - the third ends the process at once (``os._exit``, status 128 + the signal): a user is never stuck.

    ``signum`` is the first signal received (``None`` while none); the CLI exits with 128 + it.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._listeners: list[Callable[[], None]] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        """Install the handlers (only on the main thread, where ``signal`` can; elsewhere a no-op)."""
        global _installed
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            _installed = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _installed
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()
        if _installed is self:
            _installed = None

    def reinstall(self) -> None:
        """Take the signals back from a library that replaced the handlers (``ray.init`` sets its own SIGTERM one,
        ``sys.exit``); the handlers ``__exit__`` restores stay those found at ``__enter__``."""
        if self._previous and threading.current_thread() is threading.main_thread():
            for sig in self._previous:
                signal.signal(sig, self._handle)

    def listen(self, fn: Callable[[], None]) -> Listener:
        """Call ``fn`` on the first signal from now on (at once if one came already) until the returned
        ``Listener`` is closed. ``fn`` runs in a signal handler: it must only set flags (no locks, no I/O)."""
        listener = Listener(self, fn)
        self._listeners.append(listener.fn)
        if self.count:
            fn()
        return listener

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        if self.count >= 3:
            os.write(2, b"\nstopping now (a third signal): no cleanup\n")
            os._exit(128 + self.signum)
        if self.count >= 2 or not self._listeners:
            raise KeyboardInterrupt
        for fn in list(self._listeners):
            fn()


class Listener:
    """One registration of ``StopSignals.listen``; ``close`` (or the end of a ``with`` block) ends it."""

    def __init__(self, signals: StopSignals | None, fn: Callable[[], None]) -> None:
        self.signals, self.fn = signals, fn

    def close(self) -> None:
        if self.signals is not None and self.fn in self.signals._listeners:
            self.signals._listeners.remove(self.fn)
        self.signals = None

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StopFlag:
    """A listener for ``on_stop_signal`` that only records the request (for a loop that polls: the Ray driver)."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> None:
        self.requested = True


#: the ``StopSignals`` whose handlers are installed now, if any
_installed: StopSignals | None = None


def on_stop_signal(fn: Callable[[], None]) -> Listener:
    """``fn`` called on the first SIGINT / SIGTERM while the returned ``Listener`` is open, when ``StopSignals``
    handles them (``stateshift train``); otherwise (a library caller) nothing: Ctrl-C raises ``KeyboardInterrupt``
    as usual."""
    return _installed.listen(fn) if _installed is not None else Listener(None, fn)


def reinstall_stop_signals() -> None:
    """``StopSignals.reinstall`` of the installed handlers, if any (after ``ray.init``)."""
    if _installed is not None:
        _installed.reinstall()
