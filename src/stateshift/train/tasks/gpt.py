"""A small GPT with a KV cache: the built-in policy of ``stateshift train``, the model ``stateshift bench``
times and the tests' model (``random_ids`` and ``next_token_loss`` drive it outside the trainer).

About 100K parameters at the default shape (2 layers, width 64, 4 heads,
vocabulary 14). Learned positions, pre-norm blocks, untied output head, no
buffers, so its whole state is the ``params`` group (and its optimizer's).

``forward(ids, positions, key_mask, cache)`` serves both uses:

- training and old log-probs: the whole sequence at once, ``cache=None``;
- sampling: a prefill (``cache=KVCache()``) then one token at a time, each
  call appending its keys and values to the cache.

``key_mask`` (batch, keys) marks real tokens (left padding is masked out);
``positions`` are each token's index among the real tokens of its row, so a
left-padded row computes what an unpadded one would.

A third use, continuous batching (``train/continuous.py``): ``cache=SlotCache``,
a static cache of ``rows`` slots of ``max_len`` positions, in which row
``r``'s token at position ``p`` keeps its keys at index ``p``. A call names
the slots it feeds (``rows``) and each token's position; a query at position
``p`` attends to indices ``0..p`` of its slot. Rows may thus be at different
lengths, and a slot is reused by writing a new prompt from position 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of the built-in GPT: vocabulary, width, blocks, attention heads (dividing the width), longest sequence.

    Users set width, layers and heads through ``model.*`` of the train config;
    vocabulary and length follow from the task.
    """

    vocab: int = 14
    width: int = 64
    layers: int = 2
    heads: int = 4
    max_len: int = 16
    positions: str = "learned"
    """'learned': an embedding per absolute position added to the input; 'rotary': rotary embeddings of each
    position in every attention's queries and keys (attention then sees offsets between tokens only)"""

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "layers", "heads", "max_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, not {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"model.width ({self.width}) must be divisible by model.heads ({self.heads})")
        if self.positions not in ("learned", "rotary"):
            raise ValueError(f"model.positions must be 'learned' or 'rotary', not {self.positions!r}")
        if self.positions == "rotary" and (self.width // self.heads) % 2:
            raise ValueError(f"model.positions=rotary needs an even head width, not {self.width // self.heads}")


#: (cos, sin) of each token's rotary angles, (batch, 1, tokens, head dim / 2); ``None`` with learned positions
Rotary = tuple[torch.Tensor, torch.Tensor] | None


def rotary_angles(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``positions`` (batch, tokens) times the ``head_dim / 2`` rotary frequencies ``base ** (-2i/d)``."""
    freqs = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions[:, None, :, None].float() * freqs
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x`` (batch, heads, tokens, head dim) with each pair (i, i + d/2) of its features turned by its angle."""
    cos, sin = rope
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


@dataclass(slots=True)
class KVCache:
    """Per layer, the keys and values of every position seen so far: (batch, heads, positions, head dim)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


@dataclass(slots=True)
class SlotCache:
    """Static KV cache for continuous batching: per layer (rows, heads, max_len, head dim), index = position."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @staticmethod
    def empty(cfg: GPTConfig, rows: int, device: torch.device, dtype: torch.dtype = torch.float32) -> SlotCache:
        shape = (rows, cfg.heads, cfg.max_len, cfg.width // cfg.heads)
        return SlotCache(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)],
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Write ``k``/``v`` (batch, heads, new, dim) at ``positions`` (batch, new) of slots ``rows`` (``None``: all,
        in order), then attend each query to indices ``0..its position`` of its slot."""
        keys, values = self.keys[layer], self.values[layer]
        slot = torch.arange(keys.shape[0], device=keys.device) if rows is None else rows
        keys[slot[:, None], :, positions] = k.transpose(1, 2)
        values[slot[:, None], :, positions] = v.transpose(1, 2)
        if rows is not None:
            keys, values = keys[rows], values[rows]
        index = torch.arange(keys.shape[2], device=keys.device)
        mask = (index[None, None, :] <= positions[:, :, None])[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc1 = nn.Linear(cfg.width, 4 * cfg.width)
        self.fc2 = nn.Linear(4 * cfg.width, cfg.width)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | SlotCache | None,
        layer: int,
        slots: tuple[torch.Tensor | None, torch.Tensor] | None = None,
        rope: Rotary = None,
    ) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if rope is not None:  # keys are cached turned: a query's dot product with one depends on their offset only
            q, k = rotate(q, rope), rotate(k, rope)
        if isinstance(cache, SlotCache):
            assert slots is not None
            att = cache.attend(layer, q, k, v, *slots)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, w))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        if cache is not None:
            if layer < len(cache.keys):
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
                cache.keys[layer], cache.values[layer] = k, v
            else:
                cache.keys.append(k)
                cache.values.append(v)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Decoder-only transformer; returns logits (batch, new tokens, vocab)."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.max_len, cfg.width) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: KVCache | SlotCache | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``ids`` (batch, new); ``key_mask`` (batch, cached + new) bool; ``positions`` (batch, new).

        With a ``SlotCache``: ``rows`` (batch,) the slots fed (``None``: every slot, in order), ``positions``
        required, ``key_mask`` ignored (a slot's indices up to a query's position are its keys).
        """
        b, t = ids.shape
        if isinstance(cache, SlotCache):
            assert positions is not None, "a SlotCache needs positions"
            if int(positions.max()) >= self.cfg.max_len:
                raise ValueError(f"position {int(positions.max())} is past model.max_len={self.cfg.max_len}")
            x, rope = self._embed(ids, positions)
            for i, block in enumerate(self.blocks):
                x = block(x, None, cache, i, (rows, positions), rope)
            return self.head(self.ln_f(x))
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + t, device=ids.device).expand(b, t)
        if int(positions.max()) >= self.cfg.max_len:
            raise ValueError(f"position {int(positions.max())} is past model.max_len={self.cfg.max_len}")
        causal = torch.ones(t, past + t, dtype=torch.bool, device=ids.device).tril(past)
        mask = causal[None, None]
        if key_mask is not None:  # a query always sees itself, so a padding row attends to something (no NaN)
            own = torch.zeros(t, past + t, dtype=torch.bool, device=ids.device)
            own[:, past:] = torch.eye(t, dtype=torch.bool, device=ids.device)
            mask = (causal & key_mask[:, None, :] | own)[:, None]
        x, rope = self._embed(ids, positions)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, cache, i, rope=rope)
        return self.head(self.ln_f(x))

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rotary]:
        """The blocks' input and rotary angles: token embeddings plus learned position ones, or with rotary angles."""
        if self.pos is not None:
            return self.tok(ids) + self.pos(positions), None
        return self.tok(ids), rotary_angles(positions, self.cfg.width // self.cfg.heads)


def build_gpt(cfg: GPTConfig | None = None, *, seed: int = 0) -> TinyGPT:
    """A freshly initialised model; the same ``seed`` gives the same weights (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyGPT(cfg)


def random_ids(cfg: GPTConfig, step: int, *, size: int = 4, device: str | torch.device = "cpu") -> torch.Tensor:
    """``size`` rows of ``cfg.max_len`` random token ids, the same for the same ``step`` (``stateshift bench``, the tests)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.vocab, (size, cfg.max_len), generator=g).to(device)


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Cross entropy, in float32, of predicting each token of ``ids`` (batch, tokens) from those before it."""
    logits = model(ids[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
