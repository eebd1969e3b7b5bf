"""Trainer steps and updates: old log-probs (bypass / pi_old / proximal / loglinear), the loss, offload between phases.

The trainer owns its model, optimizer and ``ModelState``; only the trainer
thread calls verbs on that state (the rollouter has its own model and reads
snapshots the trainer keeps alive for it, ``handshake.py``).

Phases of one update, with ``trainer.param_offload`` on (the default):

1. old log-probs, in ``pi_old`` mode under ``PiOldCycle.old_policy()`` --
   ``swapped`` writes the pi_old snapshot into the params wherever they
   live: into the released storages while they are **offloaded** (the verl
   #6026 scenario, a snapshot of offloaded params, is the normal path here),
   or over the resident ones, rebuilt or restored afterwards.
   The first update after a sync needs no swap: the current weights *are*
   pi_old, so it onloads and computes directly.
2. onload what is parked (params; grads / optimizer state if offloaded),
   forward with gradient, loss, backward, optimizer step. With
   ``trainer.prefetch`` (off by default) these onloads are issued ahead, at the
   start of the step (``prefetch_step``; the loop calls it as soon as the
   step's samples are in hand), on a stream of their own so the copies overlap
   the batch building and the forwards (``prefetch.py``); each group is waited
   for just before its first read: the params before the first forward under
   them, grads and optimizer state before the backward and optimizer step.
   A swap (pi_old, reference) runs with no onload in flight: when the step
   begins with one, the prefetch is issued right after it.
3. nothing is offloaded here: ``park()`` runs when the trainer is about to
   *wait* for samples (``AsyncLoop.next_groups``: the queue does not hold the
   next mini-batch yet), and before an evaluation ends. An update followed at
   once by another (the queue is ahead) keeps its state on the device -- an
   offload and onload between them would move every byte twice for nothing.
   Every verb's bytes and seconds go to ``OffloadMeter``.

``pi_old`` is the snapshot taken at each sync (``begin_cycle``): the weights
the rollouter was sent, recomputed before each update. ``proximal`` (AReaL's
decoupled PPO) computes ``l_p`` ONCE per trainer step (``train_step``), under
the weights at its start, for all its ``require_batches`` mini-batch updates:
the first update's ratio is 1, later ones are clipped against it. (Recomputed
before every update it would always be 1 and the clip would never bind.)
``loglinear`` approximates ``proximal`` from ``l_b`` and ``l_t`` with no
forward of its own (``algo.loglinear_proximal``); ``bypass`` uses the
rollout's own log-probs.

Every update sets the learning rate of the schedule (``algo.lr_at``: linear
warm-up, then constant / cosine / linear decay) on the policy and its
optimizer before stepping.

The model family (built-in, Hugging Face, Megatron-core, FSDP2) is hidden
behind ``policies.Policy``: this module calls ``policy.zero_grad()``,
``policy.step(loss)`` and reads log-probs from ``policy.lm``, whatever the
family. Batches arrive on the CPU and are moved to the policy's device once
per update.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from stateshift import ModelState, Snapshot
from stateshift.core.pool import HostPool

from ..rl import algo
from ..rl.pi_old import PiOldCycle
from .config import TrainerConfig
from .policies import Policy
from .prefetch import Prefetch
from .rollout import Group
from .sampler import left_pad, sequence_logprobs


@dataclass(frozen=True, eq=False)
class Batch:
    """Groups flattened to rows (group-major), as the loss sees them."""

    groups: tuple[Group, ...]
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    l_b: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor

    @staticmethod
    def of(groups: list[Group], pad: int) -> Batch:
        """The rows of ``groups``; responses of different widths (continuous batching) are right-padded to the
        widest (``pad`` tokens, outside the mask, version -1)."""
        ids, mask = left_pad([list(g.prompt) for g in groups for _ in range(g.n)], pad)
        width = max(g.tokens.shape[1] for g in groups)

        def cat(name: str, fill: float | int | bool) -> torch.Tensor:
            parts = [getattr(g, name) for g in groups]
            return torch.cat(
                [
                    torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) if t.shape[1] < width else t
                    for t in parts
                ]
            )

        return Batch(
            groups=tuple(groups),
            prompt_ids=ids,
            prompt_mask=mask,
            tokens=cat("tokens", pad),
            mask=cat("mask", False),
            l_b=cat("logprobs", 0.0),
            versions=cat("versions", -1),
            rewards=torch.stack([g.rewards for g in groups]),
        )

    def to(self, device: torch.device) -> Batch:
        """The same batch with its tensors on ``device`` (itself when they are there already)."""
        if self.tokens.device == device:
            return self
        names = ("prompt_ids", "prompt_mask", "tokens", "mask", "l_b", "versions", "rewards")
        return Batch(groups=self.groups, **{k: getattr(self, k).to(device, non_blocking=True) for k in names})


def frees_device_memory(setting: str, executor: str, device: torch.device, rollout_device: str | None) -> bool:
    """Whether the trainer's offloads hand the device memory they free back to the CUDA driver
    (``trainer.freed_memory``; ``ModelState(free_device_memory=...)``).

    ``'auto'``: only where another process may want that memory on the trainer's GPU -- a rollouter process on
    it (``executor=process``, ``rollout_device`` None or the trainer's GPU) or a Ray actor (``executor=ray``,
    colocated on a one-GPU cluster by default). In one process (``executor=inprocess``) the rollout thread
    allocates from the same caching allocator, which frees its unused cached blocks itself before an allocation
    would fail; on the CPU the setting has no effect.

    Args:
        setting: ``'auto'``, ``'driver'`` or ``'cache'``.
        executor: the resolved ``executor`` (``'inprocess'``, ``'process'`` or ``'ray'``).
        device: the trainer's device.
        rollout_device: ``rollout.device`` (``None``: the trainer's).
    """
    if setting != "auto":
        return setting == "driver"
    if device.type != "cuda" or executor == "inprocess":
        return False
    if executor == "process" and rollout_device is not None:
        other = torch.device(rollout_device)

        def index(d: torch.device) -> int:
            return d.index if d.index is not None else torch.cuda.current_device()

        return other.type == "cuda" and index(other) == index(device)
    return True


@dataclass
class OffloadMeter:
    """Host seconds and bytes of every verb the trainer ran, by ``"<verb>.<group>"``.

    A prefetched onload (``prefetch.py``) counts the seconds it took to issue (``onload.<group>``, with its bytes)
    and the copy time that was not hidden (``prefetch_wait.<group>``: the compute stream's stall at the wait, from
    events, plus any time the host blocked for it); copy time hidden behind compute is in neither."""

    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, seconds: float, nbytes: int) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.nbytes[key] = self.nbytes.get(key, 0) + nbytes

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def total_bytes(self) -> int:
        return sum(self.nbytes.values())


class Trainer:
    """The policy being optimised, its ``ModelState``, pi_old and the reference snapshot."""

    def __init__(
        self,
        policy: Policy,
        cfg: TrainerConfig,
        *,
        temperature: float,
        version: int = 0,
        pool: HostPool | None = None,
        free_device_memory: bool | None = None,
    ) -> None:
        self.policy = policy
        self.lm = policy.lm
        self.model = policy.model
        self.device = policy.device
        self.cfg = cfg
        self.temperature = temperature
        self.version = version
        self.optimizer = policy.optimizer
        # free_device_memory: what an offload releases goes back to the CUDA driver at once, or stays cached in this
        # process (``trainer.freed_memory``, resolved by ``frees_device_memory``; None: 'auto' taken as 'driver')
        # pool: the state's own pinned pool, or a shared one a rollouter process reads (executors.weights.trainer_pool)
        free = cfg.freed_memory != "cache" if free_device_memory is None else free_device_memory
        self.state = ModelState(self.model, self.optimizer, free_device_memory=free, pool=pool)
        self.pool = pool
        self.meter = OffloadMeter()
        #: onloads issued ahead of their first read (``trainer.prefetch``)
        self.prefetcher = Prefetch(self.state, self.device, self.meter.add)
        # auto: device when pi_old fits beside the params on the GPU, else host (CPU params: host)
        self.cycle = PiOldCycle(self.state, groups=("params",), placement="auto")
        self.updates_in_cycle = 0
        self.ref: Snapshot | None = None
        self.parked: set[str] = set()
        #: optimizer updates and trainer steps so far (the learning-rate schedule and loglinear read them)
        self.updates = 0
        self.steps = 0
        #: trainer steps between two syncs, and updates in the whole run (set by the loop; defaults for tests)
        self.trigger = 1
        self.total_updates = max(cfg.steps, 1)
        #: the adaptive entropy coefficient (``trainer.entropy_target``), updated after each update
        self.entropy_coef = 0.0

    def close(self) -> None:
        """End of the run: close the state (the model back whole; pi_old, the reference and homes released) and
        free a pool given to it (a shared pool's ``/dev/shm`` files go with its blocks). Idempotent."""
        self.prefetcher.settle()
        self.state.close()
        if self.pool is not None:
            self.pool.trim()

    # -- residency --------------------------------------------------------------------------
    def _verb(self, verb: str, group: str) -> None:
        if group not in self.state.groups:
            return
        counts = self.state.residency()[group]
        moving = counts["device"] if verb == "offload" else counts["host"]
        t0 = time.perf_counter()
        getattr(self.state, verb)(group).wait()
        self.meter.add(f"{verb}.{group}", time.perf_counter() - t0, self.state.nbytes(group) if moving else 0)

    def park(self) -> None:
        """Before the trainer waits: offload what the config says (params, grads, optimizer state)."""
        self.prefetcher.settle()  # nothing is offloaded while its onload is in flight
        for group, on in (
            ("params", self.cfg.param_offload),
            ("grads", self.cfg.grad_offload),
            ("optim", self.cfg.optimizer_offload),
        ):
            if on and group in self.state.groups and self.state.residency()[group]["device"]:
                self._verb("offload", group)
                self.parked.add(group)

    def unpark(self, *groups: str) -> None:
        """Bring ``groups`` back (grads come back as zeros: their old values are not needed); a group being
        prefetched is waited for instead."""
        for group in groups:
            if self.prefetcher.wait(group) or group not in self.parked:
                continue
            if group == "grads":
                self.state.drop("grads")
            self._verb("onload", group)
            self.parked.discard(group)

    def prefetch_step(self) -> None:
        """With ``trainer.prefetch``: start bringing back what the step's updates read (``prefetch.py``), once the
        step's samples are in hand; each group is waited for just before its first read (``unpark``).

        Not when the step's first forward is a pi_old swap (``old_logprobs``): a swap runs with no onload in flight
        (Megatron's rebuild of the params reads the optimizer's master weights), and the params would only be
        stashed and restored around it; ``update`` prefetches right after the swap instead.
        """
        if not (self.cfg.old_logprob == "pi_old" and self.updates_in_cycle > 0):
            self._prefetch()

    def _prefetch(self) -> None:
        """With ``trainer.prefetch``: issue the onload of every parked group an update reads (params first: the
        first read). A no-op for groups already back or on their way."""
        if not self.cfg.prefetch:
            return
        for group in ("params", "optim", "grads"):
            if group in self.parked and group in self.state.groups:
                self.prefetcher.issue(group, zeros=group == "grads")
                self.parked.discard(group)

    # -- pi_old, reference, sync ---------------------------------------------------------------
    def begin_cycle(self) -> None:
        """pi_old := the current weights (taken at each sync; zero-copy while the params are offloaded).

        Only ``pi_old`` mode keeps the snapshot; the others just count updates since the sync.
        """
        self.prefetcher.settle()
        if self.cfg.old_logprob == "pi_old":
            t0 = time.perf_counter()
            self.cycle.begin(self.version)
            self.meter.add("snapshot.pi_old", time.perf_counter() - t0, 0)
        self.updates_in_cycle = 0

    def take_reference(self) -> None:
        self.prefetcher.settle()
        if self.cfg.kl_coef > 0:
            self.ref = self.state.snapshot(("params",), tag="ref", placement="host")

    def sync_snapshot(self) -> Snapshot:
        """Host snapshot of the current weights at ``self.version`` (zero-copy when offloaded); release after use."""
        self.prefetcher.settle()
        t0 = time.perf_counter()
        snap = self.state.snapshot(("params",), tag="sync", version=self.version, placement="host")
        self.meter.add("snapshot.sync", time.perf_counter() - t0, 0)
        return snap

    def release(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        self.state.release(snap)
        self.meter.add("release.sync", time.perf_counter() - t0, 0)

    # -- log-probs -------------------------------------------------------------------------------
    def _logprobs(self, batch: Batch, *, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return sequence_logprobs(
            self.lm, batch.prompt_ids, batch.prompt_mask, batch.tokens, self.temperature, with_entropy=with_entropy
        )

    @torch.no_grad()
    def old_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """``l_p`` for ``batch`` in the configured mode (see the module docstring); ``None`` in ``loglinear`` mode
        (computed in the loss from ``l_t``). ``proximal``: under the current weights (``train_step`` calls it for
        every mini-batch of a step before the first update)."""
        mode = self.cfg.old_logprob
        if mode == "bypass":
            return batch.l_b
        if mode == "loglinear":
            return None
        if mode == "pi_old" and self.updates_in_cycle > 0:
            self.prefetcher.settle()  # a swap runs with no onload in flight (nothing is, here: prefetch_step)
            t0 = time.perf_counter()
            with self.cycle.old_policy():  # works whether the params are offloaded or not
                t1 = time.perf_counter()
                l_p = self._logprobs(batch)[0]
                t2 = time.perf_counter()
            # host time inside the verb (swap in, swap out), not the forward between
            self.meter.add("swap.pi_old", (t1 - t0) + (time.perf_counter() - t2), 0)
            return l_p
        if mode == "pi_old":
            self.cycle.stats.skipped_swaps += 1
        self.unpark("params")
        return self._logprobs(batch)[0]

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch) -> torch.Tensor | None:
        if self.ref is None:
            return None
        self.prefetcher.settle()  # a swap runs with no onload in flight
        with self.state.swapped(self.ref):
            return self._logprobs(batch)[0]

    # -- the step and its updates -------------------------------------------------------------------
    def train_step(self, batches: list[Batch], timer: Callable[[str], Any]) -> list[dict[str, float]]:
        """One trainer step: one update per mini-batch of ``batches``; returns each update's statistics.

        ``proximal`` mode computes every mini-batch's ``l_p`` first, under the weights at the start of the step
        (one forward each, no gradient), so all the step's updates share that proximal policy (AReaL).
        """
        self.prefetch_step()  # (the loop has called it already, as soon as the samples were in hand)
        batches = [b.to(self.device) for b in batches]
        prox: list[torch.Tensor | None] = [None] * len(batches)
        if self.cfg.old_logprob == "proximal":
            with timer("old_logprob"):
                self.unpark("params")
                prox = [self._logprobs(b)[0].detach() for b in batches]
        stats = [self.update(b, timer, l_p=lp) for b, lp in zip(batches, prox, strict=True)]
        self.prefetcher.settle()  # (every group prefetched was read by the first update: nothing is left in flight)
        self.steps += 1
        return stats

    def update(self, batch: Batch, timer: Callable[[str], Any], *, l_p: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer update on ``batch``; returns its statistics. ``timer(name)`` times a phase.

        ``l_p``: the proximal log-probs computed by ``train_step`` (else computed here, ``old_logprobs``).
        """
        batch = batch.to(self.device)
        with timer("old_logprob"):
            if l_p is None:
                l_p = self.old_logprobs(batch)
            l_ref = self.reference_logprobs(batch)
        with timer("offload"):  # grads and optimizer state on their way (prefetch) are waited for in _step
            self._prefetch()  # (after a pi_old swap: prefetch_step left them parked) the update's forward overlaps
            self.unpark("params", *(g for g in ("optim", "grads") if g not in self.prefetcher.inflight))
        with timer("update"):
            stats = self._step(batch, l_p, l_ref)
        self.updates_in_cycle += 1  # parked later, only if the trainer then waits (AsyncLoop.next_groups)
        self.updates += 1
        return stats

    def lr_now(self) -> float:
        """The learning rate of the next update (``algo.lr_at`` of the config's schedule)."""
        c = self.cfg
        return algo.lr_at(
            self.updates,
            base=c.lr,
            warmup=c.lr_warmup_steps,
            total=self.total_updates,
            schedule=c.lr_schedule,
            min_ratio=c.lr_min_ratio,
        )

    def _set_lr(self) -> float:
        lr = self.lr_now()
        self.policy.lr = lr  # type: ignore[attr-defined]  # Megatron's step sets its groups' lr from it
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _step(self, batch: Batch, l_p: torch.Tensor | None, l_ref: torch.Tensor | None) -> dict[str, float]:
        cfg = self.cfg
        adv = algo.grpo_advantages(batch.rewards, norm_std=cfg.norm_adv_std).reshape(-1)
        l_t, entropy = self._logprobs(batch, with_entropy=True)
        assert entropy is not None
        if l_p is None:  # loglinear: behaviour versions -> trainer steps (version v was sent after v * trigger steps)
            l_p = algo.loglinear_proximal(batch.l_b, l_t, batch.versions * self.trigger, self.steps, batch.mask)
        bw = algo.behaviour_weights(
            l_p,
            batch.l_b,
            batch.mask,
            kind=cfg.behaviour_weight,
            level=cfg.weight_level,
            cap=cfg.weight_cap,
            lo=cfg.weight_lo,
            hi=cfg.weight_hi,
        )
        loss, ls = algo.ppo_loss(
            l_t, l_p, adv, bw.weight, bw.mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.clip_c
        )
        coef = cfg.entropy_coef + self.entropy_coef
        if coef > 0:
            loss = loss - coef * algo.masked_mean(entropy, batch.mask)
        kl_ref = 0.0
        if l_ref is not None:
            kl = algo.masked_mean(algo.kl_k3(l_t, l_ref), batch.mask)
            loss = loss + cfg.kl_coef * kl
            kl_ref = float(kl.detach())
        self.unpark("grads", "optim")  # prefetched: wait for them here, the forward with gradient enqueued already
        if "grads" not in self.parked:
            self.policy.zero_grad()
        lr = self._set_lr()
        grad_norm = self.policy.step(loss)
        mask = batch.mask
        ent = float(algo.masked_mean(entropy.detach(), mask))
        if cfg.entropy_target is not None:
            self.entropy_coef = min(
                max(self.entropy_coef + cfg.entropy_adapt_rate * (cfg.entropy_target - ent), 0.0), cfg.entropy_coef_max
            )
        return self._pi_old_check(batch, l_p) | {
            "loss": float(loss.detach()),
            "lr": lr,
            "entropy_coef": coef,
            "entropy": ent,
            "grad_norm": float(grad_norm),
            "clip_fraction": ls.clip_fraction,
            "dual_clip_fraction": ls.dual_clip_fraction,
            "kl_current_proximal": ls.kl_current_proximal,
            "kl_ref": kl_ref,
            "kl_proximal_behaviour": float(algo.masked_mean(-algo.safe_log_ratio(l_p, batch.l_b, mask), mask)),
            "behaviour_weight_mean": bw.raw_mean,
            "behaviour_weight_max": bw.raw_max,
            "behaviour_adjusted_fraction": bw.adjusted_fraction,
            "ess": bw.ess,
            "zero_advantage_groups": float((batch.rewards.std(1) == 0).float().mean()),
        }

    def _pi_old_check(self, batch: Batch, l_p: torch.Tensor) -> dict[str, float]:
        """pi_old mode: tokens drawn by the very weights pi_old holds (same version) must get ``l_p == l_b``."""
        if self.cfg.old_logprob != "pi_old":
            return {}
        same = batch.mask & (batch.versions == self.cycle.snapshot.version)
        diff = (l_p - batch.l_b)[same].abs()
        return {
            "pi_old_same_version_tokens": float(same.sum()),
            "pi_old_same_version_max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        }

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Params on the device for a while (evaluation), parked again afterwards."""
        self.unpark("params")
        try:
            yield
        finally:
            self.park()
