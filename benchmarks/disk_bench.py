"""The disk tier against the disk's own ceiling, measured in the same run (CPU or GPU machine).

    python3 benchmarks/disk_bench.py --dir /path/on/nvme --out benchmarks/results [--mb 1024] [--window-mb 64]

Ceiling: a plain sequential write (``pwrite`` + ``fdatasync``, like the disk tier) and read (after
``posix_fadvise(DONTNEED)``, so from the disk) of the same byte count, in the same directory, with the
same flags. Rows (``docs/results.md``), ``residency`` ``disk``: ``offload`` (device -> disk),
``onload`` (disk -> device; its pages dropped from the cache first), ``snapshot`` (placement disk)
and ``restore`` (from that snapshot), each with the pool's peak host bytes beside it (the staging
windows bound it), and ``pi_old_cycle`` with pi_old on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stateshift import ModelState, bench  # noqa: E402
from stateshift.rl import PiOldCycle  # noqa: E402


def disk_ceiling(directory: Path, nbytes: int, repeat: int = 3) -> dict[str, float]:
    """Median GB/s of a plain sequential write (+ fdatasync) to a new file and of its read from the disk."""
    data = torch.ones(nbytes, dtype=torch.uint8)
    mv = memoryview(data.numpy())
    writes, reads = [], []
    for i in range(repeat):
        path = directory / f"ceiling-{i}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0 = time.perf_counter()
            for a in range(0, nbytes, 64 << 20):
                os.pwrite(fd, mv[a : a + (64 << 20)], a)
            os.fdatasync(fd)
            writes.append(nbytes / (time.perf_counter() - t0) / 1e9)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for a in range(0, nbytes, 64 << 20):
                os.preadv(fd, [mv[a : a + (64 << 20)]], a)
            reads.append(nbytes / (time.perf_counter() - t0) / 1e9)
        finally:
            os.close(fd)
            path.unlink()
    return {"disk_write_gbps": sorted(writes)[repeat // 2], "disk_read_gbps": sorted(reads)[repeat // 2]}


def _timed(fn, setup=None) -> float:
    if setup is not None:
        setup()
    bench._sync()
    t0 = time.perf_counter()
    fn()
    bench._sync()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mb", type=int, default=1024, help="bytes of params, in MB")
    p.add_argument("--window-mb", type=int, default=64)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    directory = Path(args.dir or tempfile.mkdtemp(prefix="stateshift-disk-"))
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = args.mb * 1_000_000
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(nbytes // 4 // 16, device=device)) for _ in range(16))
    state = ModelState(model, disk_dir=directory, disk_window_bytes=args.window_mb << 20)
    total = state.nbytes()
    ceilings = {**disk_ceiling(directory, total), **bench.measure_ceilings(total, device, repeat=3)}
    rows = []

    def row(op, seconds, bound):
        gbps = total / seconds / 1e9
        rows.append({"backend": "torch", "op": op, "residency": "disk", "device": device.type, "bytes": total, "seconds": seconds,
                     "gbps": gbps, "ratio": gbps / ceilings[f"{bound}_gbps"], "bound": bound, "case": "",
                     "host_peak_bytes": state.pool.stats.peak_held_bytes, "window_bytes": args.window_mb << 20})

    row("offload", _timed(lambda: state.offload(to="disk")), "disk_write")
    os.posix_fadvise(state._disk.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    row("onload", _timed(state.onload), "disk_read")
    snap = None

    def take():
        nonlocal snap
        snap = state.snapshot("params", tag="disk", placement="disk")

    row("snapshot", _timed(take), "disk_write")
    os.posix_fadvise(state._disk.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    row("restore", _timed(lambda: state.restore(snap)), "disk_read")
    cycle = PiOldCycle(state, placement="disk")

    def run_cycle():
        cycle.run(range(4), lambda mb: None, lambda mb: None)

    t = _timed(run_cycle)
    moved = total * (1 + 3 * 3)  # pi_old out once; 3 swaps: stash out and in, pi_old read
    rows.append({"backend": "torch", "op": "pi_old_cycle", "residency": "disk", "device": device.type, "bytes": moved, "seconds": t,
                 "gbps": moved / t / 1e9, "ratio": (total / (ceilings["disk_write_gbps"] * 1e9) + 3 * total / (ceilings["disk_read_gbps"] * 1e9)) / t,
                 "bound": "disk_write+disk_read", "case": "", "note": "N=4, pi_old on disk, first swap skipped; bound counts only the disk bytes"})
    state.close()
    result = {"machine": bench.machine_name(device), "torch": torch.__version__, "stateshift": bench.git_sha(),
              "ceilings": ceilings, "rows": rows, "directory_filesystem": os.statvfs(directory).f_bsize}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{time.strftime('%Y-%m-%d')}-{'h200' if device.type == 'cuda' else 'cpu'}-disk.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    bench.plot_ratios([f"{r['op']}\n{r['residency']}" for r in rows], [r["ratio"] for r in rows],
                      f"disk tier, stateshift {result['stateshift']} on {result['machine']}", args.out / name.replace(".json", ".png"))
    for r in rows:
        print(f"{r['op']:<13} {r['gbps']:7.2f} GB/s  ratio {r['ratio']:.2f}  host peak {r.get('host_peak_bytes', 0) / 1e6:.0f} MB")
    print("ceilings:", {k: round(v, 2) for k, v in ceilings.items()})


if __name__ == "__main__":
    main()
