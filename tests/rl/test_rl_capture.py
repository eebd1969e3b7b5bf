"""A checkpoint's rollout capture brings back the queue, the wave in flight (kept tokens) and both random states."""

from __future__ import annotations

import torch

from stateshift.train.config import AsyncConfig
from stateshift.train.control import RunControl
from stateshift.train.executors.hub import QueueHub
from stateshift.train.executors.inprocess import RolloutWorker
from stateshift.train.handshake import WeightChannel
from stateshift.train.rollout import KVRollouter
from stateshift.train.sampler import BuiltinLM, Sampling
from stateshift.train.sidecar import read_sidecar, write_sidecar
from stateshift.train.tasks.addition import AdditionTask
from stateshift.train.tasks.gpt import build_gpt


def _worker(seed: int = 0) -> RolloutWorker:
    task = AdditionTask()
    sampling = Sampling(max_new_tokens=5, stop_token=task.stop_token, pad_token=task.pad_token)
    control = RunControl()
    rollouter = KVRollouter(BuiltinLM(build_gpt(seed=1)), sampling, seed=seed)
    hub = QueueHub(AsyncConfig(staleness_threshold=1.0), 4, task, seed=seed + 1, cond=control.cond)
    return RolloutWorker(rollouter, task, hub, WeightChannel(control, rollouter.pause), control, n=3, wave_prompts=4)


def _advance(w: RolloutWorker, *, pause_after_tokens: int | None = None) -> None:
    """One wave, on this thread; optionally stop it after some tokens (as a sync would)."""
    assert w._start_wave()
    assert w.wave is not None
    if pause_after_tokens is None:
        assert w.rollouter.generate(w.wave)
        w.port.put(w.owner, w.wave.groups(w.task.score), w.report)
        w.wave = None
        return
    lm = w.rollouter.lm
    calls = {"n": 0}

    class Pausing:
        module = lm.module

        def new_cache(self):
            return lm.new_cache()

        def __call__(self, *args):
            calls["n"] += 1
            if calls["n"] == pause_after_tokens + 1:
                w.rollouter.pause()
            return lm(*args)

    w.rollouter.lm = Pausing()
    assert not w.rollouter.generate(w.wave)
    w.rollouter.lm = lm
    w.rollouter.resume()


def _finish(w: RolloutWorker) -> list:
    assert w.wave is not None and w.rollouter.generate(w.wave)
    out = w.wave.groups(w.task.score)
    _advance(w)
    return out + list(w.port.queue.items)


def test_capture_restore_continues_identically(tmp_path):
    a = _worker()
    _advance(a)  # one finished wave in the queue
    _advance(a, pause_after_tokens=2)  # a wave in flight with 2 tokens kept
    captured = a.capture(a.port.on_sync(a.owner, a.report, capture=True))
    write_sidecar(tmp_path, step=1, version=0, capture=captured, extra={})  # through the checkpoint's sidecar
    b = _worker(seed=5)  # other seeds: everything that matters must come from the capture
    cap = read_sidecar(tmp_path).capture
    assert cap is not None
    b.port.restore(cap)
    b.restore(cap)
    assert [g.uid for g in b.port.queue.items] == [g.uid for g in a.port.queue.items]
    assert b.wave is not None and b.wave.step == 2 and b.port.next_uid == a.port.next_uid
    got_a, got_b = _finish(a), _finish(b)
    assert len(got_a) == len(got_b) > 4
    for x, y in zip(got_a, got_b, strict=True):
        assert x.uid == y.uid and x.item == y.item
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.logprobs, y.logprobs)
    assert b.port.queue.ledger.as_dict() == a.port.queue.ledger.as_dict()


def test_capture_without_restore_differs():
    """The check above can fail: a worker that is not restored continues differently."""
    a, b = _worker(), _worker(seed=5)
    _advance(a, pause_after_tokens=2)
    _advance(b, pause_after_tokens=2)
    assert not torch.equal(_finish(a)[0].tokens, _finish(b)[0].tokens)
