"""The receiving side of ``shared_host``: a published part's bytes, mapped from its ``/dev/shm`` file.

Each file is mapped ``MAP_SHARED`` once per process and, on a machine with
CUDA, registered with ``cudaHostRegister`` once, so the H2D copy from it runs
at the pinned rate; the mapping is cached by the file's identity (device and
inode), so a second version in the same blocks costs no new mapping or
registration. Mappings of files that are gone are dropped (``sweep``).
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings

import torch

from ...errors import SyncError
from .manifest import PartEntry


class HostMaps:
    """Mapped (and registered) shared blocks of one receiver, keyed by file identity."""

    def __init__(self, directory: str, register: bool) -> None:
        self.directory = directory
        self.register = register and torch.cuda.is_available()
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor, bool, str]] = {}
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
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < part.offset + part.size:
                raise SyncError(
                    "mailbox",
                    f"{part.file!r} is not a file of at least {part.offset + part.size} bytes",
                    path=where,
                    field=f"part {part.group!r} file",
                )
            key = (st.st_dev, st.st_ino)
            if key not in self._maps:
                self._maps[key] = self._map(fd, st.st_size, path)
        finally:
            os.close(fd)
        return self._maps[key][1][part.offset : part.offset + part.size]

    def _map(self, fd: int, size: int, path: str) -> tuple[mmap.mmap, torch.Tensor, bool, str]:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
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
        return mm, data, registered, path

    def ensure_registered(self) -> None:
        """Register (pin) every mapping from now on, and those made so far (copies to a CUDA target run at
        the pinned rate only from registered memory). No effect without CUDA."""
        if self.register or not torch.cuda.is_available():
            return
        self.register = True
        for key, (mm, data, registered, path) in list(self._maps.items()):
            if not registered:
                rc = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 0)
                self._maps[key] = (mm, data, int(getattr(rc, "value", rc)) == 0, path)

    def sweep(self) -> None:
        """Drop the mappings of files that were removed or replaced."""
        for key, (_, _, _, path) in list(self._maps.items()):
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == key:
                    continue
            except OSError:
                pass
            self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        mm, data, registered, _ = self._maps.pop(key)
        if registered:
            torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
        del data
        try:
            mm.close()
        except BufferError:  # a view handed out is still referenced: the mapping goes with it
            pass

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)
