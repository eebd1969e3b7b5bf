"""CUDA IPC handles as plain data (no pickling): what ``torch.multiprocessing`` sends, field by field.

``share(tensor)`` turns a device tensor into a JSON-able dict (bytes as hex);
``open_shared(ipc)`` rebuilds a tensor that maps the same device memory in
another process on the same machine. The publisher keeps the memory alive
while the version is listed or held (``mailbox.py``); torch's own IPC
reference counting keeps the producer from reusing it while a consumer has
it open.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import SyncError

_FIELDS = (
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
    "numel",
)


def share(tensor: torch.Tensor) -> dict[str, Any]:
    """Plain data naming ``tensor``'s device memory (a flat uint8 CUDA tensor) for ``open_shared`` elsewhere."""
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
    return {
        "device": int(device),
        "handle": _hex(handle),
        "storage_size_bytes": int(size_b),
        "storage_offset_bytes": int(off_b),
        "ref_counter_handle": _hex(rc_handle),
        "ref_counter_offset": int(rc_off),
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
    ints = ("device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset", "numel")
    if not all(isinstance(ipc[k], int) and not isinstance(ipc[k], bool) and ipc[k] >= 0 for k in ints):
        raise SyncError("mailbox", "sizes and offsets must be non-negative integers", path=where, field="ipc")
    for k in ("handle", "ref_counter_handle", "event_handle"):
        v = ipc[k]
        if v is not None and (
            not isinstance(v, str) or len(v) > 1024 or any(c not in "0123456789abcdef" for c in v) or len(v) % 2
        ):
            raise SyncError("mailbox", "not a hex string", path=where, field=f"ipc {k}")
    if ipc["handle"] is None or ipc["numel"] > ipc["storage_size_bytes"]:
        raise SyncError("mailbox", "no handle, or more bytes than its storage", path=where, field="ipc")
    return ipc


def open_shared(ipc: dict[str, Any], where: str) -> torch.Tensor:
    """The flat uint8 device tensor ``share`` described, mapped into this process (same machine)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ipc = check(ipc, where)
    n = ipc["numel"]

    def raw(k: str) -> bytes | None:
        return None if ipc[k] is None else bytes.fromhex(ipc[k])

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([n]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        ipc["device"],
        raw("handle"),
        ipc["storage_size_bytes"],
        ipc["storage_offset_bytes"],
        False,
        raw("ref_counter_handle"),
        ipc["ref_counter_offset"],
        raw("event_handle"),
        ipc["event_sync_required"],
    )


class Opened:
    """The arenas of the last version this process opened, kept until another version is opened or ``clear``.

    Why: torch counts the opens of a shared block. ``share`` counts one; each ``open_shared`` takes one back
    when its mapping is dropped; a block the producer dropped is freed only at a count of 0, and the count is
    unsigned, so a second open of one share wraps it and the publisher keeps that arena for good. Opened once
    per process (``load_into`` and ``receive()`` of the same version share the mapping), the count of one
    receiver comes back to 0. Several receivers of one version still take back one each: the weight-sync
    guide's known limitation. The mapping of the last version is dropped before the next is opened, so a
    receiver keeps at most one version's arenas mapped between reads."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._arenas: list[torch.Tensor] = []

    def arenas(self, ipcs: list[dict[str, Any] | None], where: str) -> list[torch.Tensor]:
        """The arenas of the parts ``ipcs`` describe (``None``: an empty part), each share opened once."""
        key = tuple(
            None if i is None else (i.get("handle"), i.get("ref_counter_handle"), i.get("ref_counter_offset"))
            for i in ipcs
        )
        if key != self._key:
            self.clear()  # the old mappings go first: their count goes back to the publisher
            self._arenas = [torch.empty(0, dtype=torch.uint8) if i is None else open_shared(i, where) for i in ipcs]
            self._key = key
        return list(self._arenas)

    def clear(self) -> None:
        """Drop the mappings kept (the receiver's ``close``)."""
        self._key, self._arenas = None, []
