"""What every part of ``executor=ray`` shares: importing Ray, placing an actor, waiting for it, reading its death.

The driver (``ray.py``), the trainer actor (``ray_trainer.py``) and its rollout side (``ray_rollouts.py``)
import this module; it imports none of them.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError, RunError

#: what ``TrainerActor.run`` returns when the driver interrupted it (Ctrl-C)
INTERRUPTED = "stateshift: interrupted"


def require_ray() -> Any:
    """The ``ray`` module, or ``ConfigError`` (key ``executor``) saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            "config",
            f"executor=ray needs Ray, which is not installed ({exc}): pip install 'stateshift[ray]'",
            key="executor",
        ) from None
    return ray


def death_reason(err: BaseException) -> str:
    """Ray's reason for an actor's death, in one line (``"it was killed by `ray.kill`."``, the exit detail, ...)."""
    text = " ".join(str(err).split())
    at = text.find("The actor is dead because")
    why = text[at + len("The actor is dead because") :].strip() if at >= 0 else text
    cut = why.find(" Some common causes")
    return (why[:cut] if cut >= 0 else why)[:400]


def cause_of(err: BaseException) -> BaseException:
    """The exception raised inside an actor (``RayTaskError.cause``), else ``err`` itself."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def actor_class(ray: Any, cls: type, bundle: dict[str, float], pg: Any, index: int, **options: Any) -> Any:
    """``cls`` as an actor class placed in bundle ``index`` of ``pg`` with that bundle's resources."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return ray.remote(cls).options(
        num_cpus=bundle["CPU"],
        num_gpus=bundle.get("GPU", 0),
        **options,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, index),
    )


def wait_ready(ray: Any, ref: Any, timeout_s: float, what: str) -> Any:
    """``ray.get(ref)``, or ``RunError("actor_start")`` saying ``what`` did not come up (Ray itself would wait forever)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RunError(
            "actor_start",
            f"{what} did not come up within ray.ready_timeout_s={timeout_s:g} s "
            f"(cluster resources: {ray.cluster_resources()})",
        ) from None
