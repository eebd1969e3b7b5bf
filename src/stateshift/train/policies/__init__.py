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
snapshot into it by name (``KVRollouter.update_weights``). Where the copy is
built in another process (a Ray rollouter actor), the two halves are apart:
``policy.rollout_state_dict()`` gives the weights the copy needs, by the
copy's names, and ``build_rollout_lm(cfg, task)`` builds the bare copy from
the config alone -- no trainer model, optimizer or process group.

Families (``model.family``): ``builtin`` and ``hf`` (``plain.py``), ``fsdp2``
(``fsdp2.py``), ``megatron`` (``megatron.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ...errors import ConfigError
from ..config import TrainConfig
from ..rollout import check_weight, missing_weights
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

    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights as the rollouter's copy names them (its ``module.state_dict()`` tensors, each once;
        sharded ones gathered), without building a copy. The tensors may share the live params' storage: copy
        them (``ray.put`` does) before the next update. Call while resident."""
        ...


#: ``model.family`` -> module with ``build(cfg, task, device) -> Policy``
FAMILIES: dict[str, str] = {
    "builtin": "stateshift.train.policies.plain",
    "hf": "stateshift.train.policies.plain",
    "fsdp2": "stateshift.train.policies.fsdp2",
    "megatron": "stateshift.train.policies.megatron",
}


def _family(cfg: TrainConfig) -> tuple[Any, torch.device]:
    """The module of ``cfg.model.family`` and the device ``cfg.run.device`` names (checked to exist)."""
    device = torch.device(cfg.run.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config", "is 'cuda' but torch sees no CUDA device here", key="run.device")
    return importlib.import_module(FAMILIES[cfg.model.family]), device


def build_policy(cfg: TrainConfig, task: Task) -> Policy:
    """The policy ``cfg.model`` describes, on ``cfg.run.device``, seeded by ``cfg.run.seed``."""
    module, device = _family(cfg)
    return module.build(cfg, task, device)


def build_rollout_lm(cfg: TrainConfig, task: Task) -> CausalLM:
    """The rollouter's own copy as ``cfg.model`` describes it, on ``cfg.run.device``, built from the config alone
    (initial weights from ``run.seed``; load the trainer's with ``KVRollouter.update_weights`` or
    ``load_rollout_weights``): what a rollouter in another process builds, instead of a whole policy."""
    module, device = _family(cfg)
    return module.build_rollout(cfg, task, device)


def load_rollout_weights(lm: CausalLM, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (``Policy.rollout_state_dict()``) into the rollouter's copy ``lm`` by name; every tensor of
    ``lm.module.state_dict()`` must be given exactly once (``ConfigError("weight_sync")`` names the first that is not)."""
    targets = {n: t for n, t in lm.module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    extra = [n for n in weights if n not in targets]
    if extra:
        check_weight(extra[0], None, weights[extra[0]])
    missing = [n for n in targets if n not in weights]
    if missing:
        raise missing_weights(missing)
    with torch.no_grad():
        for name, target in targets.items():
            check_weight(name, target, weights[name]).copy_(weights[name])


__all__ = ["FAMILIES", "Policy", "build_policy", "build_rollout_lm", "load_rollout_weights"]
