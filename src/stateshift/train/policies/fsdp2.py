"""``model.family=fsdp2``: a Hugging Face ``Qwen2ForCausalLM`` built from a config (or the causal LM of
``model.hf_path``, its weights as the initial ones), sharded with FSDP2.

World size 1 (``gloo`` on the CPU, ``nccl`` on a GPU; a process group that
already exists is used as it is). ``fully_shard`` on every decoder layer,
then on the root; fp32 params; ``torch.optim.Adam`` over the sharded
(DTensor) parameters. Nothing is downloaded: the config is written here
from ``model.width`` / ``layers`` / ``heads`` and the task's vocabulary.

A step and log-probs are ``TorchPolicy``'s (FSDP2 all-gathers in its hooks
and reduce-scatters the gradients during backward). stateshift's FSDP2
backend holds the local shards; it reshards every FSDP module before each
verb, which is what makes a pi_old swap after a no-grad forward safe: such
a forward leaves the root unsharded, and values written into the shards
would not be what the next forward reads until it is resharded
(docs/notes/fsdp2-notes.md). The rollouter's copy is an unsharded
``Qwen2ForCausalLM`` of the same config; its weights come from the
gathered state dict, and syncs copy the shards of the host snapshot by name
(world size 1: a shard is the whole parameter).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ..config import TrainConfig
from ..sampler import CausalLM, HFCausalLM
from ..tasks.base import Task
from .plain import TorchPolicy, rollout_lm_of


def init_world_of_one(device: torch.device) -> None:
    """A process group of one rank (``nccl`` on CUDA, ``gloo`` on the CPU) unless one exists already."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConfigError(
                "config",
                f"fsdp2 runs at world size 1; this process group has {dist.get_world_size()}",
                key="model.family",
            )
        return
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )


def qwen2_config(cfg: TrainConfig, task: Task):  # -> a transformers Qwen2Config
    from transformers import Qwen2Config

    m = cfg.model
    return Qwen2Config(
        vocab_size=task.vocab_size,
        hidden_size=m.width,
        intermediate_size=4 * m.width,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        num_key_value_heads=m.heads,
        max_position_embeddings=task.max_prompt_len + cfg.rollout.max_new_tokens,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        pad_token_id=task.pad_token,
    )


def _fresh(cfg: TrainConfig, task: Task, device: torch.device) -> Callable[[], nn.Module]:
    """How an unsharded, seeded model is built on ``device``: ``model.hf_path``'s (architecture and weights, via
    ``load_hf``) when set, else a ``Qwen2ForCausalLM`` of ``cfg.model``'s shape."""
    try:
        from transformers import Qwen2ForCausalLM
    except ImportError as exc:
        raise ConfigError("config", f"fsdp2 needs transformers ({exc})", key="model.family") from None
    if cfg.model.hf_path:
        from ..build import load_hf

        def from_dir() -> nn.Module:
            return load_hf(
                cfg.model.hf_path,
                task.vocab_size,
                seed=cfg.run.seed,
                positions=task.max_prompt_len + cfg.rollout.max_new_tokens,
            ).to(device)

        return from_dir
    config = qwen2_config(cfg, task)

    def fresh() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.run.seed)
            model = Qwen2ForCausalLM(config).to(dtype=torch.float32)
        return model.to(device).eval()  # no dropout: trainer and rollouter compute the same distribution

    return fresh


def _layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers to shard one by one (``model.model.layers`` of Llama/Qwen-like models; none found: [])."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) or getattr(getattr(model, "transformer", None), "h", None)
    return list(layers) if layers is not None else []


def build(cfg: TrainConfig, task: Task, device: torch.device) -> TorchPolicy:
    from torch.distributed.fsdp import fully_shard

    fresh = _fresh(cfg, task, device)
    init_world_of_one(device)
    model = fresh()
    for layer in _layers(model):
        fully_shard(layer)
    fully_shard(model)
    return TorchPolicy(
        family="fsdp2",
        device=device,
        module=model,
        make_lm=HFCausalLM,
        fresh=fresh,
        lr=cfg.trainer.lr,
        grad_clip=cfg.trainer.grad_clip,
    )


def build_rollout(cfg: TrainConfig, task: Task, device: torch.device) -> CausalLM:
    """The rollouter's copy alone (``policies.build_rollout_lm``): an unsharded model, no process group."""
    return rollout_lm_of(_fresh(cfg, task, device)(), HFCausalLM)
