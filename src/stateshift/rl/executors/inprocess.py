"""The rollout side in a thread of the trainer's process.

``RolloutWorker.run`` is the rollout thread's whole life::

    loop:
        a weight update posted?  -> copy it in, new version, ack (partial rollouts keep their tokens)
        no wave in flight?       -> admit as many prompts as the staleness rules allow (or wait)
        generate the wave        -> returns when finished, or paused by a posted update
        finished?                -> score it, put its groups in the queue

Every wait is ``RunControl.wait_for`` (bounded slices); any exception ends
the thread through ``control.fail``, which stops the run and re-raises the
same exception in the trainer thread within one wait slice.

Why a thread and not a process: torch kernels release the GIL, and at this
model size both sides spend most of their time in them; the numbers are in
``docs/rl.md`` (measured with ``benchmarks/rl_threads_vs_process.py``).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..control import RunControl
from ..queue import SampleQueue
from ..rollout import Group, KVRollouter, Wave
from ..sync import WeightChannel
from ..tasks.base import Task


@dataclass
class RolloutCapture:
    """The rollout thread's state at a sync, enough to continue exactly where it was (checkpoints)."""

    version: int
    prompt_rng: Any
    sample_rng: torch.Tensor
    next_uid: int
    wave: Wave | None
    queued: list[Group]
    running: int
    staleness_samples: int
    ledger: dict[str, Any]


class RolloutWorker:
    """Drives a ``KVRollouter`` (its own model copy) for the async loop; runs on its own thread."""

    def __init__(self, rollouter: KVRollouter, task: Task, queue: SampleQueue, channel: WeightChannel,
                 control: RunControl, *, n: int, wave_prompts: int, seed: int, torch_threads: int = 0) -> None:
        self.rollouter = rollouter
        self.task = task
        self.queue = queue
        self.channel = channel
        self.control = control
        self.n = n
        self.wave_prompts = wave_prompts
        self.torch_threads = torch_threads
        self.prompt_rng = random.Random(seed)
        self.next_uid = 0
        self.wave: Wave | None = None
        #: seconds spent generating (and scoring), and in ``update_weights``
        self.busy_s = 0.0
        self.copy_s = 0.0
        self.tokens_generated = 0

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
                    groups = self.wave.groups(self.task.score)
                    self.tokens_generated += int(sum(int(g.mask.sum()) for g in groups))
                    with self.control.cond:
                        self.queue.put(groups)
                        self.wave = None
                        self.control.progress()
                        self.control.cond.notify_all()
                self.busy_s += time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer thread
            self.control.fail("rollout", exc)

    def _start_wave(self) -> bool:
        """Admit prompts (under the staleness rules) and start a wave; ``False`` after a bounded wait if none may start."""
        with self.control.cond:
            count = self.queue.admissible(self.rollouter.version, self.wave_prompts)
            if count == 0:
                self.control.doing["rollout"] = (f"paused by staleness rules at v{self.rollouter.version} "
                                                 f"({self.queue.staleness_samples}/{self.queue.max_required} admitted)")
                self.control.check()
                self.control.cond.wait(0.05)
                return False
            self.queue.admit(count)
        items = [self.task.sample(self.prompt_rng) for _ in range(count)]
        uids = list(range(self.next_uid, self.next_uid + count))
        self.next_uid += count
        self.wave = Wave.start(uids, items, [self.task.prompt(i) for i in items], self.n, self.rollouter.sampling)
        return True

    def _take_weights(self) -> None:
        update = self.channel.take()
        if update is None:
            return
        t0 = time.perf_counter()
        snap = update.snapshot.wait()
        self.rollouter.update_weights(snap.views(), update.version)
        update.copy_s = time.perf_counter() - t0
        self.copy_s += update.copy_s
        with self.control.cond:
            self.queue.on_sync()
            captured = self.capture() if update.capture else None
            self.channel.ack(update, captured)
        self.rollouter.resume()

    # -- checkpoints ------------------------------------------------------------------------
    def capture(self) -> RolloutCapture:
        """This thread's state (call on this thread, with ``control.cond`` held)."""
        wave = self.wave
        if wave is not None:
            wave = Wave(uids=list(wave.uids), items=list(wave.items), n=wave.n, prompt_ids=wave.prompt_ids.clone(),
                        prompt_mask=wave.prompt_mask.clone(), tokens=wave.tokens.clone(), logprobs=wave.logprobs.clone(),
                        versions=wave.versions.clone(), done=wave.done.clone(), step=wave.step)
        return RolloutCapture(
            version=self.rollouter.version, prompt_rng=self.prompt_rng.getstate(), sample_rng=self.rollouter.rng_state(),
            next_uid=self.next_uid, wave=wave, queued=list(self.queue.items), running=self.queue.running,
            staleness_samples=self.queue.staleness_samples, ledger=self.queue.ledger.as_dict(),
        )

    def restore(self, cap: RolloutCapture) -> None:
        """Continue from ``cap`` (before the thread starts)."""
        from ..queue import Ledger

        self.rollouter.version = cap.version
        self.prompt_rng.setstate(cap.prompt_rng)
        self.rollouter.set_rng_state(cap.sample_rng)
        self.next_uid = cap.next_uid
        self.wave = cap.wave
        self.queue.items.extend(cap.queued)
        self.queue.running = cap.running
        self.queue.staleness_samples = cap.staleness_samples
        self.queue.ledger = Ledger.from_dict(cap.ledger)


class ThreadExecutor:
    """Runs a ``RolloutWorker`` on a thread; ``stop`` pauses generation, wakes every waiter and joins."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker
        self.thread = threading.Thread(target=worker.run, name="stateshift-rollout", daemon=True)

    def start(self) -> None:
        self.worker.control.on_stop.append(self.worker.rollouter.pause)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop and join; ``False`` if the thread did not end within ``timeout`` (it is a daemon: it cannot hold the process)."""
        self.worker.control.stop()
        self.thread.join(timeout)
        return not self.thread.is_alive()
