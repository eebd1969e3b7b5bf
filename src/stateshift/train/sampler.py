"""Causal LMs behind one call, a batched KV-cached sampler, and per-token log-probs.

Two model families: the built-in ``TinyGPT`` (``train/tasks/gpt.py``) and Hugging
Face ``transformers`` causal LMs (built from a config or a local directory;
nothing is downloaded). ``CausalLM`` hides the difference: one call
``lm(ids, positions, key_mask, cache)`` returns logits for the new tokens and
appends their keys and values to ``cache`` (or runs without a cache).

Sequences are laid out as *left-padded prompt, then response*: row ``i`` of
a batch is ``[pad .. pad, prompt_i, response_i]``; ``key_mask`` marks real
tokens and ``positions`` count real tokens, so padding changes nothing.

Log-probs are of the temperature-scaled distribution ``softmax(logits / T)``,
the same on both sides: the sampler records them as the behaviour log-prob
``l_b``, the trainer recomputes ``l_p``/``l_t`` with ``sequence_logprobs``.
Under top-p the recorded ``l_b`` is the log-prob of the distribution the
token was really drawn from: the truncated one, renormalised over the nucleus
(``log p - log sum(nucleus p)``). The trainer's ``l_p``/``l_t`` are of the
untruncated policy it optimises, so the behaviour weight ``exp(l_p - l_b)``
corrects for the truncation (with the untruncated ``l_b``, what vLLM reports
by default, the weight would aim at a policy that drew nothing).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from .tasks.gpt import KVCache, TinyGPT


@runtime_checkable
class CausalLM(Protocol):
    """A causal LM as the sampler and trainer call it."""

    #: the ``nn.Module`` whose parameters are trained and synced
    module: nn.Module

    def new_cache(self) -> Any:
        """An empty KV cache for a prefill."""
        ...

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits (batch, new, vocab) of ``ids`` (batch, new); ``key_mask`` covers cached and new keys."""
        ...


def lm_device(lm: CausalLM) -> torch.device:
    """The device ``lm`` computes on: its first parameter's (a DTensor's device for an FSDP2 model)."""
    for p in lm.module.parameters():
        return p.device
    return torch.device("cpu")


class BuiltinLM:
    """``CausalLM`` over the built-in ``TinyGPT``."""

    def __init__(self, module: TinyGPT) -> None:
        self.module = module

    def new_cache(self) -> KVCache:
        return KVCache()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.module(ids, positions=positions, key_mask=key_mask, cache=cache)


class HFCausalLM:
    """``CausalLM`` over a Hugging Face ``transformers`` causal LM (``AutoModelForCausalLM``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # transformers >= 5.2x calls the KV cache argument ``cache`` (``past_key_values`` is deprecated)
        params = inspect.signature(module.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.module(
            input_ids=ids,
            attention_mask=key_mask.long(),
            position_ids=positions,
            use_cache=cache is not None,
            **{self._cache_arg: cache},
        )
        return out.logits


@dataclass(frozen=True, slots=True)
class Sampling:
    """How tokens are drawn (the ``rollout`` config's sampling fields)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 5
    stop_token: int | None = None
    pad_token: int = 0


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape (batch, longest prompt), prompts aligned to the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = True
    return ids, mask


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Each token's index among the real tokens of its row (0 for padding before the first)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def behaviour_logp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probs (batch, vocab) of the distribution tokens are drawn from: ``softmax(logits / T)``, under
    ``top_p < 1`` truncated to the nucleus (the smallest set of most likely tokens holding ``top_p``; the most
    likely token is always in it) and renormalised; ``-inf`` outside the nucleus."""
    logp = F.log_softmax(logits.float() / sampling.temperature, -1)
    if sampling.top_p >= 1.0:
        return logp
    sorted_lp, order = logp.sort(-1, descending=True)
    sorted_p = sorted_lp.exp()
    outside_sorted = sorted_p.cumsum(-1) - sorted_p >= sampling.top_p  # the first token is always kept
    outside = torch.zeros_like(outside_sorted).scatter_(-1, order, outside_sorted)
    kept = logp.masked_fill(outside, float("-inf"))
    return kept - torch.logsumexp(kept, -1, keepdim=True)


def draw(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, behaviour log-probs) for the last-position ``logits`` (batch, vocab); temperature 0 is greedy.

    The log-prob is that of the distribution the token was drawn from (``behaviour_logp``: truncated and
    renormalised under ``top_p``)."""
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    logp = behaviour_logp(logits, sampling)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def sequence_logprobs(
    lm: CausalLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (batch, response length) of ``tokens`` after the prompts, in one forward.

    Response positions after a row's stop token are computed too (callers
    mask them). ``with_entropy`` also returns each position's entropy.
    """
    ids = torch.cat([prompt_ids, tokens], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(tokens, dtype=torch.bool)], dim=1)  # tokens' device
    logits = lm(ids, positions_of(mask), mask, None)
    width = prompt_ids.shape[1]
    pred = logits[:, width - 1 : -1].float()
    if temperature > 0:
        pred = pred / temperature
    logp_all = F.log_softmax(pred, -1)
    logp = logp_all.gather(-1, tokens[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy
