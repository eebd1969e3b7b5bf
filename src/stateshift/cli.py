"""The ``stateshift`` command.

    stateshift bench            # every verb in every residency on the built-in model
    stateshift bench --help     # sizes, device, output files
    stateshift inspect PATH     # a checkpoint's manifest and tensors, checksums verified
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .checkpoint.inspect_cmd import add_parser as _inspect_parser
from .rl.cli import add_parser as _train_parser

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time every verb in every residency on the built-in model",
        description=(
            "Build the built-in transformer, take one training step (so grads and Adam state exist), then time "
            "snapshot / restore / offload / onload / swap / pi_old cycle of its parameters in each residency, and "
            "print GB/s and the ratio to ceilings measured in the same run (pinned copies of the same bytes; a host "
            "memcpy on CPU-only machines)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda[:N]'")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median reported)")
    p.add_argument("--minibatches", type=int, default=4, help="N of the pi_old cycle")
    p.add_argument("--small-tensors", type=int, default=0, help="also bench a model of this many small tensors")
    p.add_argument("--small-numel", type=int, default=65536, help="elements of each small tensor")
    p.add_argument("--json", type=Path, default=None, help="write results (DESIGN.md section 7 format) here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart of the ratios here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench)


class ManySmall(torch.nn.Module):
    """``count`` parameters of ``numel`` elements each: the worst case for per-copy overhead."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tensors = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(numel).to(dtype)) for _ in range(count))


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench
    from .models import TinyConfig, batch, build_default, lm_loss
    from .state import ModelState

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("error: --device cuda but no CUDA device is available", file=sys.stderr)
            return 2
    if args.repeat < 1 or args.minibatches < 1:
        print("error: --repeat and --minibatches must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = TinyConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
                         dtype=DTYPES[args.dtype])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = build_default(cfg, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    lm_loss(model, batch(cfg, 0, device=device)).backward()
    opt.step()
    state = ModelState(model, opt)
    nbytes = state.nbytes("params")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {nbytes / 1e9:.3f} GB of params "
          f"({args.dtype}) on {device}; state tracked: {state.nbytes() / 1e9:.3f} GB")
    ceilings = bench.measure_ceilings(nbytes, device, repeat=args.repeat)
    per_model = 12
    total = per_model * (2 if args.small_tensors else 1)
    progress = bench.Progress(total, enabled=not args.no_progress)
    result = bench.BenchResult(machine=bench.machine_name(device), torch=torch.__version__, stateshift=bench.git_sha(),
                               ceilings={k: round(v, 2) for k, v in ceilings.items()})
    rows, extra = bench.bench_state(state, backend="torch", ceilings=ceilings, repeat=args.repeat,
                                    cycle_minibatches=args.minibatches, progress=progress)
    result.rows += rows
    result.extra.update(model={"params": sum(p.numel() for p in model.parameters()), "param_bytes": nbytes,
                               "dtype": args.dtype}, **extra)
    if args.small_tensors:
        small = ManySmall(args.small_tensors, args.small_numel, DTYPES[args.dtype]).to(device)
        small_state = ModelState(small, pool=state.pool)
        small_rows, _ = bench.bench_state(small_state, backend="torch", ceilings=ceilings, repeat=args.repeat,
                                          cycle_minibatches=args.minibatches, progress=progress)
        for r in small_rows:
            r.note = (r.note + f"; {args.small_tensors} tensors x {args.small_numel}").lstrip("; ")
        result.rows += small_rows
    stats = state.pool.stats
    result.extra["pool"] = stats.as_dict()
    print()
    print(result.table())
    print()
    print("ceilings (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    print(f"pinned pool: pinned={stats.pinned} held={stats.held_bytes / 1e9:.3f} GB in use={stats.in_use_bytes / 1e9:.3f} GB "
          f"allocations={stats.allocations} reuses={stats.reuses} requested={stats.requested_bytes / 1e9:.3f} GB")
    if "gpu_allocated_after_offload" in result.extra:
        print(f"GPU allocated: {result.extra['gpu_allocated_before_offload'] / 1e9:.3f} GB before offload, "
              f"{result.extra['gpu_allocated_after_offload'] / 1e9:.3f} GB after")
    bench.save(result, args.json, args.plot)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stateshift", description="Move, snapshot and restore a training model's state.")
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    _inspect_parser(sub)
    _train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
