"""``train_here``: the fully-asynchronous RL loop, top to bottom (``launch.run`` locks the run directory and picks
the executor).

    build the task and the policy; warm it up (or resume from a checkpoint)
    trainer (owns its ModelState) + the rollout side (``executor``: a rollouter on a thread, or
    rollouter and queue as Ray actors; its own model copy either way)
    start the rollouter and the watchdog
    for each trainer step:
        wait (bounded) for require_batches x batch_prompts groups
        (parking params etc. first, if the config offloads them and the groups are not queued yet)
        prefetch what is parked (trainer.prefetch: the copies overlap the batch building and the forwards)
        per mini-batch: old log-probs (bypass / pi_old / proximal), loss, step
        every trigger_parameter_sync_step steps: version += 1, host snapshot -> rollouter, new pi_old cycle
        every checkpoint_every steps (at a sync): the rollout side's capture; checkpoint once the step is logged
        log metrics; held-out accuracy every eval_every steps
    stop the rollout thread, account for every group left, final held-out accuracy, curves

Failure on either side stops both within one wait slice and the original
exception propagates out of ``run`` (``RunControl``); Ctrl-C does the same
with ``KeyboardInterrupt`` (under ``stateshift train`` the signal handler only
sets the stop flag, ``control.StopSignals``: the loop raises it at its next
step boundary or wait). ``summary.json`` is written in every case, during
start-up (building, loading the checkpoint, warm-up) too (``StartUp``), except
when a resume is refused before anything started (a damaged checkpoint: the
error names the file, nothing in the run directory changes). Under
Ray a rollouter actor that dies is restarted instead (``executors/ray.py``).

With ``executor=ray`` the trainer itself runs in a Ray actor: ``launch.run``
(the driver) holds the run directory's lock and starts it; the actor runs
``train_here`` below, the same code as in process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from stateshift import StateShiftError
from stateshift.checkpoint.commit import write_durable

from . import config as config_mod
from .build import build_policy, build_task
from .checkpointing import Resumed, resume_checkpoint, save_checkpoint
from .config import TrainConfig
from .control import RunControl, Watchdog, describe_sides, on_stop_signal
from .executors.base import RolloutCapture, Rollouts, RolloutStats
from .executors.weights import trainer_pool
from .metrics import MetricsLog, Progress, plot_curves, read_records
from .report import step_metrics, summarize
from .rollout import Group
from .trainer import Batch, Trainer, frees_device_memory
from .warmup import fresh_optimizer_state, heldout_accuracy, supervised_warmup


@dataclass
class RunResult:
    """What ``run`` returns (and writes to ``summary.json``)."""

    out_dir: Path
    heldout_accuracy_start: float
    heldout_accuracy_end: float
    steps: int
    wall_s: float
    summary: dict[str, Any] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    #: the trainer's final params (host copies), when ``run(..., return_params=True)``
    params: dict[str, torch.Tensor] | None = None
    #: the uid of every group trained, in training order (each at most once; steps since the start or resume)
    trained_uids: list[int] = field(default_factory=list)


#: builds the rollout side: ``(cfg, task, trainer's ``Policy`` (resident), control, version=, capture=)``, and
#: ``state=`` (the trainer's ``ModelState``, which the weight-sync library publishes from) if it ``takes_state``
RolloutsFactory = Callable[..., Rollouts]


def train_here(
    cfg: TrainConfig, out: Path, resume: bool, stream: TextIO, return_params: bool, rollouts: RolloutsFactory
) -> RunResult:
    """The run in this process (the caller holds the run directory's lock); ``rollouts`` builds the rollout side.

    ``summary.json`` is written on every way out once the run directory is locked: by ``StartUp`` if start-up
    (building, loading the checkpoint, warm-up) is interrupted or fails -- except a checkpoint or config refused
    before anything started, which changes nothing --, by ``AsyncLoop.finish`` after that. Under ``StopSignals``
    (``stateshift train``) Ctrl-C is a stop request from the moment the loop exists (``RunControl.interrupt``): the
    loop raises ``KeyboardInterrupt`` at its next step boundary or wait; a second Ctrl-C raises it at once.
    """
    t0 = time.perf_counter()
    start = StartUp(cfg, out, t0)
    with start.guard():
        loop = _start(cfg, out, resume, stream, rollouts, start)
        stop_signal = on_stop_signal(loop.control.interrupt)  # from here Ctrl-C is a stop request, not an exception
    try:
        with stop_signal:
            try:
                loop.train()
            finally:
                loop.finish(time.perf_counter() - t0)
        if loop.control.interrupted:  # Ctrl-C while the last step was stopping the rollout side: no final evaluation
            raise KeyboardInterrupt
        held_end = loop.final_heldout()
        print(
            f"held-out accuracy: {loop.held_start:.3f} after warm-up -> {held_end:.3f} after RL "
            f"({loop.step} steps, {time.perf_counter() - t0:.0f} s)",
            file=stream,
            flush=True,
        )
        result = loop.result(held_end, time.perf_counter() - t0)
        if return_params:
            snap = loop.trainer.sync_snapshot()  # a host snapshot works in any residency
            result.params = snap.tensors()  # copies
            loop.trainer.release(snap)
        return result
    finally:
        loop.trainer.close()  # on every way out: pinned (or shared) host memory back now, not at collection


def _start(
    cfg: TrainConfig, out: Path, resume: bool, stream: TextIO, rollouts: RolloutsFactory, start: StartUp
) -> AsyncLoop:
    """Build the policy and the trainer, load the checkpoint (``resume``) or warm up, build the loop."""
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    task = build_task(cfg)
    policy = build_policy(cfg, task)
    free = frees_device_memory(cfg.trainer.freed_memory, cfg.executor, policy.device, cfg.rollout.device)
    trainer = Trainer(
        policy, cfg.trainer, temperature=cfg.rollout.temperature, pool=trainer_pool(cfg), free_device_memory=free
    )
    resumed = None
    if resume:
        start.phase = "loading the checkpoint"
        resumed = resume_checkpoint(
            out / "checkpoints", trainer, warn=lambda line: print(line, file=stream, flush=True)
        )
        if (out / "metrics.jsonl").exists():
            read_records(out / "metrics.jsonl")  # a damaged log is refused now, before anything changes
        check = getattr(task, "check_position", None)  # a task reading files: the same file, or an error
        if check is not None:
            check({k[5:]: v for k, v in resumed.extra.items() if k.startswith("data_")})
        start.step = resumed.step
    config_mod.save(cfg, out / "config.yaml")  # after the checks: a refused resume changes nothing
    if resumed is None:
        start.phase = "warm-up"
        t_warm = time.perf_counter()

        def warm_progress(k: int, loss: float) -> None:
            elapsed = time.perf_counter() - t_warm
            print(f"warm-up step {k}/{cfg.warmup.steps} loss {loss:.3f} {elapsed:.0f}s", file=stream, flush=True)

        warm = supervised_warmup(
            policy.lm,
            task,
            cfg.warmup,
            seed=cfg.run.seed,
            stepper=policy.warmup_stepper(cfg.warmup.lr),
            progress=None if cfg.run.progress == "none" else warm_progress,
        )
        if cfg.warmup.steps:
            fresh_optimizer_state(policy.optimizer)  # RL starts with fresh moments in every family (Megatron's leak)
        start.phase = "held-out evaluation"
        held_start = heldout_accuracy(policy.lm, task, cfg.rollout.max_new_tokens)
        print(
            f"held-out accuracy after warm-up ({cfg.warmup.steps} steps, {warm['warmup_s']:.1f} s): {held_start:.3f}",
            file=stream,
            flush=True,
        )
    else:
        held_start = float(resumed.extra["heldout_accuracy_start"])
        trainer.entropy_coef = float(resumed.extra.get("entropy_coef", 0.0))  # the adaptive bonus goes on where it was
        print(f"resumed {out} at step {resumed.step} (version {resumed.version})", file=stream, flush=True)
    start.phase = "starting the rollout side"
    return AsyncLoop(cfg, task, trainer, out, stream, resumed, held_start, rollouts)


class StartUp:
    """Where a run's start-up is, so that ``summary.json`` can say it when start-up ends early."""

    def __init__(self, cfg: TrainConfig, out: Path, t0: float) -> None:
        self.cfg, self.out, self.t0 = cfg, out, t0
        self.phase = "building the policy"
        #: the step the run continues from (0 until a checkpoint is loaded)
        self.step = 0

    @contextmanager
    def guard(self) -> Any:
        """On an exception (Ctrl-C included), write ``summary.json`` saying where start-up was, and re-raise;
        not for a checkpoint or config refused while loading the checkpoint (nothing started: nothing changes)."""
        try:
            yield self
        except BaseException as exc:
            refused = self.phase == "loading the checkpoint" and isinstance(exc, StateShiftError)
            if not refused:
                what = (
                    "interrupted"
                    if isinstance(exc, KeyboardInterrupt)
                    else f"failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"
                )
                try:
                    write_summary(
                        self.out,
                        {
                            "status": f"{what} during start-up ({self.phase})",
                            "steps": self.step,
                            "wall_s": time.perf_counter() - self.t0,
                            "out_dir": str(self.out),
                            "config": config_mod.as_dict(self.cfg),
                        },
                    )
                except OSError:  # (an unwritable directory) the original error is the one to report
                    pass
            raise


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """``out/summary.json`` replaced atomically (a kill leaves the previous one or this one, whole)."""
    write_durable(out / "summary.json", json.dumps(summary, indent=1).encode())


class AsyncLoop:
    """The parts of one run and the steps of its loop (trainer thread)."""

    def __init__(
        self,
        cfg: TrainConfig,
        task: Any,
        trainer: Trainer,
        out: Path,
        stream: TextIO,
        resumed: Resumed | None,
        held_start: float,
        rollouts: RolloutsFactory,
    ) -> None:
        self.cfg, self.task, self.trainer, self.out, self.stream = cfg, task, trainer, out, stream
        self.held_start = held_start
        self.step = self.first_step = resumed.step if resumed is not None else 0
        self.syncs = 0
        self.cfg_dict = config_mod.as_dict(cfg)
        self.control = RunControl()
        capture: RolloutCapture | None = resumed.capture if resumed is not None else None
        extra = {"state": trainer.state} if getattr(rollouts, "takes_state", False) else {}
        self.rollouts = rollouts(
            cfg, task, trainer.policy, self.control, version=trainer.version, capture=capture, **extra
        )
        self.t_start = time.perf_counter()  # RL's wall clock starts once the rollout side is up (a process: seconds)
        self.metrics = MetricsLog(
            out, tensorboard=cfg.run.tensorboard, resume_step=resumed.step if resumed is not None else None
        )
        self.progress = Progress(cfg.trainer.steps, cfg.run.progress, self.stream)
        self.watchdog = Watchdog(
            self.control, self.describe, report_s=cfg.run.watchdog_s, stall_s=cfg.run.stall_timeout_s, stream=stream
        )
        self.times: dict[str, float] = {}
        self.losses: list[float] = []
        self.trained_uids: list[int] = []
        self.final_stats: RolloutStats | None = None
        self.ledger: dict[str, Any] = {}
        self.status = "running"
        #: why the run ends before trainer.steps ('' while it need not)
        self.stop_early = ""
        a = cfg.async_training
        trainer.trigger = a.trigger_parameter_sync_step
        trainer.steps, trainer.updates = self.step, self.step * a.require_batches
        trainer.total_updates = max(cfg.trainer.steps * a.require_batches, 1)
        #: sync mode: the groups of the current version's steps, taken all at once when the version begins
        self.cycle_groups: list[Group] = []
        trainer.take_reference()
        trainer.begin_cycle()
        trainer.park()

    # -- the loop ----------------------------------------------------------------------------------
    def train(self) -> None:
        """The steps, until ``trainer.steps``, an early stop (``_check_stop``) or the run stopping: an error, or
        Ctrl-C (``RunControl.interrupt``), raised by ``control.check`` at a step boundary or in a wait."""
        cfg = self.cfg
        try:
            self.rollouts.start()
            self.control.progress()  # the watchdog counts from here: building the rollout side is not a stall
            self.watchdog.start()
            while self.step < cfg.trainer.steps and not self.stop_early:
                self.control.check()  # a step boundary: Ctrl-C (or the other side's error) stops the run here
                t_step = time.perf_counter()
                rec = self.train_step()
                self.step += 1
                captured = None
                if self.step % cfg.async_training.trigger_parameter_sync_step == 0:
                    every = cfg.run.checkpoint_every
                    captured = self.sync_weights(checkpoint=bool(every) and self.step % every == 0)
                if self.step % cfg.run.eval_every == 0 and self.step < cfg.trainer.steps:
                    rec["heldout_accuracy"] = self.evaluate()
                    self._check_stop(rec["heldout_accuracy"])
                self._check_stop(None)
                rec["step_s"] = time.perf_counter() - t_step
                rec["wall_s"] = time.perf_counter() - self.t_start
                rec["time_eval_s_total"] = self.times.get("eval", 0.0)
                self.metrics.log(rec)
                if captured is not None:  # after the step's record: a resume from it finds the record written
                    self.save_checkpoint(captured)
                self.progress.update(self.step, rec)
                self.control.progress()
            self.status = "finished" if not self.stop_early else f"finished early: {self.stop_early}"
        except KeyboardInterrupt:
            self.status = f"interrupted at step {self.step}"
            raise
        except BaseException as exc:
            side = self.control.failed_side or "trainer"
            self.status = f"failed ({side}): {type(exc).__name__}: {exc}"
            raise

    def _check_stop(self, heldout: float | None) -> None:
        """``run.stop_accuracy`` reached at an evaluation, or ``run.max_wall_s`` passed: end after this step."""
        r = self.cfg.run
        if heldout is not None and r.stop_accuracy is not None and heldout >= r.stop_accuracy:
            self.stop_early = f"held-out accuracy {heldout:.3f} >= run.stop_accuracy at step {self.step}"
        elif r.max_wall_s is not None and time.perf_counter() - self.t_start >= r.max_wall_s and not self.stop_early:
            self.stop_early = f"run.max_wall_s ({r.max_wall_s:g} s) passed at step {self.step}"

    def next_groups(self, count: int) -> list[Group]:
        """``count`` groups from the queue, waiting (bounded slices) as long as the rollout side is alive.

        The trainer parks its state (``Trainer.park``: the configured offloads) only when it has to wait; with the
        groups already queued it goes straight on with everything resident."""
        t0 = time.perf_counter()
        parking = [0.0]

        def park() -> None:  # only when the queue does not hold them yet: the trainer is about to wait
            t = time.perf_counter()
            self.trainer.park()
            parking[0] += time.perf_counter() - t

        got = self.rollouts.take(count, self.trainer.version, on_wait=park)
        self._add_time("offload", parking[0])
        self._add_time("wait", time.perf_counter() - t0 - parking[0])
        return got

    def step_groups(self, count: int) -> list[Group]:
        """``count`` groups for this step. ``async_training.mode=sync``: at a version's first step, every group of the
        version's steps is taken first (the trainer waits for the whole version's generation, as a synchronous
        trainer waits for its longest response), then handed out step by step."""
        a = self.cfg.async_training
        if a.mode == "async":
            return self.next_groups(count)
        if not self.cycle_groups:
            self.cycle_groups = self.next_groups(count * a.require_batches * a.trigger_parameter_sync_step)
        out, self.cycle_groups = self.cycle_groups[:count], self.cycle_groups[count:]
        return out

    def train_step(self) -> dict[str, Any]:
        """``require_batches`` mini-batches, one update each (``Trainer.train_step``); returns the step's metrics."""
        groups = [
            self.step_groups(self.cfg.trainer.batch_prompts) for _ in range(self.cfg.async_training.require_batches)
        ]
        with self.timer("offload"):  # the samples are here: what is parked starts back while the batches are built
            self.trainer.prefetch_step()
        batches = [Batch.of(g, self.task.pad_token) for g in groups]
        version = self.trainer.version
        stats = self.trainer.train_step(batches, self.timer)
        depth = self.rollouts.trained(sum(len(b.groups) for b in batches))
        self.losses += [s["loss"] for s in stats]
        self.trained_uids += [g.uid for b in batches for g in b.groups]
        return step_metrics(self.step + 1, version, batches, stats, depth, self)

    def sync_weights(self, *, checkpoint: bool) -> RolloutCapture | None:
        """Version += 1; the rollouter takes a host snapshot of the weights; pi_old := these weights.

        With ``checkpoint``, returns the rollout side's capture taken with the weights (for ``save_checkpoint``).
        """
        with self.timer("sync"):
            self.trainer.version += 1
            # none where the rollout side publishes from the state itself: of resident params it is a full copy
            snap = self.trainer.sync_snapshot() if self.rollouts.reads_snapshot else None
            outcome = self.rollouts.sync(
                snap, self.trainer.version, capture=checkpoint, interrupt=self.cfg.async_training.partial_rollout
            )
            if snap is not None:
                self.trainer.release(snap)  # not on failure: a rollout thread may still be reading it
            self.syncs += 1
        with self.timer("old_logprob"):
            self.trainer.begin_cycle()
        assert outcome.captured is not None or not checkpoint
        return outcome.captured

    def save_checkpoint(self, captured: RolloutCapture) -> None:
        """Checkpoint of this step: the trainer's state as of the sync that made ``captured``.

        Taken after the step's record is in ``metrics.jsonl``: a run killed at any moment and resumed from
        its latest checkpoint thus has every record up to that step, and drops those after it (trained again).
        """
        extra: dict[str, Any] = {"heldout_accuracy_start": self.held_start, "entropy_coef": self.trainer.entropy_coef}
        position = getattr(self.task, "position", None)  # a task reading files: where it is in them
        if position is not None:  # plain ints and strings: data_samples, data_epoch, data_offset, data_train_sha256
            extra.update({f"data_{k}": v for k, v in position(captured.next_uid).items()})
        save_checkpoint(
            self.out / "checkpoints", self.step, self.trainer, captured, extra, self.cfg.run.keep_checkpoints
        )

    def evaluate(self) -> float:
        with self.timer("eval"), self.trainer.resident():
            return heldout_accuracy(self.trainer.lm, self.task, self.cfg.rollout.max_new_tokens)

    # -- bookkeeping ---------------------------------------------------------------------------------
    @contextmanager
    def timer(self, name: str) -> Any:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add_time(name, time.perf_counter() - t0)

    def _add_time(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds

    def describe(self) -> str:
        side = self.rollouts.describe()
        return describe_sides(
            self.control,
            {
                "queue": side["queue"],
                "in_flight": side["in_flight"],
                "trainer_version": self.trainer.version,
                "rollout_version": side["rollout_version"],
                "step": self.step,
            },
        )

    def finish(self, wall_s: float) -> None:
        """Stop the rollout side, account for what is left, write the summary (whatever happened, a second
        Ctrl-C while stopping included)."""
        try:
            stopped = self.rollouts.stop()
            self.watchdog.join()
            try:
                self.final_stats = self.rollouts.stats()
                self.ledger = self.rollouts.close()  # AssertionError if the ledger does not balance
            finally:
                self.metrics.close()
                self.progress.close()
            if not stopped:
                self.status += "; the rollout side did not stop within 10 s"
        finally:
            self.summary = summarize(self, wall_s)
            write_summary(self.out, self.summary)

    def final_heldout(self) -> float:
        with self.trainer.resident():
            held = heldout_accuracy(self.trainer.lm, self.task, self.cfg.rollout.max_new_tokens)
        self.summary["heldout_accuracy_end"] = held
        write_summary(self.out, self.summary)
        why = None
        if self.cfg.run.plot:
            why = plot_curves(
                self.metrics.records,
                self.metrics.staleness,
                self.summary["time_split_s"],
                self.out / "curves.png",
                title=f"stateshift train: {self.out.name}",
                heldout_ends=((0, self.held_start), (self.step, held)),
            )
        if why:
            print(f"note: no curves.png: {why}", file=self.stream)
        return held

    def result(self, held_end: float, wall_s: float) -> RunResult:
        return RunResult(
            out_dir=self.out,
            heldout_accuracy_start=self.held_start,
            heldout_accuracy_end=held_end,
            steps=self.step,
            wall_s=wall_s,
            summary=self.summary,
            losses=self.losses,
            trained_uids=self.trained_uids,
        )
