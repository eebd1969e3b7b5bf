"""Checks every policy family must pass (``test_rl_policies.py``; Megatron's run in a patched subprocess).

Run as a script (``python policy_checks.py FAMILY DIR``) it patches megatron-core for the CPU first and
runs every check for that family, printing ``ok <check>`` for each.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

from rlkit import parked_trainer, tiny
from stateshift.rl.build import build_policy, build_task
from stateshift.rl.loop import run
from stateshift.rl.rollout import KVRollouter, Wave
from stateshift.rl.trainer import Batch
from stateshift.rl.executors.inprocess import sampling_of

ALL_OFFLOAD = ["trainer.param_offload=true", "trainer.grad_offload=true", "trainer.optimizer_offload=true",
               "trainer.old_logprob=pi_old", "async_training.trigger_parameter_sync_step=2"]


def check_run(tmp: Path, family: str, *extra: str) -> dict:
    """A few async steps with every offload on and pi_old: finished, finite losses, ledger balanced, pi_old swapped.
    (An evaluation after every step parks the trainer each time: it parks only before a wait or after an
    evaluation, and whether it waits depends on timing, so without it a short run may never offload ``optim``.)"""
    cfg = tiny(tmp, f"model.family={family}", "trainer.steps=6", "run.eval_every=1", *ALL_OFFLOAD, *extra)
    res = run(cfg)
    s = res.summary
    assert s["status"] == "finished", s["status"]
    assert len(res.losses) == 6 and all(math.isfinite(x) for x in res.losses), res.losses
    assert s["ledger"]["trained"] == 6 * cfg.trainer.batch_prompts, s["ledger"]
    if cfg.trainer.old_logprob == "pi_old":
        assert s["pi_old"]["swaps"] == 3, s["pi_old"]  # updates 2, 4, 6 of cycles of 2 swap
    for group in ("params", "grads", "optim"):
        assert s["offload"]["bytes"].get(f"offload.{group}", 0) > 0, (group, s["offload"]["bytes"])
    return s


def _params(lm) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in lm.module.state_dict().items():
        if isinstance(t, torch.Tensor):
            full = getattr(t, "full_tensor", None)
            out[name] = (full() if callable(full) else t).detach().float().cpu().clone()  # no alias of storage an offload releases
    return out


def check_sync_equal(tmp: Path, family: str, *extra: str) -> None:
    """Train two updates with params offloaded; a host snapshot synced into the rollouter's copy by name makes its
    weights equal the trainer's, and the copy then samples what the trainer's own model samples."""
    cfg = tiny(tmp, f"model.family={family}", *ALL_OFFLOAD, *extra)
    task, policy, trainer, rollouter = parked_trainer(cfg)
    items = [task.sample(__import__("random").Random(i)) for i in range(cfg.trainer.batch_prompts)]
    for _ in range(2):
        wave = Wave.start(list(range(len(items))), items, [task.prompt(i) for i in items], cfg.rollout.n,
                          rollouter.sampling)
        assert rollouter.generate(wave)
        trainer.update(Batch.of(wave.groups(task.score), task.pad_token), lambda name: _null())
        trainer.park()  # what the loop does before it waits for the next batch
    assert trainer.state.residency()["params"]["device"] == 0  # offloaded: the snapshot below is of host homes
    snap = trainer.sync_snapshot()
    rollouter.update_weights(snap.wait().views(), 1)
    trainer.release(snap)
    with trainer.resident():
        want = _params(policy.lm)
    got = _params(rollouter.lm)
    assert want.keys() == got.keys(), sorted(want.keys() ^ got.keys())[:5]
    for name, t in want.items():
        assert torch.equal(t, got[name]), name


def check_rollout_copy_alone(tmp: Path, family: str) -> None:
    """The rollouter's copy built from the config alone (no policy: what a Ray rollouter actor does), loaded with
    ``policy.rollout_state_dict()``, holds the trainer's weights; the same dict is a complete weight update."""
    import importlib

    from stateshift.rl.policies import FAMILIES, build_rollout_lm, load_rollout_weights

    cfg = tiny(tmp, f"model.family={family}")
    task = build_task(cfg)
    policy = build_policy(cfg, task)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01)  # not the seeded init any more: the copy must get these from the dict
    weights = policy.rollout_state_dict()
    module = importlib.import_module(FAMILIES[family])
    real_build = module.build
    module.build = lambda *a, **k: (_ for _ in ()).throw(AssertionError("build_rollout_lm built a whole policy"))
    try:
        lm = build_rollout_lm(cfg, task)
    finally:
        module.build = real_build
    assert getattr(lm, "own_stream", False)
    assert not torch.equal(_params(lm)[next(iter(weights))], _params(policy.lm)[next(iter(weights))])
    load_rollout_weights(lm, weights)
    want, got = _params(policy.lm), _params(lm)
    assert want.keys() == got.keys(), sorted(want.keys() ^ got.keys())[:5]
    for name, t in want.items():
        assert torch.equal(t, got[name]), name
    KVRollouter(build_rollout_lm(cfg, task), sampling_of(cfg, task), seed=1).update_weights(weights.items(), 1)


def check_fresh_optimizer(tmp: Path, family: str) -> int:
    """After the warm-up, ``fresh_optimizer_state`` leaves every optimizer state tensor zero (Megatron's warm-up steps
    its RL optimizer, so there are moments to clear); returns how many it zeroed."""
    from stateshift.rl.warmup import _inner_optimizers, fresh_optimizer_state, supervised_warmup

    cfg = tiny(tmp, f"model.family={family}")
    task = build_task(cfg)
    policy = build_policy(cfg, task)
    supervised_warmup(policy.lm, task, cfg.warmup, seed=0, stepper=policy.warmup_stepper(cfg.warmup.lr))
    zeroed = fresh_optimizer_state(policy.optimizer)
    states = [t for o in _inner_optimizers(policy.optimizer) for st in o.state.values() for t in st.values()
              if isinstance(t, torch.Tensor)]
    assert len(states) == zeroed and all(int(t.count_nonzero()) == 0 for t in states)
    assert zeroed > 0 or family != "megatron"
    return zeroed


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(family: str, tmp: Path) -> None:
    if os.environ.get("STATESHIFT_MCORE_DEVICE") == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        from megatron_bench import patch_megatron_for_cpu

        patch_megatron_for_cpu()
    check_run(tmp / "a", family)
    print("ok run", flush=True)
    check_run(tmp / "b", family, "trainer.old_logprob=bypass")
    print("ok bypass", flush=True)
    check_sync_equal(tmp / "c", family)
    print("ok sync_equal", flush=True)
    check_rollout_copy_alone(tmp / "d", family)
    print("ok rollout_copy_alone", flush=True)
    check_fresh_optimizer(tmp / "e", family)
    print("ok fresh_optimizer", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
