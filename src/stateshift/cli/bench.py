"""``stateshift bench``: every verb in every residency on the built-in model, as ratios to ceilings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from ..core.engine import core_of
from ..errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--small", action="append", default=None, metavar="COUNTxSIZE",
                   help="also time snapshot/restore/offload/onload of COUNT bf16 tensors of SIZE each beside a plain "
                   "copy_ loop (repeatable; default on CUDA: 2000x512KiB and 20000x16KiB, on the CPU: none; 'none': no small "
                   "cases)")
    p.add_argument("--small-tensors", type=int, default=0, help="one more small case: this many tensors ...")
    p.add_argument("--small-numel", type=int, default=65536, help="... of this many bf16 elements each")
    p.add_argument("--json", type=Path, default=None,
                   help="write the results here (format: docs/design/result-format.md)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart of the ratios here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench)


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_small(spec: str) -> tuple[int, int]:
    """``"2000x512KiB"`` -> (2000, 524288)."""
    count, _, size = spec.partition("x")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if size.endswith(u)), "B")
    try:
        n, nbytes = int(count), int(size.removesuffix(unit)) * _UNITS[unit]
    except ValueError:
        raise UsageError(f"--small {spec!r}: use COUNTxSIZE, e.g. 2000x512KiB or 20000x16KiB") from None
    if n < 1 or nbytes < 2:
        raise UsageError(f"--small {spec!r}: the count must be >= 1 and the size >= 2 bytes")
    return n, nbytes


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {spec!r} is not a device; use 'auto', 'cpu' or 'cuda[:N]'") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {spec!r}: only 'cpu' and 'cuda' are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {spec!r} but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {spec!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def _check_args(args: argparse.Namespace) -> tuple[torch.device, Any]:
    """Every value checked before the run: a mistake costs nothing but its error message."""
    from ..models import TinyConfig

    for name in ("repeat", "minibatches", "small_numel"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if args.small_tensors < 0:
        raise UsageError(f"--small-tensors must be >= 0, not {args.small_tensors}")
    if args.small is not None and "none" in args.small and len(args.small) > 1:
        raise UsageError("--small none cannot be given with other --small cases")
    args.small_cases = [parse_small(spec) for spec in (args.small or []) if spec != "none"]
    if args.small_tensors:
        args.small_cases.append((args.small_tensors, 2 * args.small_numel))
    device = _device(args.device)
    if args.small is None and device.type == "cuda":
        args.small_cases[:0] = [(2000, 512 << 10), (20000, 16 << 10)]
    try:
        cfg = TinyConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
                         dtype=DTYPES[args.dtype])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'stateshift[bench]'") from None
    for path in (args.json, args.plot):
        if path is not None:
            _check_writable(Path(path))
    return device, cfg


def _check_writable(path: Path) -> None:
    """Open the output for appending now (and remove it again if it is new), so a bad path fails first."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()


def cmd_bench(args: argparse.Namespace) -> int:
    from .. import bench

    try:
        device, cfg = _check_args(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    state, model_info = _build(cfg, device, args.dtype)
    nbytes = state.nbytes("params")
    ceilings = bench.measure_ceilings(nbytes, device, repeat=args.repeat)
    progress = bench.Progress(13 + 4 * len(args.small_cases), enabled=not args.no_progress)
    result = bench.BenchResult(machine=bench.machine_name(device), torch=torch.__version__, stateshift=bench.git_sha(),
                               ceilings={k: float(f"{v:.4g}") for k, v in ceilings.items()})
    rows, extra = bench.bench_state(state, backend="torch", ceilings=ceilings, repeat=args.repeat,
                                    cycle_minibatches=args.minibatches, progress=progress)
    result.rows += rows
    result.extra.update(model=model_info, **extra)
    for count, nbytes in args.small_cases:
        result.rows += bench.bench_small(count, nbytes, device, repeat=args.repeat, progress=progress)
    result.extra["full_state"] = bench.memory_handed_back(state)
    result.extra["pool"] = core_of(state).pool.stats.as_dict()
    _report(result, state, ceilings)
    bench.save(result, args.json, args.plot)
    return 0


def _build(cfg: Any, device: torch.device, dtype: str) -> tuple[Any, dict[str, Any]]:
    """The built-in model after one training step (grads and Adam state exist), and its ``ModelState``."""
    from ..core.state import ModelState
    from ..models import batch, build_default, lm_loss

    model = build_default(cfg, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    lm_loss(model, batch(cfg, 0, device=device)).backward()
    opt.step()
    state = ModelState(model, opt)
    nbytes = state.nbytes("params")
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M params, {nbytes / 1e9:.3f} GB of params ({dtype}) on {device}; "
          f"state tracked: {state.nbytes() / 1e9:.3f} GB")
    return state, {"params": params, "param_bytes": nbytes, "dtype": dtype}


def _report(result: Any, state: Any, ceilings: dict[str, float]) -> None:
    stats = core_of(state).pool.stats
    print()
    print(result.table())
    print()
    print("ceilings (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    print(f"host: {result.host['cpu']}; Python workload {result.host['python_us']:.0f} us (host-bound rows scale with it)")
    if "d2h_gbps" not in ceilings:
        print("CPU only: 'device' rows are the model's own (CPU) memory, every copy is a host memcpy, "
              "and every ratio is against the host memcpy ceiling (a zero-copy verb can exceed 1)")
    print(f"pinned pool: pinned={stats.pinned} held={stats.held_bytes / 1e9:.3f} GB in use={stats.in_use_bytes / 1e9:.3f} GB "
          f"allocations={stats.allocations} reuses={stats.reuses} requested={stats.requested_bytes / 1e9:.3f} GB")
    full = result.extra.get("full_state") or {}
    if full:
        print(f"full offload of {full['bytes'] / 1e9:.3f} GB: allocated -{full['allocated_drop_bytes'] / 1e9:.3f} GB, "
              f"reserved -{full['reserved_drop_bytes'] / 1e9:.3f} GB, driver free +{full['driver_free_gain_bytes'] / 1e9:.3f} GB "
              f"(free_device_memory={full['free_device_memory']}); the onload after it: {full['onload_after_gbps']:.1f} GB/s")
    if "gpu_allocated_after_offload" in result.extra:
        print(f"GPU allocated: {result.extra['gpu_allocated_before_offload'] / 1e9:.3f} GB before offload, "
              f"{result.extra['gpu_allocated_after_offload'] / 1e9:.3f} GB after")
