"""Host time of one verb when nothing moves far: a device-placed snapshot and its restore, on the CPU.

    python benchmarks/verb_overhead.py

What it measures is the Python work a verb does before and around its copies (listing, the slot
table, the plan), which on a GPU decides how soon the first copy starts. Two models: the built-in
transformer (6 layers: 75 param slots, 47 modules) and a fake Megatron DDP model from the test fakes
(24 blocks: one flat param buffer holding 145 params, 122 modules). Params only, device placement. Each figure is the best of 15 runs of 200 (100) calls: the
least disturbed by the rest of the machine. Beside them, the naive code of the same job: a plain loop of
``copy_`` of every param into a preallocated copy.
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import torch

from stateshift import ModelState
from stateshift.core.engine import core_of
from stateshift.train.tasks.gpt import GPTConfig, build_gpt


def _torch_state() -> ModelState:
    cfg = GPTConfig(vocab=64, width=64, layers=6, heads=4, max_len=8)
    return ModelState(build_gpt(cfg).to(torch.bfloat16))


def _megatron_state() -> ModelState:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fakes.mcore.builders import build_fake_ddp, build_fake_optimizer, fake_train_step

    class Blocks(torch.nn.Module):
        def __init__(self, n: int = 24, h: int = 16) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(
                    torch.nn.LayerNorm(h), torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, h)
                )
                for _ in range(n)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x)
            return x

    torch.manual_seed(0)
    ddp = build_fake_ddp(Blocks(), use_distributed_optimizer=True)
    opt = build_fake_optimizer(ddp, "distrib")
    fake_train_step(ddp, opt, torch.randn(8, 16))
    return ModelState(ddp, opt)


def _plain_loop(state: ModelState) -> float:
    """The naive code of the same job: ``copy_`` of every param into a preallocated copy, one by one."""
    params = [m_t for s in core_of(state).slots("params") for m_t in s.tensors]
    copies = [torch.empty_like(t) for t in params]

    def loop() -> None:
        with torch.no_grad():
            for dst, src in zip(copies, params, strict=True):
                dst.copy_(src)

    return min(timeit.repeat(loop, number=200, repeat=15)) / 200 * 1e6


def main() -> int:
    print(
        f"{'model':<22} {'slots':>6} {'tensors':>8} {'modules':>8} {'snapshot us':>12} {'restore us':>11} "
        f"{'copy_ loop us':>14}"
    )
    for name, make, number in (("torch (built-in)", _torch_state, 200), ("megatron (fake DDP)", _megatron_state, 100)):
        state = make()
        modules = sum(
            1
            for b in state.backends
            for m in getattr(b, "inners", [getattr(b, "module", None)])
            if m is not None
            for _ in m.modules()
        )
        snap = lambda: state.snapshot("params", tag="p", placement="device")  # noqa: E731, B023 - timed in this iteration
        rest = lambda: state.restore(core_of(state).snapshots.get("p"))  # noqa: E731, B023 - timed in this iteration
        snap()
        times = [min(timeit.repeat(fn, number=number, repeat=15)) / number * 1e6 for fn in (snap, rest)]
        slots = core_of(state).slots("params")
        tensors = sum(len(s.info.members) for s in slots)
        print(
            f"{name:<22} {len(slots):>6} {tensors:>8} {modules:>8} {times[0]:>12.1f} {times[1]:>11.1f} "
            f"{_plain_loop(state):>14.1f}"
        )
        state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
