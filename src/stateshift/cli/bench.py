"""``stateshift bench``: the verbs on the built-in GPT, params resident and offloaded, as ratios to ceilings
(``timing``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..core.engine import core_of
from ..core.state import ModelState
from ..errors import ConfigError
from ..train.tasks.gpt import GPTConfig, build_gpt, next_token_loss, random_ids
from . import timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time snapshot, restore, offload, onload, swap and the pi_old cycle on a built-in GPT",
        description=(
            "Build a GPT of the kind 'stateshift train' trains (by default 2 layers, width 256, vocabulary 4096: "
            "3.7M parameters), take one training step (so grads and Adam state exist), then time snapshot / "
            "restore / offload / onload / swap / pi_old cycle of its parameters, resident on the device and "
            "offloaded to host, and print GB/s and the ratio to ceilings measured in the same run (pinned copies of "
            "the same bytes; a host memcpy on CPU-only machines). Disk residency, many small tensors, plots and the "
            "provenance of committed results: benchmarks/ in the source tree."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The model's shape, the device, the timing and the output file (``benchmarks/verbs_bench.py`` adds its own)."""
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--width", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    p.add_argument("--seq", type=int, default=64, help="sequence length (the model's max_len)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda[:N]'")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median reported)")
    p.add_argument("--minibatches", type=int, default=4, help="N of the pi_old cycle")
    p.add_argument(
        "--json", type=Path, default=None, help="write the results here (format: docs/design/result-format.md)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError("usage", f"--device {spec!r} is not a device; use 'auto', 'cpu' or 'cuda[:N]'") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError("usage", f"--device {spec!r}: only 'cpu' and 'cuda' are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("usage", f"--device {spec!r} but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError("usage", f"--device {spec!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def check_args(args: argparse.Namespace) -> tuple[torch.device, GPTConfig]:
    """Every value checked before the run: a mistake costs nothing but its error message.

    Args:
        args: the parsed command line (``add_arguments``).

    Returns:
        The device to run on and the model's shape.

    Raises:
        ConfigError("usage"): a value out of range, a device that does not exist, an output that cannot be written.
    """
    for name in ("repeat", "minibatches"):
        if getattr(args, name) < 1:
            raise ConfigError("usage", f"--{name} must be >= 1, not {getattr(args, name)}")
    device = _device(args.device)
    try:
        cfg = GPTConfig(vocab=args.vocab, width=args.width, layers=args.layers, heads=args.heads, max_len=args.seq)
    except ValueError as exc:
        raise ConfigError("usage", str(exc).replace("model.", "--").replace("max_len", "seq")) from None
    if args.json is not None:
        _check_writable(Path(args.json))
    return device, cfg


def _check_writable(path: Path) -> None:
    """Open the output for appending now (and remove it again if it is new), so a bad path fails first."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError("usage", f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        device, cfg = check_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    state, model_info = build(cfg, device, args.dtype)
    progress = timing.Progress(13, enabled=not args.no_progress)
    result, ceilings = measure(state, args, progress)
    result.extra["model"] = model_info
    finish(result, state)
    report(result, state, ceilings)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    return 0


def build(cfg: GPTConfig, device: torch.device, dtype: str) -> tuple[ModelState, dict[str, Any]]:
    """The built-in GPT after one training step (grads and Adam state exist), and its ``ModelState``.

    Args:
        cfg: the model's shape.
        device: where the model lives.
        dtype: a key of ``DTYPES``, the parameters' dtype.

    Returns:
        The state over the model and its optimizer, and the model's facts for the result file.
    """
    model = build_gpt(cfg).to(device=device, dtype=DTYPES[dtype])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    next_token_loss(model, random_ids(cfg, 0, device=device)).backward()
    opt.step()
    state = ModelState(model, opt)
    nbytes = state.nbytes("params")
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.1f}M params, {nbytes / 1e9:.3f} GB of params ({dtype}) on {device}; "
        f"state tracked: {state.nbytes() / 1e9:.3f} GB"
    )
    return state, {"params": params, "param_bytes": nbytes, "dtype": dtype}


def measure(
    state: ModelState, args: argparse.Namespace, progress: timing.Progress
) -> tuple[timing.BenchResult, dict[str, float]]:
    """The ceilings on the params' bytes, then the verbs with params resident and offloaded (``timing.bench_state``).

    Args:
        state: the state from ``build``.
        args: the parsed command line (``repeat``, ``minibatches``).
        progress: the progress display, one step per row.

    Returns:
        The result (its rows, no provenance: ``stateshift`` is the installed version) and the raw ceilings.
    """
    device = core_of(state).engine.device or torch.device("cpu")
    ceilings = timing.measure_ceilings(state.nbytes("params"), device, repeat=args.repeat)
    result = timing.BenchResult(
        machine=timing.machine_name(device),
        torch=torch.__version__,
        stateshift=__version__,
        ceilings={k: float(f"{v:.4g}") for k, v in ceilings.items()},
    )
    rows, extra = timing.bench_state(
        state,
        backend="torch",
        ceilings=ceilings,
        repeat=args.repeat,
        cycle_minibatches=args.minibatches,
        progress=progress,
    )
    result.rows += rows
    result.extra.update(extra)
    return result, ceilings


def finish(result: timing.BenchResult, state: ModelState) -> None:
    """Add one offload of the whole state (``full_state``) and the pinned pool's counters (``pool``)."""
    result.extra["full_state"] = timing.memory_handed_back(state)
    result.extra["pool"] = core_of(state).pool.stats.as_dict()


def report(result: timing.BenchResult, state: ModelState, ceilings: dict[str, float]) -> None:
    """Print the rows, the ceilings, the pinned pool and the full offload."""
    stats = core_of(state).pool.stats
    print()
    print(result.table())
    print()
    print("ceilings (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    if result.host:
        print(
            f"host: {result.host['cpu']}; Python workload {result.host['python_us']:.0f} us (host-bound rows scale with it)"
        )
    if "d2h_gbps" not in ceilings:
        print(
            "CPU only: 'device' rows are the model's own (CPU) memory, every copy is a host memcpy, "
            "and every ratio is against the host memcpy ceiling (a zero-copy verb can exceed 1)"
        )
    print(
        f"pinned pool: pinned={stats.pinned} held={stats.held_bytes / 1e9:.3f} GB in use={stats.in_use_bytes / 1e9:.3f} GB "
        f"allocations={stats.allocations} reuses={stats.reuses} requested={stats.requested_bytes / 1e9:.3f} GB"
    )
    full = result.extra.get("full_state") or {}
    if full:
        print(
            f"full offload of {full['bytes'] / 1e9:.3f} GB: allocated -{full['allocated_drop_bytes'] / 1e9:.3f} GB, "
            f"reserved -{full['reserved_drop_bytes'] / 1e9:.3f} GB, driver free +{full['driver_free_gain_bytes'] / 1e9:.3f} GB "
            f"(free_device_memory={full['free_device_memory']}); the onload after it: {full['onload_after_gbps']:.1f} GB/s"
        )
    if "gpu_allocated_after_offload" in result.extra:
        print(
            f"GPU allocated: {result.extra['gpu_allocated_before_offload'] / 1e9:.3f} GB before offload, "
            f"{result.extra['gpu_allocated_after_offload'] / 1e9:.3f} GB after"
        )
