"""The rollouter: KV-cached sampling == full forward, partial rollouts keep tokens and record each token's version,
Hugging Face causal LMs from a local config, weights checked by name."""

from __future__ import annotations

import pytest
import torch
from raises import raises_kind

from stateshift.errors import ConfigError
from stateshift.train.rollout import KVRollouter, Rollouter, Wave
from stateshift.train.sampler import BuiltinLM, HFCausalLM, Sampling, behaviour_logp, positions_of, sequence_logprobs
from stateshift.train.tasks.addition import PAD, STOP
from stateshift.train.tasks.gpt import GPTConfig, build_gpt

PROMPTS = [[1, 2, 3, 10, 4, 5, 6, 11], [7, 10, 8, 11], [9, 9, 10, 1, 11]]  # different lengths: left padding


def _sampling(**kw) -> Sampling:
    return Sampling(**{"temperature": 1.0, "max_new_tokens": 6, "stop_token": STOP, "pad_token": PAD, **kw})


def _check_logprobs(
    lm, wave: Wave, temperature: float, rows_versions: dict[int, object] | None = None, top_p: float = 1.0
) -> None:
    """The recorded l_b equal a full forward's: untruncated at top_p 1, else those of the truncated distribution."""
    full, _ = sequence_logprobs(lm, wave.prompt_ids, wave.prompt_mask, wave.tokens, temperature)
    mask = wave.versions >= 0
    assert mask.any()
    if top_p < 1.0:
        ids = torch.cat([wave.prompt_ids, wave.tokens], 1)
        key = torch.cat([wave.prompt_mask, torch.ones_like(wave.tokens, dtype=torch.bool)], 1)
        logits = lm(ids, positions_of(key), key, None)[:, wave.prompt_ids.shape[1] - 1 : -1]
        trunc = behaviour_logp(logits, _sampling(temperature=temperature, top_p=top_p))
        full = trunc.gather(-1, wave.tokens[..., None])[..., 0]
    assert torch.allclose(full[mask], wave.logprobs[mask], atol=1e-5)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_kv_cache_sampler_matches_full_forward(temperature, top_p):
    lm = BuiltinLM(build_gpt(GPTConfig(max_len=16), seed=3))
    sampling = _sampling(temperature=temperature, top_p=top_p)
    r = KVRollouter(lm, sampling, seed=0)
    assert isinstance(r, Rollouter)
    wave = Wave.start([0, 1, 2], [None] * 3, PROMPTS, 4, sampling)
    assert r.generate(wave)
    _check_logprobs(lm, wave, temperature, top_p=top_p)
    assert (wave.versions[wave.versions >= 0] == 0).all()


def test_same_seed_same_rollout():
    lm = BuiltinLM(build_gpt(seed=1))
    waves = []
    for _ in range(2):
        w = Wave.start([0, 1, 2], [None] * 3, PROMPTS, 4, _sampling())
        KVRollouter(lm, _sampling(), seed=7).generate(w)
        waves.append(w)
    assert torch.equal(waves[0].tokens, waves[1].tokens) and torch.equal(waves[0].logprobs, waves[1].logprobs)


class PauseAfter:
    """A CausalLM that asks its rollouter to pause after ``calls`` forwards (a weight update arriving mid-wave)."""

    def __init__(self, lm, calls: int) -> None:
        self.lm, self.module, self.calls, self.rollouter = lm, lm.module, calls, None

    def new_cache(self):
        return self.lm.new_cache()

    def __call__(self, *args):
        self.calls -= 1
        if self.calls == 0:
            self.rollouter.pause()
        return self.lm(*args)


def test_partial_rollout_spans_the_versions_it_saw():
    old, new = build_gpt(seed=1), build_gpt(seed=2)
    lm = PauseAfter(BuiltinLM(old), calls=4)  # the pause comes after the 4th forward: 3 tokens drawn under version 0
    r = KVRollouter(lm, _sampling(stop_token=None), seed=0)  # no stop token: every row runs all 6 tokens
    lm.rollouter = r
    wave = Wave.start([0, 1, 2], [None] * 3, PROMPTS, 2, r.sampling)
    assert not r.generate(wave)  # paused mid-wave, tokens kept
    assert wave.step == 3
    kept = wave.tokens[:, :3].clone()
    r.update_weights(new.state_dict().items(), version=1)
    r.resume()
    assert r.generate(wave)
    assert torch.equal(wave.tokens[:, :3], kept)
    assert (wave.versions[:, :3] == 0).all() and (wave.versions[:, 3:] == 1).all()
    group = wave.groups(lambda item, toks: (0.0, False))[0]
    assert (group.min_version, group.max_version) == (0, 1)
    # each token's behaviour log-prob is that of the weights that drew it
    old = build_gpt(seed=1)  # the rollouter's model now holds the new weights: rebuild the old ones
    for weights, cols in ((old, slice(0, 3)), (new, slice(3, 6))):
        full, _ = sequence_logprobs(BuiltinLM(weights), wave.prompt_ids, wave.prompt_mask, wave.tokens)
        assert torch.allclose(full[:, cols], wave.logprobs[:, cols], atol=1e-5)
    other, _ = sequence_logprobs(BuiltinLM(old), wave.prompt_ids, wave.prompt_mask, wave.tokens)
    assert not torch.allclose(other[:, 3:], wave.logprobs[:, 3:], atol=1e-3)  # the check above can fail


def test_update_weights_names_the_first_bad_tensor():
    r = KVRollouter(BuiltinLM(build_gpt(seed=1)), _sampling(), seed=0)
    good = dict(build_gpt(seed=2).state_dict())
    with raises_kind(ConfigError, "weight_sync", match="'head.weight': not sent, but the rollout model has it"):
        r.update_weights([(k, v) for k, v in good.items() if k != "head.weight"], 1)
    with raises_kind(ConfigError, "weight_sync", match="'nope': not in the rollout model"):
        r.update_weights([("nope", torch.zeros(1))], 1)
    with raises_kind(ConfigError, "weight_sync", match="'tok.weight'"):
        r.update_weights([("tok.weight", torch.zeros(3, 3))], 1)
    assert r.version == 0


def test_update_weights_closes_the_pairs_it_was_given_when_a_tensor_is_bad():
    """The pairs may be a generator inside a weight receiver's read (``LibraryReceiver.pairs``): a copy that
    fails half-way must end that read at once, not leave it open until the generator is collected (the
    receiver would hold the version, and its next read or close on this thread would be reentrant)."""
    r = KVRollouter(BuiltinLM(build_gpt(seed=1)), _sampling(), seed=0)
    good = dict(build_gpt(seed=2).state_dict())
    ended = []

    def pairs():
        try:
            yield from good.items()
            yield ("tok.weight", torch.zeros(3, 3))
        finally:
            ended.append(True)

    gen = pairs()
    with raises_kind(ConfigError, "weight_sync", match="'tok.weight'"):
        r.update_weights(gen, 1)
    assert ended == [True]  # closed before update_weights raised (``gen`` is still referenced here)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import transformers  # in the test extra: a missing install fails here, it is not skipped

    cfg = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    cfg.save_pretrained(path)
    return path


def test_hf_causal_lm_from_a_local_config(hf_dir):
    from stateshift.train.build import load_hf

    lm = HFCausalLM(load_hf(str(hf_dir), 14, seed=0))
    sampling = _sampling()
    r = KVRollouter(lm, sampling, seed=0)
    wave = Wave.start([0, 1, 2], [None] * 3, PROMPTS, 3, sampling)
    assert r.generate(wave)
    _check_logprobs(lm, wave, 1.0)


def test_hf_model_trains_in_the_async_loop(hf_dir, tmp_path):
    from rl.rlkit import tiny

    from stateshift.train.launch import run

    result = run(
        tiny(
            tmp_path,
            "model.family=hf",
            f"model.hf_path={hf_dir}",
            "trainer.steps=4",
            "async_training.trigger_parameter_sync_step=2",
        )
    )
    assert result.summary["status"] == "finished" and result.summary["sync"]["syncs"] == 2
    assert result.summary["sync"]["rollouter_copy_bytes"] == 2 * result.summary["sync"]["param_bytes"]
