"""The disk tier against the disk's own ceiling and against torch.save/torch.load, measured in the same run.

    python3 benchmarks/disk_bench.py --dir /path/on/nvme --out benchmarks/results [--mb 1024] [--window-mb 64]

Ceiling: a plain sequential write (``pwrite`` + ``fdatasync``, like the disk tier) and read (after
``posix_fadvise(DONTNEED)``, so from the disk) of the same byte count, in the same directory, with the
same flags as the tier: ``O_DIRECT`` (aligned buffer, aligned blocks direct, the unaligned tail
buffered) when the tier's file uses it, buffered otherwise; the result's ``io_mode`` says which.

Naive baseline (``loop_gbps`` / ``vs_loop`` of each row, the same fields as ``stateshift bench``'s
plain-loop baseline: what a user would write instead, in the same run): ``torch.save`` of the
model's tensors (a dict of the live, device or CPU, tensors) into the same directory plus ``fsync``
for offload and snapshot; ``torch.load`` of that file (its pages dropped first with
``POSIX_FADV_DONTNEED``) and ``copy_`` into the live tensors for onload and restore; both composed
into the same pi_old cycle.

Rows (``docs/design/result-format.md``), ``residency`` ``disk``: ``offload`` (device -> disk), ``onload`` (disk ->
device; its pages dropped from the cache first), ``snapshot`` (placement disk) and ``restore`` (from
that snapshot), each with the pool's peak host bytes beside it (the staging windows bound it), and
``pi_old_cycle`` with pi_old on disk. Every row, and its baseline, is the median of ``--repeat`` runs
after one untimed warm-up (the first disk offload opens the disk home and the staging windows take
their pinned memory: a one-time cost that a single timed run would count against the tier).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _harness as bench

from stateshift import ModelState
from stateshift.core.disk import O_DIRECT, DiskHome
from stateshift.core.engine import core_of
from stateshift.rl import PiOldCycle

CHUNK = 64 << 20


@dataclass
class DiskRow(bench.Row):
    """``stateshift bench``'s row (``loop_gbps`` / ``vs_loop``: the torch.save/torch.load baseline here)
    with the pool's peak host bytes and the staging window size."""

    host_peak_bytes: int = 0
    window_bytes: int = 0


def io_mode(directory: Path) -> tuple[str, int, str]:
    """The tier's I/O mode in ``directory`` (a throwaway disk home probes it), its alignment and why."""
    home = DiskHome(directory)
    try:
        return home.io_mode, home.align, home.why
    finally:
        home.close()


def disk_ceiling(directory: Path, nbytes: int, mode: str, align: int, repeat: int = 3) -> dict[str, float]:
    """Median GB/s of a plain sequential write (+ fdatasync) to a new file and of its read from the disk,
    with the tier's flags: under ``O_DIRECT`` the aligned blocks through a direct descriptor from an
    aligned buffer and the unaligned tail through a buffered one, as the tier does."""
    raw = torch.ones(nbytes + align, dtype=torch.uint8)
    data = raw[-raw.data_ptr() % align :][:nbytes]  # aligned (the tier's staging windows are placed so too)
    mv = memoryview(data.numpy())
    direct_end = nbytes // align * align if mode == "O_DIRECT" else 0
    writes, reads = [], []
    for i in range(repeat):
        path = directory / f"ceiling-{i}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        dfd = os.open(path, os.O_RDWR | O_DIRECT) if direct_end else fd
        try:
            t0 = time.perf_counter()
            for a in range(0, nbytes, CHUNK):
                b = min(a + CHUNK, nbytes)
                if a < direct_end:
                    os.pwrite(dfd, mv[a : min(b, direct_end)], a)
                if b > direct_end:
                    os.pwrite(fd, mv[max(a, direct_end) : b], max(a, direct_end))
            os.fdatasync(fd)
            writes.append(nbytes / (time.perf_counter() - t0) / 1e9)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for a in range(0, nbytes, CHUNK):
                b = min(a + CHUNK, nbytes)
                if a < direct_end:
                    os.preadv(dfd, [mv[a : min(b, direct_end)]], a)
                if b > direct_end:
                    os.preadv(fd, [mv[max(a, direct_end) : b]], max(a, direct_end))
            reads.append(nbytes / (time.perf_counter() - t0) / 1e9)
        finally:
            if dfd != fd:
                os.close(dfd)
            os.close(fd)
            path.unlink()
    return {"disk_write_gbps": sorted(writes)[repeat // 2], "disk_read_gbps": sorted(reads)[repeat // 2]}


class Naive:
    """What a user would write instead of the disk tier: ``torch.save`` + ``fsync`` out,
    ``torch.load`` (from the disk: its pages dropped first) + ``copy_`` into the live tensors back."""

    def __init__(self, model: torch.nn.Module, directory: Path) -> None:
        self.model, self.directory = model, directory

    def save(self, name: str) -> None:
        path = self.directory / f"naive-{name}.pt"
        with open(path, "wb") as f:
            torch.save({k: v.detach() for k, v in self.model.state_dict().items()}, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, name: str) -> None:
        path = self.directory / f"naive-{name}.pt"
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        live = self.model.state_dict()
        with torch.no_grad():
            for k, v in loaded.items():
                live[k].copy_(v)

    def cycle(self) -> None:
        """The same pi_old cycle (N=4, first swap skipped): pi_old saved once; per swap the current
        weights saved, pi_old loaded in, the current weights loaded back."""
        self.save("pi_old")
        for _ in range(3):
            self.save("stash")
            self.load("pi_old")
            self.load("stash")

    def cleanup(self) -> None:
        for path in self.directory.glob("naive-*.pt"):
            path.unlink()


def _timed(fn, setup=None, repeat: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, ``setup`` untimed before each."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        bench.sync()
        t0 = time.perf_counter()
        fn()
        bench.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory on the disk to measure: the disk home, the ceiling's file and the torch.save files go there (default: a temp dir)",
    )
    p.add_argument("--out", type=Path, required=True, help="where the result JSON and PNG go")
    p.add_argument("--mb", type=int, default=1024, help="bytes of params, in MB (default 1024)")
    p.add_argument("--window-mb", type=int, default=64, help="each of the two staging windows, in MiB (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per row, after one warm-up (median; default 3)")
    p.add_argument(
        "--buffered",
        action="store_true",
        help="buffered I/O even where the filesystem takes O_DIRECT (sets STATESHIFT_DISK_DIRECT=0; the ceiling follows)",
    )
    args = p.parse_args()
    if args.buffered:
        os.environ["STATESHIFT_DISK_DIRECT"] = "0"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    directory = Path(args.dir or tempfile.mkdtemp(prefix="stateshift-disk-"))
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = args.mb * 1_000_000
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(nbytes // 4 // 16, device=device)) for _ in range(16))
    state = ModelState(model, disk_dir=directory, disk_window_bytes=args.window_mb << 20)
    total = state.nbytes()
    mode, align, why = io_mode(directory)
    ceilings = {**disk_ceiling(directory, total, mode, align), **bench.measure_ceilings(total, device, repeat=3)}
    naive = Naive(model, directory)
    rows: list[DiskRow] = []

    def row(op, seconds, bound, naive_seconds):
        gbps, naive_gbps = total / seconds / 1e9, total / naive_seconds / 1e9
        rows.append(
            DiskRow(
                "torch",
                op,
                "disk",
                device.type,
                total,
                seconds,
                gbps,
                gbps / ceilings[f"{bound}_gbps"],
                bound,
                loop_gbps=naive_gbps,
                vs_loop=gbps / naive_gbps,
                host_peak_bytes=core_of(state).pool.stats.peak_held_bytes,
                window_bytes=args.window_mb << 20,
            )
        )

    r = args.repeat

    def drop_cache() -> None:
        assert core_of(state).disk_home is not None
        os.posix_fadvise(core_of(state).disk_home.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def offloaded() -> None:
        state.offload(to="disk")
        drop_cache()

    # Warm-up: the first disk offload opens the disk home (and probes O_DIRECT) and the staging windows
    # take their pinned memory; every row below is the median of ``r`` runs after it, as is the baseline.
    offloaded()
    state.onload()
    naive.save("offload")
    naive_save = _timed(lambda: naive.save("offload"), repeat=r)
    row("offload", _timed(lambda: state.offload(to="disk"), setup=state.onload, repeat=r), "disk_write", naive_save)
    assert core_of(state).disk_home is not None and core_of(state).disk_home.io_mode == mode, (
        state.describe_disk(),
        mode,
    )
    row(
        "onload",
        _timed(state.onload, setup=offloaded, repeat=r),
        "disk_read",
        _timed(lambda: naive.load("offload"), repeat=r),
    )
    snap = None

    def take():
        nonlocal snap
        if snap is not None:
            state.release(snap)  # the region is reused, as a pi_old cycle reuses its snapshot's
        snap = state.snapshot("params", tag="disk", placement="disk")

    take()
    row("snapshot", _timed(take, repeat=r), "disk_write", _timed(lambda: naive.save("snapshot"), repeat=r))
    row(
        "restore",
        _timed(lambda: state.restore(snap), setup=drop_cache, repeat=r),
        "disk_read",
        _timed(lambda: naive.load("snapshot"), repeat=r),
    )
    cycle = PiOldCycle(state, placement="disk")

    def run_cycle():
        cycle.run(range(4), lambda mb: None, lambda mb: None)

    run_cycle()
    t = _timed(run_cycle, repeat=r)
    naive_t = _timed(naive.cycle, repeat=r)
    moved = total * (1 + 3 * 3)  # pi_old out once; 3 swaps: stash out and in, pi_old read
    bound_t = total / (ceilings["disk_write_gbps"] * 1e9) + 3 * total / (ceilings["disk_read_gbps"] * 1e9)
    rows.append(
        DiskRow(
            "torch",
            "pi_old_cycle",
            "disk",
            device.type,
            moved,
            t,
            moved / t / 1e9,
            bound_t / t,
            "disk_write+disk_read",
            note="N=4, pi_old on disk, first swap skipped; bound counts only the disk bytes",
            loop_gbps=moved / naive_t / 1e9,
            vs_loop=naive_t / t,
            host_peak_bytes=core_of(state).pool.stats.peak_held_bytes,
            window_bytes=args.window_mb << 20,
        )
    )
    disk_desc = state.describe_disk()
    state.close()
    naive.cleanup()
    bsize = os.statvfs(directory).f_bsize
    if args.dir is None:
        directory.rmdir()  # (the temp dir this run made; empty now)
    result = bench.BenchResult(
        bench.machine_name(device),
        torch.__version__,
        bench.git_sha(),
        ceilings,
        list(rows),
        extra={
            "io_mode": mode,
            "io_mode_why": why,
            "align": align,
            "disk_home": disk_desc,
            "baseline": "loop_gbps/vs_loop: torch.save + fsync (offload, snapshot); fadvise DONTNEED + torch.load + copy_ (onload, restore)",
            "block_size": bsize,
            "repeat": args.repeat,
        },
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{time.strftime('%Y-%m-%d')}-{'h200' if device.type == 'cuda' else 'cpu'}-disk.json"
    (args.out / name).write_text(json.dumps(result.to_json(), indent=1))
    bench.plot_ratios(
        [f"{r.op}\n{r.residency}" for r in rows],
        [r.ratio for r in rows],
        f"disk tier ({mode}), stateshift {result.stateshift} on {result.machine}",
        args.out / name.replace(".json", ".png"),
    )
    print(f"io_mode {mode} ({why})")
    print(f"{'op':<13} {'GB/s':>7} {'ratio':>6} {'naive GB/s':>10} {'vs naive':>8} {'host peak':>10}")
    for r in rows:
        print(
            f"{r.op:<13} {r.gbps:7.2f} {r.ratio:6.2f} {r.loop_gbps or 0:10.2f} {r.vs_loop or 0:8.2f} {r.host_peak_bytes / 1e6:7.0f} MB"
        )
    print("ceilings:", {k: round(v, 2) for k, v in ceilings.items()})


if __name__ == "__main__":
    main()
