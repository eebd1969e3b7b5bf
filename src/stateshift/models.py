"""The built-in default model: a small decoder-only transformer.

Used by ``stateshift bench`` and the tests. Plain PyTorch, deterministic for
a given seed; tied input/output embeddings (one slot, two names), a
persistent buffer updated in forward (a running token count, the same kind of
state as an MoE router's ``expert_bias``) and a non-persistent causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(kw_only=True, slots=True)
class TinyConfig:
    """Shape of the default model."""

    vocab: int = 256
    """vocabulary size"""
    hidden: int = 64
    """model width"""
    layers: int = 2
    """number of transformer blocks"""
    heads: int = 4
    """attention heads (must divide ``hidden``)"""
    seq: int = 32
    """longest sequence (size of the causal mask buffer)"""
    tied: bool = True
    """tie the output projection to the input embedding"""
    dtype: torch.dtype = torch.float32
    """parameter dtype"""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        for name in ("vocab", "hidden", "layers", "heads", "seq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")

    def param_count(self) -> int:
        h, v = self.hidden, self.vocab
        per_layer = 4 * h * h + 4 * h + 8 * h * h + 5 * h + 4 * h
        return v * h + self.layers * per_layer + 2 * h + (0 if self.tied else v * h)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(h, dtype=cfg.dtype)
        self.qkv = nn.Linear(h, 3 * h, dtype=cfg.dtype)
        self.proj = nn.Linear(h, h, dtype=cfg.dtype)
        self.ln2 = nn.LayerNorm(h, dtype=cfg.dtype)
        self.fc1 = nn.Linear(h, 4 * h, dtype=cfg.dtype)
        self.fc2 = nn.Linear(4 * h, h, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (h // self.heads) ** 0.5
        att = att.masked_fill(~mask[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """A decoder-only transformer returning logits of shape (batch, seq, vocab)."""

    def __init__(self, cfg: TinyConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyConfig()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=cfg.dtype)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, dtype=cfg.dtype)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=cfg.dtype)
        if cfg.tied:
            self.head.weight = self.embed.weight
        self.register_buffer("mask", torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).tril(), persistent=False)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.tokens_seen += ids.numel()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln_f(x))


def build_default(cfg: TinyConfig | None = None, *, seed: int = 0, device: str | torch.device = "cpu") -> TinyTransformer:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = TinyTransformer(cfg)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(device)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in float32."""
    logits = model(ids[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batch(cfg: TinyConfig, step: int, *, size: int = 4, device: str | torch.device = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.vocab, (size, cfg.seq), generator=g).to(device)
