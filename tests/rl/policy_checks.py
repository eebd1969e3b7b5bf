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

from stateshift.train.build import build_policy, build_task
from stateshift.train.executors.inprocess import sampling_of
from stateshift.train.launch import run
from stateshift.train.rollout import KVRollouter, Wave
from stateshift.train.trainer import Batch

ALL_OFFLOAD = [
    "trainer.param_offload=true",
    "trainer.grad_offload=true",
    "trainer.optimizer_offload=true",
    "trainer.old_logprob=pi_old",
    "async_training.trigger_parameter_sync_step=2",
]


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
            out[name] = (
                (full() if callable(full) else t).detach().float().cpu().clone()
            )  # no alias of storage an offload releases
    return out


def check_sync_equal(tmp: Path, family: str, *extra: str) -> None:
    """Train two updates with params offloaded; a host snapshot synced into the rollouter's copy by name makes its
    weights equal the trainer's, and the copy then samples what the trainer's own model samples."""
    cfg = tiny(tmp, f"model.family={family}", *ALL_OFFLOAD, *extra)
    task, policy, trainer, rollouter = parked_trainer(cfg)
    items = [task.sample(__import__("random").Random(i)) for i in range(cfg.trainer.batch_prompts)]
    for _ in range(2):
        wave = Wave.start(
            list(range(len(items))), items, [task.prompt(i) for i in items], cfg.rollout.n, rollouter.sampling
        )
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

    from stateshift.train.policies import FAMILIES, build_rollout_lm, load_rollout_weights

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
    from stateshift.train.warmup import _inner_optimizers, fresh_optimizer_state, supervised_warmup

    cfg = tiny(tmp, f"model.family={family}")
    task = build_task(cfg)
    policy = build_policy(cfg, task)
    supervised_warmup(policy.lm, task, cfg.warmup, seed=0, stepper=policy.warmup_stepper(cfg.warmup.lr))
    zeroed = fresh_optimizer_state(policy.optimizer)
    states = [
        t
        for o in _inner_optimizers(policy.optimizer)
        for st in o.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    ]
    assert len(states) == zeroed and all(int(t.count_nonzero()) == 0 for t in states)
    assert zeroed > 0 or family != "megatron"
    return zeroed


class Recompute:
    """The uncached reference of a ``CausalLM``: a "cache" that keeps the ids seen; every call re-runs them all."""

    def __init__(self, lm) -> None:
        self.lm, self.module = lm, lm.module

    def new_cache(self) -> dict:
        return {}

    def __call__(self, ids, positions, key_mask, cache):
        new = ids.shape[1]
        if cache is not None:
            if cache:
                ids, positions = torch.cat([cache["ids"], ids], 1), torch.cat([cache["positions"], positions], 1)
            cache.update(ids=ids, positions=positions)
        return self.lm(ids, positions, key_mask, None)[:, -new:]


#: cached against uncached log-probs: fp32 models; bf16 (Megatron) on the GPU, where the one-query decode
#: kernels sum in another order than the full-sequence ones (bf16 keeps 8 bits: 2^-8 relative per logit)
KV_ATOL = {"fp32": 1e-5, "bf16": 3e-2}


def check_kv_cache(tmp: Path, family: str, *extra: str) -> dict:
    """The rollouter's KV-cached generation against recomputing the whole sequence for every token: the same
    tokens from the same seed, and per-token log-probs equal within ``KV_ATOL`` -- also equal to the trainer's
    one-forward recompute (``sequence_logprobs``), which is what ``l_p`` and ``l_t`` are computed with.

    Passing only the new token per call, as the cached path does, gives the right logits only if the model
    attends to the keys the cache holds: so this also shows the cache is used. Returns the largest differences.
    """
    from stateshift.train.policies import build_rollout_lm
    from stateshift.train.sampler import sequence_logprobs

    cfg = tiny(tmp, f"model.family={family}", "rollout.max_new_tokens=8", *extra)
    task = build_task(cfg)
    lm = build_rollout_lm(cfg, task)
    with torch.no_grad():
        for p in lm.module.parameters():  # away from the seeded init: sharper distributions, longer answers
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(p) * 0.05)
    rng = __import__("random").Random(5)
    items = [task.sample(rng) for _ in range(4)]
    prompts = [task.prompt(i) for i in items]
    prompts[1] = prompts[1][3:]  # rows of different lengths: left padding in the cache
    waves = []
    for model in (lm, Recompute(lm)):
        wave = Wave.start(list(range(4)), items, prompts, cfg.rollout.n, sampling_of(cfg, task))
        assert KVRollouter(model, sampling_of(cfg, task), seed=3).generate(wave)
        waves.append(wave)
    cached, plain = waves
    mask = cached.versions >= 0
    assert torch.equal(cached.tokens, plain.tokens) and torch.equal(mask, plain.versions >= 0)
    dev = next(lm.module.parameters()).device
    with torch.no_grad():
        recomputed, _ = sequence_logprobs(
            lm, cached.prompt_ids.to(dev), cached.prompt_mask.to(dev), cached.tokens.to(dev), cfg.rollout.temperature
        )
    diffs = {
        "vs_recompute": float((cached.logprobs - plain.logprobs)[mask].abs().max()),
        "vs_sequence_logprobs": float((cached.logprobs - recomputed.cpu())[mask].abs().max()),
    }
    tol = KV_ATOL["bf16" if family == "megatron" else "fp32"]
    assert max(diffs.values()) <= tol, (diffs, tol)
    return diffs


def check_process_equal(tmp: Path, family: str, *extra: str) -> None:
    """``executor=process`` against the thread executor at staleness 0, param offload on: the same losses, groups
    and final weights (the weights reach the rollouter process by name through shared memory)."""
    det = [
        f"model.family={family}",
        "trainer.steps=4",
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0",
        "trainer.param_offload=true",
        *extra,
    ]
    proc = run(tiny(tmp / "process", "executor=process", *det), return_params=True)
    thread = run(tiny(tmp / "thread", "executor=inprocess", *det), return_params=True)
    assert proc.summary["rollout"]["executor"] == "process" and proc.summary["sync"]["syncs"] == 2
    assert proc.losses == thread.losses and proc.trained_uids == thread.trained_uids
    for name, t in thread.params.items():
        assert torch.equal(proc.params[name], t), name


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
        os.environ["STATESHIFT_TEST_ROLLOUT_PROCESS_HOOK"] = (
            "megatron_bench:patch_megatron_for_cpu"  # its rollouter too
        )
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
    check_kv_cache(tmp / "f", family)
    print("ok kv_cache", flush=True)
    check_process_equal(tmp / "g", family)
    print("ok process_equal", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
