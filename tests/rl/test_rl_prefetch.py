"""Prefetch (``trainer.prefetch``): what a step reads is onloaded ahead and waited for just before its first read;
the result is the same bit for bit; on CUDA the copy is ordered on a stream of its own. Also: what an offload does
with the device memory it frees (``trainer.freed_memory``), and no pi_old snapshot in the modes that never swap."""

from __future__ import annotations

import importlib.util
import json
import random
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from rlkit import parked_trainer, tiny

from stateshift.core.engine import core_of
from stateshift.train import prefetch as prefetch_mod
from stateshift.train.launch import run
from stateshift.train.rollout import Wave
from stateshift.train.trainer import Batch, Trainer, frees_device_memory

#: every group parked between steps, prefetch on (tests comparing on and off override it: the later setting wins)
ALL_OFFLOADS = (
    "trainer.param_offload=true",
    "trainer.optimizer_offload=true",
    "trainer.grad_offload=true",
    "trainer.prefetch=true",
)


def _timer(name: str) -> nullcontext[None]:
    return nullcontext()


def _batches(cfg, n: int) -> list[Batch]:
    """``n`` mini-batches drawn once by a fresh policy's rollouter (the same for every trainer compared)."""
    task, _, _, rollouter = parked_trainer(cfg)
    out = []
    for k in range(n):
        items = [task.sample(random.Random(100 * k + i)) for i in range(cfg.trainer.batch_prompts)]
        wave = Wave.start(
            list(range(len(items))), items, [task.prompt(i) for i in items], cfg.rollout.n, rollouter.sampling
        )
        assert rollouter.generate(wave)
        out.append(Batch.of(wave.groups(task.score), task.pad_token))
    return out


def _train(cfg, batches: list[Batch], steps: int) -> tuple[Trainer, list[float]]:
    """A fresh trainer, parked before every step (as when it waits for samples), ``steps`` steps of
    ``require_batches`` mini-batches each, a sync (version += 1, new cycle) every ``trigger`` steps."""
    _, _, trainer, _ = parked_trainer(cfg)
    a = cfg.async_training
    trainer.trigger = a.trigger_parameter_sync_step
    losses: list[float] = []
    for step in range(steps):
        mine = batches[step * a.require_batches : (step + 1) * a.require_batches]
        losses += [s["loss"] for s in trainer.train_step(mine, _timer)]
        assert not trainer.prefetcher.inflight  # nothing stays in flight past a step
        if (step + 1) % a.trigger_parameter_sync_step == 0:
            trainer.version += 1
            trainer.begin_cycle()
        trainer.park()
    return trainer, losses


@pytest.mark.parametrize("mode", ["pi_old", "proximal", "bypass", "loglinear"])
def test_prefetch_on_and_off_train_the_same_bits(tmp_path, mode):
    common = (
        *ALL_OFFLOADS,
        f"trainer.old_logprob={mode}",
        "async_training.require_batches=2",
        "async_training.trigger_parameter_sync_step=2",
    )
    on, off = tiny(tmp_path, *common, "trainer.prefetch=true"), tiny(tmp_path, *common, "trainer.prefetch=false")
    batches = _batches(on, 8)
    a, losses_a = _train(on, batches, 4)
    b, losses_b = _train(off, batches, 4)
    assert losses_a == losses_b  # exact float equality
    a.state.onload(), b.state.onload()
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert any(k.startswith("prefetch_wait.") for k in a.meter.seconds)  # the prefetch path really ran
    assert not any(k.startswith("prefetch_wait.") for k in b.meter.seconds)
    moved = {k: v for k, v in a.meter.nbytes.items() if not k.startswith("prefetch_wait.")}
    assert moved == b.meter.nbytes  # the same bytes moved, by the same verbs
    if mode == "pi_old":
        assert a.cycle.stats.swaps == b.cycle.stats.swaps > 0


def _recorded_step(cfg, sync: bool = True) -> list[str]:
    """The verbs, forwards and optimizer steps of a trainer's second step (the first makes the grads and the
    optimizer state), in order, the real ModelState on the CPU; a park (and a sync, ``sync``) between the two."""
    batches = _batches(cfg, 2)
    trainer, _ = _train(cfg, batches[:1], 1)
    assert (trainer.updates_in_cycle == 0) is sync
    events: list[str] = []
    state, pf, policy = trainer.state, trainer.prefetcher, trainer.policy
    onload, wait, logprobs, step, old_policy = (
        state.onload,
        pf.wait,
        trainer._logprobs,
        policy.step,
        trainer.cycle.old_policy,
    )

    def rec_onload(group, **kw):
        events.append(f"onload {group}")
        return onload(group, **kw)

    def rec_wait(group):
        if group in pf.inflight:
            events.append(f"wait {group}")
        return wait(group)

    def rec_logprobs(batch, *, with_entropy=False):
        events.append("forward with grad" if with_entropy else "forward")
        return logprobs(batch, with_entropy=with_entropy)

    @contextmanager
    def rec_old_policy():
        assert not pf.inflight
        events.append("swap in")
        with old_policy():
            yield
        events.append("swap out")

    def rec_step(loss):
        events.append("step")
        assert not pf.inflight, state.residency()
        assert all(state.residency()[g]["host"] == 0 for g in ("params", "grads", "optim")), state.residency()
        return step(loss)

    state.onload, pf.wait, trainer._logprobs, policy.step = rec_onload, rec_wait, rec_logprobs, rec_step
    trainer.cycle.old_policy = rec_old_policy
    trainer.train_step(batches[1:], _timer)
    return events


def test_prefetch_issues_the_onloads_first_and_waits_just_before_each_first_read(tmp_path):
    cfg = tiny(
        tmp_path,
        *ALL_OFFLOADS,
        "trainer.old_logprob=pi_old",
        "trainer.prefetch=true",
        "async_training.trigger_parameter_sync_step=1",
    )
    assert _recorded_step(cfg) == [
        "onload params",
        "onload optim",
        "onload grads",  # issued before any compute of the step
        "wait params",
        "forward",  # the old log-probs: the first read of the params
        "forward with grad",  # the update's forward: optimizer state and grads still on their way
        "wait grads",
        "wait optim",
        "step",  # waited for just before the backward and optimizer step
    ]


def test_without_prefetch_each_group_is_onloaded_where_it_is_first_needed(tmp_path):
    cfg = tiny(
        tmp_path,
        *ALL_OFFLOADS,
        "trainer.old_logprob=pi_old",
        "trainer.prefetch=false",
        "async_training.trigger_parameter_sync_step=1",
    )
    assert _recorded_step(cfg) == [
        "onload params",
        "forward",
        "onload optim",
        "onload grads",
        "forward with grad",
        "step",
    ]


def test_a_pi_old_swap_runs_with_nothing_in_flight_and_the_prefetch_follows_it(tmp_path):
    """Later in a cycle the first forward runs under pi_old swapped into the released params: nothing is prefetched
    before it (Megatron's rebuild of the params reads the optimizer state), everything right after it."""
    cfg = tiny(
        tmp_path,
        *ALL_OFFLOADS,
        "trainer.old_logprob=pi_old",
        "trainer.prefetch=true",
        "async_training.trigger_parameter_sync_step=2",
    )
    assert _recorded_step(cfg, sync=False) == [
        "swap in",
        "forward",
        "swap out",  # the old log-probs under pi_old, nothing in flight
        "onload params",
        "onload optim",
        "onload grads",
        "wait params",
        "forward with grad",
        "wait grads",
        "wait optim",
        "step",
    ]


class _Event:
    """A stand-in for ``torch.cuda.Event``: named when recorded; ``at`` is its time in ms on the stream's clock."""

    def __init__(self, log: list[str], at: dict[str, float]) -> None:
        self.log, self.at, self.name = log, at, "?"

    def synchronize(self) -> None:
        self.log.append(f"host waits for {self.name}")

    def elapsed_time(self, end: _Event) -> float:
        return self.at[end.name] - self.at[self.name]


class _Stream:
    """A stand-in for ``torch.cuda.Stream``: records what is ordered on it."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.device = log, name, torch.device("cuda", 0)

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def record_event(self, event: _Event) -> _Event:
        event.name = f"{self.name}:{sum(line.startswith(self.name + ' records') for line in self.log) + 1}"
        self.log.append(f"{self.name} records {event.name}")
        return event

    def wait_event(self, event: _Event) -> None:
        self.log.append(f"{self.name} waits for {event.name}")


def _fake_cuda(monkeypatch, log: list[str], at: dict[str, float]) -> _Stream:
    """CUDA's stream and event calls replaced by recorders; returns the compute stream."""
    compute, side = _Stream(log, "compute"), _Stream(log, "prefetch")
    current = [compute]

    class _On:
        def __init__(self, stream: _Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current[0] = self.stream

        def __exit__(self, *exc: object) -> None:
            current[0] = compute

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _Event(log, at))
    monkeypatch.setattr(torch.cuda, "stream", _On)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    return compute


class _FakeState:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def residency(self):
        return {"optim": {"host": 1}, "grads": {"host": 1}}

    def nbytes(self, group):
        return 8

    def onload(self, group):
        self.log.append(f"onload {group}")


def test_on_cuda_the_compute_stream_waits_for_the_onload_event_and_the_host_does_not(monkeypatch):
    """The protocol of ``Prefetch`` with CUDA's stream calls replaced by recorders (the state itself on the CPU):
    the onload on the prefetch stream, the compute stream ordered after it at ``wait``, the host blocked only in
    ``settle``, and the stall read from the events there (the compute stream reached the wait at 5 ms, the copy
    was done at 9 ms: a 4 ms stall)."""
    log: list[str] = []
    at = {"compute:1": 5.0, "prefetch:1": 9.0}
    _fake_cuda(monkeypatch, log, at)
    seen: list[tuple[str, float, int]] = []
    pf = prefetch_mod.Prefetch(_FakeState(log), torch.device("cuda", 0), lambda key, s, n: seen.append((key, s, n)))  # type: ignore[arg-type]
    pf.issue("optim")
    log.append("forward")
    assert pf.wait("optim") and not pf.wait("optim")
    log.append("backward")
    pf.settle()
    assert log == [
        "prefetch waits for compute",
        "onload optim",
        "prefetch records prefetch:1",
        "forward",
        "compute records compute:1",
        "compute waits for prefetch:1",
        "backward",
        "host waits for compute:1",
        "host waits for prefetch:1",
    ]
    assert [(k, n) for k, _, n in seen] == [("onload.optim", 8), ("prefetch_wait.optim", 0)]
    assert seen[1][1] == pytest.approx(0.004)
    assert pf.stalls == [] and pf.inflight == {}
    pf.issue("optim")
    with pytest.raises(ValueError, match="already"):
        pf.issue("optim")


def test_a_copy_done_before_its_wait_stalls_nothing_and_settle_blocks_for_what_is_still_in_flight(monkeypatch):
    """A copy done before the compute stream reached its wait counts 0 (not a negative time); a group still in
    flight at ``settle`` is waited for by the host there, and that wait is what is counted."""
    log: list[str] = []
    at = {"compute:1": 9.0, "prefetch:1": 5.0}
    _fake_cuda(monkeypatch, log, at)
    seen: list[tuple[str, float]] = []
    pf = prefetch_mod.Prefetch(_FakeState(log), torch.device("cuda", 0), lambda key, s, n: seen.append((key, s)))  # type: ignore[arg-type]
    pf.issue("optim")
    pf.issue("grads")
    pf.wait("optim")
    pf.settle()
    assert log[-4:] == [
        "compute waits for prefetch:2",
        "host waits for prefetch:2",
        "host waits for compute:1",
        "host waits for prefetch:1",
    ]
    assert [k for k, _ in seen] == ["onload.optim", "onload.grads", "prefetch_wait.grads", "prefetch_wait.optim"]
    assert seen[-1][1] == 0.0
    assert pf.inflight == {} and pf.stalls == []


@pytest.mark.parametrize(
    ("setting", "executor", "device", "rollout_device", "expected"),
    [
        ("auto", "inprocess", "cuda:0", None, False),  # one process: its caching allocator serves both sides
        ("auto", "process", "cuda:0", None, True),  # a rollouter process on the trainer's GPU
        ("auto", "process", "cuda:0", "cuda:0", True),
        ("auto", "process", "cuda:0", "cuda:1", False),  # ... on another GPU: nobody else wants this memory
        ("auto", "ray", "cuda:0", None, True),  # an actor, colocated on a one-GPU cluster
        ("auto", "process", "cpu", None, False),  # no effect on the CPU
        ("driver", "inprocess", "cuda:0", None, True),
        ("cache", "process", "cuda:0", None, False),
    ],
)
def test_freed_memory_goes_to_the_driver_only_where_another_process_may_want_it(
    setting, executor, device, rollout_device, expected
):
    assert frees_device_memory(setting, executor, torch.device(device), rollout_device) is expected


def test_the_trainer_builds_its_state_with_the_resolved_setting(tmp_path):
    for setting, free in (("cache", False), ("driver", True), ("auto", True)):  # auto without a run: the driver
        _, _, trainer, _ = parked_trainer(tiny(tmp_path, f"trainer.freed_memory={setting}"))
        assert trainer.state.free_device_memory is free


@pytest.mark.parametrize("mode", ["bypass", "proximal", "loglinear", "pi_old"])
def test_no_pi_old_snapshot_in_the_modes_that_never_swap(tmp_path, mode):
    cfg = tiny(
        tmp_path,
        f"trainer.old_logprob={mode}",
        "async_training.require_batches=2",
        "async_training.trigger_parameter_sync_step=2",
    )
    trainer, _ = _train(cfg, _batches(cfg, 6), 3)
    tags = {snap.tag for snap in core_of(trainer.state).snapshots}
    verbs = set(trainer.meter.seconds)
    if mode == "pi_old":  # (the control: the mode that swaps keeps its snapshot)
        assert tags == {"pi_old"} and trainer.cycle.stats.snapshots == 2 and "swap.pi_old" in verbs
        return
    assert tags == set() and trainer.cycle.stats.snapshots == 0 and trainer.cycle.stats.swaps == 0
    assert not {"snapshot.pi_old", "swap.pi_old"} & verbs


def test_a_run_with_prefetch_equals_one_without(tmp_path):
    """Through the loop (``AsyncLoop.train_step`` prefetches once the samples are in hand): the same losses and
    weights; ``tests/gpu/test_rl_prefetch_gpu.py`` runs this on CUDA for every family."""
    common = [
        "trainer.steps=4",
        "async_training.staleness_threshold=0",
        "async_training.trigger_parameter_sync_step=2",
        "async_training.require_batches=2",
        "run.eval_every=1",
        *ALL_OFFLOADS,
        "trainer.old_logprob=pi_old",
    ]
    on = run(tiny(tmp_path / "on", *common, "trainer.prefetch=true"), return_params=True)
    off = run(tiny(tmp_path / "off", *common, "trainer.prefetch=false"), return_params=True)
    assert on.losses == off.losses and on.params is not None and off.params is not None
    assert all(torch.equal(on.params[k], v) for k, v in off.params.items())
    waits = {k for k in on.summary["offload"]["seconds"] if k.startswith("prefetch_wait.")}
    assert waits == {"prefetch_wait.params", "prefetch_wait.grads", "prefetch_wait.optim"}


def test_the_overlap_benchmark_runs_its_path_on_the_cpu(tmp_path):
    """``benchmarks/prefetch_bench.py --small``: its measurements and fields (no overlap to see on the CPU)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prefetch_bench.py"
    spec = importlib.util.spec_from_file_location("prefetch_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--small", "--out", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert {"forward_s", "onload_s", "sequential_s", "prefetched_s", "overlap", "prefetch_wait_s"} <= r.keys()
    assert r["device"] == "cpu" and r["optim_bytes"] > 0


@pytest.mark.parametrize("verb", ["park", "sync_snapshot", "begin_cycle", "take_reference", "close", "resident"])
def test_every_other_verb_waits_for_the_onloads_in_flight_first(tmp_path, verb):
    cfg = tiny(
        tmp_path,
        *ALL_OFFLOADS,
        "trainer.old_logprob=pi_old",
        "trainer.kl_coef=0.1",
        "async_training.trigger_parameter_sync_step=1",
    )
    trainer, _ = _train(cfg, _batches(cfg, 1), 1)  # (then a sync: the next step begins without a swap)
    trainer.prefetch_step()
    assert set(trainer.prefetcher.inflight) == {"params", "grads", "optim"}
    order: list[str] = []
    settle, state_verbs = trainer.prefetcher.settle, ("offload", "snapshot", "close", "onload")
    trainer.prefetcher.settle = lambda: (order.append("settle"), settle())[1]  # type: ignore[method-assign]
    wait = trainer.prefetcher.wait
    trainer.prefetcher.wait = lambda group: (
        order.append(f"wait {group}")
        if group in trainer.prefetcher.inflight  # type: ignore[method-assign]
        else None,
        wait(group),
    )[1]
    for name in state_verbs:
        real = getattr(trainer.state, name)
        setattr(trainer.state, name, lambda *a, _real=real, _name=name, **k: (order.append(_name), _real(*a, **k))[1])
    if verb == "resident":
        with trainer.resident():
            pass
    else:
        getattr(trainer, verb)()
    assert not trainer.prefetcher.inflight
    first_verb = next((i for i, e in enumerate(order) if e in state_verbs), len(order))
    assert any(e == "settle" or e.startswith("wait ") for e in order[:first_verb]), order
