"""Benchmark the FSDP2 backend: every verb on the sharded parameters, as ratios to ceilings of the same run.

On the GPU machine (world size 1, NCCL; a >= 2 GB bf16 model wrapped with ``fully_shard``)::

    python3 benchmarks/fsdp2_bench.py --out $OUT

writes ``$OUT/<yyyy-mm-dd>-<machine>-fsdp2.json`` (format: docs/design/result-format.md) and the
PNG beside it, and prints the table. The rows that must reach 0.9 of the
pinned ceiling (snapshot and restore of device-resident shards, offload,
onload) are listed at the end; ``--check`` makes the exit status say whether
they did. A CPU smoke test (gloo, a tiny model, a few seconds)::

    PYTHONPATH=src python3 benchmarks/fsdp2_bench.py --tiny --out /tmp/fsdp2-bench

Under ``torchrun`` the script joins the launched process group; rank 0 writes
the files.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import stateshift  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _harness as bench

from stateshift import ModelState
from stateshift.core.engine import core_of
from stateshift.train.tasks.gpt import GPTConfig, TinyGPT, random_ids

#: the rows whose target is >= 0.9 of the pinned ceiling
TARGETS = (("snapshot", "device"), ("restore", "device"), ("offload", "device"), ("onload", "host"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON and PNG result files")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per row (median), after one warm-up")
    p.add_argument("--minibatches", type=int, default=4, help="mini-batches of the pi_old cycle")
    p.add_argument("--min-gb", type=float, default=2.0, help="refuse a model with fewer GB of params (0: any)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and 2 repeats: a smoke test (CPU is fine)")
    p.add_argument("--check", action="store_true", help="exit 1 if a target row is below 0.9 of its ceiling")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.vocab, args.repeat, args.min_gb = 2, 64, 4, 256, 2, 0.0
    return args


def init_distributed(device: torch.device) -> None:
    """Join torchrun's process group, or make a one-process group (NCCL on CUDA, gloo on the CPU)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def build(cfg: GPTConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The built-in GPT in ``dtype``, initialised on the device, ``fully_shard`` per block and at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        model = TinyGPT(cfg).to(dtype)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():  # lazy init; leaves the root unsharded, as an RL log-prob pass does
        model(random_ids(cfg, 0, device=device))
    return model


def machine_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).replace("NVIDIA", "").strip().split()
    return re.sub(r"[^a-z0-9]+", "-", (name[0] if name else "gpu").lower())


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "auto":
        if not torch.cuda.is_available() and not args.tiny:
            print(
                "error: no CUDA device; this benchmark is for the GPU machine. Use --tiny for a CPU smoke test "
                "(or --device cpu to time the full-size model on the CPU)",
                file=sys.stderr,
            )
            return 2
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("error: --device cuda but no CUDA device is available", file=sys.stderr)
            return 2
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        cfg = GPTConfig(vocab=args.vocab, width=args.hidden, layers=args.layers, heads=args.heads, max_len=32)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        t0 = time.perf_counter()
        model = build(cfg, DTYPES[args.dtype], device)
        state = ModelState(model)
        assert [b.name for b in state.backends] == ["fsdp2"], state.backends
        nbytes = state.nbytes("params")
        params = sum(p.numel() for p in model.parameters())
        if rank == 0:
            print(
                f"model: {params / 1e6:.1f}M params ({args.dtype}), {nbytes / 1e9:.3f} GB of local shards on {device} "
                f"(world size {world}); built in {time.perf_counter() - t0:.1f}s"
            )
        if nbytes < args.min_gb * 1e9 / world:
            print(f"error: {nbytes / 1e9:.3f} GB of params per rank, less than --min-gb {args.min_gb}", file=sys.stderr)
            return 2
        ceilings = bench.measure_ceilings(nbytes, device, repeat=args.repeat)
        progress = bench.Progress(12, enabled=rank == 0 and not args.no_progress)
        rows, extra = bench.bench_state(
            state,
            backend="fsdp2",
            ceilings=ceilings,
            groups=("params",),
            repeat=args.repeat,
            cycle_minibatches=args.minibatches,
            progress=progress,
        )
        result = bench.BenchResult(
            machine=bench.machine_name(device),
            torch=torch.__version__,
            stateshift=bench.git_sha(),
            ceilings={k: round(v, 2) for k, v in ceilings.items()},
            rows=rows,
        )
        stats = core_of(state).pool.stats
        result.extra.update(
            what="fsdp2",
            world_size=world,
            model={
                "kind": "TinyGPT, fully_shard per block + root",
                "params": params,
                "param_bytes_per_rank": nbytes,
                "dtype": args.dtype,
                "layers": args.layers,
                "hidden": args.hidden,
                "vocab": args.vocab,
            },
            pool=stats.as_dict(),
            **extra,
        )
        verdicts = []
        for op, residency in TARGETS:
            row = next(r for r in rows if r.op == op and r.residency == residency and "placement=device" not in r.note)
            verdicts.append((f"{op} ({residency})", row.ratio, row.ratio >= 0.9))
        result.extra["targets"] = {name: {"ratio": round(ratio, 3), "ok": ok} for name, ratio, ok in verdicts}
        if rank == 0:
            print()
            print(result.table())
            print()
            print("ceilings (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
            if "gpu_allocated_after_offload" in extra:
                print(
                    f"GPU allocated: {extra['gpu_allocated_before_offload'] / 1e9:.3f} GB before offload, "
                    f"{extra['gpu_allocated_after_offload'] / 1e9:.3f} GB after (tracked {nbytes / 1e9:.3f} GB)"
                )
            for name, ratio, ok in verdicts:
                print(f"target {name:<18} {ratio:5.2f} x ceiling  {'ok' if ok else 'BELOW 0.9'}")
            day = datetime.date.today().isoformat()
            stem = f"{day}-{machine_slug(device)}-fsdp2"
            args.out.mkdir(parents=True, exist_ok=True)
            bench.save(result, args.out / f"{stem}.json", args.out / f"{stem}.png")
            print(f"wrote {args.out / (stem + '.json')}")
        state.close()
        return 1 if args.check and not all(ok for _, _, ok in verdicts) else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
