"""Address-stable offload/onload (ModelState(address_stable=True)) beside torch_memory_saver's own
pause/resume with its CPU backup, same bytes, same run (run on the GPU machine).

    python3 benchmarks/tms_bench.py --out DIR [--gb 5.8] [--repeat 3]

Rows (``docs/design/result-format.md`` format): ``case`` ``address-stable`` for ``offload`` and ``onload``
(ratio to the pinned D2H / H2D ceiling measured here), ``case`` ``tms-cpu-backup`` for
torch_memory_saver's pause (``offload``) and resume (``onload``) with ``enable_cpu_backup=True``;
and a CUDA-graph check: a graph captured on address-stable weights replays with the same output
after an offload and an onload. The process leaves with ``os._exit``: torch_memory_saver's
allocator ends a process whose pools are destroyed outside a region with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import _harness as bench  # noqa: E402

from stateshift import ModelState  # noqa: E402


def _timed(fn, setup, repeat):
    times = []
    for i in range(repeat + 1):
        setup()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _ours(nbytes: int, repeat: int, ceilings: dict[str, float]) -> tuple[list[dict], dict]:
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(nbytes // 2 // 4, device="cuda", dtype=torch.bfloat16)) for _ in range(4)
    )
    state = ModelState(model, address_stable=True)
    state.offload()
    state.onload()  # first onload: the storages are re-grown inside the region (address-stable from now on)
    ptrs = [p.data_ptr() for p in model]
    total = state.nbytes()
    rows = []
    for op, fn, setup, ceiling in (
        ("offload", state.offload, state.onload, "d2h"),
        ("onload", state.onload, state.offload, "h2d"),
    ):
        t = _timed(fn, setup, repeat)
        gbps = total / t / 1e9
        rows.append(
            {
                "backend": "torch",
                "op": op,
                "residency": "device" if op == "offload" else "host",
                "device": "cuda",
                "bytes": total,
                "seconds": t,
                "gbps": gbps,
                "ratio": gbps / ceilings[f"{ceiling}_gbps"],
                "bound": ceiling,
                "case": "address-stable",
                "note": "copy out + pause / resume + copy in",
            }
        )
    state.onload()
    stable = [p.data_ptr() for p in model] == ptrs
    free0 = torch.cuda.mem_get_info()[0]
    state.offload()
    gain = torch.cuda.mem_get_info()[0] - free0
    state.onload()
    return rows, {"addresses_stable": stable, "driver_free_gain_bytes": gain, "bytes": total}


def _tms_baseline(nbytes: int, repeat: int, ceilings: dict[str, float]) -> list[dict]:
    from torch_memory_saver import torch_memory_saver as tms

    with tms.region("baseline", enable_cpu_backup=True):
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    rows = []
    state = {"paused": False}

    def pause():
        tms.pause("baseline")
        state["paused"] = True

    def resume():
        tms.resume("baseline")
        state["paused"] = False

    for op, fn, setup, ceiling in (
        ("offload", pause, lambda: state["paused"] and resume(), "d2h"),
        ("onload", resume, lambda: state["paused"] or pause(), "h2d"),
    ):
        t = _timed(fn, setup, repeat)
        gbps = nbytes / t / 1e9
        rows.append(
            {
                "backend": "torch",
                "op": op,
                "residency": "device" if op == "offload" else "host",
                "device": "cuda",
                "bytes": nbytes,
                "seconds": t,
                "gbps": gbps,
                "ratio": gbps / ceilings[f"{ceiling}_gbps"],
                "bound": ceiling,
                "case": "tms-cpu-backup",
                "note": "torch_memory_saver pause / resume, enable_cpu_backup=True",
            }
        )
    if state["paused"]:
        resume()
    del x
    return rows


def _graph_check() -> dict:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    state = ModelState(mlp, address_stable=True)
    state.offload()
    state.onload()
    x = torch.randn(64, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            mlp(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        y = mlp(x)
    g.replay()
    before = y.clone()
    state.offload()
    state.onload()
    g.replay()
    torch.cuda.synchronize()
    return {"graph_replay_equal": bool(torch.equal(y, before)), "max_abs_diff": float((y - before).abs().max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gb", type=float, default=5.8)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.gb * 1e9) // 64 * 64
    ceilings = bench.measure_ceilings(nbytes, torch.device("cuda"), repeat=3)
    result = {
        "machine": bench.machine_name(torch.device("cuda")),
        "torch": torch.__version__,
        "stateshift": bench.git_sha(),
        "ceilings": ceilings,
        "rows": [],
        "errors": {},
    }
    for name, fn in (
        ("ours", lambda: _ours(nbytes, args.repeat, ceilings)),
        ("tms", lambda: _tms_baseline(nbytes, args.repeat, ceilings)),
        ("graph", _graph_check),
    ):
        try:
            out = fn()
            if name == "ours":
                result["rows"] += out[0]
                result["address_stable"] = out[1]
            elif name == "tms":
                result["rows"] += out
            else:
                result["cuda_graph"] = out
        except Exception:  # noqa: BLE001 - record and go on: one failure must not hide the others
            result["errors"][name] = traceback.format_exc()
    text = json.dumps(result, indent=1)
    print(text)
    (args.out / f"{time.strftime('%Y-%m-%d')}-h200-address-stable.json").write_text(text)
    sys.stdout.flush()
    os._exit(0 if not result["errors"] else 1)


if __name__ == "__main__":
    main()
