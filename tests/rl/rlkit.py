"""Helpers of the RL tests: tiny configs that run in a second or two, and a synchronous GRPO reference."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from stateshift.rl import algo
from stateshift.train.build import build_policy, build_task
from stateshift.train.config import TrainConfig, resolve
from stateshift.train.rollout import KVRollouter, Wave
from stateshift.train.sampler import Sampling, sequence_logprobs
from stateshift.train.trainer import Batch, Trainer
from stateshift.train.warmup import supervised_warmup

TINY = [
    "model.width=32",
    "model.heads=2",
    "warmup.steps=20",
    "warmup.batch_size=32",
    "task.heldout_size=40",
    "trainer.batch_prompts=4",
    "rollout.n=4",
    "rollout.max_concurrent_prompts=4",
    "run.eval_every=1000",
    "run.progress=none",
    "run.tensorboard=false",
    "run.plot=false",
    "run.torch_threads=1",
]


def tiny(tmp_path: Path, *overrides: str) -> TrainConfig:
    """A tiny run under ``tmp_path/run`` (later overrides win)."""
    return resolve(None, [*TINY, f"run.out_dir={tmp_path / 'run'}", *overrides])


def sync_grpo_reference(cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Synchronous on-policy GRPO written plainly: sample with the current weights, update, repeat.

    No queue, no threads, no offload, no snapshots: the same seeds and the same
    building blocks (sampler, log-probs, losses) as the async loop.
    """
    task = build_task(cfg)
    lm = build_policy(cfg, task).lm
    supervised_warmup(lm, task, cfg.warmup, seed=cfg.run.seed)
    r, t = cfg.rollout, cfg.trainer
    sampling = Sampling(
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_token=task.stop_token,
        pad_token=task.pad_token,
    )
    sampler = KVRollouter(lm, sampling, seed=cfg.run.seed + 1)
    prompts = random.Random(cfg.run.seed + 2)
    opt = torch.optim.Adam(lm.module.parameters(), lr=t.lr)
    losses = []
    adaptive = 0.0
    for step in range(t.steps):
        for group in opt.param_groups:  # the trainer's schedule: warm-up, then decay over the run's updates
            group["lr"] = algo.lr_at(
                step,
                base=t.lr,
                warmup=t.lr_warmup_steps,
                total=t.steps,
                schedule=t.lr_schedule,
                min_ratio=t.lr_min_ratio,
            )
        items = [task.sample(prompts) for _ in range(t.batch_prompts)]
        wave = Wave.start(list(range(len(items))), items, [task.prompt(i) for i in items], r.n, sampling)
        assert sampler.generate(wave)
        batch = Batch.of(wave.groups(task.score), task.pad_token)
        with torch.no_grad():
            l_p = sequence_logprobs(lm, batch.prompt_ids, batch.prompt_mask, batch.tokens, r.temperature)[0]
        adv = algo.grpo_advantages(batch.rewards, norm_std=t.norm_adv_std).reshape(-1)
        bw = algo.behaviour_weights(
            l_p, batch.l_b, batch.mask, kind=t.behaviour_weight, level=t.weight_level, cap=t.weight_cap
        )
        l_t, entropy = sequence_logprobs(
            lm, batch.prompt_ids, batch.prompt_mask, batch.tokens, r.temperature, with_entropy=True
        )
        loss, _ = algo.ppo_loss(
            l_t, l_p, adv, bw.weight, bw.mask, clip_low=t.clip_low, clip_high=t.clip_high, clip_c=t.clip_c
        )
        coef = t.entropy_coef + adaptive
        if coef > 0:
            loss = loss - coef * algo.masked_mean(entropy, batch.mask)
        if t.entropy_target is not None:  # the adaptive coefficient, as the trainer moves it
            ent = float(algo.masked_mean(entropy.detach(), batch.mask))
            adaptive = min(max(adaptive + t.entropy_adapt_rate * (t.entropy_target - ent), 0.0), t.entropy_coef_max)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.module.parameters(), t.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in lm.module.state_dict().items()}


def parked_trainer(cfg: TrainConfig):
    """``(task, policy, trainer, rollouter)`` for ``cfg``: a trainer at the start of a cycle with its state parked
    (as configured) and a rollouter on the policy's own rollout copy."""
    from stateshift.train.executors.inprocess import sampling_of

    task = build_task(cfg)
    policy = build_policy(cfg, task)
    trainer = Trainer(policy, cfg.trainer, temperature=1.0)
    rollouter = KVRollouter(policy.rollout_lm(), sampling_of(cfg, task), seed=1)
    trainer.begin_cycle()
    trainer.park()
    return task, policy, trainer, rollouter
