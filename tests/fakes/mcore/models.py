"""Fake of megatron-core 0.16.1: a tiny dense model and a tiny MoE model with a top-k router (transformer/moe/). See ``__init__.py``."""

from __future__ import annotations

import torch

from .modules import FakeDistributedDataParallel


class FakeTopKRouter(torch.nn.Module):
    """transformer/moe/router.py:131 ``TopKRouter`` with ``moe_router_enable_expert_bias`` and
    the sigmoid score function."""

    def __init__(self, hidden: int, num_experts: int, topk: int = 2, generator: torch.Generator | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.topk = topk
        #: router.py:52-54 an fp32 Parameter (cast to bf16 by the Float16Module).
        self.weight = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=generator) * 0.1)
        self.enable_expert_bias = True
        #: router.py:164-171 non-persistent fp32 buffer; accumulated in forward (:543), zeroed by
        #: finalize_model_grads (finalize_model_grads.py:285).
        self.register_buffer("local_tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        #: router.py:173-180 persistent fp32 buffer (in state_dict); not a parameter, so in no
        #: DDP buffer and no optimizer; updated in place by finalize_model_grads.py:315.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def _maintain_float32_expert_bias(self):
        """router.py:209-218 after the Float16Module cast, swap ``.data`` back to fp32: the
        buffer object stays, its storage changes (once)."""
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.to(torch.float32)

    def forward(self, x: torch.Tensor):
        """router.py:639-655 -> routing (:545) -> moe_utils.py:608 top-k with expert bias
        (the bias shifts the choice, :718-719, but not the probabilities)."""
        self._maintain_float32_expert_bias()
        logits = torch.nn.functional.linear(x, self.weight).float()
        scores = torch.sigmoid(logits)
        _, top = torch.topk(scores + self.expert_bias, k=self.topk, dim=-1)
        probs = scores.gather(-1, top)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True)
        if torch.is_grad_enabled():  # :539-543
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, top, routing_map


class FakeMoELayer(torch.nn.Module):
    """A SequentialMLP-like MoE layer (router + per-expert linear layers)."""

    def __init__(self, hidden: int, num_experts: int, topk: int = 2, generator=None):
        super().__init__()
        self.router = FakeTopKRouter(hidden, num_experts, topk, generator)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(num_experts)])

    def forward(self, x: torch.Tensor):
        probs, top, _ = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (probs * (top == e)).sum(dim=-1, keepdim=True).to(x.dtype)
            out = out + w * expert(x)
        return out


class FakeMoEModel(torch.nn.Module):
    """Input projection, one MoE layer, a frozen projection (``requires_grad=False``: outside
    every DDP buffer), output projection. Deterministic for a given ``seed``."""

    def __init__(self, hidden: int = 16, num_experts: int = 4, topk: int = 2, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = torch.nn.Linear(hidden, hidden)
            self.moe = FakeMoELayer(hidden, num_experts, topk, g)
            self.frozen = torch.nn.Linear(hidden, hidden)
            self.out = torch.nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.moe(h)
        h = self.frozen(h)
        return self.out(h)


class FakeDenseModel(torch.nn.Module):
    """Two linear layers and a frozen bias-free layer; deterministic for a given ``seed``."""

    def __init__(self, hidden: int = 16, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.l1 = torch.nn.Linear(hidden, hidden)
            self.frozen = torch.nn.Linear(hidden, hidden, bias=False)
            self.l2 = torch.nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.l2(self.frozen(torch.relu(self.l1(x))))


def fake_finalize_model_grads(model: list[FakeDistributedDataParallel], bias_update_rate: float = 1e-3) -> None:
    """distributed/finalize_model_grads.py:396 (what matters here): ``finish_grad_sync`` on
    each chunk, then ``_update_router_expert_bias`` (:293-315, ``expert_bias.copy_(bias +
    sign(mean - tokens) * rate)``), then ``reset_model_temporary_tensors`` (:279-290,
    ``local_tokens_per_expert.zero_()``)."""
    for chunk in model:
        chunk.finish_grad_sync()
    routers = [m for chunk in model for m in chunk.modules() if hasattr(m, "expert_bias") and m.expert_bias is not None]
    if routers:
        with torch.no_grad():
            tokens = torch.stack([r.local_tokens_per_expert for r in routers])
            bias = torch.stack([r.expert_bias for r in routers])
            avg = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1]
            updated = bias + torch.sign(avg - tokens) * bias_update_rate
            for r, u in zip(routers, updated, strict=True):
                r.expert_bias.copy_(u)
    for chunk in model:
        for m in chunk.modules():
            if hasattr(m, "expert_bias") and m.expert_bias is not None:
                m.local_tokens_per_expert.zero_()
