"""Weights from the trainer's process to a rollouter process: the newest version in one shared-memory file.

The process executor reaches weights through this one small adapter, so that
it can move to the weight-sync library (``stateshift.rl.sync``: ``WeightPublisher``
/ ``WeightReceiver``, with zero-copy from offloaded params and ``cuda_ipc``) by
changing this file only. The API mirrors the library's: the trainer's side
``publish(pairs, version)`` and ``handle()`` (plain data), the rollouter's side
``HostWeightReceiver(handle).pairs()``: ``(name, tensor)`` pairs.

Layout: one ``/dev/shm`` file, every tensor at a 64-byte aligned offset, the
names, dtypes, shapes and offsets in the handle (they do not change during a
run). One version at a time, written in place. Why that is safe: the trainer
writes only inside ``ProcessRollouts.sync`` (and at start), under the lock that
also covers starting a rollouter process, and a rollouter reads only while it
handles a sync message or while it starts -- each of which the trainer waits
for before it writes again. So no byte is read while it is written.

The file is removed by ``close`` (the trainer's process, at the end of the run,
whatever happened), and by a finaliser if the publisher is collected first. A
trainer's process killed outright (SIGKILL, OOM) leaves it behind: the next
publisher in that directory removes the files of processes that are gone
(``core.pool.remove_stale_files``; the process id is in the name).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...core.pool import HostPool, remove_stale_files
from ...errors import ConfigError
from ..rollout import missing_weights

ALIGN = 64


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("weight_sync", f"unknown dtype {self.dtype!r} in the handle", name=self.name)
        return dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()


def _views(buf: Any, entries: Iterable[Entry]) -> Iterator[tuple[str, torch.Tensor]]:
    for e in entries:
        if e.nbytes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only map (the receiver's): it only reads
                flat = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
        else:
            flat = torch.empty(0, dtype=torch.uint8)
        yield e.name, flat.view(e.torch_dtype).reshape(e.shape)


PREFIX = "stateshift-weights-"
#: where weight files and shared pool blocks live (memory, not disk; the weight-sync library's default too)
SHM_DIR = "/dev/shm"
#: a weight file: ``PREFIX<pid>-<hex>`` (its publisher's pid, for ``remove_stale_files``)
STALE_FILE = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+")


class HostWeightPublisher:
    """The trainer's side: a shared-memory file laid out for ``weights`` (name -> tensor), holding them as ``version``.

    ``skip(name)`` names tensors a sender may list that are aggregates of others (Megatron's flat buffers).
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        version: int,
        *,
        directory: str = SHM_DIR,
        skip: Callable[[str], bool] | None = None,
    ) -> None:
        entries, end = [], 0
        for name, t in weights.items():
            end = -(-end // ALIGN) * ALIGN
            entries.append(Entry(name, str(t.dtype), tuple(t.shape), end))
            end += t.numel() * t.element_size()
        self.entries = {e.name: e for e in entries}
        self.skip = skip
        remove_stale_files(directory, STALE_FILE)
        self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        try:
            os.ftruncate(fd, max(end, 1))
            self._map = mmap.mmap(fd, max(end, 1))
        finally:
            os.close(fd)
        self.nbytes = end
        self.version = version
        self.publish(weights.items(), version)

    def handle(self) -> dict[str, Any]:
        """Plain data for ``HostWeightReceiver``."""
        return {
            "path": self.path,
            "size": max(self.nbytes, 1),
            "entries": [(e.name, e.dtype, e.shape, e.offset) for e in self.entries.values()],
        }

    def publish(self, pairs: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write ``pairs`` in place as ``version``; every laid-out tensor exactly once (``ConfigError("weight_sync")`` names the
        first that is not, or that does not fit), before any byte is written."""
        pairs = [(n, t) for n, t in pairs if not (self.skip is not None and self.skip(n) and n not in self.entries)]
        given = {n for n, _ in pairs}
        for name, t in pairs:
            e = self.entries.get(name)
            if e is None or str(t.dtype) != e.dtype or tuple(t.shape) != e.shape:
                raise ConfigError(
                    "weight_sync",
                    f"{tuple(t.shape)} {t.dtype} sent, the rollouter's layout has "
                    + (f"{e.shape} {e.dtype}" if e is not None else "no such weight"),
                    name=name,
                )
        missing = [n for n in self.entries if n not in given]
        if missing:
            raise missing_weights(missing)
        views = dict(_views(self._map, self.entries.values()))
        with torch.no_grad():
            for name, t in pairs:
                views[name].copy_(t)
        self.version = version

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive (a failed test): the finaliser unlinks anyway
            self._map.close()
        self._finalizer()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class HostWeightReceiver:
    """The rollouter's side: maps the publisher's file; ``receive()`` yields views of the weights there."""

    def __init__(self, handle: Mapping[str, Any]) -> None:
        self.entries = [Entry(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in handle["entries"]]
        fd = os.open(handle["path"], os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, int(handle["size"]), prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def pairs(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views of the newest weights (``version``: the file holds that one whenever it is read):
        copy them before the trainer may write the next version (the end of the sync or start that handed them
        over)."""
        del version
        return _views(self._map, self.entries)

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._map.close()


#: seconds a version may take to become visible to receivers (the publisher's copies)
PUBLISH_TIMEOUT_S = 300.0


class LibraryPublisher:
    """The trainer's side over the weight-sync library: ``stateshift.rl.sync.WeightPublisher`` on the trainer's
    ``ModelState`` (``rollout.weight_transport``: ``shared_host``, ``cuda_ipc``). ``publish`` takes the library's
    own snapshot of the state (the pairs are not read) and returns once receivers can see the version."""

    def __init__(self, state: Any, version: int, *, transport: str) -> None:
        from ...rl.sync import WeightPublisher

        self.pub = WeightPublisher(state, transport=transport, name="rollout")
        self.transport = self.pub.transport
        self.version = version
        try:
            self.pub.publish(version).wait(PUBLISH_TIMEOUT_S)
        except BaseException:
            self.pub.close()
            raise

    def handle(self) -> dict[str, Any]:
        return {"sync": self.pub.handle().to_json()}

    def publish(self, pairs: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        del pairs  # the library snapshots the state itself
        self.pub.publish(version).wait(PUBLISH_TIMEOUT_S)
        self.version = version

    def close(self) -> None:
        self.pub.close()


class LibraryReceiver:
    """The rollouter's side over the weight-sync library (``stateshift.rl.sync.WeightReceiver``)."""

    def __init__(self, handle: Mapping[str, Any], name: str) -> None:
        from ...rl.sync import WeightReceiver

        self.rx = WeightReceiver(handle["sync"], name=name)

    def pairs(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of ``version`` (or newer), held while the caller iterates; let go at the end."""
        with self.rx.receive(min_version=version) as (_, pairs):
            yield from pairs

    def close(self) -> None:
        self.rx.close()


def open_receiver(handle: Mapping[str, Any], name: str) -> HostWeightReceiver | LibraryReceiver:
    """The receiving end of whichever publisher made ``handle``."""
    return LibraryReceiver(handle, name) if "sync" in handle else HostWeightReceiver(handle)


def rollout_device(cfg: Any) -> str | None:
    """Where a rollouter process computes: ``rollout.device``, else the trainer's GPU (``None``: the CPU)."""
    if cfg.rollout.device:
        return str(cfg.rollout.device)
    return f"cuda:{torch.cuda.current_device()}" if cfg.run.device == "cuda" else None


def resolved_transport(cfg: Any) -> str:
    """``rollout.weight_transport`` with ``auto`` resolved: ``cuda_ipc`` when the rollouter process computes on the
    trainer's GPU, else ``shared_host``."""
    transport = str(cfg.rollout.weight_transport)
    if transport != "auto":
        return transport
    device = rollout_device(cfg)
    same_gpu = (
        device is not None
        and cfg.run.device == "cuda"
        and torch.device(device) == torch.device("cuda", torch.cuda.current_device())
    )
    return "cuda_ipc" if same_gpu else "shared_host"


def trainer_pool(cfg: Any) -> HostPool | None:
    """The host pool for the trainer's ``ModelState``: shared (``/dev/shm`` files) when a rollouter process takes
    weights by ``shared_host``, so that a published version is the pool's own memory -- no second host copy, and no
    D2H at all while the params are offloaded (their homes are published as they are); ``None`` (the state's own
    pinned pool) otherwise."""
    if cfg.executor != "process" or resolved_transport(cfg) != "shared_host":
        return None
    return HostPool(shared=True, shm_dir=SHM_DIR)


def make_publisher(
    cfg: Any, weights: Mapping[str, torch.Tensor], version: int, *, state: Any, skip: Callable[[str], bool] | None
) -> HostWeightPublisher | LibraryPublisher:
    """The trainer's end for ``rollout.weight_transport`` (``auto``: see ``resolved_transport``)."""
    transport = resolved_transport(cfg)
    if transport == "builtin":
        return HostWeightPublisher(weights, version, skip=skip)
    return LibraryPublisher(state, version, transport=transport)
