"""``WeightPublisher``: the trainer side of weight sync.

``publish(version)`` takes one snapshot of the published groups and returns;
a thread of the publisher waits for the snapshot's copies, writes the
version's manifest and only then lists the version (``mailbox.py``), so a
receiver never sees a version whose bytes are still being written. The same
thread reclaims what dead or hung receivers hold and unlists versions nobody
holds any more (their memory goes back to the state's pool).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import secrets
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.engine import core_of
from ...core.pool import HostPool
from ...core.slot import Residency
from ...core.snapshot import Snapshot
from ...core.state import ModelState
from ...errors import BudgetError, SyncError
from .handle import NAME, TRANSPORTS, SyncHandle
from .mailbox import Mailbox, new_state, unlink_quietly
from .manifest import Manifest, PartEntry, diff, part_entry

_log = logging.getLogger("stateshift")

#: Test hook: seconds the publisher's thread sleeps after a version's bytes and manifest are written and
#: before it is listed (lets a test kill the publisher inside a publish).
DELAY_ENV = "STATESHIFT_SYNC_TEST_DELAY_LISTING_S"


@dataclass(eq=False)
class Publication:
    """One ``publish()``: what it cost the trainer and when the version became visible.

    ``publish_s``: seconds ``publish()`` took (the trainer's whole cost: enqueueing one snapshot);
    ``d2h_bytes``: device-to-host bytes the snapshot enqueued (0 for offloaded params in a shared pool);
    ``copied_bytes``: every byte the publisher copied for it, any direction (0: zero-copy);
    ``visible_s``: seconds from ``publish()`` until receivers could see it (``None`` until then);
    ``delta_bytes``: with ``delta=True``, bytes of the tensors that changed since the version before
    (``None`` until visible, or when there is no comparable version before).
    """

    version: int
    nbytes: int
    transport: str
    publish_s: float
    d2h_bytes: int
    copied_bytes: int
    visible_s: float | None = None
    delta_bytes: int | None = None
    error: BaseException | None = None
    #: ``broadcast`` only: a newer version was published before this one was sent, so it never was
    superseded: bool = False
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _t0: float = field(default=0.0, repr=False)

    @property
    def visible(self) -> bool:
        return self._done.is_set() and self.error is None and not self.superseded

    def wait(self, timeout: float | None = None) -> Publication:
        """Block until the version is visible to receivers; re-raises what failed on the publisher's thread.

        Raises: ``TimeoutError`` if it is not visible within ``timeout`` seconds; the publisher thread's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"version {self.version} not visible after {timeout} s")
        if self.error is not None:
            raise self.error
        return self


@dataclass(eq=False)
class _Live:
    """A published version the publisher keeps alive: its snapshot (or its own block) and manifest."""

    version: int
    nbytes: int
    snapshot: Snapshot | None
    manifest: Manifest | None = None
    own: list[Any] = field(default_factory=list)
    #: each part's bytes where receivers read them (set when the manifest is made)
    arenas: list[Any] = field(default_factory=list)


def pick_transport(state: ModelState, groups: tuple[str, ...], broadcast_receivers: int) -> str:
    """The ``auto`` rule: ``broadcast`` when a broadcast group was asked for (``broadcast_receivers`` > 0:
    the one transport that crosses machines); ``cuda_ipc`` when every published slot is resident on a
    CUDA device; ``shared_host`` otherwise (offloaded or mixed params, or no CUDA)."""
    if broadcast_receivers > 0:
        return "broadcast"
    slots = core_of(state).slots(groups)
    if slots and all(s.residency is Residency.DEVICE and s.device.type == "cuda" for s in slots):
        return "cuda_ipc"
    return "shared_host"


def _moved(state: ModelState, snap: Snapshot) -> tuple[int, int]:
    """``(d2h, copied)`` bytes the snapshot enqueued: a host part that shares its group's home (refs > 1
    right after the snapshot: copy-on-write) copied nothing; any other part copied all its bytes, those of
    slots resident on a CUDA device from device to host."""
    d2h = copied = 0
    for part in snap.parts:
        if part.host is not None and part.host.shared:
            continue
        copied += part.layout.total
        if part.host is not None:
            d2h += sum(
                s.nbytes
                for s in core_of(state).slots(part.group)
                if s.residency is Residency.DEVICE and s.device.type == "cuda"
            )
    return d2h, copied


class WeightPublisher:
    """Publishes versions of a ``ModelState``'s weights to receivers in other processes.

    Args:
        state: the trainer's state (any backend, params in any residency).
        transport: ``"auto"`` (``pick_transport``), ``"shared_host"``, ``"cuda_ipc"`` or ``"broadcast"``.
        groups: the groups to publish (default: ``state.forward_groups``, what a forward pass reads:
            ``params`` and ``buffers``, and Megatron's ``frozen``).
        budget_bytes: the most bytes of published versions kept alive at once (``None``: no limit;
            at most one per receiver plus the latest are ever alive). Give room for two versions at
            least: the one listed stays alive while the next is taken.
        ack_timeout_s: a receiver holding a superseded version longer than this is reclaimed
            (``SyncError("receiver_lost")`` in ``lost``); so is a receiver whose process died, at once.
            ``broadcast``: the group's timeout (joining it, and each send a receiver does not read).
        name: the publisher's name (letters, digits, ``_.-``), unique per process.
        directory: where the mailbox and shared blocks live (``/dev/shm``: memory).
        broadcast_receivers: ``broadcast`` only: how many receivers join the group.
        host, port: ``broadcast`` only: the rendezvous address (port 0: a free one).
        bucket_bytes: ``broadcast`` only: bytes per bucket.
        delta: ``shared_host`` and ``cuda_ipc``: compare each version with the one listed before it, byte for
            byte per tensor, and list the tensors that changed, so a receiver that holds that version copies
            only those (``WeightReceiver.load_into(..., delta=True)``). Costs the publisher's thread one read
            of both versions before the new one is listed.
        poll_s: how often the publisher's thread looks at its receivers.

    Raises: ``ValueError`` for a bad setting; ``LayoutError("unknown_group")`` for a group the state lacks.

    Threads: call ``publish`` from one thread (the trainer's). Close the publisher before its state:
    ``ModelState.close()`` releases every snapshot, published ones included.
    """

    def __init__(
        self,
        state: ModelState,
        *,
        transport: str = "auto",
        groups: Iterable[str] | None = None,
        budget_bytes: int | None = None,
        ack_timeout_s: float = 30.0,
        name: str = "weights",
        directory: str = "/dev/shm",
        broadcast_receivers: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = 64 << 20,
        delta: bool = False,
        poll_s: float = 0.05,
    ) -> None:
        if NAME.fullmatch(name) is None:
            raise ValueError(f"publisher name {name!r}: 1-64 letters, digits, '_', '.' or '-'")
        if transport not in ("auto", *TRANSPORTS):
            raise ValueError(f"transport must be 'auto' or one of {TRANSPORTS}, not {transport!r}")
        if budget_bytes is not None and budget_bytes < 0 or ack_timeout_s <= 0 or bucket_bytes < 1:
            raise ValueError(f"budget_bytes {budget_bytes}, ack_timeout_s {ack_timeout_s}, bucket_bytes {bucket_bytes}")
        self.state = state
        self.groups = tuple(groups) if groups is not None else tuple(state.forward_groups)
        core_of(state).layouts(self.groups)  # LayoutError("unknown_group") now, not at the first publish
        self.transport = pick_transport(state, self.groups, broadcast_receivers) if transport == "auto" else transport
        if delta and self.transport == "broadcast":
            raise ValueError("delta=True works with shared_host and cuda_ipc (receivers that read the memory itself)")
        self.name, self.budget_bytes, self.ack_timeout_s, self.poll_s = name, budget_bytes, ack_timeout_s, poll_s
        self.directory = directory
        self.delta = delta
        self._listed: _Live | None = None  # the latest version listed (never unlisted while it is the latest)
        self._tag = f"stateshift-sync-{name}-{id(self):x}"  # two publishers of one state never share a snapshot key
        #: receivers reclaimed so far (died, hung or lagged), oldest first
        self.lost: list[SyncError] = []
        self._live: dict[int, _Live] = {}
        self._last: int | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Publication, _Live] | None] = queue.Queue()
        self._failure: BaseException | None = None
        self._closed = False
        self._pid = os.getpid()
        self._own_pool: HostPool | None = None
        self._sender: Any = None
        self._setup(broadcast_receivers, host, port, bucket_bytes)
        self._thread = threading.Thread(target=self._run, name=f"stateshift-sync-{name}", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a publisher never closed still removes its files at exit

    def _setup(self, receivers: int, host: str, port: int, bucket_bytes: int) -> None:
        prefix = f"stateshift-sync-{os.getpid()}-{secrets.token_hex(8)}"
        if self.transport == "broadcast":
            from .broadcast import BroadcastSender

            if receivers < 1:
                raise ValueError("transport 'broadcast' needs broadcast_receivers >= 1")
            self._sender = BroadcastSender(
                core_of(self.state).engine.device or torch.device("cpu"),
                receivers,
                host,
                port,
                bucket_bytes,
                timeout_s=self.ack_timeout_s,
            )
            self._handle = SyncHandle(
                "broadcast",
                self.directory,
                prefix,
                self.name,
                os.getpid(),
                host=self._sender.host,
                port=self._sender.port,
                world_size=receivers + 1,
                backend=self._sender.backend,
            )
            self.mailbox = None
            return
        if self.transport == "cuda_ipc" and not all(
            s.device.type == "cuda" for s in core_of(self.state).slots(self.groups)
        ):
            raise ValueError("transport 'cuda_ipc' needs every published tensor on a CUDA device")
        pool_dir = (
            getattr(core_of(self.state).pool, "shm_dir", None)
            if getattr(core_of(self.state).pool, "shared", False)
            else None
        )
        if (
            self.transport == "shared_host"
            and pool_dir is not None
            and os.path.realpath(pool_dir) != os.path.realpath(self.directory)
        ):
            raise ValueError(
                f"the state's shared pool keeps its blocks in {pool_dir!r}, the publisher's directory is "
                f"{self.directory!r}: receivers look for both in one directory"
            )
        Mailbox.remove_stale(self.directory)
        self.mailbox = Mailbox(self.directory, prefix, owner=True)
        self._alive_fd = self.mailbox.hold_alive(None)
        with self.mailbox.locked():
            self.mailbox.write(new_state())
        if self.transport == "shared_host" and not getattr(core_of(self.state).pool, "shared", False):
            warnings.warn(
                "shared_host: the state's HostPool is not shared (HostPool(shared=True)), so each version is "
                "copied once more on the host into the publisher's own shared memory",
                stacklevel=3,
            )
            self._own_pool = HostPool(shared=True, shm_dir=self.directory)
        self._handle = SyncHandle(self.transport, self.directory, prefix, self.name, os.getpid())

    # -- public -------------------------------------------------------------------------------------
    def handle(self) -> SyncHandle:
        """The plain data a receiver needs (``SyncHandle``; ``to_json()`` for text)."""
        return self._handle

    def publish(self, version: int) -> Publication:
        """Enqueue one snapshot of the published groups as ``version``; returns without waiting for copies.

        The version becomes visible to receivers once its copies are done (``Publication.wait()``);
        until then they keep reading the one before. The trainer may step at once: the snapshot holds
        the values of this moment (rule 4), and published memory is never written again while listed.

        Raises: ``ValueError`` if ``version`` is not an integer in [0, 2**63) above the last published one;
        ``BudgetError("sync")`` (naming the receivers holding old versions) if it would pass ``budget_bytes``,
        nothing changed; ``SyncError`` if the publisher's thread failed or the publisher is closed.
        """
        if self._closed:
            raise SyncError("closed", f"publisher {self.name!r} is closed")
        if self._failure is not None:
            raise SyncError(
                "failed", f"publisher {self.name!r} failed on its thread: {self._failure!r}"
            ) from self._failure
        if (
            not isinstance(version, int)
            or isinstance(version, bool)
            or not 0 <= version < 1 << 63
            or (self._last is not None and version <= self._last)
        ):
            raise ValueError(
                f"version must be an integer in [0, 2**63) above the last published one ({self._last}), not "
                f"{str(version)[:40]}"
            )
        t0 = time.perf_counter()
        nbytes = sum(layout.total for layout in core_of(self.state).layouts(self.groups).values())
        self._check_budget(nbytes)
        placement = "device" if self.transport == "cuda_ipc" else "host"
        snap = self.state.snapshot(self.groups, tag=self._tag, version=version, placement=placement)
        d2h, copied = _moved(self.state, snap)
        live = _Live(version=version, nbytes=nbytes, snapshot=snap)
        with self._lock:
            self._live[version] = live
            self._last = version
        pub = Publication(
            version=version,
            nbytes=nbytes,
            transport=self.transport,
            publish_s=time.perf_counter() - t0,
            d2h_bytes=d2h,
            copied_bytes=copied,
            _t0=t0,
        )
        self._queue.put((pub, live))
        return pub

    def close(self) -> None:
        """Stop the thread (versions enqueued are listed first), unlist everything, free the memory and
        remove the mailbox files. Receivers reading a version now get ``SyncError("reclaimed")``. Idempotent."""
        if self._closed or os.getpid() != self._pid:  # a forked child: the publisher and its files are its parent's
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(None)
        self._thread.join()
        if self._sender is not None:
            self._sender.close()
        if self.mailbox is not None:
            versions, receivers = [], []
            with self.mailbox.locked():
                try:
                    state = self._read_state()
                    state["closed"], versions, receivers = True, list(state["versions"]), list(state["receivers"])
                    state["versions"] = []
                except SyncError as e:  # written by someone else: say closed all the same
                    if e.kind != "mailbox":
                        raise
                    state = dict(new_state(), closed=True)
                try:
                    self.mailbox.write(state)
                except OSError as exc:  # (a directory in its place): its receivers find no mailbox, as after close
                    _log.warning("weight publisher %r: cannot write its mailbox at close: %r", self.name, exc)
            self.mailbox.remove(sorted(set(versions) | set(self._live)), receivers)
            os.close(self._alive_fd)
        for live in list(self._live.values()):
            self._free(live)
        if self._own_pool is not None:
            self._own_pool.trim()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the publisher's thread -------------------------------------------------------------------------
    def _run(self) -> None:
        if self._sender is not None:
            self._run_broadcast()
            return
        while True:
            try:
                item = self._queue.get(timeout=self.poll_s)
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            if item is None:
                return
            if item:
                try:
                    self._list(*item)
                except BaseException as exc:  # noqa: BLE001 - not listed: this publish fails alone (its wait() raises)
                    self._drop_unlisted(*item, exc)
            try:
                self._scan()
            except BaseException as exc:  # noqa: BLE001 - reported by the next publish()
                if self._failure is None:
                    _log.exception("weight publisher %r failed", self.name)
                self._failure = exc

    def _drop_unlisted(self, pub: Publication, live: _Live, exc: BaseException) -> None:
        """``live`` failed before its listing (``_list``'s last step): no receiver can hold it, so its manifest
        and memory go now; ``pub.wait()`` raises ``exc``. The publisher goes on: the next version is listed
        over the one listed before (a full disk that frees up, a version the file system refused)."""
        _log.warning("weight publisher %r: version %s failed before it was listed: %r", self.name, live.version, exc)
        pub.error = exc
        pub._done.set()
        with self._lock:
            self._live.pop(live.version, None)
        assert self.mailbox is not None
        unlink_quietly(self.mailbox.manifest_path(live.version))
        self._free(live)

    def _run_broadcast(self) -> None:
        """The thread of a ``broadcast`` publisher: join the group, then send the latest version enqueued
        (older ones still queued are superseded: freed unsent), until ``close``."""
        if self._sender.device.type == "cuda":
            torch.cuda.set_device(self._sender.device)  # NCCL works on this thread's current device
        try:
            self._sender.connect()
        except BaseException as exc:  # noqa: BLE001
            self._failure = exc
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            stop = items[-1] is None
            todo = [i for i in items if i is not None]
            for pub, live in todo[:-1]:
                pub.superseded = True
                self._retire(pub, live)
            if todo:
                self._broadcast(*todo[-1])
            if stop:
                return

    def _broadcast(self, pub: Publication, live: _Live) -> None:
        try:
            if self._failure is not None:
                raise SyncError("broadcast", f"publisher {self.name!r}: the broadcast group is down: {self._failure!r}")
            assert live.snapshot is not None
            live.snapshot.wait()
            self._sender.send(live.version, live.snapshot)
        except BaseException as exc:  # noqa: BLE001 - a receiver died or the group broke: recorded, publish() raises
            if self._failure is None:
                lost = SyncError(
                    "receiver_lost", repr(exc), receiver="broadcast group", version=live.version, cause="died"
                )
                lost.__cause__ = exc
                self._lose(lost)
                self._failure = lost
            pub.error = self._failure
        self._retire(pub, live)

    def _retire(self, pub: Publication, live: _Live) -> None:
        if pub.error is None and not pub.superseded:
            pub.visible_s = time.perf_counter() - pub._t0
        pub._done.set()
        with self._lock:
            self._live.pop(live.version, None)
        self._free(live)

    def _list(self, pub: Publication, live: _Live) -> None:
        """Wait for the version's copies, write its manifest, then list it (the only place a version is listed)."""
        assert live.snapshot is not None
        live.snapshot.wait()
        live.manifest = self._manifest(pub, live)
        prev = self._listed
        if self.delta and prev is not None and prev.manifest is not None:
            live.manifest = diff(prev.manifest, prev.arenas, live.manifest, live.arenas) or live.manifest
            pub.delta_bytes = live.manifest.delta_bytes
        assert self.mailbox is not None
        self.mailbox.write_manifest(live.manifest)
        delay = float(os.environ.get(DELAY_ENV, "0") or 0)
        if delay > 0:
            time.sleep(delay)
        with self.mailbox.locked():
            state = self._read_state()
            state["versions"].append(live.version)
            self.mailbox.write(state)
        self._listed = live
        self._finish(pub)

    @staticmethod
    def _finish(pub: Publication) -> None:
        pub.visible_s = time.perf_counter() - pub._t0
        pub._done.set()

    def _manifest(self, pub: Publication, live: _Live) -> Manifest:
        assert live.snapshot is not None
        parts: list[PartEntry] = []
        for part in live.snapshot.parts:
            if self.transport == "cuda_ipc":
                from .cuda_ipc import share

                assert part.device is not None
                if part.layout.total == 0:  # an empty group (a model without buffers): nothing to share
                    parts.append(part_entry(part))
                    live.arenas.append(part.device)
                    continue
                with torch.cuda.device(part.device.device):  # this thread's current device must be the arena's
                    parts.append(part_entry(part, ipc=share(part.device)))
                live.arenas.append(part.device)
                continue
            block = part.host
            assert block is not None
            if block.file is None and block.nbytes > 0:  # a pool that is not shared: one host copy into ours
                assert self._own_pool is not None
                block = self._own_pool.acquire(part.layout.total)
                block.data.copy_(part.arena)
                live.own.append(block)
                pub.copied_bytes += block.nbytes
            parts.append(part_entry(part, file=None if block.file is None else os.path.basename(block.file[0])))
            live.arenas.append(block.data)
        if live.own:  # the state's snapshot is no longer needed: its bytes are in our blocks
            self.state.release(live.snapshot)
            live.snapshot = None
        return Manifest(version=live.version, transport=self.transport, parts=tuple(parts))

    def _read_state(self) -> dict[str, Any]:
        assert self.mailbox is not None
        return self.mailbox.read()

    def _scan(self) -> None:
        """Reclaim dead and timed-out receivers, then unlist and free versions nobody holds (under the lock)."""
        assert self.mailbox is not None
        now, drop = time.time(), []
        with self.mailbox.locked():
            state = self._read_state()
            before = repr(state)
            latest = max(state["versions"], default=None)
            died = False
            for name, entry in list(state["receivers"].items()):
                if not self.mailbox.is_alive(name):
                    died = True
                    self._lose(
                        SyncError(
                            "receiver_lost",
                            "its process is gone",
                            receiver=name,
                            version=entry.get("holding"),
                            cause="died",
                        )
                    )
                    del state["receivers"][name]
                    unlink_quietly(self.mailbox.alive_path(name))
                else:
                    self._check_timeout(name, entry, latest, now)
            if died:  # one may have died inside a mailbox write: its temporary file goes (one listing for all)
                self.mailbox.remove_left_writes()
            held = {e["holding"] for e in state["receivers"].values() if e["holding"] is not None}
            for v in list(state["versions"]):
                if v != latest and v not in held:
                    state["versions"].remove(v)
                    drop.append(v)
            if repr(state) != before:
                self.mailbox.write(state)
        for v in drop:
            self._unlist(v)

    def _check_timeout(self, name: str, entry: dict[str, Any], latest: int | None, now: float) -> None:
        """Reclaim what live receiver ``name`` holds if it is a superseded version held past the timeout."""
        holding, since = entry.get("holding"), entry.get("since") or now
        if holding is not None and holding != latest and now - since > self.ack_timeout_s:
            self._lose(
                SyncError(
                    "receiver_lost",
                    f"held a superseded version {now - since:.1f} s (ack_timeout_s {self.ack_timeout_s})",
                    receiver=name,
                    version=holding,
                    cause="timeout",
                )
            )
            entry["reclaimed"], entry["holding"] = holding, None

    def _lose(self, err: SyncError) -> None:
        _log.warning("%s", err)
        self.lost.append(err)

    def _unlist(self, version: int) -> None:
        assert self.mailbox is not None
        with self._lock:
            live = self._live.pop(version, None)
        unlink_quietly(self.mailbox.manifest_path(version))
        if live is not None:
            self._free(live)

    def _free(self, live: _Live) -> None:
        live.arenas = []
        if live.snapshot is not None and not self.state.closed:
            self.state.release(live.snapshot)
        live.snapshot = None
        for block in live.own:
            assert self._own_pool is not None
            self._own_pool.release(block)
        live.own.clear()

    def _check_budget(self, nbytes: int) -> None:
        if self.budget_bytes is None:
            return
        if self.mailbox is not None and self._live_bytes() + nbytes > self.budget_bytes:
            self._scan()
        live = self._live_bytes()
        if live + nbytes > self.budget_bytes:
            holders: tuple[tuple[str, int], ...] = ()
            if self.mailbox is not None:
                state = self._read_state()
                holders = tuple((n, e["holding"]) for n, e in state["receivers"].items() if e["holding"] is not None)
            raise BudgetError(
                "sync",
                f"publisher {self.name!r}: budget {self.budget_bytes} bytes, {live} alive in "
                f"{len(self._live)} version(s), {nbytes} more needed; held by {list(holders) or 'no receiver'}",
                holders=holders,
            )

    def _live_bytes(self) -> int:
        with self._lock:
            return sum(v.nbytes for v in self._live.values())
