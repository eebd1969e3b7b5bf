"""The Ray placement group of a run: one bundle for the trainer (and the queue), one for the rollouter.

A pure function of the ``ray`` config and the cluster's resources
(``ray.cluster_resources()``), so it is checked without a cluster.

- CPU machine: ``[{CPU: trainer_cpus}, {CPU: rollout_cpus}]``.
- One GPU: trainer and rollouter share it (``GPU: 0.5`` each, colocated; the
  trainer offloads between phases so the rollouter has the memory).
- Two GPUs or more: one each.

With ``run.device=cuda`` each actor computes on the GPU (or the half of one)
its bundle holds: Ray sets the actor's ``CUDA_VISIBLE_DEVICES``, so ``cuda``
is that device there.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import ConfigError
from ..config import RayConfig

TRAINER, ROLLOUTER = 0, 1


def auto_gpus(cluster_gpus: float) -> tuple[float, float]:
    """(trainer, rollouter) GPUs when the config leaves them to the cluster."""
    if cluster_gpus >= 2:
        return 1.0, 1.0
    if cluster_gpus >= 1:
        return 0.5, 0.5
    return 0.0, 0.0


def bundles(rc: RayConfig, cluster: Mapping[str, float]) -> list[dict[str, float]]:
    """``[trainer bundle, rollouter bundle]`` for a cluster with ``cluster`` resources.

    ``ConfigError`` naming the key when the bundles ask for more than the whole cluster has (they could
    never be placed; Ray would wait forever).
    """
    cpus, gpus = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    auto = auto_gpus(gpus)
    tg = rc.trainer_gpus if rc.trainer_gpus is not None else auto[0]
    rg = rc.rollout_gpus if rc.rollout_gpus is not None else auto[1]
    if rc.trainer_cpus + rc.rollout_cpus > cpus:
        raise ConfigError(
            "config",
            f"the trainer and rollouter bundles ask for "
            f"{rc.trainer_cpus:g} + {rc.rollout_cpus:g} CPUs, the cluster has {cpus:g}",
            key="ray.trainer_cpus",
        )
    if tg + rg > gpus:
        key = "ray.rollout_gpus" if rc.rollout_gpus is not None else "ray.trainer_gpus"
        raise ConfigError(
            "config",
            f"the trainer and rollouter bundles ask for {tg:g} + {rg:g} GPUs, the cluster has {gpus:g}",
            key=key,
        )
    out = []
    for c, g in ((rc.trainer_cpus, tg), (rc.rollout_cpus, rg)):
        out.append({"CPU": float(c), **({"GPU": float(g)} if g > 0 else {})})
    return out
