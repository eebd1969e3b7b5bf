"""The loss against verl's formulas, and the algorithm fixes: proximal once per step, sync == async at staleness 0,
NaN-free log-ratios, top-p behaviour log-probs, the learning-rate schedule, a fresh optimizer state for RL."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from rl.rlkit import parked_trainer, tiny

from stateshift.rl import algo
from stateshift.train.launch import run
from stateshift.train.rollout import Wave
from stateshift.train.sampler import Sampling, behaviour_logp, draw
from stateshift.train.trainer import Batch
from stateshift.train.warmup import fresh_optimizer_state


def _verl_vanilla_token_mean(
    log_prob, old_log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c, rollout_is_weights
):
    """verl's ``compute_policy_loss_vanilla`` with ``loss_agg_mode="token-mean"``, written out from its formulas."""

    def masked_mean(x, m):
        return (x * m).sum() / m.sum()

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1) * rollout_is_weights
    return masked_mean(pg_losses, response_mask), pg_clipfrac, ppo_kl, pg_clipfrac_lower


def test_ppo_loss_equals_verls_vanilla_dual_clip_token_mean():
    g = torch.Generator().manual_seed(0)
    l_p = -torch.rand(6, 9, generator=g) * 3
    l_t = (l_p + torch.randn(6, 9, generator=g) * 1.5).requires_grad_(True)
    adv_seq = torch.randn(6, generator=g)
    mask = torch.rand(6, 9, generator=g) > 0.25
    w = torch.rand(6, 9, generator=g) * 2
    loss, st = algo.ppo_loss(l_t, l_p, adv_seq, w, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    ref, clipfrac, kl, lower = _verl_vanilla_token_mean(
        l_t, l_p, adv_seq[:, None].expand(6, 9), mask.float(), 0.2, 0.28, 3.0, w
    )
    assert torch.allclose(loss, ref, atol=1e-6)
    assert st.clip_fraction == pytest.approx(float(clipfrac), abs=1e-6) and st.clip_fraction > 0
    assert st.dual_clip_fraction == pytest.approx(float(lower), abs=1e-6) and st.dual_clip_fraction > 0
    assert st.kl_current_proximal == pytest.approx(float(kl.detach()), abs=1e-6)
    grad = torch.autograd.grad(loss, l_t)[0]
    ref_grad = torch.autograd.grad(
        _verl_vanilla_token_mean(l_t, l_p, adv_seq[:, None].expand(6, 9), mask.float(), 0.2, 0.28, 3.0, w)[0], l_t
    )[0]
    assert torch.allclose(grad, ref_grad, atol=1e-7)


def test_loss_is_finite_with_an_overflowing_log_ratio_on_padding():
    l_p = torch.zeros(2, 4)
    l_t = torch.tensor([[-0.1, 0.1, 200.0, 300.0], [0.0, -500.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    for adv in (torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])):
        loss, st = algo.ppo_loss(l_t, l_p, adv, torch.ones(2, 4), mask)
        (grad,) = torch.autograd.grad(loss, l_t)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and st.ratio_mean == st.ratio_mean
        assert (grad[~mask] == 0).all()
    bw = algo.behaviour_weights(l_t.detach(), l_p, mask, level="sequence_product")
    assert torch.isfinite(bw.weight).all() and bw.raw_max == bw.raw_max


def test_top_p_behaviour_logprobs_are_the_truncated_distributions():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    s = Sampling(temperature=0.7, top_p=0.8)
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(logits / 0.7, -1)
    for _ in range(50):
        tokens, logp = draw(logits, s, gen)
        for row in range(2):
            order = p[row].argsort(descending=True).tolist()
            nucleus, mass = [], 0.0
            for i in order:  # the smallest set of most likely tokens holding top_p
                nucleus.append(i)
                mass += float(p[row, i])
                if mass >= 0.8:
                    break
            tok = int(tokens[row])
            assert tok in nucleus
            want = float(p[row, tok] / p[row, nucleus].sum())
            assert float(logp[row].exp()) == pytest.approx(want, rel=1e-5)
    assert torch.allclose(behaviour_logp(logits, Sampling(temperature=0.7)), torch.log_softmax(logits / 0.7, -1))


def _two_batches(cfg):
    task, policy, trainer, rollouter = parked_trainer(cfg)
    out = []
    for seed in (1, 2):
        rng = random.Random(seed)
        items = [task.sample(rng) for _ in range(cfg.trainer.batch_prompts)]
        wave = Wave.start(
            list(range(len(items))), items, [task.prompt(i) for i in items], cfg.rollout.n, rollouter.sampling
        )
        assert rollouter.generate(wave)
        out.append(Batch.of(wave.groups(task.score), task.pad_token))
    return trainer, out


@pytest.mark.parametrize("mode", ["proximal", "loglinear"])
def test_proximal_logprobs_are_computed_once_per_step_and_the_clip_binds(tmp_path, mode):
    cfg = tiny(
        tmp_path,
        f"trainer.old_logprob={mode}",
        "trainer.lr=0.05",
        "trainer.lr_warmup_steps=0",
        "trainer.param_offload=false",
        "trainer.clip_low=0.05",
        "trainer.clip_high=0.05",
    )
    trainer, batches = _two_batches(cfg)
    stats = trainer.train_step(batches, lambda name: contextlib.nullcontext())
    assert stats[0]["clip_fraction"] == 0.0 and stats[0]["kl_current_proximal"] == pytest.approx(0.0, abs=1e-6)
    assert stats[1]["clip_fraction"] > 0  # the second mini-batch is clipped against the step's start
    assert stats[1]["kl_current_proximal"] != 0.0
    assert trainer.steps == 1 and trainer.updates == 2


LONGTAIL_CONTINUOUS = [
    "task.name=longtail",
    "task.max_terms=4",
    "task.warmup_max_terms=2",
    "rollout.max_new_tokens=28",
    "rollout.batching=continuous",
]


@pytest.mark.parametrize("extra", [[], LONGTAIL_CONTINUOUS], ids=["waves", "continuous"])
def test_sync_mode_equals_async_at_staleness_zero(tmp_path, extra):
    common = [
        "trainer.steps=4",
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0",
        "trainer.lr_warmup_steps=1",
        *extra,
    ]
    a = run(tiny(tmp_path / "a", *common), return_params=True)
    s = run(tiny(tmp_path / "s", *common, "async_training.mode=sync"), return_params=True)
    s_stale = run(
        tiny(tmp_path / "t", *common, "async_training.mode=sync", "async_training.staleness_threshold=0.5"),
        return_params=True,
    )  # sync ignores the staleness budget: the same samples
    assert a.losses == s.losses == s_stale.losses and len(a.losses) == 4
    assert a.trained_uids == s.trained_uids
    assert a.params is not None and s.params is not None
    assert all(torch.equal(a.params[k], s.params[k]) for k in a.params)
    assert s.summary["ledger"]["by_version"] == {"0": 8, "1": 8}
    assert s.summary["staleness_tokens"].keys() <= {"0", "1"}  # generated by pi_old (0 or 1 update behind, no sync)


def test_async_with_staleness_is_not_the_sync_run(tmp_path):
    """The comparison above can fail: async with a staleness budget trains other samples."""
    common = [
        "trainer.steps=4",
        "async_training.trigger_parameter_sync_step=2",
        "trainer.lr_warmup_steps=1",
        "async_training.staleness_threshold=1.0",
        "rollout.max_concurrent_prompts=2",
    ]
    a = run(tiny(tmp_path / "a", *common))
    s = run(tiny(tmp_path / "s", *common, "async_training.mode=sync"))
    assert s.summary["ledger"]["by_version"] == {"0": 8, "1": 8}
    assert a.summary["ledger"]["generated"] > 16 or a.losses != s.losses


def test_lr_schedule_warms_up_and_decays():
    kw = dict(base=1.0, warmup=4, total=14, min_ratio=0.1)
    assert [algo.lr_at(i, schedule="cosine", **kw) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert algo.lr_at(4, schedule="cosine", **kw) == 1.0
    assert algo.lr_at(9, schedule="cosine", **kw) == pytest.approx(0.55)
    assert algo.lr_at(14, schedule="cosine", **kw) == pytest.approx(0.1) == algo.lr_at(99, schedule="linear", **kw)
    assert algo.lr_at(9, schedule="linear", **kw) == pytest.approx(0.55)
    assert algo.lr_at(50, schedule="constant", **kw) == 1.0


def test_fresh_optimizer_state_steps_like_a_new_adam():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.Adam(a.parameters(), lr=0.1)
    for _ in range(3):  # the "warm-up" leaves moments behind
        opt_a.zero_grad()
        a(torch.randn(5, 4)).square().sum().backward()
        opt_a.step()
    b.load_state_dict(a.state_dict())
    moments = [t for st in opt_a.state.values() for t in st.values()]
    assert fresh_optimizer_state(opt_a) == len(moments) and all(int(t.count_nonzero()) == 0 for t in moments)
    assert all(t is u for t, u in zip(moments, [t for st in opt_a.state.values() for t in st.values()], strict=True))
    opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    for m, o in ((a, opt_a), (b, opt_b)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_fresh_optimizer_state_reaches_into_chained_and_wrapped_optimizers():
    p = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(3)
    inner.step()

    class Wrapped:  # Megatron's DistributedOptimizer keeps its torch optimizer as .optimizer
        optimizer = inner

    class Chained:
        chained_optimizers = [Wrapped()]

    assert fresh_optimizer_state(Chained()) == 3
    assert all(int(t.count_nonzero()) == 0 for t in inner.state[p].values())
