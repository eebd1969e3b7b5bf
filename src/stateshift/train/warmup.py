"""Before RL: supervised warm-up on easy problems, and the held-out accuracy that measures progress."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .config import WarmupConfig
from .rollout import KVRollouter, Wave
from .sampler import CausalLM, Sampling, left_pad, lm_device, positions_of
from .tasks.base import Task

#: one warm-up optimizer step on a loss: zero the grads, backward, step
Stepper = Callable[[torch.Tensor], None]


def adam_stepper(params: Iterable[torch.Tensor], lr: float) -> Stepper:
    """A fresh ``torch.optim.Adam`` of its own over ``params`` (the warm-up of plain torch and FSDP2 models)."""
    opt = torch.optim.Adam(params, lr=lr)

    def step(loss: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers holding the state: Megatron's ``ChainedOptimizer`` -> its ``chained_optimizers``, a
    Megatron ``DistributedOptimizer`` / ``MixedPrecisionOptimizer`` -> its ``optimizer``, a torch one itself."""
    out: list[Any] = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        out.append(inner if isinstance(inner, torch.optim.Optimizer) else opt)
    return out


@torch.no_grad()
def fresh_optimizer_state(optimizer: Any) -> int:
    """Adam as if it had never stepped: every state tensor (moments, step counters) zeroed IN PLACE, every plain
    number step set to 0. Returns how many tensors it zeroed.

    For a family whose warm-up steps the RL optimizer itself (Megatron: its fp32 masters must follow the params),
    so that the warm-up's moments do not leak into RL. In place, so the tensors a ``ModelState`` registered stay
    the registered ones (call it while they are resident: before the trainer first parks). The next step of a
    torch Adam equals a new Adam's first step (``tests/rl/test_rl_loss.py``).
    """
    zeroed = 0
    for opt in _inner_optimizers(optimizer):
        for state in getattr(opt, "state", {}).values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                    zeroed += 1
                elif key == "step" and isinstance(value, (int, float)):
                    state[key] = type(value)(0)
    return zeroed


def supervised_warmup(
    lm: CausalLM,
    task: Task,
    cfg: WarmupConfig,
    *,
    seed: int,
    stepper: Stepper | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, float]:
    """Teacher-forced cross entropy on the answers of ``task.warmup_batch`` problems (easy ones).

    ``stepper`` runs each optimizer step (``Policy.warmup_stepper``); by default a fresh Adam of its own
    (``adam_stepper``). ``progress(steps done, loss)`` is called 20 times over the warm-up (the last at its end;
    each reads the loss, a device sync). Deterministic for a seed on the CPU; returns the last loss and the
    seconds it took.
    """
    if cfg.steps == 0:
        return {"warmup_loss": float("nan"), "warmup_s": 0.0}
    rng = random.Random(seed ^ 0x5EED)
    step = stepper if stepper is not None else adam_stepper(lm.module.parameters(), cfg.lr)
    dev = lm_device(lm)
    t0 = time.perf_counter()
    loss = torch.tensor(float("nan"))
    every = max(1, cfg.steps // 20)
    for k in range(cfg.steps):
        pairs = task.warmup_batch(rng, cfg.batch_size)  # type: ignore[attr-defined]
        prompt_ids, prompt_mask = left_pad([p for p, _ in pairs], task.pad_token)
        width = max(len(a) for _, a in pairs)
        answers = torch.full((len(pairs), width), -100, dtype=torch.long)
        for i, (_, a) in enumerate(pairs):
            answers[i, : len(a)] = torch.tensor(a)
        ids = torch.cat([prompt_ids, answers.clamp(min=0)], dim=1).to(dev)
        mask = torch.cat([prompt_mask, answers >= 0], dim=1).to(dev)
        answers = answers.to(dev)
        logits = lm(ids, positions_of(mask), mask, None)[:, prompt_ids.shape[1] - 1 : -1]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            answers.reshape(-1),
            ignore_index=-100,
            label_smoothing=cfg.label_smoothing,
        )
        step(loss)
        if progress is not None and ((k + 1) % every == 0 or k + 1 == cfg.steps):
            progress(k + 1, float(loss.detach()))
    return {"warmup_loss": float(loss.detach()), "warmup_s": time.perf_counter() - t0}


@torch.no_grad()
def heldout_accuracy(
    lm: CausalLM, task: Task, max_new_tokens: int, *, items: Sequence[Any] | None = None, batch: int = 512
) -> float:
    """Exact-match accuracy of greedy answers to ``task.heldout()`` (problems never trained on), or to ``items``,
    some of them.

    Raises:
        ValueError: ``items`` is empty (an accuracy of nothing)."""
    items = task.heldout() if items is None else list(items)
    if not items:
        raise ValueError("heldout_accuracy needs at least one problem")
    sampling = Sampling(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_token=task.stop_token, pad_token=task.pad_token
    )
    sampler = KVRollouter(lm, sampling, seed=0)
    exact = 0
    for start in range(0, len(items), batch):
        chunk = items[start : start + batch]
        wave = Wave.start(list(range(len(chunk))), chunk, [task.prompt(i) for i in chunk], 1, sampling)
        sampler.generate(wave)
        exact += sum(bool(g.exact[0]) for g in wave.groups(task.score))
    return exact / len(items)
