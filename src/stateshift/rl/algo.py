"""The losses: GRPO advantages, behaviour weights, the clipped PPO loss with dual clip, token-mean.

Notation (``docs/guide/rl.md``): ``l_b`` behaviour (the rollout's), ``l_p``
proximal (pi_old, or ``l_b`` in bypass mode), ``l_t`` current. Ratio
``r = exp(l_t - l_p)``; behaviour weight ``w = exp(l_p - l_b)`` (no gradient),
truncated at ``cap`` or masked outside ``[lo, hi]``, per token
(``token``), or per sequence: the product over its tokens
(``sequence_product``, verl's ``sequence``) or their geometric mean
(``sequence_geomean``, verl's ``geometric``). Every function takes a
``mask`` (batch, tokens) of the response tokens that count and returns
plain tensors; statistics are computed without gradient.

Log-ratios are masked before ``exp`` and clamped to ``+-LOG_RATIO_CLAMP``
(verl clamps at 20): a padded position or an overflowing ratio never makes
``inf * 0 = NaN``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

WeightKind = Literal["truncate", "mask"]
WeightLevel = Literal["token", "sequence_product", "sequence_geomean"]

#: log-ratios are clamped to +-this before ``exp`` (verl's ``compute_policy_loss`` clamps at 20)
LOG_RATIO_CLAMP = 20.0


def safe_log_ratio(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``a - b`` on ``mask``, 0 elsewhere, clamped to ``+-LOG_RATIO_CLAMP``: its ``exp`` is finite everywhere,
    and positions outside ``mask`` get no gradient (``torch.where``, not a multiplication by 0)."""
    return torch.where(mask, a - b, torch.zeros_like(a)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


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

    ``level``: ``"token"`` one weight per token; ``"sequence_product"`` each sequence's product
    ``exp(sum(l_p - l_b))`` for all its tokens (verl's ``sequence``); ``"sequence_geomean"`` its geometric
    mean ``exp(mean(l_p - l_b))`` (verl's ``geometric``). Log-weights are masked and clamped before ``exp``
    (``safe_log_ratio``). ``ess`` is the effective sample size ``(sum w)^2 / (N sum w^2)`` of the raw
    weights (1 when on-policy).

    Raises:
        ValueError: an unknown ``level``.
    """
    with torch.no_grad():
        log_w = safe_log_ratio(l_p, l_b, mask)
        if level == "sequence_product":
            log_w = log_w.sum(1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(log_w)
        elif level == "sequence_geomean":
            log_w = (log_w.sum(1) / mask.sum(1).clamp(min=1))[:, None].expand_as(log_w)
        elif level != "token":
            raise ValueError(f"weight level {level!r}: one of token, sequence_product, sequence_geomean")
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
            weight=weight,
            mask=new_mask,
            raw_mean=float(vals.mean()) if vals.numel() else 1.0,
            raw_max=float(vals.max()) if vals.numel() else 1.0,
            adjusted_fraction=float(adjusted.sum()) / n,
            ess=ess,
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

    ``advantages`` is per sequence (batch,) or per token (batch, tokens). The log-ratio is masked, then
    clamped to ``+-LOG_RATIO_CLAMP`` before ``exp`` (verl's ``compute_policy_loss``); ``weight`` must be
    finite (``behaviour_weights`` gives finite ones). The loss is verl's ``vanilla`` policy loss with
    ``loss_agg_mode="token-mean"`` times ``weight`` (``tests/rl/test_rl_loss.py`` pins it to verl's formulas).
    """
    adv = advantages[:, None].expand_as(l_t) if advantages.dim() == 1 else advantages
    ratio = torch.exp(safe_log_ratio(l_t, l_p, mask))
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
            kl_current_proximal=float(masked_mean(-safe_log_ratio(l_t, l_p, mask), mask)),
            ratio_mean=float(masked_mean(ratio, mask)),
        )
    return loss, stats


def kl_k3(l_t: torch.Tensor, l_ref: torch.Tensor) -> torch.Tensor:
    """Per-token KL(current || reference) estimate ``exp(l_ref - l_t) - (l_ref - l_t) - 1`` (>= 0, unbiased)."""
    d = l_ref - l_t
    return d.exp() - d - 1.0


def loglinear_proximal(
    l_b: torch.Tensor, l_t: torch.Tensor, behaviour_step: torch.Tensor, step: int, mask: torch.Tensor
) -> torch.Tensor:
    """AReaL's ``prox_logp_method=loglinear``: ``l_p ~ l_b + a (l_t - l_b)`` without a forward of its own.

    ``a = (v_prox - v_b) / (v_theta - v_b)`` per token, in trainer steps: ``v_prox = step`` (the weights at the
    start of this trainer step), ``v_theta = step + 1`` (the policy this step optimises), ``v_b =
    behaviour_step`` (the step whose weights drew the token, <= ``step``). A token drawn by the proximal
    weights themselves gets ``a = 0`` (``l_p = l_b``, exact); an older one leans toward ``l_t``. ``l_t`` is
    detached. Positions outside ``mask`` get ``l_b``.

    Returns:
        ``l_p`` (batch, tokens), without gradient.
    """
    with torch.no_grad():
        v_b = behaviour_step.to(l_t.dtype).clamp(max=step)
        alpha = (step - v_b) / (step + 1 - v_b)
        return torch.where(mask, l_b + alpha * (l_t.detach() - l_b), l_b)


def lr_at(update: int, *, base: float, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """The learning rate of optimizer update ``update`` (0-based): linear warm-up over ``warmup`` updates from
    ``base / warmup`` to ``base``, then ``schedule`` (``constant``; ``cosine`` or ``linear`` decay to
    ``min_ratio * base`` at update ``total``, flat after it).

    Raises:
        ValueError: an unknown ``schedule``.
    """
    import math

    if update < warmup:
        return base * (update + 1) / warmup
    if schedule == "constant":
        return base
    span = max(total - warmup, 1)
    frac = min(max(update - warmup, 0) / span, 1.0)
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * frac))
    elif schedule == "linear":
        shape = 1.0 - frac
    else:
        raise ValueError(f"lr schedule {schedule!r}: one of constant, cosine, linear")
    return base * (min_ratio + (1.0 - min_ratio) * shape)
