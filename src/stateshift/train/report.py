"""The numbers of a run: one record per trainer step, and the run's summary."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..core.engine import core_of
from .executors.base import Rollouts, RolloutStats

if TYPE_CHECKING:
    from .config import TrainConfig
    from .trainer import Batch, Trainer


class RunView(Protocol):
    """What the report reads of a run (``loop.AsyncLoop`` is one): its parts and its counters so far."""

    cfg: TrainConfig
    cfg_dict: dict[str, Any]
    trainer: Trainer
    rollouts: Rollouts
    out: Path
    status: str
    step: int
    first_step: int
    syncs: int
    held_start: float
    t_start: float
    times: dict[str, float]
    ledger: dict[str, Any]
    final_stats: RolloutStats | None
    metrics: Any
    watchdog: Any


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def staleness_counts(batches: list[Batch], version: int) -> Counter[int]:
    """Trained tokens by how many versions their policy was behind the trainer's version."""
    out: Counter[int] = Counter()
    for b in batches:
        lag = (version - b.versions)[b.mask]
        out.update(dict(zip(*[t.tolist() for t in torch.unique(lag, return_counts=True)], strict=True)))
    return out


def length_bucket(length: int) -> str:
    """The response-length bucket of ``length`` tokens: powers of two, ``"1-1"``, ``"2-3"``, ``"4-7"``, ..."""
    lo = 1 << (max(int(length), 1).bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def by_length(batches: list[Batch], version: int) -> dict[str, dict[str, float]]:
    """Per response-length bucket (``length_bucket``): rows, exact-answer accuracy and mean per-token staleness."""
    acc: dict[str, list[float]] = {}
    stale: dict[str, list[float]] = {}
    for b in batches:
        exact = torch.cat([g.exact for g in b.groups]).float().tolist()
        lengths = b.mask.sum(1).tolist()
        lag = ((version - b.versions) * b.mask).sum(1) / b.mask.sum(1).clamp(min=1)
        for e, n, s in zip(exact, lengths, lag.tolist(), strict=True):
            key = length_bucket(n)
            acc.setdefault(key, []).append(e)
            stale.setdefault(key, []).append(s)
    order = sorted(acc, key=lambda k: int(k.split("-")[0]))
    return {
        "rows_by_length": {k: float(len(acc[k])) for k in order},
        "accuracy_by_length": {k: _mean(acc[k]) for k in order},
        "staleness_by_length": {k: _mean(stale[k]) for k in order},
    }


def step_metrics(
    step: int, version: int, batches: list[Batch], stats: list[dict[str, float]], depth: int, loop: RunView
) -> dict[str, Any]:
    """Task, policy, off-policy and system metrics of one step (cumulative seconds and bytes where named ``_total``)."""
    rewards = torch.cat([b.rewards.reshape(-1) for b in batches])
    exact = torch.cat([g.exact for b in batches for g in b.groups]).float()
    finished = torch.cat([g.finished for b in batches for g in b.groups]).float()
    lengths = torch.cat([b.mask.sum(1) for b in batches]).float()
    spans = torch.cat(
        [
            torch.where(b.mask, b.versions, -(10**9)).amax(1) - torch.where(b.mask, b.versions, 10**9).amin(1)
            for b in batches
        ]
    ).float()
    stale = staleness_counts(batches, version)
    n_tok = sum(stale.values()) or 1
    side = loop.rollouts.stats()
    rec: dict[str, Any] = {
        "step": step,
        "version": version,
        "rollout_version": side.version,
        "queue_depth": depth,
        "reward": float(rewards.mean()),
        "accuracy": float(exact.mean()),
        "response_length": float(lengths.mean()),
        "eos_rate": float(finished.mean()),
        "staleness_mean": sum(k * v for k, v in stale.items()) / n_tok,
        "staleness_max": max(stale, default=0),
        "version_span_mean": float(spans.mean()),
        "version_span_max": float(spans.max()),
        "staleness_tokens": {str(k): v for k, v in sorted(stale.items())},
        **by_length(batches, version),
    }
    for key in stats[0]:
        values = [s[key] for s in stats]
        rec[key] = max(values) if "max" in key else sum(values) if key.endswith("_tokens") else _mean(values)
    rec.update(system_metrics(loop, side))
    return rec


def system_metrics(loop: RunView, side: RolloutStats) -> dict[str, Any]:
    """Cumulative time split, bytes moved, idle ratios and throughput so far (``side``: the rollout side's numbers)."""
    t = loop.times
    wall = max(time.perf_counter() - loop.t_start, 1e-9)
    meter, cycle = loop.trainer.meter, loop.trainer.cycle.stats
    return {
        "time_generate_s_total": side.busy_s,
        "time_old_logprob_s_total": t.get("old_logprob", 0.0),
        "time_update_s_total": t.get("update", 0.0),
        "time_sync_s_total": t.get("sync", 0.0),
        "time_offload_s_total": t.get("offload", 0.0),
        "time_wait_s_total": t.get("wait", 0.0),
        "time_reward_s_total": side.reward_s,
        "reward_zeroed_total": side.reward_zeroed,
        "offload_bytes_total": meter.total_bytes(),
        "offload_verb_s_total": meter.total_seconds(),
        "pi_old_bytes_total": cycle.pcie_bytes + cycle.device_bytes + cycle.host_bytes,
        "trainer_idle_ratio": t.get("wait", 0.0) / wall,
        "rollout_idle_ratio": 1.0 - min(side.busy_s / wall, 1.0),
        "samples_per_s": side.generated * loop.cfg.rollout.n / wall,
        "rollout_restarts": len(side.restarts),
    } | ({"rollout_row_occupancy": loop.rollouts.occupancy()} if hasattr(loop.rollouts, "occupancy") else {})


def summarize(loop: RunView, wall_s: float) -> dict[str, Any]:
    """The run's totals (``summary.json``): status, ledger, time split, bytes, held-out accuracy."""
    trainer = loop.trainer
    steps = max(loop.step - loop.first_step, 1)
    meter = trainer.meter
    cycle = trainer.cycle.stats.as_dict()
    pi_old_bytes = cycle["pcie_bytes"] + cycle["device_bytes"] + cycle["host_bytes"]
    side = loop.final_stats or RolloutStats()
    return {
        "status": loop.status,
        "steps": loop.step,
        "wall_s": wall_s,
        "out_dir": str(loop.out),
        "heldout_accuracy_start": loop.held_start,
        "ledger": loop.ledger,
        "rollout": {"executor": loop.cfg.executor, "restarts": side.restarts, "refused_late_groups": side.refused},
        "time_split_s": {
            "generate": side.busy_s,
            "old_logprob": loop.times.get("old_logprob", 0.0),
            "update": loop.times.get("update", 0.0),
            "sync": loop.times.get("sync", 0.0),
            "offload": loop.times.get("offload", 0.0),
            "wait": loop.times.get("wait", 0.0),
            "eval": loop.times.get("eval", 0.0),
        },
        "offload": {
            "bytes": dict(meter.nbytes),
            "seconds": dict(meter.seconds),
            "bytes_per_step": meter.total_bytes() / steps,
        },
        "pi_old": {**cycle, "bytes_per_step": pi_old_bytes / steps},
        "sync": {
            "syncs": loop.syncs,
            "rollouter_copy_s": side.copy_s,
            "rollouter_copy_bytes": side.copy_bytes,
            "param_bytes": trainer.state.nbytes("params"),
        },
        "staleness_tokens": {str(k): v for k, v in sorted(loop.metrics.staleness.items())},
        "watchdog_reports": loop.watchdog.reports,
        "pool": core_of(trainer.state).pool.stats.as_dict(),
        "verbs_s": meter.total_seconds(),
        "memory": {
            **memory_peaks(trainer),
            **({"rollout_device_peak_allocated_bytes": side.device_peak_bytes} if side.device_peak_bytes else {}),
        },
        "config": loop.cfg_dict,
    }


def memory_peaks(trainer: Any) -> dict[str, Any]:
    """Peak device memory of this process (CUDA: allocated and reserved by PyTorch) and peak pinned host pool bytes."""
    out: dict[str, Any] = {
        "device": str(trainer.device),
        "pinned_pool_peak_bytes": core_of(trainer.state).pool.stats.peak_held_bytes,
    }
    if trainer.device.type == "cuda":
        out["device_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(trainer.device)
        out["device_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(trainer.device)
        free, total = torch.cuda.mem_get_info(trainer.device)
        out["driver_free_bytes_at_end"], out["device_total_bytes"] = free, total
    return out
