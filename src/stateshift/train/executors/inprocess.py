"""The rollout side in a thread of the trainer's process (``executor=inprocess``, the default).

``RolloutWorker.run`` is a rollouter's whole life, in this executor on the
rollout thread and under Ray inside the rollouter actor::

    loop:
        a weight update posted?  -> copy it in, new version, ack (partial rollouts keep their tokens)
        no wave in flight?       -> ask the queue for prompts: orphans of a dead rollouter first, else
                                    as many as the staleness rules allow (or wait, bounded)
        generate the wave        -> returns when finished, or paused by a posted update
        finished?                -> score it, put its groups in the queue

Every wait is bounded; any exception ends the loop through ``control.fail``,
which stops the run and re-raises the same exception in the trainer thread
within one wait slice (in process), or ends the actor's ``run`` call with it
(Ray).

Why a thread and not a process by default: torch kernels release the GIL,
and at this model size both sides spend most of their time in them; the
numbers are in ``docs/notes/rl-runs.md`` (measured with ``benchmarks/rl_threads_vs_process.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from stateshift import Snapshot

from ..build import rollout_copy
from ..config import TrainConfig
from ..control import SLICE_S, RunControl
from ..handshake import WeightChannel, WeightUpdate
from ..policies import Policy
from ..rollout import Group, KVRollouter, Wave
from ..sampler import CausalLM, Sampling
from ..tasks.base import Task
from .base import QueuePort, RolloutCapture, RolloutStats, SyncOutcome, WorkerReport, take_in_slices
from .hub import QueueHub, hub_args

__all__ = ["InProcessRollouts", "RolloutCapture", "RolloutWorker", "sampling_of"]


def sampling_of(cfg: TrainConfig, task: Task) -> Sampling:
    r = cfg.rollout
    return Sampling(
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_token=task.stop_token,
        pad_token=task.pad_token,
    )


class RolloutWorker:
    """Drives a ``KVRollouter`` (its own model copy) for the async loop; runs on one thread.

    ``owner`` numbers this rollouter among those of the run (a restarted one gets the next number); the
    queue accepts its groups only for prompts it handed to this owner.
    """

    def __init__(
        self,
        rollouter: KVRollouter,
        task: Task,
        port: QueuePort,
        channel: WeightChannel,
        control: RunControl,
        *,
        n: int,
        wave_prompts: int,
        owner: int = 0,
        torch_threads: int = 0,
    ) -> None:
        self.rollouter = rollouter
        self.task = task
        self.port = port
        self.channel = channel
        self.control = control
        self.n = n
        self.wave_prompts = wave_prompts
        self.owner = owner
        self.torch_threads = torch_threads
        self.wave: Wave | None = None
        self.report = WorkerReport(version=rollouter.version)

    @classmethod
    def build(
        cls,
        cfg: TrainConfig,
        task: Task,
        model: CausalLM,
        port: QueuePort,
        control: RunControl,
        *,
        version: int,
        owner: int,
        seed: int,
    ) -> RolloutWorker:
        """A worker over a ``KVRollouter`` of ``model`` (the rollouter's own copy) at ``version``, as both executors
        build it; a weight update posted on its channel pauses the rollouter (partial rollout)."""
        rollouter = KVRollouter(model, sampling_of(cfg, task), seed=seed, version=version)
        return cls(
            rollouter,
            task,
            port,
            WeightChannel(control, rollouter.pause),
            control,
            n=cfg.rollout.n,
            wave_prompts=cfg.rollout.max_concurrent_prompts,
            owner=owner,
            torch_threads=cfg.run.torch_threads,
        )

    def hand_over(self, update: WeightUpdate, *, interrupt: bool) -> SyncOutcome:
        """Called from another thread: post ``update`` and wait (bounded) until this worker's thread took it in."""
        self.channel.post(update, interrupt=interrupt)
        self.channel.wait_acked(update)
        return SyncOutcome(update.captured, update.copy_s)

    # -- the thread -------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self.torch_threads:
                torch.set_num_threads(self.torch_threads)  # OpenMP's thread count is per calling thread
            while not self.control.stopping:
                self._take_weights()
                if self.wave is None and not self._start_wave():
                    continue
                assert self.wave is not None
                self.control.doing["rollout"] = f"generating {len(self.wave.uids)} prompts at v{self.rollouter.version}"
                t0 = time.perf_counter()
                finished = self.rollouter.generate(self.wave)
                if finished:
                    t_score = time.perf_counter()
                    groups = self.wave.groups(self.task.score)
                    self.report.reward_s += time.perf_counter() - t_score
                    reward = getattr(self.task, "reward", None)  # a task scoring with a user's reward counts errors
                    self.report.reward_zeroed = getattr(reward, "zeroed", 0)
                    self.report.tokens += int(sum(int(g.mask.sum()) for g in groups))
                    self.report.busy_s += time.perf_counter() - t0
                    self.port.put(self.owner, groups, self.report)
                    self.wave = None
                    self.control.progress()
                else:
                    self.report.busy_s += time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            self.control.fail("rollout", exc)

    def _start_wave(self) -> bool:
        """Start a wave of the prompts the queue hands out; ``False`` after a bounded wait if it hands out none."""
        version = self.rollouter.version
        got = self.port.start(self.owner, version, self.wave_prompts, SLICE_S)
        if not got:
            self.control.doing["rollout"] = f"paused by the staleness rules at v{version}"
            return False
        uids, items = [u for u, _ in got], [i for _, i in got]
        self.wave = Wave.start(uids, items, [self.task.prompt(i) for i in items], self.n, self.rollouter.sampling)
        return True

    def _take_weights(self) -> None:
        update = self.channel.take()
        if update is None:
            return
        t0 = time.perf_counter()
        self.rollouter.update_weights(update.weights(), update.version)
        update.copy_s = time.perf_counter() - t0
        r = self.report
        r.copy_s, r.copy_bytes, r.version = r.copy_s + update.copy_s, self.rollouter.copy_bytes, update.version
        queue_part = self.port.on_sync(self.owner, r, update.capture)
        captured = self.capture(queue_part) if queue_part is not None else None
        self.channel.ack(update, captured, resume=self.rollouter.resume)

    # -- checkpoints ------------------------------------------------------------------------
    def capture(self, queue_part: dict[str, Any]) -> RolloutCapture:
        """This rollouter's state (call on its thread) with the queue's part (``QueuePort.on_sync``)."""
        wave = self.wave
        if wave is not None:
            wave = Wave(
                uids=list(wave.uids),
                items=list(wave.items),
                n=wave.n,
                prompt_ids=wave.prompt_ids.clone(),
                prompt_mask=wave.prompt_mask.clone(),
                tokens=wave.tokens.clone(),
                logprobs=wave.logprobs.clone(),
                versions=wave.versions.clone(),
                done=wave.done.clone(),
                step=wave.step,
            )
        return RolloutCapture(
            version=self.rollouter.version, sample_rng=self.rollouter.rng_state(), wave=wave, **queue_part
        )

    def restore(self, cap: RolloutCapture) -> None:
        """Continue from ``cap`` (before the thread starts); the queue's part goes to ``QueueHub.restore``."""
        self.rollouter.version = self.report.version = cap.version
        self.rollouter.set_rng_state(cap.sample_rng)
        self.wave = cap.wave


class InProcessRollouts:
    """The rollouter on a thread of this process; the queue shared under ``control.cond``.

    The rollouter's model is built afresh and given ``policy``'s weights (call while they are resident).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        task: Task,
        policy: Policy,
        control: RunControl,
        *,
        version: int,
        capture: RolloutCapture | None = None,
    ) -> None:
        self.control = control
        self.hub = QueueHub(**hub_args(cfg, task), cond=control.cond)
        self.worker = RolloutWorker.build(
            cfg,
            task,
            rollout_copy(cfg, task, policy),
            self.hub,
            control,
            version=version,
            owner=0,
            seed=cfg.run.seed + 1,
        )
        self.rollouter = self.worker.rollouter
        if capture is not None:
            self.hub.restore(capture)
            self.worker.restore(capture)
        self.thread = threading.Thread(target=self.worker.run, name="stateshift-rollout", daemon=True)

    def start(self) -> None:
        self.control.on_stop.append(self.rollouter.pause)
        self.thread.start()

    def take(self, count: int, trainer_version: int, on_wait: Callable[[], None] | None = None) -> list[Group]:
        return take_in_slices(
            self.control, count, lambda need, wait_s: self.hub.take(need, trainer_version, wait_s), on_wait
        )

    def trained(self, count: int) -> int:
        return self.hub.trained(count)

    reads_snapshot = True

    def sync(self, snapshot: Snapshot | None, version: int, *, capture: bool, interrupt: bool) -> SyncOutcome:
        """Post the snapshot; returns once the rollout thread copied it in (the snapshot may be released then)."""
        assert snapshot is not None
        return self.worker.hand_over(WeightUpdate.of_snapshot(snapshot, version, capture=capture), interrupt=interrupt)

    def stats(self) -> RolloutStats:
        return self.hub.stats()

    def describe(self) -> dict[str, Any]:
        q = self.hub.queue
        return {"queue": q.depth(), "in_flight": q.running, "rollout_version": self.rollouter.version}

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop and join; ``False`` if the thread did not end within ``timeout`` (a daemon: it cannot hold the process)."""
        self.control.stop()
        if self.thread.ident is not None:
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def close(self) -> dict[str, Any]:
        return self.hub.close()
