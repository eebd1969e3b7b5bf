"""What the guards cost on the hot path: a forward + backward + optimizer step of the built-in model
with and without a ModelState's hooks, in the same process (CPU or CUDA), and with another state's
storage offloaded meanwhile (then every tensor operation of this thread is checked against the released
storages, ``core/touch.py``), plus the cost per operator of that check on a tiny tensor.

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

from stateshift import ModelState
from stateshift.train.tasks.gpt import GPTConfig, build_gpt, next_token_loss, random_ids


def step_time(model, opt, cfg, device, repeat: int) -> float:
    """Median seconds per training step: wall time on CUDA; on the CPU the time this thread ran
    (one torch thread), so other processes on a shared machine do not count."""
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    times = []
    for i in range(repeat + 3):
        ids = random_ids(cfg, i, size=8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        opt.zero_grad()
        next_token_loss(model, ids).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(clock() - t0)
    return statistics.median(times)


def op_cost_us(n: int = 20000) -> float:
    """Median microseconds per tiny tensor operation (``torch.add`` of two 8-element tensors)."""
    a, b = torch.ones(8), torch.ones(8)
    times = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(n):
            torch.add(a, b)
        times.append((time.thread_time() - t0) / n * 1e6)
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
    cfg = GPTConfig(vocab=1024, width=args.hidden, layers=args.layers, heads=4, max_len=64)
    model = build_gpt(cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    other = ModelState(build_gpt(GPTConfig(vocab=64, width=32, layers=1, heads=4, max_len=8)).to(device))
    rows = []
    for round_ in range(3):  # alternate, so drift on a shared machine hits all three
        plain = step_time(model, opt, cfg, device, args.repeat)
        op_off = op_cost_us()
        state = ModelState(model, opt)
        guarded = step_time(model, opt, cfg, device, args.repeat)
        other.offload()  # another model's state offloaded: the touch check is on for this thread
        offloaded = step_time(model, opt, cfg, device, args.repeat)
        op_on = op_cost_us()
        other.onload()
        state.close()  # removes the hooks
        rows.append(
            {
                "round": round_,
                "plain_ms": plain * 1e3,
                "guarded_ms": guarded * 1e3,
                "ratio": guarded / plain,
                "offloaded_elsewhere_ms": offloaded * 1e3,
                "ratio_offloaded": offloaded / plain,
                "op_us_nothing_released": op_off,
                "op_us_something_released": op_on,
            }
        )
    hooks = sum(1 for m in model.modules() if m._parameters or m._buffers)
    print(
        f"{'round':>5} {'plain ms':>9} {'guarded ms':>11} {'ratio':>6} {'+offloaded ms':>14} {'ratio':>6} "
        f"{'op us':>6} {'op us (checked)':>16}   ({hooks} modules hooked, {device})"
    )
    for r in rows:
        print(
            f"{r['round']:>5} {r['plain_ms']:>9.2f} {r['guarded_ms']:>11.2f} {r['ratio']:>6.3f} "
            f"{r['offloaded_elsewhere_ms']:>14.2f} {r['ratio_offloaded']:>6.3f} "
            f"{r['op_us_nothing_released']:>6.2f} {r['op_us_something_released']:>16.2f}"
        )
    med = statistics.median(r["ratio"] for r in rows)
    med_off = statistics.median(r["ratio_offloaded"] for r in rows)
    print(f"median ratio guarded / plain: {med:.3f}; with another state offloaded: {med_off:.3f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": str(device),
                    "layers": args.layers,
                    "hidden": args.hidden,
                    "modules_hooked": hooks,
                    "rounds": rows,
                    "median_ratio": med,
                    "median_ratio_offloaded_elsewhere": med_off,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
