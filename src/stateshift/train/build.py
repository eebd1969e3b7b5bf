"""Building a run's parts from its config: the task, the policy (``policies/``: built-in, Hugging Face,
Megatron-core, FSDP2), the rollouter's copy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from .config import TrainConfig
from .hf_dir import load_tokenizer, refuse_own_code, weight_files
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
    return LongTailTask(
        min_terms=t.min_terms,
        max_terms=t.max_terms,
        warmup_max_terms=t.warmup_max_terms,
        partial_credit=t.partial_credit,
        stop_credit=t.stop_credit,
        heldout_size=t.heldout_size,
    )


def _file(cfg: TrainConfig) -> Task:
    """``task.name=file``: the tokenizer of ``task.tokenizer_path`` (or ``model.hf_path``), the files, ``reward.fn``."""
    from .reward import Reward
    from .tasks.files import FileSpec, FileTask

    t, r = cfg.task, cfg.reward
    tokenizer = load_tokenizer(t.tokenizer_path or cfg.model.hf_path)
    spec = FileSpec(
        prompt_key=t.prompt_key,
        messages_key=t.messages_key,
        answer_key=t.answer_key,
        max_prompt_len=t.max_prompt_len,
        chat_template=t.chat_template,
    )
    reward = Reward(r.fn, on_error=r.on_error, correct_at=r.correct_at)
    return FileTask(
        t.train_path,
        t.heldout_path,
        tokenizer,
        reward,
        spec=spec,
        seed=cfg.run.seed,
        shuffle=t.shuffle,
        heldout_size=t.heldout_size,
    )


#: ``task.name`` -> how the task is built from the config (every name of ``TaskConfig.name``'s ``Literal``)
TASKS: dict[str, Callable[[TrainConfig], Task]] = {"addition": _addition, "longtail": _longtail, "file": _file}


def build_task(cfg: TrainConfig) -> Task:
    """The task ``cfg.task.name`` names (``TASKS``); for ``file``, errors name the file, line or key at fault."""
    return TASKS[cfg.task.name](cfg)


def load_hf(path: str, vocab_size: int, *, seed: int, positions: int = 0):  # -> a PreTrainedModel
    """``AutoModelForCausalLM`` from a local directory: its weights if it has any, else initialised from config.json.

    Nothing is downloaded (``local_files_only``). Weights: ``model.safetensors``, or the shards of
    ``model.safetensors.index.json`` (each checked to exist first), or ``pytorch_model.bin``. The model's
    vocabulary must hold the task's tokens and, if its config says, ``positions`` positions (prompt + response).

    Raises:
        ConfigError("model_dir"): ``config.json`` or a listed shard is missing, the directory asks for code of its own
            (never run), or transformers cannot load it (named: a pickle, a model too large to allocate, ...).
        ConfigError: ``model.hf_path``: the vocabulary or the positions are too small.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(path)
    files = weight_files(root)
    refuse_own_code(root, "config.json")

    def cannot(exc: Exception, name: str) -> ConfigError:
        return ConfigError("model_dir", f"transformers cannot load it: {str(exc)[:300]}", path=root, name=name)

    try:
        config = AutoConfig.from_pretrained(root, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # (whatever a broken config.json makes transformers raise)
        raise cannot(exc, "config.json") from exc
    if getattr(config, "vocab_size", vocab_size) < vocab_size:
        raise ConfigError(
            "config", f"vocab_size {config.vocab_size} < the task's {vocab_size} tokens", key="model.hf_path"
        )
    if getattr(config, "max_position_embeddings", positions) < positions:
        raise ConfigError(
            "config",
            f"max_position_embeddings {config.max_position_embeddings} < "
            f"{positions} (task.max_prompt_len + rollout.max_new_tokens)",
            key="model.hf_path",
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            if files:
                model = AutoModelForCausalLM.from_pretrained(
                    root, local_files_only=True, dtype=torch.float32, trust_remote_code=False
                )
            else:
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        except Exception as exc:  # (a pickle refused, a size past memory, a bad file: named, never a traceback)
            raise cannot(exc, files[0].name if files else "config.json") from exc
    return model.eval()  # no dropout: trainer and rollouter compute the same distribution


def rollout_copy(cfg: TrainConfig, task: Task, policy: Policy) -> CausalLM:
    """The rollouter's own model: built afresh (no hooks of the trainer's ``ModelState``), with ``policy``'s weights,
    on the same device (``Policy.rollout_lm``).

    Call while the policy's params are resident. From here on it changes only by syncs.
    """
    return policy.rollout_lm()
