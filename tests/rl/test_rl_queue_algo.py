"""Admission rules of the queue (verl, AReaL), the ledger, and the loss pieces."""

from __future__ import annotations

import torch

from stateshift.rl import algo
from stateshift.train.config import AsyncConfig
from stateshift.train.queue import SampleQueue
from stateshift.train.rollout import Group


def _group(uid: int, version: int) -> Group:
    t = torch.zeros(2, 3, dtype=torch.long)
    return Group(
        uid=uid,
        item=None,
        prompt=(1,),
        tokens=t,
        mask=torch.ones(2, 3, dtype=torch.bool),
        logprobs=torch.zeros(2, 3),
        versions=torch.full((2, 3), version),
        rewards=torch.zeros(2),
        exact=torch.zeros(2, dtype=torch.bool),
        finished=torch.ones(2, dtype=torch.bool),
    )


def test_verl_staleness_budget():
    q = SampleQueue(AsyncConfig(), required=32)  # defaults: staleness 0.1, trigger 4
    assert q.max_required == int(32 * 1.1 * 4) == 140 and q.capacity == 140
    q.admit(q.admissible(0, 200))
    assert q.staleness_samples == 140 and q.admissible(0, 1) == 0  # paused until the next sync
    q.put([_group(i, 0) for i in range(140)])
    q.take(128, 0)
    q.trained(128)
    q.on_sync()  # 12 queued groups are stale: they count against the next version's budget
    assert q.staleness_samples == 12 and q.admissible(1, 1000) == 128
    q.check()


def test_staleness_zero_is_one_version_per_sync():
    q = SampleQueue(AsyncConfig(staleness_threshold=0, trigger_parameter_sync_step=1), required=4)
    assert q.admissible(0, 10) == 4


def test_areal_admission():
    cfg = AsyncConfig(staleness_threshold=10, trigger_parameter_sync_step=1, max_head_offpolicyness=1)
    q = SampleQueue(cfg, required=4)
    assert q.admissible(0, 100) == 8  # (eta + v + 1) * B - (accepted + running) = 2 * 4
    q.admit(8)
    q.put([_group(i, 0) for i in range(8)])
    assert q.admissible(0, 100) == 0 and q.admissible(1, 100) == 4


def test_max_lag_discards_with_a_reason_and_refunds_the_budget():
    q = SampleQueue(AsyncConfig(max_lag=1), required=2)
    q.admit(4)
    q.put([_group(0, 0), _group(1, 2), _group(2, 0), _group(3, 2)])
    before = q.staleness_samples
    got = q.take(2, trainer_version=2)
    assert [g.uid for g in got] == [1, 3]
    assert sum(q.ledger.discarded.values()) == 2 and "stale" in next(iter(q.ledger.discarded))
    assert q.staleness_samples == before - 2
    q.trained(2)
    q.check()


def test_ledger_catches_a_lost_group():
    q = SampleQueue(AsyncConfig(), required=2)
    q.admit(3)
    q.put([_group(0, 0), _group(1, 0), _group(2, 0)])
    q.items.pop()  # a group vanishing silently (what verl's full queue did) breaks the balance
    try:
        q.check()
    except AssertionError:
        return
    raise AssertionError("the ledger did not notice a lost group")


def test_dual_clip_and_clip():
    l_p = torch.zeros(1, 3)
    l_t = torch.log(torch.tensor([[1.5, 0.5, 10.0]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss_pos, st = algo.ppo_loss(l_t, l_p, torch.tensor([1.0]), torch.ones(1, 3), mask)
    assert torch.isclose(loss_pos, torch.tensor(-(1.2 + 0.5 + 1.2) / 3))  # ratio clipped at 1.2 above
    loss_neg, st = algo.ppo_loss(l_t, l_p, torch.tensor([-1.0]), torch.ones(1, 3), mask, clip_c=3.0)
    assert torch.isclose(loss_neg, torch.tensor((1.5 + 0.8 + 3.0) / 3))  # 10 dual-clipped at c|A| = 3
    assert st.dual_clip_fraction > 0


def test_behaviour_weights_truncate_mask_sequence():
    l_b = torch.zeros(2, 2)
    l_p = torch.log(torch.tensor([[3.0, 1.0], [0.25, 1.0]]))
    mask = torch.ones(2, 2, dtype=torch.bool)
    t = algo.behaviour_weights(l_p, l_b, mask, kind="truncate", cap=2.0)
    assert torch.allclose(t.weight, torch.tensor([[2.0, 1.0], [0.25, 1.0]])) and t.adjusted_fraction == 0.25
    m = algo.behaviour_weights(l_p, l_b, mask, kind="mask", lo=0.5, hi=2.0)
    assert m.mask.tolist() == [[False, True], [False, True]]
    s = algo.behaviour_weights(l_p, l_b, mask, kind="truncate", level="sequence_geomean", cap=10.0)
    assert torch.allclose(s.weight[0], torch.full((2,), 3.0**0.5)) and torch.allclose(
        s.weight[1], torch.full((2,), 0.5)
    )
    prod = algo.behaviour_weights(l_p, l_b, mask, kind="truncate", level="sequence_product", cap=10.0)
    assert torch.allclose(prod.weight[0], torch.full((2,), 3.0)) and torch.allclose(
        prod.weight[1], torch.full((2,), 0.25)
    )
    on = algo.behaviour_weights(l_b, l_b, mask)
    assert on.ess == 1.0 and on.raw_max == 1.0


def test_grpo_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = algo.grpo_advantages(r)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (1 / 3) ** 0.5, atol=1e-4)  # unbiased std
    assert (a[1] == 0).all()
    assert torch.allclose(algo.grpo_advantages(r, norm_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_no_group_is_admitted_past_what_the_runs_steps_will_train():
    """The last version generates nothing that no step trains, however the rollouter's timing falls (a sync run on
    a loaded machine generated 2-4 groups of a version 2 that its 2 versions never trained)."""
    q = SampleQueue(AsyncConfig(staleness_threshold=0, trigger_parameter_sync_step=2, max_lag=0), required=4, total=16)
    for version in (0, 1):
        q.admit(q.admissible(version, 100))
        q.put([_group(i, version) for i in range(8)])
        for _ in range(2):
            q.trained(len(q.take(4, version)))
        q.on_sync()
    assert q.ledger.trained == 16 and q.admissible(2, 100) == 0
    q.check()
    late = SampleQueue(AsyncConfig(max_lag=0), required=4, total=8)  # a discarded group is generated again
    late.admit(late.admissible(0, 100))
    assert late.running == 8
    late.put([_group(i, 0) for i in range(8)])
    late.trained(len(late.take(4, 0)))
    assert len(late.take(4, 1)) == 0 and late.admissible(1, 100) == 4
