"""What the benchmark scripts share beyond the timing of ``stateshift bench``: provenance, plots, probes.

    import _harness as bench        # benchmarks/ is on sys.path when a script runs from it

- the timing itself (``timed``, ``measure_ceilings``, ``bench_state``, ``Row``, ...) is the library's
  ``stateshift.cli.timing``, re-exported here so a script needs one import;
- provenance of a committed result: ``git_sha`` (the commit measured) and ``host_facts`` (the host's CPU
  and its Python speed), filled in by this module's ``BenchResult``;
- plots: ``plot_ratios`` and ``write_plot`` (matplotlib, the ``bench`` extra), ``save`` (JSON and PNG);
- result files written whole or not at all: ``write_whole``, ``write_json``;
- the many-small-tensors probe: ``ManySmall`` and ``bench_small``.

Result files follow ``docs/design/result-format.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # a source checkout without an install
    sys.path.insert(0, str(ROOT / "src"))

from stateshift import ModelState  # noqa: E402
from stateshift.cli.timing import (  # noqa: E402
    BenchResult as _Result,
    Progress,
    Row,
    VerbBench,
    bench_state,
    machine_name,
    measure_ceilings,
    memory_handed_back,
    plain_loops,
    sync,
    timed,
    timed_device,
)

__all__ = [
    "BenchResult",
    "ManySmall",
    "Progress",
    "Row",
    "VerbBench",
    "bench_small",
    "bench_state",
    "git_sha",
    "host_facts",
    "machine_name",
    "measure_ceilings",
    "memory_handed_back",
    "plain_loops",
    "plot_ratios",
    "save",
    "size_label",
    "sync",
    "timed",
    "timed_device",
    "write_plot",
]


def git_sha() -> str:
    """The commit measured: $STATESHIFT_GIT_SHA (set where the tree travels without .git), else git."""
    if os.environ.get("STATESHIFT_GIT_SHA"):
        return os.environ["STATESHIFT_GIT_SHA"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
        return "unknown"


def host_facts() -> dict[str, Any]:
    """The host CPU's model name and ``python_us``: the median time of a fixed pure-Python workload (a walk
    over 2000 small objects, the kind of work a verb does per slot). Two runs on hosts whose figures differ
    are not comparable for host-bound rows (many small tensors, isolated device-placed verbs)."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    objs = [Row("", "", "", "", i, 0.0, 0.0, 0.0, "") for i in range(2000)]

    def work() -> int:
        return sum(r.bytes for r in objs if r.ratio == 0.0) + len([r for r in objs if r.note == ""])

    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return {"cpu": cpu, "python_us": round(sorted(times)[len(times) // 2] * 1e6, 1)}


@dataclass
class BenchResult(_Result):
    """The library's result with its provenance: ``host`` measured here (``stateshift`` is the caller's ``git_sha()``)."""

    host: dict[str, Any] = field(default_factory=lambda: host_facts())


def write_plot(result: BenchResult, path: Path) -> bool:
    """A bar chart of ratios to the ceiling; returns False (and says why) when matplotlib is missing."""
    labels = [
        f"{r.backend}\n{r.op}\n{r.residency}{' dev' if 'placement=device' in r.note else ''}\n{r.case}"
        for r in result.rows
    ]
    return plot_ratios(
        labels, [r.ratio for r in result.rows], f"stateshift {result.stateshift} on {result.machine}", path
    )


def plot_ratios(
    labels: list[str],
    ratios: list[float],
    title: str,
    path: Path,
    *,
    ylabel: str = "throughput / ceiling",
    target: float = 0.9,
) -> bool:
    """Bars of ratios (default: throughput over ceiling, 0.9 drawn as the target line); False (said on
    stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no plot written to {path} (pip install 'stateshift[bench]')", file=sys.stderr)
        return False
    capped = [min(r, 2.0) for r in ratios]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels)), 4.5))
    ax.bar(range(len(labels)), capped, color=["tab:green" if r >= target else "tab:orange" for r in capped])
    ax.axhline(target, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel(f"{ylabel} (capped at 2)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """``write(part)`` into ``path.part``, then renamed over ``path``: whenever the writer is killed (a device
    call's time limit), ``path`` holds the last whole file, never a half-written one."""
    part = path.with_name(path.name + ".part")
    write(part)
    part.replace(path)


def write_json(path: Path, result: Any) -> None:
    """``result`` as indented JSON at ``path``, whole or not at all (``write_whole``)."""
    write_whole(path, lambda part: part.write_text(json.dumps(result, indent=1)))


def save(result: BenchResult, json_path: Path | None, plot_path: Path | None) -> None:
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(json_path, result.to_json())
    if plot_path is not None:
        write_plot(result, plot_path)


# --------------------------------------------------------------------------- many small tensors


class ManySmall(torch.nn.Module):
    """``count`` parameters of ``nbytes`` bytes each (bf16): the worst case for per-copy overhead."""

    def __init__(
        self, count: int, nbytes: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
    ) -> None:
        super().__init__()
        numel = max(1, nbytes // dtype.itemsize)
        self.tensors = torch.nn.ParameterList(
            torch.nn.Parameter(torch.ones(numel, dtype=dtype, device=device)) for _ in range(count)
        )


def size_label(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return f"{nbytes}B"


def bench_small(
    count: int, nbytes: int, device: torch.device, *, repeat: int = 5, progress: Progress | None = None
) -> list[Row]:
    """Snapshot, restore, offload and onload of ``count`` tensors of ``nbytes``, each beside the plain loop
    a user would write: ``copy_(non_blocking=True)`` per tensor into (or from) preallocated host memory.
    The ratios are to ceilings measured here, on this case's own byte count (named in each row's note)."""
    model = ManySmall(count, nbytes, device)
    params = list(model.parameters())
    state = ModelState(model, free_device_memory=False)  # the copies alone, like the loop (memory: see full_state)
    total = state.nbytes("params")
    ceilings = measure_ceilings(total, device, repeat=repeat)
    loops = plain_loops(params, repeat=repeat)
    snap = state.snapshot("params", tag="small")
    ops = {
        "snapshot": ("d2h", lambda: state.snapshot("params", tag="small-b"), None),
        "restore": ("h2d", lambda: state.restore(snap), None),
        "offload": ("d2h", lambda: state.offload("params"), lambda: state.onload("params")),
        "onload": ("h2d", lambda: state.onload("params"), lambda: state.offload("params")),
    }
    case = f"small-{size_label(nbytes)}"
    rows = []
    for op, (direction, fn, setup) in ops.items():
        t = timed(fn, repeat=repeat, setup=setup)
        ceiling = ceilings.get(f"{direction}_gbps", ceilings["host_memcpy_gbps"])
        gbps, loop = total / t / 1e9, loops[direction][0] / loops[direction][1] / 1e9
        rows.append(
            Row(
                "torch",
                op,
                "device" if op in ("snapshot", "offload", "restore") else "host",
                device.type,
                total,
                t,
                gbps,
                gbps / ceiling,
                direction if device.type == "cuda" else "host_memcpy",
                f"{count} tensors x {size_label(nbytes)}; plain loop {loop:.1f} GB/s; ceiling {ceiling:.1f} GB/s",
                case,
                loop,
                gbps / loop,
            )
        )
        if progress is not None:
            progress.step(f"{op} ({case})")
    state.onload()
    state.close()
    return rows
