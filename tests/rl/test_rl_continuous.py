"""Continuous batching: the same samples as waves (greedy: exactly), behaviour log-probs of the static KV cache equal a
full forward's, every slot busy while rows wait, and a run that learns through it. The long-tail task's generator
and reward."""

from __future__ import annotations

import json
import random

import pytest
import torch
from rl.rlkit import tiny

from stateshift.train.continuous import BuiltinSlotLM, ContinuousEngine, to_group
from stateshift.train.launch import run
from stateshift.train.report import length_bucket
from stateshift.train.rollout import KVRollouter, Wave
from stateshift.train.sampler import BuiltinLM, Sampling, sequence_logprobs
from stateshift.train.tasks.gpt import GPTConfig, build_gpt
from stateshift.train.tasks.longtail import PAD, STOP, LongTailTask, Sums, decode, encode, log_uniform_k
from stateshift.train.trainer import Batch

TASK = LongTailTask(max_terms=4, warmup_max_terms=2, heldout_size=20)


def _model(seed: int = 0) -> BuiltinLM:
    return BuiltinLM(
        build_gpt(GPTConfig(vocab=TASK.vocab_size, width=32, heads=2, max_len=TASK.max_prompt_len + 28), seed=seed)
    )


def _sampling(temperature: float) -> Sampling:
    return Sampling(temperature=temperature, max_new_tokens=28, stop_token=STOP, pad_token=PAD)


def _continuous(lm, items, temperature, slots=4, n=2, seed=0):
    eng = ContinuousEngine(
        BuiltinSlotLM(lm), _sampling(temperature), slots, n, torch.Generator().manual_seed(seed), torch.device("cpu")
    )
    eng.add([(uid, it, TASK.prompt(it)) for uid, it in enumerate(items)])
    eng.version = 0
    groups, steps = [], 0
    with torch.no_grad():
        while eng.busy:
            eng.fill()
            assert eng.free == 0 or not eng.pending  # no slot idles while a row waits
            groups += [to_group(g, TASK, PAD) for g in eng.step(0)]
            steps += 1
    return sorted(groups, key=lambda g: g.uid), steps, eng


def test_greedy_continuous_equals_greedy_waves_and_keeps_slots_busy():
    lm = _model()
    rng = random.Random(0)
    items = [TASK.sample(rng) for _ in range(6)]
    groups, steps, eng = _continuous(lm, items, 0.0)
    wave = Wave.start(list(range(6)), items, [TASK.prompt(i) for i in items], 2, _sampling(0.0))
    with torch.no_grad():
        assert KVRollouter(lm, _sampling(0.0), seed=0).generate(wave)
    for g, wg in zip(groups, wave.groups(TASK.score), strict=True):
        for r in range(2):
            want = wg.tokens[r][wg.mask[r]]
            assert g.tokens[r][g.mask[r]].tolist() == want.tolist()
            assert torch.allclose(g.logprobs[r][g.mask[r]], wg.logprobs[r][wg.mask[r]], atol=1e-5)
        assert torch.equal(g.rewards, wg.rewards)
    assert eng.occupancy > 0.6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_behaviour_logprobs_equal_a_full_forward(temperature):
    lm = _model(1)
    rng = random.Random(1)
    items = [TASK.sample(rng) for _ in range(5)]
    groups, _, _ = _continuous(lm, items, temperature, slots=6, n=3, seed=2)
    batch = Batch.of(groups, PAD)  # groups of different widths, padded to the widest
    with torch.no_grad():
        full, _ = sequence_logprobs(lm, batch.prompt_ids, batch.prompt_mask, batch.tokens, temperature)
    assert torch.allclose(full[batch.mask], batch.l_b[batch.mask], atol=1e-5)
    assert (batch.versions[batch.mask] == 0).all() and not batch.mask[:, -1].all()


def test_sampled_lengths_follow_the_waves_distribution_with_every_slot_busy():
    """Sampling (temperature 1, a random model: lengths spread from 1 to the cap): the same length distribution as
    waves, and fewer decode steps -- the slots follow the mean length, waves the max."""
    lm = _model(2)
    rng = random.Random(2)
    items = [TASK.sample(rng) for _ in range(16)]
    groups, steps, eng = _continuous(lm, items, 1.0, slots=8, n=4, seed=3)
    cont = torch.cat([g.mask.sum(1) for g in groups]).float()
    wave_lengths, wave_steps = [], 0
    for start in range(0, 16, 2):  # waves of 8 rows, as many as the slots
        chunk = items[start : start + 2]
        wave = Wave.start(list(range(2)), chunk, [TASK.prompt(i) for i in chunk], 4, _sampling(1.0))
        with torch.no_grad():
            assert KVRollouter(lm, _sampling(1.0), seed=start).generate(wave)
        wave_lengths.append((wave.versions >= 0).sum(1))
        wave_steps += wave.step
    waves = torch.cat(wave_lengths).float()
    assert cont.std() > 3 and waves.std() > 3  # varied lengths
    assert abs(cont.mean() - waves.mean()) < 3 * (waves.std() + cont.std()) / 64**0.5
    assert steps < 0.8 * wave_steps and eng.occupancy > 0.8


def test_run_with_continuous_batching_on_the_longtail_task(tmp_path):
    cfg = tiny(
        tmp_path,
        "task.name=longtail",
        "task.max_terms=4",
        "task.warmup_max_terms=2",
        "rollout.max_new_tokens=28",
        "rollout.batching=continuous",
        "trainer.steps=4",
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0.5",
    )
    result = run(cfg)
    s = result.summary
    assert s["status"] == "finished" and s["ledger"]["trained"] == 16
    recs = [json.loads(x) for x in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["rollout_row_occupancy"] <= 1 for r in recs)
    assert all(sum(r["rows_by_length"].values()) == 16 for r in recs)
    assert all(r["loss"] == r["loss"] for r in recs)


def test_longtail_generator_prompt_answer_and_reward():
    p = Sums((12, 7, 99), 4)
    assert decode(p.prompt) == "21+____70+____99=___________" and decode(p.answer) == "212100,709100,998110$"
    assert all(p.prompt[i] == p.answer[i] for i in range(0, 21, 7))  # a copied digit is max_terms * 7 back
    assert TASK.score(Sums((12, 7, 99), 6), p.answer) == (pytest.approx(1.3), True)
    wrong_last = encode("212100,709100,998111$")
    r, exact = TASK.score(Sums((12, 7, 99), 6), wrong_last)
    assert not exact and r == pytest.approx(0.2 * 2 / 3 + 0.1)
    assert TASK.score(Sums((12, 7, 99), 6), p.answer[:-1]) == (pytest.approx(0.2), False)  # no stop: not exact
    rng = random.Random(3)
    ks = [log_uniform_k(rng, 2, 64) for _ in range(4000)]
    assert min(ks) == 2 and max(ks) == 64 and ks.count(2) > 4 * ks.count(16) > 0  # log-uniform: short ones common
    task = LongTailTask()
    held = {x.terms for x in task.heldout()}
    assert len(held) > 450 and not any(task.sample(rng).terms in held for _ in range(2000))
    easy = task.warmup_batch(rng, 200)
    assert max(len(a) for _, a in easy) <= 7 * 8 and all(len(pr) == task.max_prompt_len for pr, _ in easy)
    lengths = [len(task.sample(rng).answer) for _ in range(2000)]
    assert min(lengths) == 14 and max(lengths) > 300  # 14 to a few hundred tokens, set by the prompt


def test_length_buckets():
    assert [length_bucket(n) for n in (1, 2, 3, 4, 7, 8, 320)] == ["1-1", "2-3", "2-3", "4-7", "4-7", "8-15", "256-511"]


def test_heldout_accuracy_of_some_problems_counts_only_those(tmp_path):
    """``heldout_accuracy(items=...)``: the exact fraction among those problems (the long-tail bench's accuracy by
    answer length); the default is every held-out problem; no problem at all is an error."""
    from stateshift.train.build import build_policy, build_task
    from stateshift.train.warmup import heldout_accuracy

    cfg = tiny(tmp_path)
    task = build_task(cfg)
    lm = build_policy(cfg, task).lm
    items = task.heldout()
    key = lambda p: tuple(task.prompt(p))  # noqa: E731  (task.heldout() makes new objects: its prompt names one)
    assert len({key(p) for p in items}) == len(items)
    good = {key(p) for p in items[::3]}  # "exact" for every third problem, whatever was generated

    class Marked:
        def __getattr__(self, name):
            return getattr(task, name)

        def score(self, item, response):
            return task.score(item, response)[0], key(item) in good

    marked, n = Marked(), cfg.rollout.max_new_tokens
    assert heldout_accuracy(lm, marked, n) == pytest.approx(len(good) / len(items))
    assert heldout_accuracy(lm, marked, n, items=items[:6]) == pytest.approx(2 / 6)  # items 0 and 3
    assert heldout_accuracy(lm, marked, n, items=items[1:3]) == 0.0
    with pytest.raises(ValueError):
        heldout_accuracy(lm, marked, n, items=[])
