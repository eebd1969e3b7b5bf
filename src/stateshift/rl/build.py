"""Building a run's parts from its config: the task, the policy (``policies/``: built-in, Hugging Face,
Megatron-core, FSDP2), the rollouter's copy."""

from __future__ import annotations

from pathlib import Path

from .config import ConfigError, TrainConfig
from .policies import Policy, build_policy
from .sampler import CausalLM
from .tasks.addition import AdditionTask
from .tasks.base import Task
from .tasks.longtail import LongTailTask

__all__ = ["TASKS", "build_policy", "build_task", "load_hf", "rollout_copy"]


def _addition(cfg: TrainConfig) -> Task:
    t = cfg.task
    return AdditionTask(digit_credit=t.digit_credit, heldout_size=t.heldout_size, stop_credit=t.stop_credit)


def _longtail(cfg: TrainConfig) -> Task:
    t = cfg.task
    return LongTailTask(min_terms=t.min_terms, max_terms=t.max_terms, warmup_max_terms=t.warmup_max_terms,
                        partial_credit=t.partial_credit, stop_credit=t.stop_credit, heldout_size=t.heldout_size)


#: ``task.name`` -> how the task is built from the config
TASKS = {"addition": _addition, "longtail": _longtail}


def build_task(cfg: TrainConfig) -> Task:
    """The task ``cfg.task.name`` names (``TASKS``)."""
    return TASKS[cfg.task.name](cfg)


def load_hf(path: str, vocab_size: int, *, seed: int):  # noqa: ANN201 - a transformers PreTrainedModel
    """``AutoModelForCausalLM`` from a local directory: its weights if it has any, else initialised from config.json.

    Nothing is downloaded (``local_files_only``). The model's vocabulary must
    hold the task's tokens.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ConfigError("model.hf_path", f"{path!r} has no config.json")
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    if getattr(config, "vocab_size", vocab_size) < vocab_size:
        raise ConfigError("model.hf_path", f"vocab_size {config.vocab_size} < the task's {vocab_size} tokens")
    has_weights = any(root.glob("*.safetensors")) or any(root.glob("*.bin"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if has_weights:
            model = AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()  # no dropout: trainer and rollouter compute the same distribution


def rollout_copy(cfg: TrainConfig, task: Task, policy: Policy) -> CausalLM:
    """The rollouter's own model: built afresh (no hooks of the trainer's ``ModelState``), with ``policy``'s weights,
    on the same device (``Policy.rollout_lm``).

    Call while the policy's params are resident. From here on it changes only by syncs.
    """
    return policy.rollout_lm()
