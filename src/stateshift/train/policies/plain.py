"""Plain-torch policies: the built-in GPT (``builtin``) and a Hugging Face causal LM from a directory (``hf``).

A step is the textbook one: ``backward``, ``clip_grad_norm_``, ``torch.optim.Adam.step``. The warm-up has an
Adam of its own (the RL optimizer starts fresh after it). The rollouter's copy is the same architecture built
afresh and loaded with ``state_dict`` (``rollout_state_dict``) -- not a deep copy, which would carry the trainer
state's guard hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..sampler import BuiltinLM, CausalLM, HFCausalLM
from ..tasks.base import Task
from ..tasks.gpt import GPTConfig, build_gpt
from ..warmup import Stepper, adam_stepper
from . import load_rollout_weights


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state with every DTensor gathered to a plain tensor (an FSDP2 model's shards; no-op otherwise)."""
    out = {}
    for name, value in module.state_dict().items():
        full = getattr(value, "full_tensor", None)
        out[name] = full() if callable(full) else value
    return out


@dataclass(eq=False)
class TorchPolicy:
    """A ``torch.nn.Module`` with ``torch.optim.Adam``; ``make_lm`` wraps a module as a ``CausalLM``.

    ``fresh`` builds an unsharded module of the same architecture on ``device`` (the rollouter's copy).
    """

    family: str
    device: torch.device
    module: nn.Module
    make_lm: Callable[[nn.Module], CausalLM]
    fresh: Callable[[], nn.Module]
    lr: float
    grad_clip: float
    lm: CausalLM = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        self.lm = self.make_lm(self.module)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=self.lr)

    @property
    def model(self) -> nn.Module:
        return self.module

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def step(self, loss: torch.Tensor) -> float:
        loss.backward()
        norm: Any = (
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
            if self.grad_clip > 0
            else torch.tensor(0.0)
        )
        self.optimizer.step()
        full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
        return float(full() if callable(full) else norm)

    def warmup_stepper(self, lr: float) -> Stepper:
        return adam_stepper(self.module.parameters(), lr)

    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.module)

    def rollout_lm(self) -> CausalLM:
        lm = rollout_lm_of(self.fresh(), self.make_lm)
        load_rollout_weights(lm, self.rollout_state_dict())
        return lm


def rollout_lm_of(module: nn.Module, make_lm: Callable[[nn.Module], CausalLM]) -> CausalLM:
    """``module`` as the rollouter's private copy (its own CUDA stream, see ``KVRollouter``)."""
    lm = make_lm(module)
    lm.own_stream = True  # type: ignore[attr-defined]
    return lm


def _fresh(
    cfg: TrainConfig, task: Task, device: torch.device
) -> tuple[Callable[[], nn.Module], Callable[[nn.Module], CausalLM]]:
    """How ``builtin`` (the seeded built-in GPT) or ``hf`` (``load_hf``) is built on ``device``, and its ``CausalLM``."""
    from ..build import load_hf

    m = cfg.model
    if m.family == "builtin":
        gpt = GPTConfig(
            vocab=task.vocab_size,
            width=m.width,
            layers=m.layers,
            heads=m.heads,
            max_len=task.max_prompt_len + cfg.rollout.max_new_tokens,
            positions=m.positions,
        )

        def fresh() -> nn.Module:
            return build_gpt(gpt, seed=cfg.run.seed).to(device)

        return fresh, BuiltinLM  # type: ignore[return-value]

    def fresh_hf() -> nn.Module:
        return load_hf(
            m.hf_path, task.vocab_size, seed=cfg.run.seed, positions=task.max_prompt_len + cfg.rollout.max_new_tokens
        ).to(device)

    return fresh_hf, HFCausalLM  # type: ignore[return-value]


def build(cfg: TrainConfig, task: Task, device: torch.device) -> TorchPolicy:
    """``builtin`` (the seeded built-in GPT) or ``hf`` (``load_hf``), moved to ``device``."""
    fresh, make_lm = _fresh(cfg, task, device)
    return TorchPolicy(
        family=cfg.model.family,
        device=device,
        module=fresh(),
        make_lm=make_lm,
        fresh=fresh,
        lr=cfg.trainer.lr,
        grad_clip=cfg.trainer.grad_clip,
    )


def build_rollout(cfg: TrainConfig, task: Task, device: torch.device) -> CausalLM:
    """The rollouter's copy alone (``policies.build_rollout_lm``): the same module, no optimizer."""
    fresh, make_lm = _fresh(cfg, task, device)
    return rollout_lm_of(fresh(), make_lm)
