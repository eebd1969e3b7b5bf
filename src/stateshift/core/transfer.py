"""The copy engine: every byte stateshift moves goes through ``CopyEngine``.

Most copies go between a group's slots and an *arena* (a home, a snapshot,
a stash) laid out by the group's ``Layout``. Their shape is fixed by the
layout, so it is planned once: ``Plan`` (built by ``plan``, cached by the
caller per layout and slot subset) groups the slots into *runs* in arena
order -- a chunk of at most ``CHUNK_BYTES`` of one large slot, or many small
slots that are neighbours in the arena. A verb on an unchanged group then
does no per-tensor Python work beyond the copies: each staged run is one
batched kernel (``Run.gather``: a ``cat`` into the span; ``Run.scatter``:
``split_with_sizes_copy`` out of it where the slots are small; a split and a
multi-tensor copy otherwise, or where padding lies between its slots) and one
PCIe copy.

Directions and streams:

- device-to-host and host-to-device copies run on two side streams, one per
  direction, so an offload and an onload (or a stash and a write) overlap;
  ``exchange`` pipelines both: chunk k of the values going out and chunk k
  of the values coming in move at once, and a chunk is overwritten only
  after its outgoing copy has completed;
- small slots cross PCIe through staging buffers on the device: outgoing
  ones are gathered by one batched kernel on the current stream into a
  ring of ``RING`` buffers the device-to-host stream drains (a buffer is
  reused only after the copy that drained it completed: events, never a
  synchronize); incoming ones cross into a second ring on the
  host-to-device stream and are scattered by the current stream, so one
  run's scatter overlaps the next run's PCIe copy; the batched kernels
  move 8-, 4- or 2-byte words where every size of the run allows
  (``Run.word``);
- device-to-device copies (device-placed snapshots and stashes) are spread
  over the current stream and a third side stream (``_device_runs``);
  host-to-host copies run at once on the calling thread.

Ordering (``docs/design/design.md``, rules 3 and 4): each side stream first waits for the
current stream, so copies read the values as of the call; the current stream
then waits for every side stream's last event, so compute enqueued after the
call neither overwrites a source still being read nor reads a destination
not yet written. Large slots read on a side stream by a caller that frees
them right after (offload) are ``record_stream``-ed there; small ones are
read by the gather on the current stream and need nothing. Host memory
written by a copy is safe to read only after the returned ``Transfer`` has
been waited on.
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

Pair = tuple[torch.Tensor, torch.Tensor]
#: tensors as torch's list functions take them (a list, or the tuple ``split`` returns)
Tensors = list[torch.Tensor] | tuple[torch.Tensor, ...]
#: called with a run just before it is enqueued (``CopyEngine.from_arena``)
BeforeRun = Callable[["Run"], None]

#: Below this many bytes a slot is staged with its neighbours (a copy costs ~5 us of fixed overhead).
SMALL_BYTES = 1 << 20
#: The largest single copy: large slots move in chunks of this size, staged runs are at most this long.
CHUNK_BYTES = 64 << 20
#: Largest gap allowed between two slots of one staged run. A device-to-host run writes its whole
#: arena span, gaps included, so a gap must never hold another slot: layouts align every slot to 64
#: bytes (``layout.ALIGN``), so a gap under 64 bytes is padding only.
MAX_GAP = 63
#: Staging buffers in flight per direction.
RING = 3
#: A staged run is scattered by one ``split_with_sizes_copy`` when its slots average below this many bytes,
#: else split into views and copied by ``_foreach_copy_``: on the H200, in one process, alternating,
#: restore of 2000 x 512 KiB read 43.1 GB/s fused against 45.3 split (its pinned list of pointers crosses
#: PCIe behind the staging copies), 20000 x 16 KiB 6.7 against 3.9 (a one-off measurement).
FUSED_SCATTER_BELOW = 64 << 10

_STREAMS = ("d2h", "h2d", "d2d", "h2h")


@dataclass
class Transfer:
    """Handle of enqueued copies: ``wait()`` makes the host side safe to read.

    ``nbytes`` counts the bytes moved per direction (``d2h``, ``h2d``, ``d2d``,
    ``h2h``); ``seconds()`` waits and returns how long the copies took (CUDA
    event timing on the device, wall time of host copies on the CPU).
    """

    events: list[torch.cuda.Event] = field(default_factory=list)
    nbytes: dict[str, int] = field(default_factory=dict)
    timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list, repr=False)
    host_seconds: float = 0.0

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def done(self) -> bool:
        return all(event.query() for event in self.events)

    def merged(self, other: Transfer | None) -> Transfer:
        if other is None:
            return self
        nbytes = dict(self.nbytes)
        for k, v in other.nbytes.items():
            nbytes[k] = nbytes.get(k, 0) + v
        return Transfer(
            self.events + other.events, nbytes, self.timing + other.timing, self.host_seconds + other.host_seconds
        )

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    def seconds(self) -> float:
        """Seconds the copies took: the longest timed device span, plus host copy time. Waits first."""
        for _, end in self.timing:
            end.synchronize()
        device = max((start.elapsed_time(end) / 1e3 for start, end in self.timing), default=0.0)
        return device + self.host_seconds


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Run:
    """Bytes ``[start, end)`` of an arena and the slots (or the slot chunk) they hold.

    A *chunk* run (``sizes is None``) is bytes ``[offset, offset + end - start)``
    of one slot. A *staged* run holds several small slots; ``sizes`` splits its
    span into slots and gaps, ``keep`` picks the slots out of that split.
    """

    start: int
    end: int
    items: tuple[int, ...]
    sizes: tuple[int, ...] | None = None
    keep: Callable[[Tensors], Tensors] | None = None
    offset: int = 0
    #: a staged run's element: the widest integer type (8, 4, 2 or 1 bytes) dividing every size in
    #: ``sizes``, so its multi-tensor copies move words, not bytes
    word: torch.dtype = torch.uint8
    #: a staged run without gaps: its slots' sizes in ``word`` elements (``gather`` and ``scatter`` are then
    #: one call each, with no view per slot)
    counts: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def views(self, span: torch.Tensor, word: torch.dtype | None = None) -> Tensors:
        """The slots' regions inside ``span`` (this run's bytes of an arena or of a staging buffer), as
        ``word`` elements (default ``self.word``). ``span`` starts at an arena offset (a multiple of
        ``layout.ALIGN``) or at a staging buffer's start, so it is aligned for any word -- except in a
        window of the disk tier, which may start mid-slot: ``gather`` and ``scatter`` check
        (``_in_words``)."""
        assert self.sizes is not None
        word = self.word if word is None else word
        w = word.itemsize
        parts = span.view(word).split([n // w for n in self.sizes]) if w > 1 else span.split(self.sizes)
        return parts if self.keep is None else self.keep(parts)

    def _in_words(self, span: torch.Tensor) -> bool:
        """Whether ``span`` can be viewed as ``word`` elements (a disk staging window whose size is not a
        multiple of 8 can put a run at an odd byte of it: then both sides move as bytes)."""
        return span.storage_offset() % self.word.itemsize == 0

    def _as_bytes(self, span: torch.Tensor, devs: Tensors) -> tuple[Tensors, list[torch.Tensor]]:
        """The run's regions of ``span`` and its slots, both as bytes (the rare path ``_in_words`` refuses)."""
        return self.views(span, torch.uint8), [d.view(torch.uint8) for d in devs]

    def gather(self, span: torch.Tensor, devs: Tensors) -> None:
        """Copy a staged run's slots (``devs``, as ``word`` elements) into ``span``, its bytes of an arena or
        of a staging buffer. Without gaps, and with the slots on ``span``'s device (``plan`` never stages
        slots of two devices together), that is one ``cat`` into ``span``: no Python view per slot (a verb
        on 2000 small slots made 2000 of them), one batched kernel on a device."""
        if not self._in_words(span):
            regions, slots = self._as_bytes(span, devs)
            torch._foreach_copy_(regions, slots)
        elif self.counts is not None and devs[0].device == span.device:
            torch.cat(devs, out=span.view(self.word))
        else:
            torch._foreach_copy_(self.views(span), devs)

    def scatter(self, devs: Tensors, span: torch.Tensor) -> None:
        """Copy ``span`` into a staged run's slots: ``gather`` reversed, one ``split_with_sizes_copy`` where
        the slots are small (``FUSED_SCATTER_BELOW``)."""
        if not self._in_words(span):
            regions, slots = self._as_bytes(span, devs)
            torch._foreach_copy_(slots, regions)
        elif (
            self.counts is not None
            and self.nbytes < FUSED_SCATTER_BELOW * len(self.items)
            and devs[0].device == span.device
        ):
            torch.split_with_sizes_copy(span.view(self.word), self.counts, out=devs)
        else:
            torch._foreach_copy_(devs, self.views(span))


@dataclass
class Plan:
    """Runs over one arena layout and one set of slots.

    ``dev(k)``: run k's slot side -- the chunk's byte view, or the staged
    slots' byte views in run order -- resolved on first use of that run
    (through ``view_of``), which must come when those slots hold their
    storage: a slot's byte view made earlier follows its storage through
    release (slicing a chunk out of it then fails: the storage is empty), and
    one made of a released storage would re-grow it. So every copy resolves
    run k only after ``before(run k)`` gave its storage back, and never the
    runs after it (an onload of storages released elsewhere, e.g. by
    Megatron's own ``offload_to_cpu``, meets a plan first used there).
    Byte views follow their storage through release and re-growth, so a
    resolved run stays valid until the layout changes.
    """

    runs: tuple[Run, ...]
    host: tuple[bool, ...]  #: per run: the slots' own storage is host memory (a CPU model)
    nbytes: int
    view_of: Callable[[int], torch.Tensor] = field(repr=False)
    _devs: list[Tensors | None] | None = field(default=None, repr=False)

    _whole: Plan | None = field(default=None, repr=False)

    def dev(self, k: int) -> Tensors:
        """Run ``k``'s slot side, resolved now if not yet (its slots must hold their storage: class docstring)."""
        devs = self._devs
        if devs is None:
            devs = self._devs = [None] * len(self.runs)
        got = devs[k]
        if got is None:
            got = devs[k] = _run_views(self.runs[k], self.view_of)
        return got

    def window(self, ks: Sequence[int], lo: int) -> Plan:
        """Runs ``ks`` only, their arena offsets shifted by ``-lo`` (a window of the arena, e.g. a staging buffer);
        the runs already resolved are shared, the others resolve on first use."""
        runs = tuple(replace(self.runs[k], start=self.runs[k].start - lo, end=self.runs[k].end - lo) for k in ks)
        devs = self._devs
        return Plan(
            runs,
            tuple(self.host[k] for k in ks),
            sum(r.nbytes for r in runs),
            self.view_of,
            None if devs is None else [devs[k] for k in ks],
        )

    def whole(self) -> Plan:
        """The same copies with each large slot in one piece: chunks only pay off across PCIe (a pipeline);
        on one side of it a copy per chunk is a kernel per chunk."""
        if self._whole is None:
            runs: list[Run] = []
            host: list[bool] = []
            for run, h in zip(self.runs, self.host, strict=True):
                last = runs[-1] if runs else None
                if (
                    run.sizes is None
                    and run.offset
                    and last is not None
                    and last.sizes is None
                    and last.items == run.items
                ):
                    runs[-1] = Run(last.start, run.end, run.items, offset=last.offset)
                else:
                    runs.append(run)
                    host.append(h)
            self._whole = Plan(tuple(runs), tuple(host), self.nbytes, self.view_of)
        return self._whole


def plan(
    offsets: Sequence[int],
    sizes: Sequence[int],
    on_host: Sequence[bool],
    view_of: Callable[[int], torch.Tensor],
    indices: Sequence[int] | None = None,
    *,
    small: int = SMALL_BYTES,
    chunk: int = CHUNK_BYTES,
    devices: Sequence[Any] | None = None,
) -> Plan:
    """Plan the copies between slots ``indices`` (default all) and an arena with these slot offsets.

    ``on_host[i]``: slot i's storage is host memory; ``view_of(i)``: slot i's
    byte view (a 1-D uint8 tensor over its whole storage), asked for only when
    the plan is first used to copy; ``devices[i]``: slot i's device (a staged
    run never holds slots of two devices).
    """
    order = sorted(range(len(offsets)) if indices is None else indices, key=offsets.__getitem__)
    runs: list[Run] = []
    pending: list[int] = []

    def flush() -> None:
        if len(pending) == 1:
            i = pending[0]
            runs.append(Run(offsets[i], offsets[i] + sizes[i], (i,)))
        elif pending:
            runs.append(_staged(pending, offsets, sizes))
        pending.clear()

    for i in order:
        n, off = sizes[i], offsets[i]
        if n == 0:
            continue
        if n >= small:
            flush()
            runs += [Run(off + a, off + min(a + chunk, n), (i,), offset=a) for a in range(0, n, chunk)]
            continue
        if pending:
            last = pending[-1]
            gap = off - offsets[last] - sizes[last]
            same = on_host[last] == on_host[i] and (devices is None or devices[last] == devices[i])
            if not (0 <= gap <= MAX_GAP and same and off + n - offsets[pending[0]] <= chunk):
                flush()
        pending.append(i)
    flush()
    host = tuple(on_host[r.items[0]] for r in runs)
    return Plan(tuple(runs), host, sum(sizes[i] for i in {i for r in runs for i in r.items}), view_of)


def _staged(items: list[int], offsets: Sequence[int], sizes: Sequence[int]) -> Run:
    split: list[int] = []
    keep: list[int] = []
    pos = offsets[items[0]]
    for i in items:
        gap = offsets[i] - pos
        if gap:
            split.append(gap)
        keep.append(len(split))
        split.append(sizes[i])
        pos = offsets[i] + sizes[i]
    getter = None if len(keep) == len(split) else operator.itemgetter(*keep)
    word = next(w for w in _WORDS if all(n % w.itemsize == 0 for n in split))
    counts = tuple(n // word.itemsize for n in split) if getter is None else None
    return Run(offsets[items[0]], pos, tuple(items), tuple(split), getter, word=word, counts=counts)


#: multi-tensor copies run one element per thread-step: the widest element that fits moves the most bytes
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _run_views(run: Run, view_of: Callable[[int], torch.Tensor]) -> Tensors:
    """The slot side of a run: byte views (a storage starts aligned for any word) as ``run.word``."""
    if run.sizes is None:
        v = view_of(run.items[0])
        whole = run.offset == 0 and run.nbytes == v.numel()
        return (v,) if whole else (v[run.offset : run.offset + run.nbytes],)
    if run.word is torch.uint8:
        return tuple(view_of(i) for i in run.items)
    return tuple(view_of(i).view(run.word) for i in run.items)


# --------------------------------------------------------------------------- the engine


class CopyEngine:
    """One engine per accelerator device (or one engine without streams on CPU-only machines)."""

    def __init__(
        self,
        device: torch.device | None = None,
        *,
        small_bytes: int = SMALL_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        timing: bool = True,
    ) -> None:
        if (device is None and torch.cuda.is_available()) or (
            device is not None and device.type == "cuda" and device.index is None
        ):
            device = torch.device(
                "cuda", torch.cuda.current_device()
            )  # (a CUDA device without an index: the current one)
        self.device = device if device is not None and device.type == "cuda" else None
        self.small_bytes = small_bytes
        self.chunk_bytes = chunk_bytes
        self.timing = timing
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        self._d2d: torch.cuda.Stream | None = None
        if self.device is not None:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
            self._d2d = torch.cuda.Stream(self.device)

    def plan(
        self,
        offsets: Sequence[int],
        sizes: Sequence[int],
        on_host: Sequence[bool],
        view_of: Callable[[int], torch.Tensor],
        indices: Sequence[int] | None = None,
        chunk: int | None = None,
        devices: Sequence[Any] | None = None,
    ) -> Plan:
        """``plan`` with this engine's small-slot and chunk sizes (``chunk``: no run longer than this instead)."""
        chunk = self.chunk_bytes if chunk is None else chunk
        return plan(
            offsets, sizes, on_host, view_of, indices, small=min(self.small_bytes, chunk), chunk=chunk, devices=devices
        )

    # -- arena copies -------------------------------------------------------------------------
    def to_arena(self, p: Plan, arena: torch.Tensor, *, frees_sources: bool = False) -> Transfer:
        """Copy the plan's slots into ``arena``. ``frees_sources``: the caller releases them right after."""
        return self._arena(p, arena, out=True, frees_sources=frees_sources)

    def from_arena(self, p: Plan, arena: torch.Tensor, *, before: BeforeRun | None = None) -> Transfer:
        """Copy ``arena`` into the plan's slots. ``before(run)`` runs on this thread just before a run is
        enqueued (e.g. to give its slots their storage back, so that work overlaps the copies already going)."""
        return self._arena(p, arena, out=False, frees_sources=False, before=before)

    def exchange(self, p: Plan, out: torch.Tensor, inp: torch.Tensor) -> Transfer:
        """Copy the slots into ``out`` and ``inp`` into the slots, both directions at once over PCIe.

        Run k of ``inp`` is written only after run k's outgoing copy completed.
        """
        host_out = out.is_cpu
        if self.device is None or host_out != inp.is_cpu or not host_out:
            return self.to_arena(p, out).merged(self.from_arena(p, inp))
        pcie = [k for k, h in enumerate(p.host) if not h]
        rest = [k for k, h in enumerate(p.host) if h]
        t = self._host_runs(p, rest, out, True).merged(self._host_runs(p, rest, inp, False))
        if not pcie:
            return t
        with self._on_device():
            return t.merged(self._pcie(p, pcie, out, inp, frees_sources=False))

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """The engine's device made current for a whole call (a no-op when it is already): ``_On`` switches
        streams of the current device only."""
        if self.device is None or torch.cuda.current_device() == self.device.index:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def _arena(
        self, p: Plan, arena: torch.Tensor, *, out: bool, frees_sources: bool, before: BeforeRun | None = None
    ) -> Transfer:
        if arena.is_cpu:
            whole = p.whole()
            t = self._host_runs(whole, [k for k, h in enumerate(whole.host) if h], arena, out, before)
            pcie = [k for k, h in enumerate(p.host) if not h]
            if pcie:
                with self._on_device():
                    t = t.merged(
                        self._pcie(
                            p,
                            pcie,
                            arena if out else None,
                            None if out else arena,
                            frees_sources=frees_sources,
                            before=before,
                        )
                    )
            return t
        with self._on_device():
            return self._device_runs(p.whole(), arena, out, before)

    def _host_runs(
        self, p: Plan, ks: list[int], arena: torch.Tensor, out: bool, before: BeforeRun | None = None
    ) -> Transfer:
        """Runs whose slots and arena are both host memory: plain copies on this thread."""
        if not ks:
            return Transfer()
        t0 = time.perf_counter()
        moved = 0
        for k in ks:
            if before is not None:
                before(p.runs[k])
            moved += self._local_run(p.runs[k], p.dev(k), arena, out)
        return Transfer(nbytes={"h2h": moved}, host_seconds=time.perf_counter() - t0)

    @staticmethod
    def _local_run(run: Run, devs: Tensors, arena: torch.Tensor, out: bool) -> int:
        """One run between slots and an arena on the same side (host-host or device-device)."""
        span = arena[run.start : run.end]
        if run.sizes is None:
            (span.copy_(devs[0]) if out else devs[0].copy_(span))
        elif out:
            run.gather(span, devs)
        else:
            run.scatter(devs, span)
        return run.nbytes

    def _device_runs(self, p: Plan, arena: torch.Tensor, out: bool, before: BeforeRun | None = None) -> Transfer:
        """Slots to/from a device arena (host slots of a device arena: PCIe pairs).

        Device-to-device runs alternate between the current stream and the
        ``d2d`` side stream, which first waits for the current one (it reads the
        values as of the call); the current stream then waits for it, so
        compute enqueued after the call is ordered after every copy. One stream
        runs its copies back to back with a gap and a partial last wave each;
        two let one copy's tail overlap the next one's start. With ``before``
        (storage given back on the current stream just before its run) every
        run stays on the current stream.
        """
        assert self.device is not None
        current = torch.cuda.current_stream(self.device)
        lanes = [current] if before is not None or self._d2d is None else [current, self._d2d]
        if len(lanes) > 1:
            lanes[1].wait_stream(current)
        starts = [self._timed_start(s) for s in lanes]
        pairs: list[Pair] = []
        moved = 0
        load = [0] * len(lanes)
        for k, run in enumerate(p.runs):
            if before is not None:
                before(run)
            if p.host[k]:
                span = arena[run.start : run.end]
                regions = (span,) if run.sizes is None else run.views(span)
                pairs += list(zip(regions, p.dev(k), strict=True)) if out else list(zip(p.dev(k), regions, strict=True))
                continue
            lane = load.index(min(load))  # the stream with the fewest bytes queued so far
            with _On(lanes[lane], current):
                moved += self._local_run(run, p.dev(k), arena, out)
            load[lane] += run.nbytes
        events = [s.record_event() for s in lanes]
        for e in events[1:]:
            current.wait_event(e)
        timing = [pair for st, s in zip(starts, lanes, strict=True) for pair in self._timed_end(st, s)]
        t = Transfer(events, {"d2d": moved}, timing)
        return t.merged(self.copy(pairs)) if pairs else t

    # -- PCIe -----------------------------------------------------------------------------------
    def _pcie(
        self,
        p: Plan,
        ks: list[int],
        out: torch.Tensor | None,
        inp: torch.Tensor | None,
        *,
        frees_sources: bool,
        before: BeforeRun | None = None,
    ) -> Transfer:
        """Runs ``ks`` across PCIe: slots -> ``out`` and/or ``inp`` -> slots (host arenas), pipelined per run.

        Outgoing staged runs are gathered on the current stream (sources as of
        the call; nothing to record for a caller that frees them) into a ring
        of buffers the device-to-host stream drains; incoming ones land in one
        buffer the host-to-device stream copies into and scatters from. With
        both directions, the incoming copy of run k waits for the outgoing
        copy of run k only, so run k+1 goes out while run k comes in.
        """
        if not ks:
            return Transfer()
        if self.device is None:
            raise RuntimeError("device tensors given to a copy engine built without a CUDA device")
        current = torch.cuda.current_stream(self.device)
        d2h, h2d = self._d2h, self._h2d
        assert d2h is not None and h2d is not None
        starts = [self._timed_start(s) for s in (d2h, h2d)]
        for s in (d2h, h2d):
            s.wait_stream(current)
        biggest = max((p.runs[k].nbytes for k in ks if p.runs[k].sizes is not None), default=0)
        ring = _Ring(self.device, biggest) if out is not None else None
        in_ring = _Ring(self.device, biggest) if inp is not None and biggest else None
        nbytes = {"d2h": 0, "h2d": 0}
        for k in ks:
            run = p.runs[k]  # (its slot views resolve after ``before``: ``Plan``)
            if out is not None:
                assert ring is not None
                nbytes["d2h"] += self._out(run, p.dev(k), out[run.start : run.end], ring, current, d2h, frees_sources)
            if inp is not None:
                if before is not None:
                    before(run)  # e.g. storage given back on the current stream (a staged run's scatter is there too)
                if run.sizes is None:  # a chunk is written by the copy itself, on the side stream:
                    if before is not None:
                        h2d.wait_stream(current)  # after its storage came back
                    if out is not None:
                        h2d.wait_stream(d2h)  # after its old values went out
                nbytes["h2d"] += self._in(run, p.dev(k), inp[run.start : run.end], in_ring, h2d, current)
        events = [d2h.record_event(), h2d.record_event()]
        for e in events:
            current.wait_event(e)
        timing = [
            (st, s.record_event(torch.cuda.Event(enable_timing=True)))
            for st, s in zip(starts, (d2h, h2d), strict=True)
            if st is not None
        ]
        return Transfer(events, {k: v for k, v in nbytes.items() if v}, timing)

    @staticmethod
    def _out(
        run: Run,
        devs: Tensors,
        span: torch.Tensor,
        ring: _Ring,
        current: torch.cuda.Stream,
        side: torch.cuda.Stream,
        frees_sources: bool,
    ) -> int:
        if run.sizes is None:
            with _On(side, current):
                span.copy_(devs[0], non_blocking=True)
            if frees_sources:
                devs[0].record_stream(side)
            return run.nbytes
        buf = ring.take(run.nbytes, current)  # the copy that drained it last is done
        run.gather(buf, devs)
        side.wait_stream(current)
        with _On(side, current):
            span.copy_(buf, non_blocking=True)
        ring.used(side)
        return run.nbytes

    @staticmethod
    def _in(
        run: Run,
        devs: Tensors,
        span: torch.Tensor,
        ring: _Ring | None,
        side: torch.cuda.Stream,
        current: torch.cuda.Stream,
    ) -> int:
        """One run in. A staged run crosses PCIe into a ring buffer on the side stream and is scattered
        by the current stream, so the next run's PCIe copy overlaps this scatter. The scatter comes
        after every earlier current-stream write of the run's slots (their storage coming back, and in
        an exchange the gather of their old values), and a buffer is refilled only after the scatter
        that read it (the ring's events)."""
        if run.sizes is None:
            with _On(side, current):
                devs[0].copy_(span, non_blocking=True)
            return run.nbytes
        assert ring is not None
        staged = ring.take(run.nbytes, side)
        with _On(side, current):
            staged.copy_(span, non_blocking=True)
        current.wait_stream(side)
        run.scatter(devs, staged)
        ring.used(current)
        return run.nbytes

    # -- generic pairs --------------------------------------------------------------------------
    def copy(self, pairs: Sequence[Pair], *, frees_sources: bool = False) -> Transfer:
        """Enqueue ``dst.copy_(src)`` for arbitrary pairs of byte views (paths no plan covers)."""
        by_kind: dict[str, list[Pair]] = {k: [] for k in _STREAMS}
        for dst, src in pairs:
            if dst.numel() != src.numel():
                raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()} bytes")
            kind = ("h" if src.is_cpu else "d") + "2" + ("h" if dst.is_cpu else "d")
            by_kind[kind].append((dst, src))
        t0 = time.perf_counter()
        for dst, src in by_kind["h2h"]:
            dst.copy_(src)
        t = Transfer(nbytes={"h2h": sum(d.numel() for d, _ in by_kind["h2h"])}, host_seconds=time.perf_counter() - t0)
        if not (by_kind["d2h"] or by_kind["h2d"] or by_kind["d2d"]):
            return t
        if self.device is None:
            raise RuntimeError("device tensors given to a copy engine built without a CUDA device")
        current = torch.cuda.current_stream(self.device)
        events = []
        for kind, stream in (("d2h", self._d2h), ("h2d", self._h2d), ("d2d", current)):
            batch = by_kind[kind]
            if batch:
                assert stream is not None
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    for dst, src in batch:
                        dst.copy_(src, non_blocking=True)
                        if frees_sources and kind == "d2h":
                            src.record_stream(stream)
                    events.append(stream.record_event())
                t.nbytes[kind] = sum(d.numel() for d, _ in batch)
        for e in events:
            current.wait_event(e)
        t.events += events
        return t

    # -- timing ---------------------------------------------------------------------------------
    def _timed_start(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        if not self.timing or self.device is None:
            return None
        s = stream or torch.cuda.current_stream(self.device)
        return s.record_event(torch.cuda.Event(enable_timing=True))

    def _timed_end(
        self, start: torch.cuda.Event | None, stream: torch.cuda.Stream
    ) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        if start is None:
            return []
        return [(start, stream.record_event(torch.cuda.Event(enable_timing=True)))]


class _On:
    """``with _On(stream, back):`` makes ``stream`` this thread's current stream, then ``back``: what
    ``torch.cuda.stream(stream)`` does for a stream of the current device, without its per-entry device
    lookups (about 15 us of host time each, and a verb enters one per run: half of a device-placed
    snapshot's host time). ``back`` is the stream current on entry; the engine's calls run on its device
    (``CopyEngine._on_device``), so both are streams of the current device."""

    __slots__ = ("back", "stream")

    def __init__(self, stream: torch.cuda.Stream, back: torch.cuda.Stream) -> None:
        self.stream, self.back = stream, back

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.back)


class _Ring:
    """``RING`` device staging buffers reused round-robin: ``take(n, stream)`` hands a buffer to ``stream``
    only after the work that last used it (recorded on another stream with ``used``) has completed --
    out: filled by the current stream, drained by the device-to-host one; in: filled by the
    host-to-device stream, scattered by the current one."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.device, self.size = device, size
        self.bufs: list[torch.Tensor] = []
        self.last: list[torch.cuda.Event | None] = []
        self.i = -1

    def take(self, nbytes: int, stream: torch.cuda.Stream) -> torch.Tensor:
        self.i = (self.i + 1) % RING
        if self.i == len(self.bufs):
            self.bufs.append(torch.empty(self.size, dtype=torch.uint8, device=self.device))
            self.last.append(None)
        event = self.last[self.i]
        if event is not None:
            stream.wait_event(event)
        return self.bufs[self.i][:nbytes]

    def used(self, stream: torch.cuda.Stream) -> None:
        self.last[self.i] = stream.record_event()
