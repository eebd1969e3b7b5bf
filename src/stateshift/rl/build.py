"""Building a run's parts from its config: the task, the policy (built-in or Hugging Face), the rollouter's copy."""

from __future__ import annotations

from pathlib import Path

from .config import TrainConfig
from .config import ConfigError
from .sampler import BuiltinLM, CausalLM, HFCausalLM
from .tasks.addition import AdditionTask, PROMPT_LEN
from .tasks.base import Task
from .tasks.gpt import GPTConfig, build_gpt


def build_task(cfg: TrainConfig) -> Task:
    return AdditionTask(digit_credit=cfg.task.digit_credit, heldout_size=cfg.task.heldout_size)


def build_policy(cfg: TrainConfig, task: Task) -> CausalLM:
    """The trainer's policy: the built-in GPT (seeded), or a ``transformers`` causal LM from a local directory."""
    m = cfg.model
    if m.family == "builtin":
        gpt = GPTConfig(vocab=task.vocab_size, width=m.width, layers=m.layers, heads=m.heads,
                        max_len=PROMPT_LEN + cfg.rollout.max_new_tokens)
        return BuiltinLM(build_gpt(gpt, seed=cfg.run.seed))
    return HFCausalLM(load_hf(m.hf_path, task.vocab_size, seed=cfg.run.seed))


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


def rollout_copy(cfg: TrainConfig, task: Task, lm: CausalLM) -> CausalLM:
    """The rollouter's own model: built afresh (no hooks of the trainer's ``ModelState``), with ``lm``'s weights.

    Call while ``lm``'s params are resident. From here on it changes only by syncs.
    """
    fresh = build_policy(cfg, task)
    fresh.module.load_state_dict(lm.module.state_dict())
    return fresh
