"""CUDA IPC handles as plain data (no pickling): what ``torch.multiprocessing`` sends, field by field.

``share(tensor)`` turns a device tensor into a JSON-able dict (bytes as hex);
``open_shared(ipc)`` rebuilds a tensor that maps the same device memory in
another process on the same machine.

Who keeps the memory alive: the publisher's mailbox protocol alone
(``mailbox.py``): a version's arena is freed only once it is unlisted and no
live receiver holds it, and a receiver that held it past the timeout learns
that its read may be torn (``SyncError("reclaimed")``). torch's own IPC
reference count is switched off on both sides, because it cannot count more
than one open of a share: ``share`` counts one, every open takes one back when
its mapping is dropped, and torch frees a block the producer dropped only at a
count of exactly 0 -- unsigned, so a second open (a second receiver, or one
receiver opening a version twice) wraps it and the arena is never freed (an H100
ran out of memory after a few versions of a 6 GB model). So ``share`` takes its
own count back at once (the count is 0: the producer frees the arena as soon as
the publisher drops it), and ``open_shared`` gives torch a counter name that no
shared-memory object can have (``NO_COUNTER``), so a receiver's count-back
finds nothing to count.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import SyncError

#: the reference counter a receiver names to torch: a '/' inside makes it a name ``shm_open`` refuses, so the
#: count-back when a mapping is dropped fails, and torch ignores that failure (as for a producer that exited)
NO_COUNTER = b"/stateshift/no-counter"

_FIELDS = (
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "event_handle",
    "event_sync_required",
    "numel",
)


def share(tensor: torch.Tensor) -> dict[str, Any]:
    """Plain data naming ``tensor``'s device memory (a flat uint8 CUDA tensor) for ``open_shared`` elsewhere.

    torch's reference count of the share is taken back before this returns (module doc): keeping the memory
    alive while a receiver reads it is the caller's protocol, not torch's."""
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_cuda:
        raise ValueError("share() takes a flat uint8 CUDA tensor")
    _, args = reduce_tensor(tensor)
    (
        _cls,
        _size,
        _stride,
        offset,
        _scls,
        _dtype,
        device,
        handle,
        size_b,
        off_b,
        _rg,
        rc_handle,
        rc_off,
        ev_handle,
        ev_sync,
    ) = args
    if offset != 0:
        raise ValueError("share() takes a tensor at the start of its storage")
    if rc_handle is not None:  # (None: an empty storage, nothing counted)
        torch.UntypedStorage._release_ipc_counter_cuda(rc_handle, rc_off)
    return {
        "device": int(device),
        "handle": _hex(handle),
        "storage_size_bytes": int(size_b),
        "storage_offset_bytes": int(off_b),
        "event_handle": _hex(ev_handle),
        "event_sync_required": bool(ev_sync),
        "numel": tensor.numel(),
    }


def _hex(b: bytes | None) -> str | None:
    return None if b is None else bytes(b).hex()


def check(ipc: dict[str, Any], where: str) -> dict[str, Any]:
    """``ipc`` if it has exactly the fields ``share`` writes, of their types (``SyncError("mailbox")`` otherwise)."""
    if set(ipc) != set(_FIELDS):
        raise SyncError("mailbox", f"fields {sorted(ipc)[:12]}", path=where, field="ipc")
    ints = ("device", "storage_size_bytes", "storage_offset_bytes", "numel")
    if not all(isinstance(ipc[k], int) and not isinstance(ipc[k], bool) and ipc[k] >= 0 for k in ints):
        raise SyncError("mailbox", "sizes and offsets must be non-negative integers", path=where, field="ipc")
    for k in ("handle", "event_handle"):
        v = ipc[k]
        if v is not None and (
            not isinstance(v, str) or len(v) > 1024 or any(c not in "0123456789abcdef" for c in v) or len(v) % 2
        ):
            raise SyncError("mailbox", "not a hex string", path=where, field=f"ipc {k}")
    if ipc["handle"] is None or ipc["numel"] > ipc["storage_size_bytes"]:
        raise SyncError("mailbox", "no handle, or more bytes than its storage", path=where, field="ipc")
    if not isinstance(ipc["event_sync_required"], bool):
        raise SyncError("mailbox", "event_sync_required must be true or false", path=where, field="ipc")
    return ipc


def open_shared(ipc: dict[str, Any], where: str) -> torch.Tensor:
    """The flat uint8 device tensor ``share`` described, mapped into this process (same machine), counted by
    nobody (``NO_COUNTER``): it is safe to read while the publisher's protocol says the version is held.

    The storage is made by torch's ``_new_shared_cuda`` directly, not through ``rebuild_cuda_tensor``, whose
    per-process cache is keyed by (segment handle, offset) without the size: a block the publisher freed and
    gave, larger, to a later version at the same offset of the same segment was found there, stale, while
    another receiver in this process still held the old mapping (a ``RuntimeError``). torch's own map of opened
    segments (one ``cudaIpcOpenMemHandle`` per segment per process) stays below this and is always right: a
    segment is the same memory in every share of it."""
    ipc = check(ipc, where)

    def raw(k: str) -> bytes | None:
        return None if ipc[k] is None else bytes.fromhex(ipc[k])

    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        ipc["device"],
        raw("handle"),
        ipc["storage_size_bytes"],
        ipc["storage_offset_bytes"],
        NO_COUNTER,
        0,
        raw("event_handle"),
        ipc["event_sync_required"],
    )
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (ipc["numel"],), (1,))


class Opened:
    """The arenas of the last version this process opened, kept until another version is opened or ``clear``.

    ``load_into`` and ``receive()`` of one version share one mapping (opening a share costs 0.3 ms on an
    H100). A new version's arenas are opened before the last version's are dropped: torch maps a segment
    once per process and unmaps it when its last storage goes, so a segment the publisher reuses for the next
    version (its caching allocator hands the freed block back) stays mapped instead of being unmapped and
    mapped again in the reader's wait. Between reads a receiver keeps one version's arenas mapped; during
    an open, two. Any number of receivers in one process each keep their own (``open_shared`` shares no
    cache of storages)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._arenas: list[torch.Tensor] = []

    def arenas(self, version: int, ipcs: list[dict[str, Any] | None], where: str) -> list[torch.Tensor]:
        """The arenas of ``version``'s parts ``ipcs`` describe (``None``: an empty part), each opened once.

        Raises:
            SyncError: ``"mailbox"`` for an ``ipc`` entry ``check`` refuses; the last version's arenas are
                kept then."""
        key = (version, *(None if i is None else (i.get("handle"), i.get("storage_offset_bytes")) for i in ipcs))
        if key != self._key:
            opened = [torch.empty(0, dtype=torch.uint8) if i is None else open_shared(i, where) for i in ipcs]
            self._key, self._arenas = key, opened  # the old mappings go now, after the new (class doc)
        return list(self._arenas)

    def clear(self) -> None:
        """Drop the mappings kept (the receiver's ``close``)."""
        self._key, self._arenas = None, []
