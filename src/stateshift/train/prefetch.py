"""Onloads issued ahead of the phase that reads them (``trainer.prefetch``), so their copies overlap compute.

Why a stream of its own: ``ModelState.onload`` enqueues its host-to-device
copies on the copy engine's side stream, but that stream first waits for the
*current* stream, and the current stream then waits for the copies (and
scatters the small slots itself). Called on the compute stream, an onload
issued before a forward would therefore delay the forward until the copy is
done: nothing would overlap on the GPU. ``Prefetch.issue`` runs the onload
with a prefetch stream as the current one, so the copies are ordered on that
stream and the compute stream goes on with the forward meanwhile.

The invariants, on CUDA:

- the prefetch stream waits for the compute stream before each onload: the
  copies see every earlier write, and device memory the onload re-grows on
  the prefetch stream (the caching allocator keys free blocks by stream) is
  reused only after every compute-stream read of it enqueued before;
- ``wait(group)`` -- called just before the group is first read -- makes
  the compute stream wait for the event recorded after the group's onload
  (its copies and scatters), so no kernel reads the group before its copy
  completed; the host does not block: it goes on enqueueing the forward;
- no other verb runs while an onload is in flight: the trainer calls
  ``settle`` before it offloads, snapshots or swaps, which waits as ``wait``
  does and then blocks the host until every onload is done -- a swap waits
  for every group, not only its own: its rebuild may read others
  (Megatron's rebuilds the params from the optimizer's fp32 master weights).

Memory: storage re-grown on the prefetch stream returns, when offloaded, to
that stream's pool of the caching allocator, where the next prefetch finds
it; with ``trainer.freed_memory=cache`` and onloads on both streams (an
evaluation onloads on the compute stream) each pool may cache a copy of a
group's size (the allocator frees cached blocks before an allocation fails).

On the CPU there is no stream: ``issue`` is the onload itself (host copies,
done when it returns) and ``wait`` only records a zero.

Accounting (``OffloadMeter``, the verbs' share of the step): ``issue``'s host
seconds go to ``onload.<group>`` with the group's bytes. ``prefetch_wait.<group>``
gets the copy time that was not hidden: the time the compute stream stalled at
``wait`` (from an event recorded on it there to the onload's event; zero when
the copy was done first), read by ``settle`` once both events have completed,
plus any time ``settle`` itself blocked the host. Copy time hidden behind
compute is counted nowhere, by design.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from stateshift import ModelState

#: ``(key, seconds, bytes)``: where issue and wait times go (``OffloadMeter.add``)
Record = Callable[[str, float, int], None]


class Prefetch:
    """Onloads in flight on a prefetch stream, by group, until ``wait``; stalls measured until ``settle``."""

    def __init__(self, state: ModelState, device: torch.device, record: Record) -> None:
        self.state = state
        self.record = record
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: group -> the prefetch stream's event after its onload (``None`` on the CPU: done already)
        self.inflight: dict[str, torch.cuda.Event | None] = {}
        #: ``(group, compute stream at its wait, onload done)``: stalls to read once both events completed
        self.stalls: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def issue(self, group: str, *, zeros: bool = False) -> None:
        """Start bringing ``group`` back to the device (``zeros``: drop it first, it comes back zero-filled).

        Raises:
            ValueError: ``group`` is in flight already.
        """
        if group in self.inflight:
            raise ValueError(f"group {group!r} is being prefetched already")
        t0 = time.perf_counter()
        if zeros:
            self.state.drop(group)
        moving = self.state.residency()[group]["host"]  # (dropped slots come back as zeros: no bytes move)
        event = None
        if self.stream is None:
            self.state.onload(group)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                self.state.onload(group)
                event = torch.cuda.Event(enable_timing=True)
                self.stream.record_event(event)
        self.inflight[group] = event
        self.record(f"onload.{group}", time.perf_counter() - t0, self.state.nbytes(group) if moving else 0)

    def wait(self, group: str) -> bool:
        """Order the compute stream after ``group``'s onload (the host goes on); ``False`` if it was not in
        flight (nothing to wait for). On the CPU the onload is done already: a zero stall is recorded."""
        if group not in self.inflight:
            return False
        done = self.inflight.pop(group)
        if done is None:
            self.record(f"prefetch_wait.{group}", 0.0, 0)
            return True
        assert self.stream is not None
        compute = torch.cuda.current_stream(self.stream.device)
        reached = torch.cuda.Event(enable_timing=True)
        compute.record_event(reached)  # where the compute stream would go on without the copy
        compute.wait_event(done)
        self.stalls.append((group, reached, done))
        return True

    def settle(self) -> None:
        """Wait for every onload in flight, blocking the host until each is done (before any other verb on the
        state), then record the stalls of the waits since the last ``settle``."""
        for group, done in list(self.inflight.items()):
            if done is None:
                self.wait(group)
                continue
            del self.inflight[group]
            assert self.stream is not None
            torch.cuda.current_stream(self.stream.device).wait_event(done)
            t0 = time.perf_counter()
            done.synchronize()  # (the host's wait is the stall here: no compute-stream event is needed)
            self.record(f"prefetch_wait.{group}", time.perf_counter() - t0, 0)
        for group, reached, done in self.stalls:
            reached.synchronize()  # (both have completed once the step has read its loss: no wait here then)
            done.synchronize()
            self.record(f"prefetch_wait.{group}", max(0.0, reached.elapsed_time(done)) / 1e3, 0)
        self.stalls.clear()
