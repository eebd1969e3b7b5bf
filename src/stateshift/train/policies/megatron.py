"""``model.family=megatron``: a megatron-core 0.16.1 GPTModel trained the Megatron way, on one GPU.

Built as Megatron's own scripts build it at world size 1: local layer spec
(no Transformer-Engine or Apex needed), bf16 params, ``Float16Module``,
``DistributedDataParallel`` with ``use_distributed_optimizer=True`` and
fp32 gradient reduction, ``get_megatron_optimizer`` Adam (no weight decay;
``trainer.grad_clip`` as Megatron's ``clip_grad``). stateshift's Megatron
backend detects the DDP chunk and the optimizer: ``params`` is the flat bf16
``param_data`` buffer, ``grads`` the fp32 ``grad_data``, ``optim`` the fp32
master shards and Adam's moments.

A step is Megatron's sequence: ``zero_grad_buffer`` (+ the optimizer's
``zero_grad``), forward, ``backward``, ``finish_grad_sync``, ``opt.step()``
(which copies the main grads to the fp32 masters, clips, steps and writes
the masters back into the bf16 params). Log-probs come from the model's
logits (``Float16Module`` returns them as fp32 of bf16 values).

The warm-up steps this same optimizer at ``warmup.lr`` (its fp32 masters
must follow the params: a separate torch optimizer would be overwritten by
stale masters at the first RL step), so Adam's moments carry from the
warm-up into RL -- unlike the plain-torch families, whose warm-up has an
Adam of its own.

The rollouter's copy: the same GPTModel in a ``Float16Module``, without
DDP, on the same device, generating with Megatron's own static KV cache
(``StaticKVCache``: megatron-core's ``StaticInferenceContext``), so a
response of ``T`` tokens costs ``T`` one-position forwards after the
prefill, not ``T`` forwards of the whole sequence. Weight syncs copy the host snapshot's per-parameter views by
name; the snapshot also lists the flat buffers that hold them
(``buffers.<j>.param_data``), which the copy skips (``skip_weight``).

On the CPU: only inside a process that patched megatron-core for it
(``benchmarks/megatron_bench.patch_megatron_for_cpu``) and set
``STATESHIFT_MCORE_DEVICE=cpu`` -- tests and development, not training.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..config import TrainConfig
from ..tasks.base import Task
from ..warmup import Stepper
from . import load_rollout_weights
from .fsdp2 import init_world_of_one

#: held by every Megatron forward in this process: megatron-core's CUDA RNG tracker is one global object that
#: each attention forward forks (even at dropout 0: ``DotProductAttention``, ``tensor_parallel.random.fork``),
#: and two threads forking it at once break its current-state bookkeeping ("current state name default-rng
#: is not the same as the desired state name model-parallel-rng", seen on the GPU with the rollout thread
#: generating while the trainer computed). The backward forks nothing (no activation recompute), so it runs
#: outside; kernels launched under the lock still run on the GPU while the other thread holds it.
FORWARD_LOCK = threading.Lock()

#: snapshot names of Megatron's flat buffers: aggregates of the parameters, which are sent on their own too
FLAT_BUFFER = re.compile(r"^(chunk\d+\.)?(expert_parallel_)?buffers\.\d+\.(param_data|grad_data)$")


@dataclass
class StaticKVCache:
    """Megatron's own KV cache for one generation: a ``StaticInferenceContext`` made at the first (prefill) call.

    Per layer it holds key and value memory of (model's max sequence length, batch, heads, head dim), filled
    by the attention layers at ``sequence_len_offset``; ``advance`` moves the offset past the tokens just run.
    """

    context: Any = None

    def context_for(self, batch: int, max_len: int) -> Any:
        if self.context is None:
            from megatron.core.inference.contexts import StaticInferenceContext

            self.context = StaticInferenceContext(batch, max_len)
            self.context.materialize_only_last_token_logits = False  # logits of every new token (``CausalLM``)
        return self.context

    def advance(self, new: int) -> None:
        self.context.sequence_len_offset += new
        self.context.enable_decode_mode()


def attention_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's mask (batch, 1, s, s), True = masked: causal and padding; every query sees itself (no NaN rows)."""
    s = key_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=key_mask.device).tril()
    own = torch.eye(s, dtype=torch.bool, device=key_mask.device)
    return ~((causal & key_mask[:, None, :]) | own)[:, None]


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block (Megatron uses its KV cache only outside training mode)."""
    was = module.training
    if was:
        module.eval()
    try:
        yield
    finally:
        if was:
            module.train()


class MegatronLM:
    """``CausalLM`` over a Megatron GPTModel: ``call`` is what runs it (DDP or ``Float16Module``), ``module`` the
    innermost GPTModel, whose parameter names are the snapshot's.

    With a cache (``new_cache``) a call runs only the new tokens, against the keys and values the earlier
    calls left in Megatron's static KV cache: the prefill costs the prompt, each next token one position.
    The mask of a call is the last ``new`` rows of the full causal-and-padding mask over every key so far.
    """

    skip_weight = staticmethod(lambda name: FLAT_BUFFER.match(name) is not None)

    def __init__(self, call: nn.Module, module: nn.Module, *, own_stream: bool = False) -> None:
        self.call = call
        self.module = module
        self.own_stream = own_stream

    def new_cache(self) -> StaticKVCache:
        return StaticKVCache()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache: Any) -> torch.Tensor:
        if cache is None:
            with FORWARD_LOCK:
                return self.call(ids, positions, attention_mask(key_mask))
        new = ids.shape[1]
        context = cache.context_for(ids.shape[0], int(self.module.max_sequence_length))
        mask = attention_mask(key_mask)[:, :, -new:]
        with FORWARD_LOCK, evaluating(self.call):
            logits = self.call(ids, positions, mask, inference_context=context, runtime_gather_output=True)
        cache.advance(new)
        return logits


def init_megatron(device: torch.device, seed: int) -> None:
    """One rank, tensor and pipeline parallel size 1 (idempotent); Megatron's CUDA RNG tracker seeded."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed.*")
    from megatron.core import parallel_state, tensor_parallel

    init_world_of_one(device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


@dataclass(eq=False)
class MegatronPolicy:
    """A GPTModel in Float16Module + Megatron DDP, with its DistributedOptimizer (see the module docstring)."""

    device: torch.device
    config: Any
    ddp: Any
    optimizer: Any
    lr: float
    make_gpt: Any
    family: str = "megatron"
    lm: MegatronLM = field(init=False)

    def __post_init__(self) -> None:
        self.lm = MegatronLM(self.ddp, self.ddp.module.module)

    @property
    def model(self) -> Any:
        return self.ddp

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _step(self, loss: torch.Tensor, lr: float) -> float:
        loss.backward()
        self.ddp.finish_grad_sync()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, norm, _ = self.optimizer.step()
        return float(norm or 0.0)

    def step(self, loss: torch.Tensor) -> float:
        return self._step(loss, self.lr)

    def warmup_stepper(self, lr: float) -> Stepper:
        def step(loss: torch.Tensor) -> None:
            self.zero_grad()
            self._step(loss, lr)

        return step

    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        """The GPTModel's tensors by name (the bf16 params are views into DDP's flat ``param_data``)."""
        return {n: t for n, t in self.lm.module.state_dict().items() if isinstance(t, torch.Tensor)}

    def rollout_lm(self) -> MegatronLM:
        lm = rollout_lm_of(self.config, self.make_gpt)
        load_rollout_weights(lm, self.rollout_state_dict())
        return lm


def rollout_lm_of(config: Any, make_gpt: Any) -> MegatronLM:
    """A fresh GPTModel in a ``Float16Module`` (no DDP), as the rollouter's private copy."""
    from megatron.core.transformer.module import Float16Module

    wrapper = Float16Module(config, make_gpt())
    return MegatronLM(wrapper, wrapper.module, own_stream=True)


def _check_usable(device: torch.device) -> None:
    if device.type == "cpu" and os.environ.get("STATESHIFT_MCORE_DEVICE") != "cpu":
        raise ConfigError(
            "config",
            "model.family=megatron needs run.device=cuda (megatron-core computes on CUDA; "
            "the CPU works only in a process patched for tests, STATESHIFT_MCORE_DEVICE=cpu)",
            key="run.device",
        )
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "config", f"megatron needs megatron-core: pip install 'stateshift[megatron]' ({exc})", key="model.family"
        ) from None


def _gpt(cfg: TrainConfig, task: Task, device: torch.device) -> tuple[Any, Any]:
    """Megatron's ``TransformerConfig`` of ``cfg.model`` and a seeded GPTModel factory on ``device``."""
    _check_usable(device)
    init_megatron(device, cfg.run.seed)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    config = TransformerConfig(
        num_layers=m.layers,
        hidden_size=m.width,
        num_attention_heads=m.heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu",
    )

    def make_gpt() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.run.seed)
            gpt = GPTModel(
                config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=task.vocab_size,
                max_sequence_length=task.max_prompt_len + cfg.rollout.max_new_tokens,
            )
        return gpt.to(device)

    return config, make_gpt


def build(cfg: TrainConfig, task: Task, device: torch.device) -> MegatronPolicy:
    config, make_gpt = _gpt(cfg, task, device)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        module=Float16Module(config, make_gpt()),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.trainer.lr,
            bf16=True,
            use_distributed_optimizer=True,
            weight_decay=0.0,
            clip_grad=cfg.trainer.grad_clip,
        ),
        [ddp],
    )
    return MegatronPolicy(
        device=device, config=config, ddp=ddp, optimizer=optimizer, lr=cfg.trainer.lr, make_gpt=make_gpt
    )


def build_rollout(cfg: TrainConfig, task: Task, device: torch.device) -> MegatronLM:
    """The rollouter's copy alone (``policies.build_rollout_lm``): no DDP, no optimizer (Megatron's model-parallel
    state is still set up: a GPTModel needs it)."""
    config, make_gpt = _gpt(cfg, task, device)
    return rollout_lm_of(config, make_gpt)
