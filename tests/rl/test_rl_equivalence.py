"""The async loop against plain references: on-policy == synchronous GRPO; pi_old with offload; resume."""

from __future__ import annotations

import pytest
import torch
from rl.rlkit import sync_grpo_reference, tiny

from stateshift.train.launch import run


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_on_policy_async_equals_sync_grpo_bit_for_bit(tmp_path):
    """trigger_parameter_sync_step=1, staleness 0: every sample is drawn by the weights it trains: synchronous GRPO."""
    cfg = tiny(
        tmp_path,
        "trainer.steps=6",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=0",
    )
    assert cfg.trainer.old_logprob == "pi_old" and cfg.trainer.param_offload  # the default path, offload included
    result = run(cfg, return_params=True)
    ref_losses, ref_params = sync_grpo_reference(cfg)
    assert result.losses == ref_losses  # exact float equality
    assert result.params is not None
    _same(result.params, ref_params)
    ledger = result.summary["ledger"]
    assert ledger["trained"] == 6 * 4
    assert all(ledger["by_version"][str(v)] == 4 for v in range(6))  # one step's worth per version, no more


def test_reference_detects_a_difference(tmp_path):
    """The comparison above can fail: one more update (or another seed) changes the losses and weights."""
    cfg = tiny(
        tmp_path,
        "trainer.steps=3",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=0",
    )
    other = tiny(
        tmp_path,
        "trainer.steps=3",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=0",
        "trainer.lr=5e-3",
    )
    assert sync_grpo_reference(cfg)[0][1:] != sync_grpo_reference(other)[0][1:]


def test_pi_old_with_param_and_optimizer_offload(tmp_path):
    """pi_old recomputed while params and optimizer state are offloaded; same-version tokens: l_p == l_b.

    The trainer parks only before it waits for samples, or after an evaluation: an evaluation after every step
    makes every update start from offloaded state, whatever the queue does."""
    cfg = tiny(
        tmp_path,
        "trainer.steps=8",
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0.5",
        "trainer.param_offload=true",
        "trainer.optimizer_offload=true",
        "trainer.grad_offload=true",
        "run.eval_every=1",
    )
    result = run(cfg)
    s = result.summary
    assert s["status"] == "finished" and result.steps == 8
    records = list(_records(result.out_dir))
    assert sum(r["pi_old_same_version_tokens"] for r in records) > 0
    assert max(r["pi_old_same_version_max_abs_diff"] for r in records) <= 1e-5
    # pi_old was really used (swaps while offloaded) and really differs from the current weights:
    assert s["pi_old"]["swaps"] >= 4 and max(r["kl_current_proximal"] != 0 for r in records)
    assert {"offload.params", "offload.optim", "offload.grads", "onload.params", "onload.optim"} <= s["offload"][
        "bytes"
    ].keys()
    assert s["offload"]["bytes"]["offload.optim"] > 0 and s["offload"]["bytes"]["offload.params"] > 0


def test_resume_equals_uninterrupted(tmp_path):
    common = [
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0",
        "run.checkpoint_every=2",
        "trainer.optimizer_offload=true",
    ]
    full = run(tiny(tmp_path / "a", "trainer.steps=6", *common), return_params=True)
    first = run(tiny(tmp_path / "b", "trainer.steps=5", *common))  # stopped after step 5; last checkpoint: step 4
    assert (first.out_dir / "checkpoints" / "latest").read_text() == "step-4"
    resumed = run(tiny(tmp_path / "b", "trainer.steps=6", *common), resume=first.out_dir, return_params=True)
    assert first.losses[:4] + resumed.losses == full.losses
    assert resumed.losses[0] == first.losses[4]  # step 5 redone from the checkpoint, identically
    assert resumed.params is not None and full.params is not None
    _same(resumed.params, full.params)
    assert resumed.heldout_accuracy_start == full.heldout_accuracy_start
    steps = [r["step"] for r in _records(resumed.out_dir)]
    assert steps == [1, 2, 3, 4, 5, 6]  # the log continues where the checkpoint was, no step twice
    # the same groups were trained; what the rollouter produced after the last sync depends on when it was stopped
    la, lb = resumed.summary["ledger"], full.summary["ledger"]
    assert la["trained"] == lb["trained"] == 6 * 4
    assert {v: la["by_version"][v] for v in "012"} == {v: lb["by_version"][v] for v in "012"}


def _records(out_dir):
    import json

    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.old_logprob=bypass", "trainer.weight_level=sequence_product"],
        ["trainer.old_logprob=loglinear", "trainer.weight_level=sequence_geomean", "async_training.require_batches=2"],
        [
            "trainer.old_logprob=proximal",
            "trainer.behaviour_weight=mask",
            "trainer.kl_coef=0.1",
            "async_training.max_head_offpolicyness=1",
            "async_training.max_lag=2",
            "async_training.partial_rollout=false",
        ],
    ],
)
def test_other_modes_run(tmp_path, overrides):
    result = run(tiny(tmp_path, "trainer.steps=6", "async_training.trigger_parameter_sync_step=2", *overrides))
    s = result.summary
    assert s["status"] == "finished" and s["pi_old"]["snapshots"] == 0  # no pi_old kept outside pi_old mode
    records = _records(result.out_dir)
    assert all(r["loss"] == r["loss"] for r in records)  # no NaN
    if "trainer.kl_coef=0.1" in overrides:
        assert any(r["kl_ref"] > 0 for r in records)
