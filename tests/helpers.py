"""Shared test helpers: a small model + optimizer, training steps, value capture.

``DEVICES`` holds "cpu" and, where CUDA exists, "cuda" (marked ``gpu``), so the
same correctness suite runs in CI and on the GPU machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from stateshift import ModelState
from stateshift.train.tasks.gpt import GPTConfig, TinyGPT, next_token_loss as lm_loss, random_ids as batch

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])

SMALL = GPTConfig(vocab=64, width=32, layers=2, heads=4, max_len=16)


class CountingGPT(TinyGPT):
    """The built-in GPT (``stateshift.train.tasks.gpt``) with what the tests need of a model's state beyond it.

    The output head tied to the token embedding (one storage, two names: ``tok.weight``, ``head.weight``), a
    persistent buffer updated in forward in training mode (``tokens_seen``, a running token count: the same
    kind of state as an MoE router's ``expert_bias``) and a non-persistent buffer (``mask``, the causal mask: never saved).
    """

    def __init__(self, cfg: GPTConfig, *, tied: bool = True) -> None:
        super().__init__(cfg)
        if tied:
            self.head.weight = self.tok.weight
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.float32))
        self.register_buffer("mask", torch.ones(cfg.max_len, cfg.max_len, dtype=torch.bool).tril(), persistent=False)

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.training:
            self.tokens_seen += ids.numel()
        return super().forward(ids, *args, **kwargs)


def build_model(
    cfg: GPTConfig = SMALL,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    tied: bool = True,
    dtype: torch.dtype = torch.float32,
) -> CountingGPT:
    """A ``CountingGPT`` whose weights depend on ``seed`` only, its parameters in ``dtype`` (the token count stays fp32)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CountingGPT(cfg, tied=tied)
    model.to(device=device, dtype=dtype)
    model.tokens_seen = model.tokens_seen.float()
    return model


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for tiny tensors: with several, each op costs milliseconds on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


TESTS = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(TESTS), "src")


def run_isolated(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (for what may crash the process: a segfault is a return code here),
    with ``sys.argv[1:3]`` = tests/ and src/ (the script puts them on its path) and ``args`` after them."""
    return subprocess.run(
        [sys.executable, "-c", code, TESTS, SRC, *args], capture_output=True, text=True, timeout=timeout
    )


def assert_isolated(code: str, *printed: str, args: tuple[str, ...] = (), timeout: float = 300) -> None:
    """``run_isolated(code, *args)`` exited 0 (no crash) and printed every string of ``printed``; the
    return code and the tails of its output are the failure message."""
    proc = run_isolated(code, *args, timeout=timeout)
    assert proc.returncode == 0 and all(s in proc.stdout for s in printed), (
        proc.returncode,
        proc.stdout[-2000:],
        proc.stderr[-3000:],
    )


def make(
    device: str = "cpu",
    *,
    seed: int = 0,
    cfg: GPTConfig = SMALL,
    lr: float = 1e-2,
    tied: bool = True,
    dtype: torch.dtype = torch.float32,
    **shape: Any,
):
    """``build_model`` and its Adam; ``shape``: fields of ``cfg`` to change (``width=48``, ``layers=3``, ...)."""
    model = build_model(dataclasses.replace(cfg, **shape), seed=seed, device=device, tied=tied, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    return model, opt


def train_step(model, opt, step: int, *, set_to_none: bool = False) -> float:
    ids = batch(model.cfg, step, device=next(model.parameters()).device)
    opt.zero_grad(set_to_none=set_to_none)
    loss = lm_loss(model, ids)
    loss.backward()
    opt.step()
    return loss.item()


def warm(model, opt, steps: int = 1) -> None:
    """Take steps so that grads and optimizer state exist."""
    for i in range(steps):
        train_step(model, opt, 10_000 + i)


def capture(state: ModelState, groups=None) -> dict[str, torch.Tensor]:
    """Every member's current values, wherever it lives (through a temporary snapshot)."""
    snap = state.snapshot(groups if groups is not None else state.groups, tag="_capture")
    try:
        return {k: v.cpu() for k, v in snap.tensors().items()}
    finally:
        state.release(snap)


def live(model, opt=None) -> dict[str, torch.Tensor]:
    """Values read straight from the objects (all must be resident)."""
    out = {f"param:{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for k, p in model.named_parameters():
        if p.grad is not None:
            out[f"grad:{k}"] = p.grad.detach().cpu().clone()
    if opt is not None:
        for i, st in enumerate(opt.state.values()):
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim:{i}:{key}"] = v.detach().cpu().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].cpu(), b[k].cpu()), f"values differ at {k}"


def perturb(model, opt=None, amount: float = 0.5, local=lambda t: t) -> None:
    """In-place change of every resident tensor (the same tensor objects).

    ``local`` maps a (D)Tensor to the tensor that owns storage (FSDP2: its local shard).
    """
    with torch.no_grad():
        for p in model.parameters():
            local(p).add_(amount)
            if p.grad is not None:
                local(p.grad).add_(amount)
        for b in model.buffers():
            if b.dtype.is_floating_point:
                b.add_(amount)
        if opt is not None:
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
                        local(v).add_(amount)


def _block0(name: str) -> bool:
    return name.startswith("blocks.0.")


#: Each mix puts a warmed-up state into some residency and returns the groups it dropped.
MIXES = {
    "resident": lambda st: set(),
    "params_offloaded": lambda st: (st.offload("params"), set())[1],
    "all_offloaded": lambda st: (st.offload(), set())[1],
    "grads_dropped": lambda st: (st.drop("grads"), {"grads"})[1],
    "partial": lambda st: (st.offload(["params", "optim"], only=_block0), set())[1],
    "mixed": lambda st: (st.offload(["params", "optim"]), st.drop("grads"), {"grads"})[2],
}


def expected_after(values: dict[str, torch.Tensor], dropped: set[str]) -> dict[str, torch.Tensor]:
    """What a capture reads after a mix: dropped grads read as zeros."""
    if "grads" not in dropped:
        return values
    return {k: (torch.zeros_like(v) if k.endswith(".grad") else v) for k, v in values.items()}


def block_import(monkeypatch, prefix: str) -> None:
    """Make ``import <prefix>...`` fail as if the package were not installed."""
    import builtins

    real = builtins.__import__

    def blocked(name, *a, **k):
        if name.startswith(prefix):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", blocked)
