"""Messages between the trainer's process and a rollouter process (``executor=process``): one pipe, the wire format.

A message is any picklable object; every ``torch.Tensor`` in it travels as its
bytes in a NumPy buffer (``wire.to_wire``), not through torch's pickling, whose
``multiprocessing`` reductions would move each tensor's storage into a shared
memory file of its own (one file descriptor per tensor: a queue put of 32
groups holds ~300 of them). Groups and captures are small; the weights never
travel here (``weights.py``: shared memory).

A ``Link`` has one reader and one writer thread on each end; ``recv`` waits in
bounded slices (``poll``), so no thread waits forever for a process that is gone:
a dead peer shows as ``EOFError``/``OSError`` (``RunError("link_closed")``) at once, since the
pipe's other end closes with the process.
"""

from __future__ import annotations

import io
import pickle
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from ...errors import RunError
from .wire import from_wire, to_wire


class _WirePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return from_wire, (to_wire(obj),)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """``obj`` pickled with every tensor in the wire format."""
    buf = io.BytesIO()
    _WirePickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


class Link:
    """One end of a duplex pipe carrying pickled messages (tensors in the wire format)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, obj: Any) -> None:
        """Send ``obj``; ``RunError("link_closed")`` if the other end is gone."""
        try:
            self.conn.send_bytes(dumps(obj))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise RunError("link_closed", f"the other process is gone ({exc})") from None

    def recv(self, timeout: float) -> tuple[bool, Any]:
        """``(True, message)``, or ``(False, None)`` if none came within ``timeout`` s; ``RunError("link_closed")`` if the
        other end is gone."""
        try:
            if not self.conn.poll(timeout):
                return False, None
            return True, pickle.loads(self.conn.recv_bytes())
        except (EOFError, ConnectionResetError, OSError) as exc:
            raise RunError("link_closed", f"the other process is gone ({type(exc).__name__})") from None

    def close(self) -> None:
        self.conn.close()


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it pickles (the parent re-raises the same type), else a ``RuntimeError`` carrying its text; in
    both cases with the rollouter process's traceback attached as a note."""
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(dumps(exc))
        out = exc
    except Exception:  # noqa: BLE001 - any exception that cannot cross: send its text
        out = RuntimeError(f"{type(exc).__name__}: {exc}")
    if not any("in the rollouter process" in n for n in getattr(out, "__notes__", [])):
        out.add_note(f"raised in the rollouter process:\n{text}")
    return out
