"""What the guards cost on the hot path: a forward + backward + optimizer step of the built-in model
with and without a ModelState's hooks, in the same process (CPU or CUDA).

    python3 benchmarks/guard_overhead.py [--layers 8] [--hidden 256] [--repeat 30] [--device cpu]

Prints a table (median ms per step and the ratio guarded / plain) and writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stateshift import ModelState  # noqa: E402
from stateshift.models import TinyConfig, batch, build_default, lm_loss  # noqa: E402


def step_time(model, opt, cfg, device, repeat: int) -> float:
    """Median seconds per training step: wall time on CUDA; on the CPU the time this thread ran
    (one torch thread), so other processes on a shared machine do not count."""
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    times = []
    for i in range(repeat + 3):
        ids = batch(cfg, i, size=8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        opt.zero_grad()
        lm_loss(model, ids).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(clock() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    cfg = TinyConfig(vocab=1024, hidden=args.hidden, layers=args.layers, heads=4, seq=64)
    model = build_default(cfg, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    rows = []
    for round_ in range(3):  # alternate, so drift on a shared machine hits both
        plain = step_time(model, opt, cfg, device, args.repeat)
        state = ModelState(model, opt)
        guarded = step_time(model, opt, cfg, device, args.repeat)
        state.close()  # removes the hooks
        rows.append({"round": round_, "plain_ms": plain * 1e3, "guarded_ms": guarded * 1e3, "ratio": guarded / plain})
    hooks = sum(1 for m in model.modules() if m._parameters or m._buffers)
    print(f"{'round':>5} {'plain ms':>9} {'guarded ms':>11} {'ratio':>6}   ({hooks} modules hooked, {device})")
    for r in rows:
        print(f"{r['round']:>5} {r['plain_ms']:>9.2f} {r['guarded_ms']:>11.2f} {r['ratio']:>6.3f}")
    med = statistics.median(r["ratio"] for r in rows)
    print(f"median ratio guarded / plain: {med:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "layers": args.layers, "hidden": args.hidden,
                                         "modules_hooked": hooks, "rounds": rows, "median_ratio": med}, indent=1))


if __name__ == "__main__":
    main()
