"""The trained policy behind one small interface (``Policy``): how the model is built, how a step runs, how
log-probs are read.

The trainer (``trainer.py``), the warm-up and the rollouter see only this
interface, so there is one code path for every model family; each family
differs in three things and nothing else:

- **building**: the model and optimizer that ``ModelState(policy.model,
  policy.optimizer)`` wraps (stateshift's backends detect the family: a
  plain module, Megatron DDP + distributed optimizer, an FSDP2 module);
- **a step**: ``zero_grad`` and ``step(loss)`` (backward, gradient sync,
  clipping, optimizer step) in the family's own sequence;
- **log-probs**: ``policy.lm``, a ``CausalLM`` whose logits the shared
  ``sequence_logprobs`` turns into per-token log-probs.

``rollout_lm()`` builds the rollouter's own copy on the same device (a
plain model of the same architecture, loaded with the current weights);
from then on it changes only by weight syncs, which copy the trainer's host
snapshot into it by name (``KVRollouter.update_weights``).

Families (``model.family``): ``builtin`` and ``hf`` (``plain.py``), ``fsdp2``
(``fsdp2.py``), ``megatron`` (``megatron.py``).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

import torch

from ..config import ConfigError, TrainConfig
from ..sampler import CausalLM
from ..tasks.base import Task
from ..warmup import Stepper


@runtime_checkable
class Policy(Protocol):
    """The trainer's model as the trainer, the warm-up and the rollouter use it."""

    #: ``model.family``
    family: str
    #: where it computes (``run.device``)
    device: torch.device
    #: its forward (logits), for log-probs, the warm-up and evaluation
    lm: CausalLM
    #: what ``ModelState`` wraps: the module (or Megatron DDP chunk) and its optimizer
    model: Any
    optimizer: Any

    def zero_grad(self) -> None:
        """Zero the gradients before a backward."""
        ...

    def step(self, loss: torch.Tensor) -> float:
        """Backward ``loss``, synchronise and clip the gradients (``trainer.grad_clip``), step; the gradient norm."""
        ...

    def warmup_stepper(self, lr: float) -> Stepper:
        """The supervised warm-up's optimizer step at learning rate ``lr``."""
        ...

    def rollout_lm(self) -> CausalLM:
        """A fresh copy for the rollouter, on the same device, with the current weights (call while resident)."""
        ...


#: ``model.family`` -> module with ``build(cfg, task, device) -> Policy``
FAMILIES: dict[str, str] = {
    "builtin": "stateshift.rl.policies.plain",
    "hf": "stateshift.rl.policies.plain",
    "fsdp2": "stateshift.rl.policies.fsdp2",
    "megatron": "stateshift.rl.policies.megatron",
}


def build_policy(cfg: TrainConfig, task: Task) -> Policy:
    """The policy ``cfg.model`` describes, on ``cfg.run.device``, seeded by ``cfg.run.seed``."""
    device = torch.device(cfg.run.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device", "is 'cuda' but torch sees no CUDA device here")
    module = importlib.import_module(FAMILIES[cfg.model.family])
    return module.build(cfg, task, device)


__all__ = ["FAMILIES", "Policy", "build_policy"]
