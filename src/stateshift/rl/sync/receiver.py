"""``WeightReceiver``: the receiving side of weight sync, in any process on the publisher's machine
(``shared_host``, ``cuda_ipc``) or on any machine (``broadcast``).

A receiver holds one version at a time: ``receive()`` marks the latest listed
version as held (under the mailbox lock), reads it, and lets it go; the
publisher never rewrites or frees a held version (``mailbox.py``), unless the
receiver holds a superseded version past the publisher's timeout -- then
letting go raises ``SyncError("reclaimed")`` and what was read must be
discarded (``load_into`` reads again by itself).

Letting go is a check and a release. The check (after the reads are done: a
``stat`` showing that nobody wrote the mailbox since this receiver's hold, else
one unlocked read of it) decides whether what was read is whole;
the release (the locked rewrite of the receiver's entry) runs on the
receiver's own thread, so the reader goes on without waiting for file work;
the receiver's next hold, and ``close``, wait for it first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch

from ...backends.torch import named_buffers, named_parameters
from ...errors import LayoutError, SyncError
from .copyplan import Plans
from .cuda_ipc import Opened
from .handle import NAME, SyncHandle
from .mailbox import Mailbox, unlink_quietly
from .manifest import Manifest
from .shared_host import HostMaps

_log = logging.getLogger("stateshift")

Target = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Receipt:
    """One version received.

    ``wait_s``: seconds spent waiting for a version at least ``min_version`` to be listed, and holding it;
    ``pause_s``: seconds from the version held (its manifest read, its memory mapped) to the check that it
    was not reclaimed (``_let_go``) -- for ``load_into``, the copy into the target (and the cover check when
    a plan is built); for ``receive``, the body of the ``with`` too;
    ``gbps``: ``nbytes`` over ``pause_s``.
    """

    version: int
    nbytes: int
    transport: str
    wait_s: float
    pause_s: float
    #: bytes copied into the target (``load_into``; fewer than ``nbytes`` for a delta); ``None`` for ``receive``
    copied_bytes: int | None = None
    #: ``load_into``: seconds of the copies alone (enqueued and synchronised), within ``pause_s``
    copy_s: float | None = None
    #: ``load_into``: whether this load built its copy plan (and ran the cover check) rather than reusing one:
    #: a first load, or new arenas or targets (``copyplan.py``)
    planned: bool | None = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.pause_s / 1e9 if self.pause_s > 0 else float("inf")


class WeightReceiver:
    """Receives the versions a ``WeightPublisher`` publishes.

    Args:
        handle: the publisher's ``SyncHandle`` (or its ``to_json()`` text); checked field by field.
        name: this receiver's name (letters, digits, ``_.-``), unique among the publisher's receivers;
            the publisher's errors about it name it.
        device: where ``receive()`` yields tensors: ``None`` (default) yields views of the published
            memory itself (host for ``shared_host``, the publisher's device memory for ``cuda_ipc``);
            a device (``"cuda"``) stages each version there first and lets the published one go at once.
        timeout_s: default seconds ``receive``/``load_into`` wait for a version.

    Raises: ``SyncError("mailbox")`` for a handle or mailbox that does not check out; ``SyncError`` if the
    publisher is closed.

    Threads: a receiver serves one ``receive``/``load_into`` at a time (others wait); one called inside
    another on the same thread is a ``SyncError``.
    """

    def __init__(
        self, handle: SyncHandle | str, *, name: str, device: str | torch.device | None = None, timeout_s: float = 60.0
    ) -> None:
        if NAME.fullmatch(name) is None:
            raise ValueError(f"receiver name {name!r}: 1-64 letters, digits, '_', '.' or '-'")
        self.handle = SyncHandle.from_json(handle) if isinstance(handle, (str, bytes)) else handle.checked()
        self.name = name
        self.device = None if device is None else torch.device(device)
        if self.device is not None and self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.timeout_s = timeout_s
        self.transport = self.handle.transport
        #: the last version received (``None`` before the first)
        self.last_receipt: Receipt | None = None
        self._staging: dict[int, torch.Tensor] = {}
        #: the target object ``load_into`` last filled whole, and the version it holds (a strong reference,
        #: so its identity cannot be reused by another object)
        self._last_target: tuple[object, int] | None = None
        self._copied: int | None = None
        self._copy_s: float | None = None
        self._planned: bool | None = None
        #: copy plans, by layout, arenas and target (``copyplan.py``): the per-tensor work done once, not per version
        self._plans = Plans()
        self._serial = threading.Lock()
        self._owner: threading.Thread | None = None  # (the object, not its ident: idents are reused)
        self._closed = False
        self._link: Any = None
        #: the release thread (``_let_go``), started at the first release, and the last release sent to it
        self._releaser: ThreadPoolExecutor | None = None
        self._releasing: Future[None] | None = None
        #: a descriptor on the mailbox file whose write marked the version now held (``_let_go``)
        self._held_fd: int | None = None
        self.mailbox: Mailbox | None = None
        if self.transport == "broadcast":
            from .broadcast import BroadcastLink

            self._link = BroadcastLink(self.handle, self.device, timeout_s=max(timeout_s, 600.0))
            return
        self.mailbox = Mailbox(self.handle.directory, self.handle.prefix)
        self._maps = HostMaps(self.handle.directory, register=self.device is not None and self.device.type == "cuda")
        self._opened = Opened()  # cuda_ipc: the last version's arenas, each share opened once
        self._alive_fd = self.mailbox.hold_alive(name)
        try:
            with self.mailbox.locked():
                state = self.mailbox.read()
                if state["closed"]:
                    raise SyncError("closed", f"publisher {self.handle.publisher!r} is closed")
                state["receivers"][name] = {"holding": None, "since": None, "reclaimed": None}
                self.mailbox.write(state)
        except BaseException:
            self._leave_files()
            raise

    # -- public -------------------------------------------------------------------------------------
    def latest_version(self) -> int | None:
        """The newest version listed now (``broadcast``: the newest received), ``None`` if none yet."""
        if self._link is not None:
            return self._link.version
        assert self.mailbox is not None
        return max(self.mailbox.read()["versions"], default=None)

    def publisher_alive(self) -> bool:
        """Whether the publisher's process still runs (``broadcast``: whether its group is still up)."""
        if self._link is not None:
            return self._link.alive
        assert self.mailbox is not None
        return self.mailbox.is_alive(None)

    @contextmanager
    def receive(
        self, min_version: int | None = None, timeout: float | None = None
    ) -> Iterator[tuple[int, Iterator[tuple[str, torch.Tensor]]]]:
        """Hold the latest version (at least ``min_version``) and yield ``(version, pairs)``.

        ``pairs`` iterates ``(name, tensor)`` in the shape vLLM's ``model.load_weights`` takes. The tensors
        are valid only inside the ``with`` block (the version is let go at its end): copy them, never
        keep them. A version is whole: every tensor comes from the same ``publish()``. Copies enqueued on
        a CUDA device inside the block (``copy_`` returns before it is done) are safe: the block's end
        synchronises the version's device (for a version in host memory, the current device) before
        letting go, so the publisher cannot write the next version under a copy still reading this one.

        Raises: ``SyncError("timeout")`` if no such version is listed within ``timeout`` (default
        ``timeout_s``); ``SyncError("reclaimed")`` at the end of the block if the publisher reclaimed the
        version meanwhile (held past its ``ack_timeout_s``): discard what was read.
        """
        with self._one_at_a_time(), self._receive(min_version, timeout) as got:
            yield got

    @contextmanager
    def _receive(
        self, min_version: int | None, timeout: float | None
    ) -> Iterator[tuple[int, Iterator[tuple[str, torch.Tensor]]]]:
        with self._held(min_version, timeout, reading=True) as (version, manifest, arenas):
            yield version, _pairs(manifest, arenas)

    def load_into(
        self, target: Target, *, min_version: int | None = None, timeout: float | None = None, delta: bool = False
    ) -> int:
        """Copy the latest version (at least ``min_version``) into ``target`` in place, by name; returns its version.

        ``target``: a ``torch.nn.Module`` (its parameters and persistent buffers, by ``state_dict`` name),
        a mapping or an iterable of ``(name, tensor)``. Coverage is strict: every published tensor must
        have a target and every target a published tensor, of the same shape and dtype; the first that
        does not is named by a ``LayoutError("mismatch")`` (``field``: ``missing``, ``extra``, ``shape`` or
        ``dtype``) raised before any byte is copied. A version reclaimed mid-copy is read again (once).
        The target is safe to use when this returns (device copies are synchronised).

        ``delta=True``: when the version is published with ``delta`` against the version this receiver
        last loaded into this same ``target`` object, only the tensors that changed are copied (the
        result is the same, byte for byte). It trusts that nobody wrote the target since that load;
        otherwise, and for any other version, everything is copied.
        """
        with self._one_at_a_time():
            return self._load_into(target, min_version, timeout, delta)

    def _load_into(self, target: Target, min_version: int | None, timeout: float | None, delta: bool) -> int:
        targets = _targets(target)
        if self.mailbox is not None and any(t.is_cuda for t in targets.values()):
            self._maps.ensure_registered()
        built = self._plans.built
        for attempt in (0, 1):
            try:
                with self._held(min_version, timeout, reading=False) as (version, manifest, arenas):
                    last = self._last_target
                    only = (
                        manifest.base is not None
                        and delta
                        and last is not None
                        and last[0] is target
                        and last[1] == manifest.base
                    )
                    self._last_target = None  # a copy that fails half-way leaves the target at no version
                    t0 = time.perf_counter()
                    self._copied = self._plans.copy(manifest, arenas, targets, only)
                    self._copy_s = time.perf_counter() - t0
                    self._planned = self._plans.built != built  # (an attempt reclaimed may have built it)
                # let go whole (not reclaimed): only now is the target this version, a base for the next delta
                self._last_target = (target, version)
                return version
            except SyncError as e:
                if e.kind != "reclaimed" or attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Leave the publisher (it stops tracking this receiver) and unmap everything. Idempotent.

        Called from another thread while a ``receive`` or ``load_into`` runs, it waits for that to end
        (nothing it reads is unmapped under it), at most ``timeout_s``, then raises ``SyncError("timeout")``
        and changes nothing (a ``receive`` block left open, say a generator over it never finished). Inside a
        ``receive`` block on the same thread it raises ``SyncError("reentrant")`` and changes nothing (the
        block's tensors stay readable): close after it."""
        with self._one_at_a_time("close()", wait_s=self.timeout_s):
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()
            return
        assert self.mailbox is not None
        if self._held_fd is not None:
            os.close(self._held_fd)
            self._held_fd = None
        self._settle()
        if self._releaser is not None:
            self._releaser.shutdown(wait=True)
        try:
            with self.mailbox.locked():
                state = self.mailbox.read()
                state["receivers"].pop(self.name, None)
                self.mailbox.write(state)
        except SyncError as e:  # the publisher is gone: nothing to leave
            if e.kind != "mailbox":
                raise
        self._leave_files()
        self._maps.close()
        self._opened.clear()

    def _leave_files(self) -> None:
        assert self.mailbox is not None
        os.close(self._alive_fd)
        unlink_quietly(self.mailbox.alive_path(self.name))
        self.mailbox.close()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------
    @contextmanager
    def _one_at_a_time(self, what: str = "receive()/load_into()", wait_s: float | None = None) -> Iterator[None]:
        """Serialise ``receive``, ``load_into`` and ``close`` across threads (a receiver holds one version at a
        time: two reads at once would let go of each other's version; a close would unmap a read's memory);
        a call inside a read on the same thread is a ``SyncError("reentrant")``, and waiting longer than
        ``wait_s`` for another thread's read (``None``: no limit) a ``SyncError("timeout")``."""
        if self._owner is threading.current_thread():
            raise SyncError("reentrant", f"receiver {self.name!r}: {what} called inside a read on the same thread")
        if not self._serial.acquire(timeout=-1 if wait_s is None else min(wait_s, threading.TIMEOUT_MAX)):
            raise SyncError(
                "timeout", f"receiver {self.name!r}: {what} waited {wait_s:g}s for a read on another thread"
            )
        self._owner = threading.current_thread()
        try:
            yield
        finally:
            self._owner = None
            self._serial.release()

    @contextmanager
    def _held(
        self, min_version: int | None, timeout: float | None, *, reading: bool
    ) -> Iterator[tuple[int, Manifest, list[torch.Tensor]]]:
        """Hold the latest version (at least ``min_version``) for the body: yields ``(version, manifest, arenas)``
        and lets go after it, on an error too, then records ``last_receipt``.

        ``reading`` (``receive()``: the body is the caller's): the arenas are first staged on ``device`` when
        one is set (and the version let go at once: the staged copies are ours), and the devices the body's
        copies read are synchronised before the let-go (a ``load_into`` synchronises its own copies)."""
        version, manifest, arenas, let_go, wait_s = self._take(min_version, timeout)
        self._copied, self._copy_s, self._planned = None, None, None
        t1 = time.perf_counter()
        devices: set[torch.device] = set()
        try:
            if reading and self.device is not None and any(a.device != self.device for a in arenas):
                arenas = self._stage(arenas)
                let_go, early = _nothing, let_go
                early()
            if reading:
                devices = _copy_devices(arenas)
            yield version, manifest, arenas
            _synchronize(devices)  # the body's device copies read the version: done before it is let go
        except BaseException:
            with suppress(Exception):  # (a device that fails to synchronise: let go all the same)
                _synchronize(devices)
            _let_go_after_error(let_go)
            raise
        let_go()
        self.last_receipt = Receipt(
            version,
            manifest.nbytes,
            self.transport,
            wait_s,
            time.perf_counter() - t1,
            self._copied,
            self._copy_s,
            self._planned,
        )

    def _take(
        self, min_version: int | None, timeout: float | None
    ) -> tuple[int, Manifest, list[torch.Tensor], Callable[[], None], float]:
        if self._closed:
            raise SyncError("closed", f"receiver {self.name!r} is closed")
        t0 = time.perf_counter()
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        if self._link is not None:
            version, manifest, arenas = self._link.next(min_version, deadline)
            return version, manifest, arenas, _nothing, time.perf_counter() - t0
        self._settle()
        version = self._hold(min_version, deadline)
        wait_s = time.perf_counter() - t0
        try:
            assert self.mailbox is not None
            manifest = self.mailbox.read_manifest(version)
            if self.transport == "cuda_ipc":
                ipcs = [(p.ipc or {}) if p.size else None for p in manifest.parts]
                arenas = self._opened.arenas(version, ipcs, self.mailbox.manifest_path(version))
            else:
                self._maps.sweep()
                arenas = [self._maps.arena(p, self.mailbox.manifest_path(version)) for p in manifest.parts]
        except BaseException:
            _let_go_after_error(lambda: self._let_go(version))
            raise
        return version, manifest, arenas, lambda: self._let_go(version), wait_s

    def _hold(self, min_version: int | None, deadline: float) -> int:
        """Mark the latest listed version (at least ``min_version``) as held by this receiver; returns it."""
        assert self.mailbox is not None
        pause, look = 0.001, time.monotonic() + 0.5
        first, latest = True, None

        def listed(state: dict[str, Any]) -> int | None:
            """The latest listed version if it will do (``None`` if not yet); raises if the publisher closed."""
            if state["closed"]:
                raise SyncError("closed", f"publisher {self.handle.publisher!r} is closed")
            nonlocal latest
            latest = max(state["versions"], default=None)
            return latest if latest is not None and (min_version is None or latest >= min_version) else None

        while True:
            # the first try goes straight to the lock (the version is usually listed already); while waiting,
            # an unlocked look first (the mailbox is replaced whole, never read half-way)
            if first or listed(self.mailbox.read()) is not None:
                first = False
                with self.mailbox.locked():
                    state = self.mailbox.read()
                    version = listed(state)
                    if version is not None:
                        entry = state["receivers"].setdefault(self.name, {})
                        entry.update(holding=version, since=time.time(), reclaimed=None)
                        if self._held_fd is not None:  # a hold never let go (cannot happen: every path lets go)
                            os.close(self._held_fd)
                        self._held_fd = self.mailbox.write(state, keep=True)
                        return version
            gone = time.monotonic() > look and not self.mailbox.is_alive(None)  # a dead publisher lists nothing more
            look = time.monotonic() + 0.5 if time.monotonic() > look else look
            if time.monotonic() > deadline or gone:
                alive = not gone and self.mailbox.is_alive(None)
                raise SyncError(
                    "timeout",
                    f"receiver {self.name!r}: no version >= {min_version} listed (latest {latest}); "
                    f"the publisher is {'alive' if alive else 'gone'}",
                    min_version=min_version,
                    publisher_alive=alive,
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _let_go(self, version: int) -> None:
        """Stop holding ``version`` (call it once every read of it is done, device copies included).

        Raises ``SyncError("reclaimed")`` if the publisher reclaimed it meanwhile (or closed): what was read
        may be torn. Why the mailbox as it is now decides it: it is replaced whole (never read half-way);
        only this receiver ever sets its entry's ``holding`` to a version, and the publisher reclaims one only
        by clearing it -- so an entry that holds ``version`` now, after the reads, held it throughout them.
        Usually nobody wrote the mailbox since this receiver's hold did, and a ``stat`` says so
        (``Mailbox.unchanged``); otherwise it is read. The release itself runs on the release thread
        (``_release``)."""
        assert self.mailbox is not None
        fd, self._held_fd = self._held_fd, None
        if fd is not None:
            try:
                unchanged = self.mailbox.unchanged(fd)
            finally:
                os.close(fd)
            if unchanged:
                self._release_later(version)
                return
        try:
            state = self.mailbox.read()
        except SyncError as e:
            if e.kind != "mailbox":
                raise
            raise SyncError("reclaimed", "the publisher closed", receiver=self.name, version=version) from None
        entry = state["receivers"].get(self.name)
        if entry is not None:
            self._release_later(version)
        if entry is None or entry.get("holding") != version:
            raise SyncError("reclaimed", receiver=self.name, version=version)

    def _release_later(self, version: int) -> None:
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(1, thread_name_prefix=f"stateshift-sync-rx-{self.name}")
        self._releasing = self._releaser.submit(self._release, version)

    def _release(self, version: int) -> None:
        """Clear this receiver's entry if it still names ``version`` (held, or reclaimed from it): under the
        lock, on the release thread. The publisher closed: nothing to release."""
        assert self.mailbox is not None
        with self.mailbox.locked():
            try:
                state = self.mailbox.read()
            except SyncError as e:
                if e.kind == "mailbox":
                    return
                raise
            entry = state["receivers"].get(self.name)
            if entry is not None and version in (entry.get("holding"), entry.get("reclaimed")):
                entry.update(holding=None, since=None, reclaimed=None)
                self.mailbox.write(state)

    def _settle(self) -> None:
        """Wait for the last release (a new hold must not race the release of the one before). A release that
        failed leaves the entry holding its version: the publisher reclaims it after its ``ack_timeout_s``,
        as from a receiver that lags; it is logged, not raised into an unrelated call."""
        pending, self._releasing = self._releasing, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:  # noqa: BLE001 - see the docstring
            _log.warning("receiver %r: releasing a version failed (%r); the publisher will reclaim it", self.name, e)

    def _stage(self, arenas: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy each part to ``device`` (one buffer per part, reused); returns them once the copies are done."""
        assert self.device is not None
        out = []
        for i, arena in enumerate(arenas):
            buf = self._staging.get(i)
            if buf is None or buf.numel() != arena.numel():
                buf = self._staging[i] = torch.empty(arena.numel(), dtype=torch.uint8, device=self.device)
            buf.copy_(arena, non_blocking=True)
            out.append(buf)
        _synchronize([self.device])
        return out


def _nothing() -> None:
    return None


def _let_go_after_error(let_go: Callable[[], None]) -> None:
    """Let go on the way out of an error: a reclaim found then changes nothing (the error says enough)."""
    try:
        let_go()
    except SyncError as e:
        if e.kind != "reclaimed":
            raise


def _pairs(manifest: Manifest, arenas: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for part, arena in zip(manifest.parts, arenas, strict=True):
        for t in part.tensors:
            if not t.aggregate:
                yield t.name, t.view(arena)


def _targets(target: Target) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        pairs = [*named_parameters(target), *named_buffers(target)]
    else:
        pairs = list(target.items()) if isinstance(target, Mapping) else list(target)
    out: dict[str, torch.Tensor] = {}
    for name, t in pairs:
        t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2): its local shard, as the publisher's state lists it
        if name in out:
            raise LayoutError("mismatch", "named twice in the target", tensor=name, field="extra")
        out[name] = t
    return out


def _copy_devices(arenas: list[torch.Tensor]) -> set[torch.device]:
    """The CUDA devices a ``receive`` block's copies of ``arenas`` may run on: the arenas' own and, for arenas
    in host memory, the current device when this process uses CUDA (a copy to another device from host
    memory is the caller's to synchronise)."""
    out = {a.device for a in arenas if a.device.type == "cuda"}
    if any(a.device.type == "cpu" for a in arenas) and torch.cuda.is_initialized():
        out.add(torch.device("cuda", torch.cuda.current_device()))
    return out


def _synchronize(devices: Iterable[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
