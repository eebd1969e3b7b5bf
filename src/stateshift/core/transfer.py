"""The copy engine: every byte stateshift moves goes through ``CopyEngine.copy``.

A call takes pairs of byte tensors (``dst``, ``src``: 1-D ``uint8`` views of
equal length) and enqueues the copies without blocking the host:

- device-to-host and host-to-device copies run on two side streams, one per
  direction, so an offload and an onload (or a stash and a write) overlap;
- device-to-device copies run as one multi-tensor kernel on the current stream;
- host-to-host copies run at once, on the calling thread.

Ordering (DESIGN.md rules 3 and 4): each side stream first waits for the
current (compute) stream, so a copy reads the values as of the call; the
current stream then waits for the copy's event, so compute enqueued after the
call neither overwrites a source still being read nor reads a destination not
yet written; sources that the caller frees right after the call (offload) are
``record_stream``-ed on the side stream, so their memory is not reused
before the copy has read it. Host memory
written by a copy is safe to read only after the returned ``Transfer`` has
been waited on.

Small copies are coalesced: below ``small_bytes`` a copy costs more in fixed
overhead (about 5 us) than in bytes, so runs of small items that are adjacent
in host memory are gathered on the device into a staging buffer with one
kernel and moved with one copy (or the reverse for host-to-device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

Pair = tuple[torch.Tensor, torch.Tensor]

#: Below this many bytes an item is coalesced with its neighbours.
SMALL_BYTES = 1 << 20
#: The largest staging run, bounding the device memory coalescing borrows.
STAGING_BYTES = 64 << 20
#: Largest gap allowed between two items of one staged run. A device-to-host
#: run writes its whole host span, gaps included, so a gap must never hold
#: another item: layouts align every item to 64 bytes (``snapshot.ALIGN``), so
#: a gap under 64 bytes is padding only.
MAX_GAP = 63


@dataclass
class Transfer:
    """Handle of enqueued copies. ``wait()`` makes the host side safe to read."""

    events: list[torch.cuda.Event] = field(default_factory=list)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def done(self) -> bool:
        return all(event.query() for event in self.events)

    def merged(self, other: Transfer | None) -> Transfer:
        if other is None:
            return self
        return Transfer(self.events + other.events)


def _host_span(items: Sequence[torch.Tensor]) -> torch.Tensor:
    """A uint8 view from the first item's start to the last item's end (same storage)."""
    first, last = items[0], items[-1]
    start = first.storage_offset()
    end = last.storage_offset() + last.numel()
    span = torch.empty(0, dtype=torch.uint8)
    return span.set_(first.untyped_storage(), start, (end - start,), (1,))


class CopyEngine:
    """One engine per accelerator device (or one no-op engine on CPU-only machines)."""

    def __init__(
        self,
        device: torch.device | None = None,
        *,
        small_bytes: int = SMALL_BYTES,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device if device is not None and device.type == "cuda" else None
        self.small_bytes = small_bytes
        self.staging_bytes = staging_bytes
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        if self.device is not None:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)

    def copy(self, pairs: Sequence[Pair], *, frees_sources: bool = False) -> Transfer:
        """Enqueue ``dst.copy_(src)`` for every pair; see the module docstring for ordering.

        ``frees_sources``: the caller releases the device sources right after
        the call (offload), so they are ``record_stream``-ed on the side stream
        and their memory is not reused before the copy has read it. Without
        it, memory freed later on the current stream is still safe, because
        the current stream waits for the copy.
        """
        d2h: list[Pair] = []
        h2d: list[Pair] = []
        d2d: list[Pair] = []
        for dst, src in pairs:
            if dst.numel() != src.numel():
                raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()} bytes")
            if dst.numel() == 0:
                continue
            dst_dev, src_dev = not dst.is_cpu, not src.is_cpu
            if not dst_dev and not src_dev:
                dst.copy_(src)
            elif dst_dev and src_dev:
                d2d.append((dst, src))
            elif src_dev:
                d2h.append((dst, src))
            else:
                h2d.append((dst, src))
        if not (d2h or h2d or d2d):
            return Transfer()
        if self.device is None:
            raise RuntimeError("device tensors given to a copy engine built without a CUDA device")
        current = torch.cuda.current_stream(self.device)
        events: list[torch.cuda.Event] = []
        for stream, batch, host_is_dst in ((self._d2h, d2h, True), (self._h2d, h2d, False)):
            if batch:
                assert stream is not None
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    self._move(batch, host_is_dst, stream, frees_sources)
                    events.append(stream.record_event())
        if d2d:
            small = [p for p in d2d if p[0].numel() < self.small_bytes]
            for dst, src in d2d:
                if dst.numel() >= self.small_bytes:
                    dst.copy_(src)
            if small:
                torch._foreach_copy_([d for d, _ in small], [s for _, s in small])
            events.append(current.record_event())
        for event in events:
            current.wait_event(event)
        return Transfer(events)

    def _move(self, batch: list[Pair], host_is_dst: bool, stream: torch.cuda.Stream, frees_sources: bool) -> None:
        h, d = (0, 1) if host_is_dst else (1, 0)  # which side of a pair is host memory
        if frees_sources and host_is_dst:
            for pair in batch:
                pair[1].record_stream(stream)
        batch = sorted(batch, key=lambda p: p[h].data_ptr())
        for run in self._runs(batch, h):
            if len(run) == 1:
                dst, src = run[0]
                dst.copy_(src, non_blocking=True)
                continue
            hosts = [pair[h] for pair in run]
            span = _host_span(hosts)
            staging = torch.empty(span.numel(), dtype=torch.uint8, device=self.device)
            base = hosts[0].storage_offset()
            # per-item slices: measured faster than one Tensor.split with gap sizes (its Python wrapper
            # cost ~4 ms per 500 items on the H200 host)
            views = [staging[item.storage_offset() - base : item.storage_offset() - base + item.numel()] for item in hosts]
            devs = [pair[d] for pair in run]
            if host_is_dst:
                torch._foreach_copy_(views, devs)
                span.copy_(staging, non_blocking=True)
            else:
                staging.copy_(span, non_blocking=True)
                torch._foreach_copy_(devs, views)

    def _runs(self, batch: list[Pair], h: int) -> list[list[Pair]]:
        """Split host-address-sorted pairs into runs: each large item alone, small neighbours together.

        ``h`` is the index of the host tensor in each pair.
        """
        runs: list[list[Pair]] = []
        current: list[Pair] = []
        run_start = run_end = 0
        base = None
        for pair in batch:
            host = pair[h]
            n = host.numel()
            if n >= self.small_bytes:
                if current:
                    runs.append(current)
                    current = []
                runs.append([pair])
                continue
            ptr = host.data_ptr()
            owner = host._base if host._base is not None else host  # regions are slices of one arena
            same = (
                current
                and owner is base
                and 0 <= ptr - run_end <= MAX_GAP
                and ptr + n - run_start <= self.staging_bytes
            )
            if not same:
                if current:
                    runs.append(current)
                current, run_start, base = [], ptr, owner
            current.append(pair)
            run_end = ptr + n
        if current:
            runs.append(current)
        return runs
