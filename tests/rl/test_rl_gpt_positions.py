"""The built-in GPT's positions: rotary ones give what a full forward gives through either KV cache, depend on the
offsets between tokens only, and are chosen by ``model.positions``."""

from __future__ import annotations

import pytest
import torch

from stateshift.train.config import resolve
from stateshift.train.tasks.gpt import GPTConfig, KVCache, SlotCache, build_gpt


def _rotary(max_len: int = 64):
    return build_gpt(GPTConfig(vocab=16, width=32, layers=2, heads=4, max_len=max_len, positions="rotary"), seed=0)


def test_rotary_kv_cache_and_slot_cache_equal_a_full_forward():
    model = _rotary()
    ids = torch.randint(0, 16, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :12], cache=cache)] + [model(ids[:, i : i + 1], cache=cache) for i in range(12, 20)]
        slots = SlotCache.empty(model.cfg, 3, torch.device("cpu"))
        pos = torch.arange(20).expand(3, 20)
        slotted = [model(ids[:, :12], pos[:, :12], cache=slots)]
        slotted += [model(ids[:, i : i + 1], pos[:, i : i + 1], cache=slots) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(slotted, 1), full, atol=1e-5, rtol=1e-5)


def test_rotary_output_depends_on_offsets_only():
    ids = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(10).expand(2, 10)
    rotary = _rotary()
    learned = build_gpt(GPTConfig(vocab=16, width=32, layers=2, heads=4, max_len=64), seed=0)
    with torch.no_grad():
        torch.testing.assert_close(rotary(ids, pos + 40), rotary(ids, pos), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(learned(ids, pos + 40), learned(ids, pos), atol=1e-3)
    assert rotary.pos is None and not any("pos." in name for name in rotary.state_dict())


def test_model_positions_key_and_its_checks():
    assert resolve(None, []).model.positions == "learned"
    assert resolve(None, ["model.positions=rotary"]).model.positions == "rotary"
    with pytest.raises(Exception, match="model.positions"):
        resolve(None, ["model.positions=rotary", "model.width=12", "model.heads=4"])  # head width 3: odd
    with pytest.raises(ValueError, match="model.positions"):
        GPTConfig(positions="alibi")
