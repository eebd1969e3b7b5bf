"""Every verb in every residency on the built-in GPT, with the provenance, plot and probes of a committed result.

    python3 benchmarks/verbs_bench.py --json benchmarks/results/<date>-<machine>-torch.json --plot <same>.png
    python3 benchmarks/verbs_bench.py --small 2000x512KiB --small 20000x16KiB   # the many-small-tensors probe

``stateshift bench`` with what a committed result file needs beyond it: the commit measured and the host's
CPU and Python speed (``_harness.git_sha`` / ``host_facts``), the many-small-tensors cases beside a plain
``copy_`` loop (``--small``: on CUDA 2000x512KiB and 20000x16KiB unless told otherwise), and a PNG of the
ratios (``--plot``, matplotlib). Takes every option of ``stateshift bench``. Format:
docs/design/result-format.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _harness as bench

from stateshift.cli import bench as cli_bench
from stateshift.errors import ConfigError

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_small(spec: str) -> tuple[int, int]:
    """``"2000x512KiB"`` -> (2000, 524288)."""
    count, _, size = spec.partition("x")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if size.endswith(u)), "B")
    try:
        n, nbytes = int(count), int(size.removesuffix(unit)) * _UNITS[unit]
    except ValueError:
        raise ConfigError("usage", f"--small {spec!r}: use COUNTxSIZE, e.g. 2000x512KiB or 20000x16KiB") from None
    if n < 1 or nbytes < 2:
        raise ConfigError("usage", f"--small {spec!r}: the count must be >= 1 and the size >= 2 bytes")
    return n, nbytes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli_bench.add_arguments(p)
    p.add_argument(
        "--small",
        action="append",
        default=None,
        metavar="COUNTxSIZE",
        help="also time snapshot/restore/offload/onload of COUNT bf16 tensors of SIZE each beside a plain "
        "copy_ loop (repeatable; default on CUDA: 2000x512KiB and 20000x16KiB, on the CPU: none; 'none': no small "
        "cases)",
    )
    p.add_argument("--small-tensors", type=int, default=0, help="one more small case: this many tensors ...")
    p.add_argument("--small-numel", type=int, default=65536, help="... of this many bf16 elements each")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart of the ratios here (matplotlib)")
    return p


def small_cases(args: argparse.Namespace, on_cuda: bool) -> list[tuple[int, int]]:
    """The (count, bytes) cases of ``--small``, ``--small-tensors`` / ``--small-numel`` and the CUDA default."""
    if args.small_numel < 1 or args.small_tensors < 0:
        raise ConfigError("usage", "--small-numel must be >= 1 and --small-tensors >= 0")
    if args.small is not None and "none" in args.small and len(args.small) > 1:
        raise ConfigError("usage", "--small none cannot be given with other --small cases")
    cases = [parse_small(spec) for spec in (args.small or []) if spec != "none"]
    if args.small_tensors:
        cases.append((args.small_tensors, 2 * args.small_numel))
    if args.small is None and on_cuda:
        cases[:0] = [(2000, 512 << 10), (20000, 16 << 10)]
    return cases


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        device, cfg = cli_bench.check_args(args)
        cases = small_cases(args, device.type == "cuda")
        if args.plot is not None:
            import matplotlib  # noqa: F401
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError:
        print("error: --plot needs matplotlib: pip install 'stateshift[bench]'", file=sys.stderr)
        return 2
    state, model_info = cli_bench.build(cfg, device, args.dtype)
    progress = bench.Progress(13 + 4 * len(cases), enabled=not args.no_progress)
    result, ceilings = cli_bench.measure(state, args, progress)
    result.stateshift, result.host = bench.git_sha(), bench.host_facts()
    result.extra["model"] = model_info
    for count, nbytes in cases:
        result.rows += bench.bench_small(count, nbytes, device, repeat=args.repeat, progress=progress)
    cli_bench.finish(result, state)
    cli_bench.report(result, state, ceilings)
    bench.save(result, args.json, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
