"""Continuous batching: a rollouter that follows the mean response length, not the max (``rollout.batching=continuous``).

A wave (``rollout.py``) starts ``max_concurrent_prompts`` prompts together and
ends with its longest response: on a long-tail task most rows sit finished
while the last ones generate. Here the rollouter owns ``R =
max_concurrent_prompts * n`` row **slots** over a static KV cache
(``tasks/gpt.py: SlotCache``):

- a prompt admitted by the queue becomes ``n`` pending rows (one group);
- every free slot takes a pending row at once: its prompt is written into the
  slot's cache from position 0 (a prefill of the new rows only) -- a finished
  row is replaced by a row of a new prompt at the next token;
- one decode step feeds every busy slot one token, each at its own position;
- a group is handed to the queue as soon as its ``n`` rows are done, with
  responses as wide as its longest (``Batch.of`` pads to the batch's widest).

Weight updates: with ``partial_rollout`` on, an update is taken at the next
token boundary; the busy rows keep their tokens and are prefilled again
(prompt + tokens so far) under the new weights, so every later token is drawn
by the new weights only (as ``KVRollouter`` does for a wave). Off, the engine
admits nothing more, finishes its busy rows, then takes the update.

Randomness: the rollouter's generator only (one ``multinomial`` over the busy
rows per step), so a run is reproducible for a seed given the same admission
schedule; greedy decoding gives the wave's tokens exactly
(``tests/rl/test_rl_continuous.py``).

The interface another family would implement (``SlotLM``): ``new_slot_cache(rows)``
and ``lm(ids, positions, rows, cache)`` returning logits, with the semantics of
``SlotCache`` (a slot's keys indexed by position; a query attends to indices
``0..its position``). A Hugging Face model maps it onto ``StaticCache`` with
per-row ``cache_position``; Megatron and FSDP2 onto a preallocated
(rows, heads, max_len, dim) buffer per layer written at each token's position,
with the same mask. ``ContinuousWorker`` drives any ``SlotLM`` through the
same ``QueuePort`` (``start`` / ``put`` / ``on_sync``) as ``RolloutWorker``,
so a process executor runs it unchanged in the child process: build a
``ContinuousWorker`` where it builds a ``RolloutWorker``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .config import TrainConfig
from .control import SLICE_S, RunControl
from .executors.inprocess import InProcessRollouts, RolloutWorker
from .policies import Policy
from .rollout import Group
from .sampler import BuiltinLM, Sampling, draw
from .tasks.base import Task
from .tasks.gpt import SlotCache

__all__ = ["ContinuousEngine", "ContinuousInProcessRollouts", "ContinuousWorker", "SlotLM", "slot_lm"]


@runtime_checkable
class SlotLM(Protocol):
    """A causal LM with a static per-row KV cache (see the module docstring)."""

    def new_slot_cache(self, rows: int) -> Any: ...

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None, cache: Any
    ) -> torch.Tensor:
        """Logits (batch, new, vocab); ``rows`` the slots fed (``None``: all, in order)."""
        ...


class BuiltinSlotLM:
    """``SlotLM`` over the built-in ``TinyGPT`` of a ``BuiltinLM``."""

    def __init__(self, lm: BuiltinLM) -> None:
        self.lm = lm
        self.module = lm.module

    def new_slot_cache(self, rows: int) -> SlotCache:
        p = next(self.module.parameters())
        return SlotCache.empty(self.module.cfg, rows, p.device, p.dtype)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None, cache: Any
    ) -> torch.Tensor:
        return self.module(ids, positions=positions, cache=cache, rows=rows)


def slot_lm(lm: Any) -> SlotLM:
    """The ``SlotLM`` of a rollouter's ``CausalLM`` (``TypeError`` for a family without one yet)."""
    if isinstance(lm, BuiltinLM):
        return BuiltinSlotLM(lm)
    raise TypeError(f"continuous batching needs a SlotLM; {type(lm).__name__} has none in this version")


@dataclass(eq=False)
class _GroupState:
    uid: int
    item: Any
    prompt: list[int]
    n: int
    rows: list[dict[str, list[Any]] | None] = field(default_factory=list)
    done: int = 0


@dataclass(eq=False)
class _Row:
    group: _GroupState
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False


class ContinuousEngine:
    """The slots, their static KV cache and the pending rows; called from one thread (the rollout thread)."""

    def __init__(
        self, lm: SlotLM, sampling: Sampling, rows: int, n: int, generator: torch.Generator, device: torch.device
    ) -> None:
        self.lm, self.sampling, self.n, self.generator, self.device = lm, sampling, n, generator, device
        self.cache = lm.new_slot_cache(rows)
        self.slots: list[_Row | None] = [None] * rows
        self.pending: deque[_Row] = deque()
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        #: the version whose weights computed the cache (``refresh`` on a change)
        self.version = -1
        #: slot-steps with a row busy, and all slot-steps (occupancy = busy / total)
        self.busy_slot_steps = 0
        self.slot_steps = 0

    @property
    def free(self) -> int:
        return sum(s is None for s in self.slots)

    @property
    def busy(self) -> bool:
        return any(s is not None for s in self.slots) or bool(self.pending)

    def want(self) -> int:
        """Prompts to ask the queue for, so every free slot gets a row."""
        return max(math.ceil((self.free - len(self.pending)) / self.n), 0)

    def add(self, prompts: list[tuple[int, Any, list[int]]]) -> None:
        """Admitted ``(uid, item, prompt)``: ``n`` pending rows each."""
        for uid, item, prompt in prompts:
            g = _GroupState(uid, item, list(prompt), self.n, [None] * self.n)
            self.pending.extend(_Row(g, i) for i in range(self.n))

    def _prefill(self, slots: list[int]) -> None:
        """Write the sequences (prompt + tokens so far) of ``slots`` into their cache from position 0; their next
        logits come from each sequence's last token."""
        seqs = [self.slots[s].group.prompt + self.slots[s].tokens for s in slots]  # type: ignore[union-attr]
        width = max(len(q) for q in seqs)
        ids = torch.full((len(seqs), width), self.sampling.pad_token, dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, : len(q)] = torch.tensor(q, dtype=torch.long)
        ids = ids.to(self.device)
        pos = torch.arange(width, device=self.device).expand(len(seqs), width)
        rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        logits = self.lm(ids, pos, rows, self.cache)
        last = torch.tensor([len(q) - 1 for q in seqs], device=self.device)
        if self.logits is None:
            self.logits = torch.zeros(len(self.slots), logits.shape[-1], device=self.device)
        self.logits[rows] = logits[torch.arange(len(seqs), device=self.device), last].float()
        self.lens[rows] = last + 1

    def refresh(self, version: int) -> None:
        """New weights (``version``): every busy row's cache is computed again by them (tokens kept)."""
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        if busy:
            self._prefill(busy)
        self.version = version

    def fill(self) -> None:
        """Every free slot takes a pending row (a prefill of those rows only)."""
        started = []
        for i, s in enumerate(self.slots):
            if s is None and self.pending:
                self.slots[i] = self.pending.popleft()
                started.append(i)
        if started:
            self._prefill(started)

    def step(self, version: int) -> list[_GroupState]:
        """One token for every busy slot (drawn by weights ``version``); returns the groups it completed."""
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        self.slot_steps += len(self.slots)
        self.busy_slot_steps += len(busy)
        if not busy:
            return []
        assert self.logits is not None
        idx = torch.tensor(busy, dtype=torch.long, device=self.device)
        tok, logp = draw(self.logits[idx], self.sampling, self.generator)
        tok_l, logp_l = tok.tolist(), logp.tolist()
        done_groups, cont = [], []
        for j, i in enumerate(busy):
            row = self.slots[i]
            assert row is not None
            row.tokens.append(tok_l[j])
            row.logprobs.append(logp_l[j])
            row.versions.append(version)
            stop = self.sampling.stop_token is not None and tok_l[j] == self.sampling.stop_token
            if stop or len(row.tokens) >= self.sampling.max_new_tokens:
                row.finished = stop
                self.slots[i] = None
                g = row.group
                g.rows[row.index] = {
                    "tokens": row.tokens,
                    "logprobs": row.logprobs,
                    "versions": row.versions,
                    "finished": [row.finished],
                }
                g.done += 1
                if g.done == g.n:
                    done_groups.append(g)
            else:
                cont.append(j)
        if cont:
            keep = idx[cont]
            pos = self.lens[keep]
            logits = self.lm(
                tok[cont][:, None], pos[:, None], keep if len(cont) < len(self.slots) else None, self.cache
            )
            self.logits[keep] = logits[:, -1].float()  # type: ignore[index]
            self.lens[keep] = pos + 1
        return done_groups

    @property
    def occupancy(self) -> float:
        return self.busy_slot_steps / self.slot_steps if self.slot_steps else 0.0


def to_group(g: _GroupState, task: Task, pad: int) -> Group:
    """A completed group as the queue's ``Group``: responses right-padded to the group's longest."""
    width = max(len(r["tokens"]) for r in g.rows)  # type: ignore[index]
    shape = (g.n, width)
    tokens = torch.full(shape, pad, dtype=torch.long)
    logprobs, versions = torch.zeros(shape), torch.full(shape, -1, dtype=torch.long)
    finished = torch.zeros(g.n, dtype=torch.bool)
    scored = []
    for i, r in enumerate(g.rows):
        assert r is not None
        k = len(r["tokens"])
        tokens[i, :k] = torch.tensor(r["tokens"])
        logprobs[i, :k] = torch.tensor(r["logprobs"])
        versions[i, :k] = torch.tensor(r["versions"])
        finished[i] = r["finished"][0]
        scored.append(task.score(g.item, r["tokens"]))
    return Group(
        uid=g.uid,
        item=g.item,
        prompt=tuple(g.prompt),
        tokens=tokens,
        mask=versions >= 0,
        logprobs=logprobs,
        versions=versions,
        rewards=torch.tensor([s[0] for s in scored]),
        exact=torch.tensor([s[1] for s in scored]),
        finished=finished,
    )


class ContinuousWorker(RolloutWorker):
    """A ``RolloutWorker`` whose loop drives a ``ContinuousEngine`` instead of waves (same queue port, same weight
    handshake, same reports)."""

    def __init__(self, base: RolloutWorker, rows: int) -> None:
        super().__init__(
            base.rollouter,
            base.task,
            base.port,
            base.channel,
            base.control,
            n=base.n,
            wave_prompts=base.wave_prompts,
            owner=base.owner,
            torch_threads=base.torch_threads,
        )
        r = self.rollouter
        self.engine = ContinuousEngine(slot_lm(r.lm), r.sampling, rows, base.n, r.generator, r.device)

    def run(self) -> None:
        try:
            if self.torch_threads:
                torch.set_num_threads(self.torch_threads)
            with torch.no_grad():
                while not self.control.stopping:
                    self._iteration()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            self.control.fail("rollout", exc)

    def _iteration(self) -> None:
        eng, r = self.engine, self.rollouter
        update = self.channel.take()
        if update is not None and (r.paused or not eng.busy):  # partial rollout: now; else once drained
            self._take_weights()
        if update is None:
            self._admit()
        if not eng.busy:
            return
        self.control.doing["rollout"] = f"{len(eng.slots) - eng.free} rows busy at v{r.version}"
        t0 = time.perf_counter()
        with r._on_stream():  # the rollouter's own CUDA stream (KVRollouter): its kernels overlap the trainer's
            if eng.version != r.version:
                eng.refresh(r.version)
            eng.fill()
            done = eng.step(r.version)  # its .tolist() waits for the stream: nothing it wrote is read early
        self.report.busy_s += time.perf_counter() - t0
        if done:
            groups = [to_group(g, self.task, r.sampling.pad_token) for g in done]
            self.report.tokens += int(sum(int(g.mask.sum()) for g in groups))
            self.port.put(self.owner, groups, self.report)
            self.control.progress()

    def _admit(self) -> None:
        eng = self.engine
        want = eng.want()
        if want <= 0:
            return
        got = self.port.start(self.owner, self.rollouter.version, want, 0.0 if eng.busy else SLICE_S)
        if not got and not eng.busy:
            self.control.doing["rollout"] = f"paused by the staleness rules at v{self.rollouter.version}"
        eng.add([(uid, item, self.task.prompt(item)) for uid, item in got])

    def capture(self, queue_part: dict[str, Any]) -> Any:
        raise NotImplementedError("checkpoints with rollout.batching=continuous are not supported in this version")


class ContinuousInProcessRollouts(InProcessRollouts):
    """``InProcessRollouts`` with a ``ContinuousWorker`` on its thread."""

    def __init__(
        self, cfg: TrainConfig, task: Task, policy: Policy, control: RunControl, *, version: int, capture: Any = None
    ) -> None:
        super().__init__(cfg, task, policy, control, version=version, capture=capture)
        import threading

        self.worker = ContinuousWorker(self.worker, cfg.rollout.max_concurrent_prompts * cfg.rollout.n)
        self.thread = threading.Thread(target=self.worker.run, name="stateshift-rollout", daemon=True)

    def occupancy(self) -> float:
        return self.worker.engine.occupancy  # type: ignore[attr-defined]
