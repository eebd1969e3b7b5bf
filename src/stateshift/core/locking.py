"""How verbs of a ``ModelState`` and compute on its tensors are ordered across threads.

Verbs run under the state's lock (``locked``), so a rollout thread and a
training thread may both call them. Compute that reads the state's storage
(a guarded forward, a backward, an optimizer step) is a *reader* of the state's
``ReaderGate``: its first hook enters the gate, its last one leaves it (a
forward that raises leaves it too: the leaving hook is ``always_call``).
The rule, which holds for every verb, not for a list of cases:

- a verb waits, before it lists or touches anything, until no other thread
  is inside a reader; a reader that starts meanwhile waits for the verb (a
  waiting verb goes first, so a thread running forwards back to back cannot
  starve it);
- on the thread of a running reader (a hook), a verb that releases storage
  (``offload``, ``drop``, a ``swapped()`` exit) raises
  ``StateError("inside_compute")`` -- waiting for itself would never end -- and the
  other verbs run at once (they free nothing the reader reads).

Why a reader left behind cannot block verbs for ever: each reader is keyed
by the Python frame that called its hook (torch's module call, the
optimizer's step); one whose frame is no longer on its thread's stack (an
exception that skipped the leaving hook, a thread that died) is dropped the
next time its thread enters, or when a verb waiting for it looks again
(every half second).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

from ..errors import StateError
from . import touch

_F = TypeVar("_F", bound=Callable[..., Any])

#: verbs that release storage: refused from inside compute on the same thread
RELEASING = frozenset({"offload", "drop", "swapped() exit"})


def _chain(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _live_prefix(stack: list[tuple[FrameType, str]], top: FrameType | None) -> int:
    """How many entries of ``stack`` (bottom first) are frames still running below ``top``."""
    live = {id(f) for f in _chain(top)}
    n = 0
    while n < len(stack) and id(stack[n][0]) in live:
        n += 1
    return n


class ReaderGate:
    """Readers (compute) and verbs of one state, ordered as the module docstring says."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._cond = threading.Condition(lock)
        self._tls = threading.local()
        #: thread ident -> (outermost reader frame, what it is), of every thread inside a reader
        self._readers: dict[int, tuple[FrameType, str]] = {}
        self._waiting = 0

    def _stack(self) -> list[tuple[FrameType, str]]:
        try:
            return self._tls.stack  # type: ignore[no-any-return]
        except AttributeError:
            stack: list[tuple[FrameType, str]] = []
            self._tls.stack = stack
            return stack

    def enter(self, frame: FrameType, what: str) -> None:
        """Compute called from ``frame`` starts reading the state's storage (a pre-hook calls this)."""
        stack = self._stack()
        if stack:
            if stack[-1][0] is frame:
                return
            if not self._nested(stack, frame):
                self._forget_stale(stack, frame)
            if stack:  # inside a running reader of this thread: no wait (the verbs wait for the outermost)
                stack.append((frame, what))
                return
        with self._cond:
            if not self._lock._is_owned():  # type: ignore[attr-defined]  # (a verb's own compute: no wait)
                while self._waiting:
                    self._cond.wait()
            self._readers[threading.get_ident()] = (frame, what)
        stack.append((frame, what))

    @staticmethod
    def _nested(stack: list[tuple[FrameType, str]], frame: FrameType) -> bool:
        """Whether ``frame`` runs inside the innermost reader (a submodule's call: a few frames down)."""
        top = stack[-1][0]
        return any(f is top for f in _chain(frame))

    def leave(self, frame: FrameType) -> None:
        """Compute called from ``frame`` is done (a post-hook calls this; without a matching enter: nothing)."""
        stack = self._stack()
        if not stack or stack[-1][0] is not frame:
            return
        stack.pop()
        if not stack:
            with self._cond:
                self._readers.pop(threading.get_ident(), None)
                self._cond.notify_all()

    def _forget_stale(self, stack: list[tuple[FrameType, str]], top: FrameType | None) -> None:
        """Drop this thread's readers whose frames are gone (left by an exception that skipped a hook)."""
        del stack[_live_prefix(stack, top) :]
        if not stack:
            with self._cond:
                self._readers.pop(threading.get_ident(), None)
                self._cond.notify_all()

    @contextmanager
    def exclusive(self, verb: str) -> Iterator[None]:
        """Run a verb (with the state's lock held) once no other thread is inside a reader.

        Raises ``StateError("inside_compute")`` when ``verb`` releases storage and this thread is inside a reader."""
        stack = self._stack()
        if stack:
            self._forget_stale(stack, sys._getframe())
            if stack and verb in RELEASING:
                raise StateError("inside_compute", verb=verb, compute=stack[0][1])
            if stack:  # a reader itself: waiting for other readers could wait for one that waits for it
                yield
                return
        me = threading.get_ident()
        self._waiting += 1
        try:
            while any(t != me for t in self._readers):
                if not self._cond.wait(timeout=0.5):
                    self._forget_stale_others(me)
        finally:
            self._waiting -= 1
            self._cond.notify_all()
        yield

    def _forget_stale_others(self, me: int) -> None:
        frames = sys._current_frames()
        for tid, (frame, _) in list(self._readers.items()):
            if tid != me and not any(f is frame for f in _chain(frames.get(tid))):
                del self._readers[tid]  # (its thread drops its own stack on its next enter)


class Guard:
    """What a backend's hooks are given: callable as ``Check`` (the residency check), plus the state's
    ``ReaderGate`` as ``enter(frame, what)`` / ``leave(frame)`` (``core/source.py``)."""

    __slots__ = ("check", "enter", "leave")

    def __init__(self, check: Callable[..., None], gate: ReaderGate) -> None:
        self.check = check
        self.enter = gate.enter
        self.leave = gate.leave

    def __call__(self, tensors: Any, where: str, *, writes: bool = False) -> None:
        self.check(tensors, where, writes=writes)


@contextmanager
def verb_scope(core: Any, verb: str) -> Iterator[None]:
    """The body of a verb of a state's core (``engine.Core``): under its lock, ordered after readers
    (``ReaderGate.exclusive``), free to touch released storage (``touch.unchecked``); afterwards the
    released storages are published (``touch``).

    Raises:
        StateError("closed"): the state was closed.
    """
    with core.lock:
        if core.closed:
            raise StateError("closed", f"ModelState was closed; {verb}() needs a new one")
        with core.gate.exclusive(verb), touch.unchecked():
            try:
                yield
            finally:
                core.publish_released()


def locked(fn: _F) -> _F:
    """Run a method of a ``ModelState`` (its ``_core``'s scope) or of a core in ``verb_scope``."""
    name = fn.__name__

    @functools.wraps(fn)
    def verb(self: Any, *args: Any, **kwargs: Any) -> Any:
        with verb_scope(getattr(self, "_core", self), name):
            return fn(self, *args, **kwargs)

    return verb  # type: ignore[return-value]
