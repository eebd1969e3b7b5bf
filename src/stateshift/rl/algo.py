"""The losses: GRPO advantages, behaviour weights, the clipped PPO loss with dual clip, token-mean.

Notation (``docs/rl.md``): ``l_b`` behaviour (the rollout's), ``l_p``
proximal (pi_old, or ``l_b`` in bypass mode), ``l_t`` current. Ratio
``r = exp(l_t - l_p)``; behaviour weight ``w = exp(l_p - l_b)`` (no gradient),
truncated at ``cap`` or masked outside ``[lo, hi]``, per token or per
sequence (geometric mean over the sequence's tokens). Every function takes a
``mask`` (batch, tokens) of the response tokens that count and returns
plain tensors; statistics are computed without gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

WeightKind = Literal["truncate", "mask"]
WeightLevel = Literal["token", "sequence"]


def grpo_advantages(rewards: torch.Tensor, *, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` (groups, n): reward minus its group's mean (over its std)."""
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if norm_std:
        adv = adv / (rewards.std(dim=1, keepdim=True) + eps)
    return adv


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


@dataclass(frozen=True, slots=True)
class BehaviourWeights:
    """``w`` (batch, tokens) and the mask after IcePop-style masking; statistics for the metrics."""

    weight: torch.Tensor
    mask: torch.Tensor
    raw_mean: float
    raw_max: float
    adjusted_fraction: float
    ess: float


def behaviour_weights(
    l_p: torch.Tensor,
    l_b: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: WeightKind = "truncate",
    level: WeightLevel = "token",
    cap: float = 2.0,
    lo: float = 0.5,
    hi: float = 2.0,
) -> BehaviourWeights:
    """``w = exp(l_p - l_b)``: truncated (``min(w, cap)``) or tokens outside ``[lo, hi]`` masked.

    ``level="sequence"`` uses each sequence's geometric mean ``exp(mean(l_p - l_b))``
    for all its tokens. ``ess`` is the effective sample size ``(sum w)^2 / (N sum w^2)``
    of the raw weights (1 when on-policy).
    """
    with torch.no_grad():
        log_w = (l_p - l_b).masked_fill(~mask, 0.0)
        if level == "sequence":
            per_seq = log_w.sum(1) / mask.sum(1).clamp(min=1)
            log_w = per_seq[:, None].expand_as(log_w)
        raw = log_w.exp()
        if kind == "truncate":
            weight = raw.clamp(max=cap)
            adjusted = (raw > cap) & mask
            new_mask = mask
        else:
            outside = (raw < lo) | (raw > hi)
            weight = torch.ones_like(raw)
            adjusted = outside & mask
            new_mask = mask & ~outside
        vals = raw[mask]
        n = max(int(mask.sum()), 1)
        ess = float(vals.sum() ** 2 / (n * (vals**2).sum())) if vals.numel() else 1.0
        return BehaviourWeights(
            weight=weight, mask=new_mask,
            raw_mean=float(vals.mean()) if vals.numel() else 1.0, raw_max=float(vals.max()) if vals.numel() else 1.0,
            adjusted_fraction=float(adjusted.sum()) / n, ess=ess,
        )


@dataclass(frozen=True, slots=True)
class LossStats:
    clip_fraction: float
    dual_clip_fraction: float
    kl_current_proximal: float
    ratio_mean: float


def ppo_loss(
    l_t: torch.Tensor,
    l_p: torch.Tensor,
    advantages: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[torch.Tensor, LossStats]:
    """Token-mean of ``w * max(-A r, -A clip(r, 1-clip_low, 1+clip_high))``, dual-clipped at ``clip_c |A|`` for ``A < 0``.

    ``advantages`` is per sequence (batch,) or per token (batch, tokens).
    """
    adv = advantages[:, None].expand_as(l_t) if advantages.dim() == 1 else advantages
    ratio = torch.exp(l_t - l_p)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(clipped, clip_c * adv.abs())
    per_token = torch.where(adv < 0, dual, clipped)
    loss = masked_mean(weight * per_token, mask)
    with torch.no_grad():
        stats = LossStats(
            clip_fraction=float(masked_mean((loss2 > loss1).float(), mask)),
            dual_clip_fraction=float(masked_mean(((adv < 0) & (clipped > clip_c * adv.abs())).float(), mask)),
            kl_current_proximal=float(masked_mean(l_p - l_t, mask)),
            ratio_mean=float(masked_mean(ratio, mask)),
        )
    return loss, stats


def kl_k3(l_t: torch.Tensor, l_ref: torch.Tensor) -> torch.Tensor:
    """Per-token KL(current || reference) estimate ``exp(l_ref - l_t) - (l_ref - l_t) - 1`` (>= 0, unbiased)."""
    d = l_ref - l_t
    return d.exp() - d - 1.0
