"""The receiving side of ``shared_host``: a published part's bytes, mapped from its ``/dev/shm`` file.

Each file is mapped ``MAP_SHARED`` once per process and, on a machine with
CUDA, registered with ``cudaHostRegister`` once, so the H2D copy from it runs
at the pinned rate; the mapping is cached by the file's identity (device and
inode), so a second version in the same blocks costs no new mapping or
registration. Mappings of files that are gone are dropped (``sweep``). Each mapped file keeps a
descriptor open under a shared ``flock`` (``hold_in_use``): a sweep of dead processes' files, after
the publisher died, leaves the blocks a live receiver still reads its last version from.
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings
from dataclasses import dataclass

import torch

from ...core.pool import hold_in_use
from ...errors import SyncError
from .manifest import PartEntry


@dataclass
class _Mapping:
    """One mapped block: the mapping, its bytes as a tensor, whether it is registered, its path, and a descriptor
    kept open on it (its shared ``flock`` says the file is in use: ``hold_in_use``)."""

    mm: mmap.mmap
    data: torch.Tensor
    registered: bool
    path: str
    fd: int


class HostMaps:
    """Mapped (and registered) shared blocks of one receiver, keyed by file identity."""

    def __init__(self, directory: str, register: bool) -> None:
        self.directory = directory
        self.register = register and torch.cuda.is_available()
        self._maps: dict[tuple[int, int], _Mapping] = {}
        #: how many files were mapped (and registered) so far
        self.mapped = 0

    def arena(self, part: PartEntry, where: str) -> torch.Tensor:
        """The part's bytes (uint8, host) as a view of its file's mapping. The name was checked by the
        manifest (a bare pool-block name); here its kind and size are (``SyncError("mailbox")``)."""
        if part.size == 0:
            return torch.empty(0, dtype=torch.uint8)
        if part.file is None:
            raise SyncError("mailbox", "no file", path=where, field=f"part {part.group!r}")
        path = os.path.join(self.directory, part.file)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise SyncError(
                "mailbox", f"{part.file!r}: {exc.strerror}", path=where, field=f"part {part.group!r} file"
            ) from None
        end = part.offset + part.size
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < end:
                raise SyncError(
                    "mailbox",
                    f"{part.file!r} is not a file of at least {end} bytes",
                    path=where,
                    field=f"part {part.group!r} file",
                )
            key = (st.st_dev, st.st_ino)
            if key in self._maps and self._maps[key].data.numel() < end:  # the file grew since it was mapped
                self._drop(key)
            if key not in self._maps:
                self._maps[key] = self._map(fd, st.st_size, path)
                fd = -1  # kept open by the mapping's entry (``hold_in_use``), closed when it is dropped
        finally:
            if fd >= 0:
                os.close(fd)
        return self._maps[key].data[part.offset : end]

    def _map(self, fd: int, size: int, path: str) -> _Mapping:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        hold_in_use(fd)  # a sweep after the publisher died leaves the file to this receiver (its last version)
        data = torch.frombuffer(mm, dtype=torch.uint8)
        registered = False
        if self.register:
            rc = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), size, 0)
            registered = int(getattr(rc, "value", rc)) == 0
            if not registered:
                warnings.warn(
                    f"cudaHostRegister of {path} failed (CUDA error {rc}); its copies run pageable", stacklevel=4
                )
        self.mapped += 1
        return _Mapping(mm, data, registered, path, fd)

    def ensure_registered(self) -> None:
        """Register (pin) every mapping from now on, and those made so far (copies to a CUDA target run at
        the pinned rate only from registered memory). No effect without CUDA."""
        if self.register or not torch.cuda.is_available():
            return
        self.register = True
        for m in self._maps.values():
            if not m.registered:
                rc = torch.cuda.cudart().cudaHostRegister(m.data.data_ptr(), m.data.numel(), 0)
                m.registered = int(getattr(rc, "value", rc)) == 0

    def sweep(self) -> None:
        """Drop the mappings of files that were removed or replaced."""
        for key, m in list(self._maps.items()):
            try:
                st = os.stat(m.path)
                if (st.st_dev, st.st_ino) == key:
                    continue
            except OSError:
                pass
            self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        m = self._maps.pop(key)
        if m.registered:
            torch.cuda.cudart().cudaHostUnregister(m.data.data_ptr())
        os.close(m.fd)  # (the file is no longer in use by this receiver)
        mm = m.mm
        del m
        try:
            mm.close()
        except BufferError:  # a view handed out is still referenced: the mapping goes with it
            pass

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)
