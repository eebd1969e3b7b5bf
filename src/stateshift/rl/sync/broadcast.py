"""The ``broadcast`` transport: versions pushed to every receiver through a process group of their own
(gloo on the CPU, NCCL on GPUs), the one transport that crosses machines.

The group is built from a ``TCPStore`` the publisher hosts (rank 0; receivers
take ranks 1..N from the store's counter), separate from any default group
the trainer runs, so it needs no ``init_process_group``. Per version, rank 0
counts the version as sent in the store, then broadcasts a header (version,
manifest bytes, payload bytes), the manifest JSON, then the payload (the
snapshot's parts back to back) in buckets of ``bucket_bytes``. A receiver
posts its receive of a header only once the store counts one more version
than it received: a collective cannot be cancelled, so a wait for a version
that times out must leave none posted. When the payload is not where the
group communicates (a host snapshot on NCCL), two device buckets alternate:
the copy into bucket k+1 (on a copy stream) overlaps the broadcast of bucket k.

A receiver receives a whole version into its own staging buffer before it
yields anything, so a publisher that dies mid-broadcast leaves it on the
last whole version (it gets the group's error). Every receiver gets every
version sent (a collective); the publisher coalesces versions published
faster than it sends (only the latest goes out). A receiver that dies breaks
the group: the publisher records a ``SyncError("receiver_lost")`` and stops
broadcasting (``publish`` raises ``SyncError`` from then on).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from ...core.snapshot import Snapshot
from ...errors import SyncError
from .handle import SyncHandle
from .manifest import MAX_MANIFEST_BYTES, Manifest, part_entry

_VERSION = 1


#: the key of the group's store that counts the versions the publisher sent (``BroadcastLink._next_header``)
SENT = "stateshift-sync-sent"


def _group(store: Any, rank: int, size: int, backend: str, host: str, timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("stateshift-sync", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


class BroadcastSender:
    """Rank 0: hosts the store, joins the group (``connect``, on the publisher's thread), sends versions."""

    def __init__(
        self, device: torch.device, receivers: int, host: str, port: int, bucket_bytes: int, timeout_s: float = 300.0
    ) -> None:
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.world = receivers + 1
        self.host, self.bucket_bytes, self.timeout_s = host, bucket_bytes, timeout_s
        self.store = dist.TCPStore(
            host, port, self.world, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.port = self.store.port
        self.pg: Any = None
        self._buckets: list[torch.Tensor] = []

    def connect(self) -> None:
        """Join the group: returns once every receiver has joined (or raises after ``timeout_s``)."""
        if self.pg is None:
            self.pg = _group(self.store, 0, self.world, self.backend, self.host, self.timeout_s)

    def send(self, version: int, snapshot: Snapshot) -> None:
        """Broadcast ``snapshot`` (waited for) as ``version``: header, manifest, payload."""
        self.connect()
        parts, offset = [], 0
        for p in snapshot.parts:
            parts.append(part_entry(p, offset=offset))
            offset += p.layout.total
        raw = Manifest(version=version, transport="broadcast", parts=tuple(parts)).to_json()
        self.store.add(SENT, 1)  # receivers post their receive of the header once they see it counted
        self._bcast(torch.tensor([_VERSION, version, len(raw), offset, self.bucket_bytes], dtype=torch.int64))
        self._bcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self._payload([p.arena for p in snapshot.parts])

    def _bcast(self, t: torch.Tensor) -> None:
        t = t.to(self.device)
        self.pg.broadcast(t, 0).wait()

    def _payload(self, arenas: list[torch.Tensor]) -> None:
        chunks = [a[i : i + self.bucket_bytes] for a in arenas for i in range(0, a.numel(), self.bucket_bytes)]
        if all(c.device == self.device for c in chunks):
            works = [self.pg.broadcast(c, 0) for c in chunks]  # in order; the group runs them back to back
            for w in works:
                w.wait()
            return
        self._pipelined(chunks)

    def _pipelined(self, chunks: list[torch.Tensor]) -> None:
        """Host chunks through two device buckets: copy k+1 (copy stream) overlaps the broadcast of k."""
        if not self._buckets:
            self._buckets = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        copy_stream = torch.cuda.Stream(self.device)
        works: list[Any] = [None, None]
        for k, chunk in enumerate(chunks):
            b = k % 2
            if works[b] is not None:
                works[b].wait()  # bucket b's last broadcast is done before it is overwritten
                copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            buf = self._buckets[b][: chunk.numel()]
            with torch.cuda.stream(copy_stream):
                buf.copy_(chunk, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(copy_stream)
            works[b] = self.pg.broadcast(buf, 0)
        for w in works:
            if w is not None:
                w.wait()
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Leave the group: receivers waiting for a version get ``SyncError`` (their group ended)."""
        self.pg = None
        self.store = None


class BroadcastLink:
    """A receiver's end: joins the group in its constructor, receives whole versions into staging memory."""

    def __init__(self, handle: SyncHandle, device: torch.device | None, timeout_s: float = 300.0) -> None:
        if handle.world_size < 2 or handle.port == 0 or handle.backend not in ("gloo", "nccl"):
            raise SyncError(
                "mailbox",
                f"world_size {handle.world_size}, port {handle.port}, backend {handle.backend!r}",
                path="<handle>",
                field="broadcast",
            )
        self.device = (
            torch.device("cpu")
            if handle.backend == "gloo"
            else (device or torch.device("cuda", torch.cuda.current_device()))
        )
        store = dist.TCPStore(handle.host, handle.port, handle.world_size, False, datetime.timedelta(seconds=timeout_s))
        self.rank = int(store.add("stateshift-sync-rank", 1))
        if self.rank >= handle.world_size:
            raise SyncError(
                "broadcast", f"broadcast group of {handle.publisher!r} is full ({handle.world_size - 1} receivers)"
            )
        self.pg = _group(store, self.rank, handle.world_size, handle.backend, handle.host, timeout_s)
        self.version: int | None = None
        self.alive = True
        self._staging: torch.Tensor | None = None
        self.store: Any = store
        #: versions received so far: the next header is posted only once the publisher counted more as sent
        self._received = 0

    def next(self, min_version: int | None, deadline: float) -> tuple[int, Manifest, list[torch.Tensor]]:
        """Receive versions until one is at least ``min_version``; returns it (its arenas: staging views).

        Raises ``SyncError("timeout")`` once ``deadline`` (``time.monotonic()``) passes with no such version;
        a version whose header arrived is then received whole first."""
        while True:
            if not self.alive:
                raise SyncError("broadcast", "the broadcast group ended (the publisher closed or died)")
            version, manifest, arenas = self._one(deadline, min_version)
            if min_version is None or version >= min_version:
                return version, manifest, arenas

    def _one(self, deadline: float, min_version: int | None) -> tuple[int, Manifest, list[torch.Tensor]]:
        try:
            header = self._next_header(deadline, min_version)
            return self._receive(header)
        except SyncError as exc:  # ours: the receiver's timeout (the header stays posted), or a version refused
            if exc.kind != "timeout":
                self.alive = False  # (what follows a refused header would be read out of step)
            raise
        except RuntimeError as exc:  # the group's error: the publisher closed or died, or it timed out
            self.alive = False
            raise SyncError("broadcast", f"the broadcast group ended: {exc}") from exc

    def _next_header(self, deadline: float, min_version: int | None) -> list[int]:
        """The next version's header. A collective cannot be cancelled, so it is posted only once the publisher
        counted the version as sent (``SENT`` in the group's store, read without blocking until ``deadline``):
        a wait that times out leaves nothing posted, and the process can go on or exit."""
        pause = 0.001
        while int(self.store.add(SENT, 0)) <= self._received:  # (an error here: the publisher's store is gone)
            if time.monotonic() > deadline:
                raise SyncError(
                    "timeout",
                    f"broadcast: no version >= {min_version} within the receiver's timeout (latest {self.version})",
                    min_version=min_version,
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        header = torch.zeros(5, dtype=torch.int64, device=self.device)
        self.pg.broadcast(header, 0).wait()
        self._received += 1
        return [int(x) for x in header.tolist()]

    def _receive(self, header: list[int]) -> tuple[int, Manifest, list[torch.Tensor]]:
        kind, version, mlen, total, bucket = header
        if kind != _VERSION:
            raise SyncError("mailbox", f"kind {kind}", path="<broadcast>", field="header")
        if not 0 < mlen <= MAX_MANIFEST_BYTES or total < 0 or bucket < 1:
            raise SyncError("mailbox", f"manifest {mlen} bytes, payload {total}", path="<broadcast>", field="header")
        raw = torch.empty(mlen, dtype=torch.uint8, device=self.device)
        self.pg.broadcast(raw, 0).wait()
        manifest = Manifest.parse(raw.cpu().numpy().tobytes(), "<broadcast>")
        ends = [p.offset + p.size for p in manifest.parts]
        if any(e > total for e in ends) or sum(p.size for p in manifest.parts) != total or manifest.version != version:
            raise SyncError(
                "mailbox",
                f"parts past the payload of {total} bytes, or version mismatch",
                path="<broadcast>",
                field="parts",
            )
        if self._staging is None or self._staging.numel() != total:
            self._staging = torch.empty(total, dtype=torch.uint8, device=self.device)
        spans = [
            (p.offset + i, p.offset + min(i + bucket, p.size)) for p in manifest.parts for i in range(0, p.size, bucket)
        ]
        works = [self.pg.broadcast(self._staging[a:b], 0) for a, b in spans]  # the sender's buckets, one for one
        for w in works:
            w.wait()
        self.version = version
        return version, manifest, [self._staging[p.offset : p.offset + p.size] for p in manifest.parts]

    def close(self) -> None:
        self.pg = None
        self.store = None
