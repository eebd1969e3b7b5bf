"""Timing of ``stateshift bench``: the verbs with params resident and offloaded, as ratios to ceilings measured in the same run.

Ceilings (same process, same byte count): a pinned device-to-host and
host-to-device copy between preallocated buffers, a device-to-device copy
(bytes read + written) and a host memcpy. On a CPU-only machine the only
ceiling is the host memcpy, and every ratio is against it.

Timing: warm-up runs first, then the median of ``repeat`` runs; each run is
bracketed by ``torch.cuda.synchronize()`` and a host clock, so it counts the
whole verb (host work, both streams, the waits), not one kernel. Device-placed
rows also carry ``device_ratio``: the same verb enqueued behind running compute
(``timed_device``: events, its host work hidden) over the same copy timed the
same way (ceiling ``d2d_queued_gbps``). Rows with a ``loop_gbps`` compare with
the plain ``copy_`` loop a user would write over the same tensors
(``plain_loops``), timed the same way in the same run.

Result files follow ``docs/design/result-format.md`` (``BenchResult.to_json``). The provenance of committed
results (the commit, the host's CPU and Python speed), plots and the probes of many small tensors live in
``benchmarks/_harness.py``: the library runs no subprocess and imports no plotting package.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..core.engine import core_of
from ..core.state import ModelState


@dataclass
class Row:
    backend: str
    op: str
    residency: str
    device: str
    bytes: int
    seconds: float
    gbps: float
    ratio: float
    bound: str
    note: str = ""
    #: what the row measures beyond op and residency ("small-512KiB", "bidirectional", "address-stable", ...)
    case: str = ""
    #: the plain-loop baseline of the same run (GB/s) and our throughput over it
    loop_gbps: float | None = None
    vs_loop: float | None = None
    #: device-placed rows on CUDA: GPU seconds of the verb enqueued behind running compute (its host
    #: work hidden, ``timed_device``) and their ratio to the event-timed device-copy ceiling
    device_seconds: float | None = None
    device_ratio: float | None = None


@dataclass
class BenchResult:
    machine: str
    torch: str
    stateshift: str
    ceilings: dict[str, float]
    rows: list[Row] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    #: the host CPU and its Python speed (``benchmarks/_harness.py: host_facts``; empty from ``stateshift bench``)
    host: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "machine": self.machine,
            "host": self.host,
            "torch": self.torch,
            "stateshift": self.stateshift,
            "ceilings": self.ceilings,
            "rows": [asdict(r) for r in self.rows],
        }
        out.update(self.extra)
        return out

    def table(self) -> str:
        head = (
            f"{'backend':<9} {'op':<13} {'residency':<9} {'case':<14} {'GB':>7} {'seconds':>8} {'GB/s':>7} {'ratio':>6} "
            f"{'queued':>6} {'vs loop':>7}  bound"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows:
            vs = f"{r.vs_loop:>7.2f}" if r.vs_loop is not None else f"{'':>7}"
            queued = f"{r.device_ratio:>6.2f}" if r.device_ratio is not None else f"{'':>6}"
            lines.append(
                f"{r.backend:<9} {r.op:<13} {r.residency:<9} {r.case:<14} {r.bytes / 1e9:>7.3f} {r.seconds:>8.4f} "
                f"{r.gbps:>7.1f} {r.ratio:>6.2f} {queued} {vs}  {r.bound}{('  ' + r.note) if r.note else ''}"
            )
        return "\n".join(lines)


class Progress:
    """Progress on stderr: a redrawn bar on a terminal, one plain line per step otherwise (log files)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        if not self.tty:
            sys.stderr.write(f"[{self.done}/{self.total}] {elapsed:.1f}s {what}\n")
            return
        width = 24
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:6.1f}s {what:<40}"
        )
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], *, repeat: int, warmup: int = 1, setup: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after ``warmup`` runs; ``setup`` runs untimed before each."""
    times = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


_SLEEP_CYCLES_PER_S: dict[torch.device, float] = {}


def _sleep_rate(device: torch.device) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on ``device`` (measured once with events)."""
    if device not in _SLEEP_CYCLES_PER_S:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S[device] = 20_000_000 / (start.elapsed_time(end) / 1e3)
    return _SLEEP_CYCLES_PER_S[device]


def timed_device(fn: Callable[[], Any], *, repeat: int, warmup: int = 1) -> float | None:
    """Median GPU seconds of ``fn``'s work when it is enqueued behind running compute (None without CUDA).

    Each run starts a sleep kernel three times longer than ``fn``'s host
    work, then records a start event, calls ``fn`` and records an end event
    on the current stream: the GPU meets the start event only after the host
    has enqueued everything, so the span counts the copies and the gaps
    between them, not the verb's Python work (which ``timed`` counts). That
    is what a verb costs when it is queued behind a forward or an optimizer
    step, as in a training loop. A verb that waits for the GPU on the host
    inside ``fn`` loses the overlap, and the span shows it.
    """
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    host = []
    for _ in range(max(1, warmup)):
        sync()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        sync()
    lead = int(max(2e-3, 3 * max(host)) * _sleep_rate(device))
    times = []
    for _ in range(repeat):
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(lead)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    sync()
    return statistics.median(times)


def plain_loops(tensors: list[torch.Tensor], *, repeat: int) -> dict[str, tuple[int, float]]:
    """The loop a user would write instead, per direction: ``(bytes, median seconds)``.

    ``copy_(non_blocking=True)`` per tensor into preallocated host memory
    (pinned on CUDA: ``d2h``), back (``h2d``), and into preallocated device
    tensors (``d2d``, CUDA only).
    """
    data = [t.detach() for t in tensors]
    sizes = [t.numel() * t.element_size() for t in data]
    starts = _aligned_starts(sizes)
    nbytes = sum(sizes)
    cuda = bool(data) and data[0].is_cuda
    block = torch.empty(
        starts[-1] + sizes[-1] if data else 0, dtype=torch.uint8, pin_memory=cuda
    )  # one allocation, as a user would
    host = [block[a : a + n].view(t.dtype).view(t.shape) for a, n, t in zip(starts, sizes, data, strict=True)]
    out = {
        "d2h": (
            nbytes,
            timed(lambda: [h.copy_(t, non_blocking=True) for h, t in zip(host, data, strict=True)], repeat=repeat),
        ),
        "h2d": (
            nbytes,
            timed(lambda: [t.copy_(h, non_blocking=True) for h, t in zip(host, data, strict=True)], repeat=repeat),
        ),
    }
    if cuda:
        dev = [torch.empty_like(t) for t in data]
        out["d2d"] = (nbytes, timed(lambda: [d.copy_(t) for d, t in zip(dev, data, strict=True)], repeat=repeat))
    return out


def _aligned_starts(sizes: list[int]) -> list[int]:
    starts, pos = [], 0
    for n in sizes:
        starts.append(pos)
        pos += (n + 63) // 64 * 64
    return starts


def measure_ceilings(nbytes: int, device: torch.device, *, repeat: int = 5) -> dict[str, float]:
    """GB/s of the plain copies that bound each verb, on ``nbytes`` bytes."""
    host_a = torch.empty(nbytes, dtype=torch.uint8)
    host_b = torch.empty(nbytes, dtype=torch.uint8)
    host_a.fill_(1)
    host_b.fill_(2)
    out = {"host_memcpy_gbps": nbytes / timed(lambda: host_b.copy_(host_a), repeat=repeat) / 1e9}  # noqa: F821 - runs before the del below
    if device.type == "cuda":
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out["d2h_gbps"] = nbytes / timed(lambda: pinned.copy_(dev_a, non_blocking=True), repeat=repeat) / 1e9
        out["h2d_gbps"] = nbytes / timed(lambda: dev_a.copy_(pinned, non_blocking=True), repeat=repeat) / 1e9
        out["d2d_gbps"] = 2 * nbytes / timed(lambda: dev_b.copy_(dev_a), repeat=repeat) / 1e9
        queued = timed_device(lambda: dev_b.copy_(dev_a), repeat=repeat)
        assert queued is not None
        out["d2d_queued_gbps"] = 2 * nbytes / queued / 1e9  # the same copy timed like ``timed_device`` rows
        out["bidir_gbps"] = 2 * nbytes / timed(lambda: _both_ways(pinned, dev_a, dev_b), repeat=repeat) / 1e9
        del pinned, dev_a, dev_b
    del host_a, host_b
    return out


_BIDIR: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream, torch.Tensor]] = {}


def _both_ways(pinned: torch.Tensor, dev_a: torch.Tensor, dev_b: torch.Tensor) -> None:
    """A D2H copy and an H2D copy of the same size at once, on two streams (the bidirectional ceiling)."""
    dev = dev_a.device
    if dev not in _BIDIR or _BIDIR[dev][2].numel() != pinned.numel():
        _BIDIR[dev] = (torch.cuda.Stream(dev), torch.cuda.Stream(dev), torch.empty_like(pinned).pin_memory())
    s1, s2, other = _BIDIR[dev]
    s1.wait_stream(torch.cuda.current_stream(dev))
    s2.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s1):
        pinned.copy_(dev_a, non_blocking=True)
    with torch.cuda.stream(s2):
        dev_b.copy_(other, non_blocking=True)
    torch.cuda.current_stream(dev).wait_stream(s1)
    torch.cuda.current_stream(dev).wait_stream(s2)


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).replace("NVIDIA ", "")
        return f"{torch.cuda.device_count()}x {name}"
    return f"cpu ({os.cpu_count()} cores)"


@dataclass
class VerbBench:
    """Times every verb on ``groups`` of ``state`` in each residency, appending ``Row``s (see ``bench_state``)."""

    state: ModelState
    backend: str
    ceilings: dict[str, float]
    groups: tuple[str, ...] = ("params",)
    repeat: int = 5
    progress: Progress | None = None
    #: the tensors a user's plain loop would copy instead (``plain_loops``); None: the groups' slots
    loop_tensors: list[torch.Tensor] | None = None
    rows: list[Row] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dev = core_of(self.state).engine.device or torch.device("cpu")
        self.cuda = self.dev.type == "cuda"
        self.nbytes = self.state.nbytes(self.groups)
        host = self.ceilings["host_memcpy_gbps"]
        c = self.ceilings
        self.d2h, self.h2d, self.d2d = (
            (c["d2h_gbps"], c["h2d_gbps"], c["d2d_gbps"]) if self.cuda else (host, host, host)
        )
        self.names = ("d2h", "h2d", "d2d") if self.cuda else ("host_memcpy",) * 3
        self.loops: dict[str, tuple[int, float]] = {}

    def add(
        self,
        op: str,
        residency: str,
        seconds: float,
        ceiling: float,
        bound: str,
        note: str = "",
        *,
        loop: str | None = None,
        queued: float | None = None,
    ) -> None:
        """One row; ``loop``: the direction of the plain loop to compare with, ``queued``: ``timed_device`` seconds."""
        gbps = self.nbytes / seconds / 1e9 if seconds > 0 else float("inf")
        # the device-copy ceiling counts bytes read + written: count the row's bytes the same way
        ratio = gbps * (2 if bound == "d2d" else 1) / ceiling
        row = Row(self.backend, op, residency, self.dev.type, self.nbytes, seconds, gbps, ratio, bound, note)
        if loop in self.loops:
            loop_bytes, loop_s = self.loops[loop]
            row.loop_gbps = loop_bytes / loop_s / 1e9
            row.vs_loop = gbps / row.loop_gbps
        if queued:
            row.device_seconds = queued
            row.device_ratio = 2 * self.nbytes / queued / 1e9 / self.ceilings["d2d_queued_gbps"]
        self.rows.append(row)
        if self.progress is not None:
            self.progress.step(f"{op} ({residency})")

    def add_bound(
        self, op: str, seconds: float, moved: int, bound_seconds: float, bound: str, note: str, case: str = ""
    ) -> None:
        """A row whose bound is a sum of phases at their ceilings (``bound_seconds``); ratio = bound / measured."""
        self.rows.append(
            Row(
                self.backend,
                op,
                "device",
                self.dev.type,
                moved,
                seconds,
                moved / seconds / 1e9,
                bound_seconds / seconds,
                bound if self.cuda else "host_memcpy",
                note,
                case,
            )
        )
        if self.progress is not None:
            self.progress.step(op)

    def add_mixed(self, op: str, seconds: float, pcie_bytes: int, d2d_bytes: int, note: str) -> None:
        """A row that moves bytes over PCIe and on the device: its bound is the sum of both at their ceilings."""
        bound = pcie_bytes / (min(self.d2h, self.h2d) * 1e9) + 2 * d2d_bytes / (self.d2d * 1e9)
        self.add_bound(
            op,
            seconds,
            pcie_bytes + d2d_bytes,
            bound,
            "pcie+d2d",
            note + f"; pcie {pcie_bytes / 1e9:.2f} GB, device {d2d_bytes / 1e9:.2f} GB",
        )

    def bidir_seconds(self, n: int) -> float:
        """Bound of one host-stash swap of ``n`` bytes: in = n out and n in at once, out = n in."""
        both = self.ceilings.get("bidir_gbps", self.ceilings["host_memcpy_gbps"]) * 1e9
        return 2 * n / both + n / (self.h2d * 1e9)

    def snap(self, placement: str = "host") -> None:
        self.state.snapshot(self.groups, tag="bench", placement=placement)  # type: ignore[arg-type]

    def resident(self) -> None:
        """Snapshot, restore, offload and onload with the groups on the device."""
        st, g, r = self.state, self.groups, self.repeat
        d2h_name, h2d_name, d2d_name = self.names
        st.onload(g)
        tensors = self.loop_tensors or [s.bytes() for name in g for s in core_of(st).slots(name)]
        self.loops = plain_loops(tensors, repeat=r)
        self.add("snapshot", "device", timed(self.snap, repeat=r), self.d2h, d2h_name, loop="d2h")
        snap_dev = lambda: self.snap("device")  # noqa: E731
        self.add(
            "snapshot",
            "device",
            timed(snap_dev, repeat=r),
            self.d2d,
            d2d_name,
            note="placement=device",
            loop="d2d",
            queued=timed_device(snap_dev, repeat=r),
        )
        self.saved = st.snapshot(g, tag="bench-saved")
        self.add("restore", "device", timed(lambda: st.restore(self.saved), repeat=r), self.h2d, h2d_name, loop="h2d")
        saved_dev = st.snapshot(g, tag="bench-saved-dev", placement="device")
        restore_dev = lambda: st.restore(saved_dev)  # noqa: E731
        self.add(
            "restore",
            "device",
            timed(restore_dev, repeat=r),
            self.d2d,
            d2d_name,
            note="placement=device",
            loop="d2d",
            queued=timed_device(restore_dev, repeat=r),
        )
        mem_before = torch.cuda.memory_allocated(self.dev) if self.cuda else 0
        self.add(
            "offload",
            "device",
            timed(lambda: st.offload(g), setup=lambda: st.onload(g), repeat=r),
            self.d2h,
            d2h_name,
            loop="d2h",
        )
        if self.cuda:
            sync()
            self.extra.update(
                gpu_allocated_before_offload=mem_before,
                tracked_bytes=self.nbytes,
                gpu_allocated_after_offload=torch.cuda.memory_allocated(self.dev),
            )
        self.add(
            "onload",
            "host",
            timed(lambda: st.onload(g), setup=lambda: st.offload(g), repeat=r),
            self.h2d,
            h2d_name,
            loop="h2d",
        )

    def offloaded(self) -> None:
        """Snapshot and restore with the groups offloaded (copy-on-write homes)."""
        st = self.state
        st.offload(self.groups)
        self.add(
            "snapshot",
            "host",
            timed(self.snap, repeat=self.repeat),
            self.ceilings["host_memcpy_gbps"],
            "host_memcpy",
            note="zero-copy (copy-on-write home)",
        )
        self.add(
            "restore",
            "host",
            timed(lambda: st.restore(self.saved), repeat=self.repeat),
            self.ceilings["host_memcpy_gbps"],
            "host_memcpy",
            note="pointer copy",
        )
        st.onload(self.groups)

    def swaps(self) -> None:
        """``swapped()`` of a host snapshot: host stash (both directions at once on entry) and device stash."""
        n, st = self.nbytes, self.state

        def swap(stash: str) -> None:
            with st.swapped(self.saved, stash=stash):  # type: ignore[arg-type]
                pass

        self.add_bound(
            "swap",
            timed(lambda: swap("host"), repeat=self.repeat),
            3 * n,
            self.bidir_seconds(n),
            "bidir+h2d",
            "host snapshot, stash on host: in = out+in at once, out = in",
            case="bidirectional",
        )
        on_dev = self.cuda
        self.add_mixed(
            "swap",
            timed(lambda: swap("device"), repeat=self.repeat),
            n if on_dev else 3 * n,
            2 * n if on_dev else 0,
            "host snapshot, stash on device",
        )

    def cycles(self, n: int) -> None:
        """The pi_old cycle of ``n`` mini-batches without a rebuild: pi_old on the host with a host stash
        (bidirectional), on the host with a device stash, on the device."""
        st, nb = self.state, self.nbytes
        for placement, stash in (("host", "host"), ("host", "device"), ("device", "device")):

            def cycle(placement: str = placement, stash: str = stash) -> None:
                pi_old = st.snapshot(self.groups, tag="pi_old", placement=placement)  # type: ignore[arg-type]
                for _ in range(n):
                    with st.swapped(pi_old, stash=stash):  # type: ignore[arg-type]
                        pass

            t = timed(cycle, repeat=max(1, self.repeat // 2))
            note = f"N={n}, pi_old placement={placement}, stash={stash}"
            if placement == "host" and stash == "host":
                bound = nb / (self.d2h * 1e9) + n * self.bidir_seconds(nb)
                self.add_bound("pi_old_cycle", t, (1 + 3 * n) * nb, bound, "bidir+h2d", note, case="bidirectional")
            elif placement == "host":
                self.add_mixed(
                    "pi_old_cycle",
                    t,
                    (1 + n) * nb if self.cuda else (1 + 3 * n) * nb,
                    2 * n * nb if self.cuda else 0,
                    note,
                )
            else:
                self.add_mixed("pi_old_cycle", t, 0, (1 + 3 * n) * nb, note)

    def cleanup(self) -> None:
        for key in [("bench", None), ("bench-saved", None), ("bench-saved-dev", None), ("pi_old", None)]:
            if key in core_of(self.state).snapshots:
                self.state.release(core_of(self.state).snapshots.get(*key))
        sync()


def bench_state(
    state: ModelState,
    *,
    backend: str,
    ceilings: dict[str, float],
    groups: tuple[str, ...] = ("params",),
    repeat: int = 5,
    cycle_minibatches: int = 4,
    progress: Progress | None = None,
    loop_tensors: list[torch.Tensor] | None = None,
) -> tuple[list[Row], dict[str, Any]]:
    """Time every verb on ``groups`` of ``state`` in each residency. Leaves the groups on the device.
    ``loop_tensors``: the tensors of those groups as the user holds them (the plain-loop baseline)."""
    b = VerbBench(state, backend, ceilings, groups, repeat, progress, loop_tensors)
    b.resident()
    b.offloaded()
    b.swaps()
    b.cycles(cycle_minibatches)
    b.cleanup()
    return b.rows, b.extra


def memory_handed_back(state: ModelState, groups: tuple[str, ...] | None = None) -> dict[str, Any]:
    """One offload of ``groups`` (default all) as configured (``free_device_memory``): what PyTorch's
    allocator and the driver got back, and the speed of the onload that follows. ``{}`` without CUDA.
    ``offload_gbps`` includes pinning whatever homes the pool had no block for (``homes_pinned_bytes``: a
    group keeps its home after an onload and ``core_of(state).pool.trim()`` frees only idle blocks, so after a trim
    the groups never offloaded before pin theirs afresh, as in a state's first offload)."""
    dev = core_of(state).engine.device
    if dev is None:
        return {}
    total = state.nbytes(groups)
    sync()
    a0, r0, f0 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev), torch.cuda.mem_get_info(dev)[0]
    held = core_of(state).pool.stats.held_bytes
    t0 = time.perf_counter()
    state.offload(groups)
    sync()
    t_off = time.perf_counter() - t0
    pinned = core_of(state).pool.stats.held_bytes - held
    a1, r1, f1 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev), torch.cuda.mem_get_info(dev)[0]
    t0 = time.perf_counter()
    state.onload(groups)
    sync()
    t_on = time.perf_counter() - t0
    return {
        "bytes": total,
        "allocated_drop_bytes": a0 - a1,
        "reserved_drop_bytes": r0 - r1,
        "driver_free_gain_bytes": f1 - f0,
        "free_device_memory": state.free_device_memory,
        "offload_gbps": total / t_off / 1e9,
        "homes_pinned_bytes": pinned,
        "onload_after_gbps": total / t_on / 1e9,
    }
