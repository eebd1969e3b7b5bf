"""Does a prefetched onload overlap compute on the GPU? The optimizer state's onload against a forward, in one
process: each alone, then one after the other (onload, wait, forward: ``trainer.prefetch=false``), then
prefetched (issued on the prefetch stream, forward, wait: ``train/prefetch.py``, what the trainer does).

    python3 benchmarks/prefetch_bench.py [--width 4096] [--layers 8] [--tokens 4096] [--repeats 7] [--out FILE]
    python3 benchmarks/prefetch_bench.py --small    # the CPU: the path only (no stream: nothing can overlap)

A stack of ``--layers`` square fp32 linear layers of ``--width`` with Adam (its moments, twice the params' bytes,
are the ``optim`` group moved), a forward of ``--tokens`` rows under ``no_grad``. Median seconds over
``--repeats`` (after one warm-up round), each round from the optimizer state offloaded and the device idle:

- ``forward_s``, ``onload_s``: each alone (the onload waited for on the host, then the device synchronized);
- ``sequential_s``: onload and its wait, then the forward;
- ``prefetched_s``: ``Prefetch.issue``, the forward, ``Prefetch.wait`` (the compute stream waits for the copy's
  event, the host does not), ``Prefetch.settle`` (reads the stall);
- ``hidden_s`` = sequential - prefetched; ``overlap`` = hidden / min(forward, onload): 1 when the shorter of the
  two is fully hidden behind the other, 0 when nothing overlaps;
- ``prefetch_wait_s``: the compute stream's stall at ``Prefetch.wait``, from events (the copy time not hidden:
  what the trainer's verbs metric counts for it).

At the defaults: 134M parameters, 1.07 GB of optimizer state (about 20 ms at 55 GB/s), a forward of 1.1 TFLOP
in fp32 (the same order). About half a minute of GPU time. Prints the JSON; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from stateshift import ModelState  # noqa: E402
from stateshift.train.prefetch import Prefetch  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(width: int, layers: int, device: torch.device) -> tuple[torch.nn.Module, ModelState]:
    """The model, one Adam step (its moments exist from then on), its ModelState with the optimizer state offloaded."""
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device=device)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = ModelState(model, opt, free_device_memory=False)  # memory cached: the copies alone, not cudaMalloc
    state.offload("optim").wait()
    return model, state


def timed(round_: Callable[[], None], state: ModelState, device: torch.device, repeats: int) -> float:
    """Median seconds of ``round_`` (from the optimizer state offloaded and the device idle; one warm-up round)."""
    out = []
    for i in range(repeats + 1):
        if state.residency()["optim"]["device"]:
            state.offload("optim").wait()
        _sync(device)
        t0 = time.perf_counter()
        round_()
        _sync(device)
        if i:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure(width: int, layers: int, tokens: int, repeats: int, device: torch.device) -> dict[str, Any]:
    model, state = build(width, layers, device)
    x = torch.randn(tokens, width, device=device)
    waits: list[float] = []
    pf = Prefetch(state, device, lambda key, s, n: waits.append(s) if key.startswith("prefetch_wait.") else None)

    @torch.no_grad()
    def forward() -> None:
        model(x)

    def onload() -> None:
        state.onload("optim").wait()

    def sequential() -> None:
        onload()
        forward()

    def prefetched() -> None:
        pf.issue("optim")
        forward()
        pf.wait("optim")
        pf.settle()

    r = {
        name: timed(fn, state, device, repeats)
        for name, fn in (
            ("forward_s", forward),
            ("onload_s", onload),
            ("sequential_s", sequential),
            ("prefetched_s", prefetched),
        )
    }
    hidden = r["sequential_s"] - r["prefetched_s"]
    shorter = min(r["forward_s"], r["onload_s"])
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "width": width,
        "layers": layers,
        "tokens": tokens,
        "repeats": repeats,
        "optim_bytes": state.nbytes("optim"),
        **{k: round(v, 6) for k, v in r.items()},
        "hidden_s": round(hidden, 6),
        "overlap": round(hidden / shorter, 3) if shorter > 0 else None,
        "prefetch_wait_s": round(statistics.median(waits[1:] or waits), 6),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--small", action="store_true", help="a toy size on the CPU (checks the path)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.small:
        a.width, a.layers, a.tokens, a.repeats = 64, 2, 32, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not a.small else "cpu")
    result = measure(a.width, a.layers, a.tokens, a.repeats, device)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
