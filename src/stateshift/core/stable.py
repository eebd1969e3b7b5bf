"""How a slot's device storage is released and given back: in place (default) or address-stable.

``InPlace``: ``resize_(0)`` releases a storage, ``resize_(nbytes)`` re-grows it
(the caching allocator may hand back another address).

``AddressStable`` (``ModelState(address_stable=True)``, needs the optional
``torch_memory_saver``, ``pip install 'stateshift[tms]'``): the first time a
group's storages are re-grown they are allocated inside a torch_memory_saver
region of their own tag (CUDA virtual memory); from then on releasing the
group unmaps its physical memory (``pause``) and giving it back maps new
memory at the same virtual addresses (``resume``), so a CUDA graph captured
on those tensors replays correctly after an offload. The values still move
through stateshift's pinned homes and copy engine: offload = our copy out,
then ``pause``; onload = ``resume``, then our copy in. torch_memory_saver's
own CPU backup is never used.

Rules this keeps (torch_memory_saver ends the process on a misuse, so they are
checked here): a tag is paused or resumed whole and never twice in a row, so
an address-stable group moves as a whole (``only=`` on it is refused); the
device is synchronised before a pause (an unmap does not wait for streams);
free memory is checked before a resume (out of memory there is fatal);
nothing is allocated inside a paused tag's region.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..errors import StateError
from .slot import Slot, regrow_all, release_all


class StoragePolicy(Protocol):
    def regrow(self, group: str, slots: Sequence[Slot], whole: bool) -> None: ...

    def release(self, group: str, slots: Sequence[Slot], whole: bool) -> None: ...

    def paused(self, group: str) -> bool: ...


class InPlace:
    """Release with ``resize_(0)``, re-grow with ``resize_(nbytes)``."""

    def regrow(self, group: str, slots: Sequence[Slot], whole: bool) -> None:
        regrow_all(slots)

    def release(self, group: str, slots: Sequence[Slot], whole: bool) -> None:
        release_all(slots)

    def paused(self, group: str) -> bool:
        return False


def _tms() -> Any:
    try:
        from torch_memory_saver import torch_memory_saver  # type: ignore[import-not-found]
    except ImportError as exc:
        raise StateError(
            "address_stable", f"address_stable=True needs torch_memory_saver ({exc}): pip install 'stateshift[tms]'"
        ) from None
    try:
        torch_memory_saver.hook_mode = "torch"  # in-process pluggable allocator, no LD_PRELOAD
    except AttributeError:
        pass  # already configured by its first use
    return torch_memory_saver


class AddressStable:
    """Address-stable release and re-growth through torch_memory_saver (see the module docstring)."""

    def __init__(self, device: torch.device, prefix: str) -> None:
        self.device = device
        self.prefix = prefix
        self.tms = _tms()
        self._adopted: set[str] = set()
        self._paused: set[str] = set()

    def tag(self, group: str) -> str:
        return f"{self.prefix}:{group}"

    def paused(self, group: str) -> bool:
        return group in self._paused

    def adopted(self, group: str) -> bool:
        return group in self._adopted

    def regrow(self, group: str, slots: Sequence[Slot], whole: bool) -> None:
        if group in self._paused:
            self._whole(group, whole, "onload")
            need = sum(s.nbytes for s in slots)
            free, _ = torch.cuda.mem_get_info(self.device)
            if free < need:
                raise StateError(
                    "address_stable", f"group {group!r}: {need} bytes to map back, {free} free on {self.device}"
                )
            self.tms.resume(self.tag(group))
            self._paused.discard(group)
            return
        with torch.cuda.device(self.device), self.tms.region(self.tag(group), enable_cpu_backup=False):
            regrow_all(slots)
        if whole and any(s.device.type == "cuda" for s in slots):
            self._adopted.add(group)

    def release(self, group: str, slots: Sequence[Slot], whole: bool) -> None:
        if group not in self._adopted:
            release_all(slots)
            return
        self._whole(group, whole, "offload")
        torch.cuda.synchronize(self.device)  # an unmap does not wait for the streams using the memory
        self.tms.pause(self.tag(group))
        self._paused.add(group)

    def _whole(self, group: str, whole: bool, verb: str) -> None:
        if not whole:
            raise StateError(
                "address_stable",
                f"group {group!r} is address-stable: {verb} moves it whole (no only=, no partly resident group)",
            )


def make_policy(address_stable: bool, device: torch.device | None, prefix: str) -> StoragePolicy:
    """The storage policy a ``ModelState`` uses; address-stable only where CUDA is."""
    if not address_stable:
        return InPlace()
    if device is None:
        warnings.warn(
            "address_stable=True has no effect on a machine without CUDA (storages are host memory)", stacklevel=3
        )
        return InPlace()
    return AddressStable(device, prefix)
