"""``executor=ray``: the trainer, the rollouter and the queue as Ray actors in one placement group.

    driver (stateshift train)          holds the run directory's lock; placement group; waits (this module)
      TrainerActor      bundle 0       loop.train_here, the same loop as in process (ray_trainer.py), with
                                       RayRollouts as its rollout side (ray_rollouts.py)
        QueueHub actor  bundle 0       the queue, the prompts, the in-flight registry (hub.py; no CPU of its own)
        RolloutActor    bundle 1       one rollouter incarnation, the in-process RolloutWorker loop inside
                                       (ray_actors.py); replaced when it dies

The bundles (``placement.py``): CPU only on a CPU cluster; GPUs where the
cluster has them (one each, or half of one each when there is one).

**Weights** go by object reference: at a sync the trainer copies its host
snapshot into Ray's object store (``ray.put``; the snapshot is released when
the sync returns, as in process) and calls ``update_weights(ref, version)``
on the rollouter, which copies them into its model at the next token
boundary and acknowledges. The trainer keeps the newest reference: it is
what a replacement rollouter is built with.

**A rollouter that dies** (``ray.kill``, SIGKILL, OOM, its node lost): a
supervisor thread in the trainer waits on the rollouter's ``run`` call; Ray
resolves it with ``ActorDiedError`` within milliseconds of the death. The
supervisor prints which rollouter died (name, pid) and Ray's reason at once,
tells the queue (``owner_died``: its in-flight prompts become orphans), and
starts a new rollouter with the last weights it was sent and their version;
the new one generates the orphans first. Groups already queued live in the
queue actor and are not touched. A group the dead rollouter sent before it
died but that arrives after is refused (it is being generated again). The
ledger thus counts every group once; ``summary.json`` lists each restart
(``rollout.restarts``). After ``ray.max_rollout_restarts`` restarts the
next death stops the run with ``RunError("rollout_died")``. A rollouter that
*raises* is not restarted: the run stops with that exception, as in
process (a bug does not go away by restarting). The queue actor dying stops
the run (``RunError("rollout_died")``: its groups are gone; resume from the last
checkpoint).

**The trainer dying** ends the run (Ray kills the actors it owns): the driver
raises ``RunError("trainer_died")`` naming the last checkpoint; ``stateshift train
--resume DIR`` continues from it.

Results equal the in-process executor's with fixed seeds wherever the
schedule does not depend on timing (``staleness_threshold=0``): the same
code runs on each side, with the same seeds (``tests/rl/test_rl_ray.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ...errors import RunError
from ..config import TrainConfig
from ..control import StopFlag, on_stop_signal, reinstall_stop_signals
from .placement import TRAINER, bundles
from .ray_common import INTERRUPTED, actor_class, death_reason, wait_ready

#: seconds between two looks at the stop flag while the driver waits for the trainer
WAIT_SLICE_S = 0.2

#: the raylet's setting of its workers' niceness (read from the environment when it starts)
NICENESS = "RAY_worker_niceness"


# --------------------------------------------------------------------------- the driver


def run_on_ray(cfg: TrainConfig, out: Path, resume: bool, return_params: bool) -> Any:
    """Start (or join) Ray, place the trainer actor, run it, clean up; returns its ``RunResult``.

    The caller holds the run directory's lock. Ctrl-C here stops the trainer at its next wait (it writes its
    summary) and re-raises ``KeyboardInterrupt``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from .ray_trainer import TrainerActor

    started = _init(ray, cfg)
    reinstall_stop_signals()  # ray.init's SIGTERM handler exits at once: SIGTERM stops the run as Ctrl-C does
    pg = trainer = None
    try:
        specs = bundles(cfg.ray, ray.cluster_resources())
        pg = placement_group(specs, strategy=cfg.ray.placement_strategy)
        wait_ready(ray, pg.ready(), cfg.ray.ready_timeout_s, f"the placement group {specs}")
        trainer = actor_class(
            ray, TrainerActor, specs[TRAINER], pg, TRAINER, max_concurrency=2, name=f"stateshift-trainer-{os.getpid()}"
        ).remote(os.getcwd())
        ref = trainer.run.remote(cfg, str(out.resolve()), resume, return_params, pg, specs)
        return _await_trainer(ray, trainer, ref, out)
    finally:
        if trainer is not None:
            ray.kill(trainer)
        if pg is not None:
            remove_placement_group(pg)
        if started:
            ray.shutdown()


def _init(ray: Any, cfg: TrainConfig) -> bool:
    """``ray.init`` unless Ray is initialised already; ``True`` if this run started it (and shuts it down).

    A private local instance runs its workers at this process's priority: Ray's default (``RAY_worker_niceness``
    15) makes the trainer and the rollouter yield to every other process of the machine, so on a shared machine
    a run was 2x slower than in process. Ray's job submission sets 0 too; a value in the environment wins.
    """
    if ray.is_initialized():
        return False
    rc = cfg.ray
    if rc.address:
        ray.init(address=rc.address, logging_level=logging.WARNING)
        return True
    saved = os.environ.get(NICENESS)
    os.environ.setdefault(NICENESS, "0")  # read by the raylet that ray.init starts, and only then
    try:
        ray.init(address="local", num_cpus=rc.num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    finally:
        if saved is None:
            del os.environ[NICENESS]
    return True


def _await_trainer(ray: Any, trainer: Any, ref: Any, out: Path) -> Any:
    """The trainer's result; its error re-raised as itself; its death as ``RunError("trainer_died")``; Ctrl-C: the
    trainer is told (it stops at its next step or wait and writes its summary), ``KeyboardInterrupt`` re-raised."""
    try:
        result = _get_unless_stopped(ray, ref)
    except KeyboardInterrupt:
        trainer.interrupt.remote()
        try:
            ray.get(ref, timeout=30)  # it stops at its next wait and writes its summary (a second Ctrl-C: at once)
        except Exception:  # noqa: BLE001 - we are leaving on Ctrl-C whatever it says
            pass
        raise
    except ray.exceptions.RayTaskError as err:  # (first: an actor's death raised *inside* the trainer is its error)
        raise err.as_instanceof_cause() from None
    except ray.exceptions.RayActorError as err:
        latest = out / "checkpoints" / "latest"
        where = latest.read_text().strip() if latest.is_file() else "none yet"
        raise RunError(
            "trainer_died",
            f"the trainer actor died: {death_reason(err)}; latest checkpoint: {where} "
            f"(continue with: stateshift train --resume {out})",
        ) from None
    if result == INTERRUPTED:
        raise KeyboardInterrupt
    return result


def _get_unless_stopped(ray: Any, ref: Any) -> Any:
    """``ray.get(ref)``, waiting in slices; ``KeyboardInterrupt`` (raised here, between two slices) once Ctrl-C or
    SIGTERM came (``StopSignals``: its handler only sets the flag), or wherever Ctrl-C lands without it."""
    stop = StopFlag()
    with on_stop_signal(stop):
        while not ray.wait([ref], timeout=WAIT_SLICE_S)[0]:
            if stop.requested:
                raise KeyboardInterrupt
    return ray.get(ref)
