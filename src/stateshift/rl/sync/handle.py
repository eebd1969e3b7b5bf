"""``SyncHandle``: the plain data a receiving process needs to find a publisher.

A handle is a frozen dataclass of strings and integers; ``to_json()`` and
``SyncHandle.from_json()`` turn it into text and back, so it travels by any
means (a multiprocessing queue, a Ray object reference, argv). Nothing in it
is code and nothing is unpickled: a receiver checks every field
(``SyncError("mailbox")``) before it opens a file.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Literal

from ...errors import SyncError

Transport = Literal["shared_host", "cuda_ipc", "broadcast"]
TRANSPORTS: tuple[str, ...] = ("shared_host", "cuda_ipc", "broadcast")
#: Names of publishers and receivers: what may appear inside a file name.
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PREFIX = re.compile(r"stateshift-sync-(\d{1,10})-[0-9a-f]{8,32}")
#: the longest handle text a receiver parses (a publisher writes a few hundred characters)
MAX_HANDLE_CHARS = 64 << 10


@dataclass(frozen=True)
class SyncHandle:
    """Where a publisher's versions are announced, and how their bytes travel.

    Fields: ``transport``; ``directory`` and ``prefix`` of the publisher's
    mailbox files (``<directory>/<prefix>.json`` and its lock files);
    ``publisher``: the publisher's name; ``pid``: its process id; for
    ``broadcast``: ``host``, ``port`` of its rendezvous store, ``world_size``
    (publisher plus receivers) and ``backend`` (``gloo`` or ``nccl``).
    """

    transport: str
    directory: str
    prefix: str
    publisher: str
    pid: int
    host: str = ""
    port: int = 0
    world_size: int = 0
    backend: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> SyncHandle:
        """A handle from ``to_json()``'s text, every field checked (``SyncError("mailbox")``)."""
        if len(text) > MAX_HANDLE_CHARS:
            raise SyncError("mailbox", f"{len(text)} characters, more than {MAX_HANDLE_CHARS}", path="<handle>")
        try:
            obj = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise SyncError("mailbox", str(exc)[:200], path="<handle>", field="json") from None
        if not isinstance(obj, dict) or set(obj) != {f.name for f in fields(SyncHandle)}:
            raise SyncError(
                "mailbox", f"expected {sorted(f.name for f in fields(SyncHandle))}", path="<handle>", field="fields"
            )
        return SyncHandle(**obj).checked()

    def checked(self) -> SyncHandle:
        """This handle, if every field is of the kind a publisher writes (``SyncError("mailbox")`` otherwise)."""
        ints = (self.pid, self.port, self.world_size)
        strs = (self.transport, self.directory, self.prefix, self.publisher, self.host, self.backend)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in ints) or not all(
            isinstance(s, str) for s in strs
        ):
            raise SyncError("mailbox", "integers and strings expected", path="<handle>", field="types")
        if self.transport not in TRANSPORTS:
            raise SyncError(
                "mailbox", f"{self.transport!r} is not one of {TRANSPORTS}", path="<handle>", field="transport"
            )
        if not self.directory.startswith("/") or "\0" in self.directory:
            raise SyncError(
                "mailbox", f"{self.directory!r} is not an absolute path", path="<handle>", field="directory"
            )
        if PREFIX.fullmatch(self.prefix) is None or NAME.fullmatch(self.publisher) is None:
            raise SyncError(
                "mailbox",
                f"{self.prefix!r} / {self.publisher!r} is not a publisher's name",
                path="<handle>",
                field="prefix",
            )
        if self.backend not in ("", "gloo", "nccl"):
            raise SyncError("mailbox", f"{self.backend!r}", path="<handle>", field="backend")
        return self
