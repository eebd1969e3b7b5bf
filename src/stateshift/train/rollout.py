"""The rollout side: samples, in-flight waves, the ``Rollouter`` protocol and our KV-cached rollouter.

A **wave** is the batch of generations in flight: ``groups x n`` rows, one
prompt per group. A wave is generated token by token; between two tokens the
rollouter may be **paused** (a weight update is waiting). ``generate`` then
returns with the tokens kept; after ``update_weights`` the next ``generate``
call re-runs the prompt and the kept tokens through the new weights (a fresh
KV cache, so every later token is computed by the new weights only) and
continues. Each token records the version of the weights that drew it, so a
partial rollout shows the span of versions it saw.

A finished wave becomes ``Group`` s: immutable records that the queue carries
to the trainer. The trainer reads them on its own thread; nothing writes a
group after the rollout thread built it, so reading needs no lock.

``Rollouter`` is the interface a vLLM or SGLang adapter would implement
(pause with ``mode="keep"``, a weight update with a version, resume);
``KVRollouter`` is the in-package implementation over any ``CausalLM``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ConfigError
from .sampler import CausalLM, Sampling, draw, left_pad, lm_device, positions_of


def check_weight(name: str, target: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``target`` (the rollout model's tensor named ``name``, ``None`` if it has none), if ``value`` fits it.

    Raises:
        ConfigError("weight_sync"): ``name`` is not in the rollout model, or ``value`` has another shape or dtype.
    """
    if target is None:
        raise ConfigError("weight_sync", "not in the rollout model", name=name)
    if target.shape != value.shape or target.dtype != value.dtype:
        raise ConfigError(
            "weight_sync",
            f"{tuple(value.shape)} {value.dtype} sent, the rollout model has {tuple(target.shape)} {target.dtype}",
            name=name,
        )
    return target


def missing_weights(missing: list[str]) -> ConfigError:
    """The error for weights of the rollout model that were not sent (``missing``, the first named)."""
    return ConfigError(
        "weight_sync", f"not sent, but the rollout model has it ({len(missing)} missing)", name=missing[0]
    )


@dataclass(frozen=True, eq=False, slots=True)
class Group:
    """One prompt's ``n`` responses with their ledger: per-token behaviour log-prob and policy version.

    Tensors are (n, response length); ``mask`` covers each response up to and
    including its stop token; ``versions`` is -1 outside the mask.
    """

    uid: int
    item: Any
    prompt: tuple[int, ...]
    tokens: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor
    exact: torch.Tensor
    finished: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def min_version(self) -> int:
        return int(self.versions[self.mask].min())

    @property
    def max_version(self) -> int:
        return int(self.versions[self.mask].max())


@dataclass(eq=False)
class Wave:
    """Generations in flight: rows ``g*n .. g*n+n-1`` answer group ``g``. Written only by the rollout thread."""

    uids: list[int]
    items: list[Any]
    n: int
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    done: torch.Tensor
    step: int = 0

    @staticmethod
    def start(uids: list[int], items: list[Any], prompts: list[list[int]], n: int, sampling: Sampling) -> Wave:
        rows = [p for p in prompts for _ in range(n)]
        ids, mask = left_pad(rows, sampling.pad_token)
        shape = (len(rows), sampling.max_new_tokens)
        return Wave(
            uids=list(uids),
            items=list(items),
            n=n,
            prompt_ids=ids,
            prompt_mask=mask,
            tokens=torch.full(shape, sampling.pad_token, dtype=torch.long),
            logprobs=torch.zeros(shape),
            versions=torch.full(shape, -1, dtype=torch.long),
            done=torch.zeros(len(rows), dtype=torch.bool),
        )

    @property
    def finished(self) -> bool:
        return self.step >= self.tokens.shape[1] or bool(self.done.all())

    def to(self, device: torch.device) -> Wave:
        """A working copy on ``device`` (the same wave when it is there already)."""
        if self.tokens.device == device:
            return self
        return Wave(
            uids=self.uids,
            items=self.items,
            n=self.n,
            step=self.step,
            **{
                k: getattr(self, k).to(device)
                for k in ("prompt_ids", "prompt_mask", "tokens", "logprobs", "versions", "done")
            },
        )

    def take_progress(self, work: Wave) -> None:
        """Copy what ``work`` (a working copy made by ``to``) generated back into this wave's tensors."""
        if work is self:
            return
        for k in ("tokens", "logprobs", "versions", "done"):
            getattr(self, k).copy_(getattr(work, k))
        self.step = work.step

    def groups(self, score: Any) -> list[Group]:
        """The finished wave as groups; ``score(item, tokens) -> (reward, exact)`` rates each response."""
        out: list[Group] = []
        mask = self.versions >= 0
        for g, (uid, item) in enumerate(zip(self.uids, self.items, strict=True)):
            rows = slice(g * self.n, (g + 1) * self.n)
            scored = [score(item, self.tokens[r][mask[r]].tolist()) for r in range(rows.start, rows.stop)]
            width = self.prompt_mask[rows.start].sum()
            out.append(
                Group(
                    uid=uid,
                    item=item,
                    prompt=tuple(self.prompt_ids[rows.start, -int(width) :].tolist()) if width else (),
                    tokens=self.tokens[rows].clone(),
                    mask=mask[rows].clone(),
                    logprobs=self.logprobs[rows].clone(),
                    versions=self.versions[rows].clone(),
                    rewards=torch.tensor([s[0] for s in scored]),
                    exact=torch.tensor([s[1] for s in scored]),
                    finished=self.done[rows].clone(),
                )
            )
        return out


@runtime_checkable
class Rollouter(Protocol):
    """What the async loop needs from a rollout engine (ours: ``KVRollouter``; a vLLM/SGLang adapter would map
    ``pause`` to ``pause_generation(mode="keep")`` and ``update_weights`` to its weight-transfer calls)."""

    #: the policy version of the weights it generates with
    version: int

    def generate(self, wave: Wave) -> bool:
        """Continue ``wave`` until it is finished (``True``) or ``pause()`` was called (``False``, tokens kept)."""
        ...

    def pause(self) -> None:
        """Make a running ``generate`` return at the next token boundary. Safe from any thread."""
        ...

    def resume(self) -> None:
        """Allow ``generate`` to run again."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy ``(name, tensor)`` pairs into the model (not while ``generate`` runs); ``version`` becomes current."""
        ...


class KVRollouter:
    """Batched, KV-cached sampling over a ``CausalLM`` the rollouter owns (its own copy of the weights).

    All calls but ``pause``/``resume`` come from one thread (the rollout
    thread); ``generator`` is the only source of randomness, so a rollout is
    reproducible from its state (``rng_state``).

    Device: the model's (``lm_device``). Waves live on the CPU between calls
    (the queue, checkpoints and scoring read them there); ``generate`` works on
    a copy on the device and writes its progress back before it returns. An
    ``lm`` with ``own_stream = True`` (the rollouter's private copy, which
    nothing else computes with) runs on a CUDA stream of its own, so its
    kernels can overlap the trainer's; ``generate`` and ``update_weights``
    wait for that stream before they return, so nothing they wrote is read
    early on another stream. Any other ``lm`` (the trainer's model, when
    evaluating) computes on the caller's current stream, which is what orders
    its forward after the engine's onload copies.
    """

    def __init__(self, lm: CausalLM, sampling: Sampling, *, seed: int, version: int = 0) -> None:
        self.lm = lm
        self.sampling = sampling
        self.version = version
        self.device = lm_device(lm)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        own = bool(getattr(lm, "own_stream", False)) and self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if own else None
        self._pause = threading.Event()
        self._running = False
        self._targets_cache: dict[str, torch.Tensor] | None = None
        #: names sent with the weights that the model does not hold on their own (e.g. Megatron's flat buffers)
        self._skip = getattr(lm, "skip_weight", None)
        #: seconds and bytes of the weight copies so far
        self.copy_seconds = 0.0
        self.copy_bytes = 0

    def pause(self) -> None:
        self._pause.set()

    def resume(self) -> None:
        self._pause.clear()

    @property
    def paused(self) -> bool:
        return self._pause.is_set()

    @property
    def _targets(self) -> dict[str, torch.Tensor]:
        """The model's tensors by name (``_extra_state`` entries that are not tensors left out); read at the first sync."""
        if self._targets_cache is None:
            self._targets_cache = {
                n: t for n, t in self.lm.module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)
            }
        return self._targets_cache

    def _on_stream(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy by name; every model tensor must be given exactly once (``ConfigError("weight_sync")`` names the first that is not).

        Names ``lm.skip_weight(name)`` declares aggregates of others (a Megatron flat buffer holds every
        parameter that is also sent on its own) are not copied. ``weights`` is closed (if it has ``close``)
        when this returns or raises: a generator inside a weight receiver's read ends that read at once.
        """
        if self._running:
            raise RuntimeError("update_weights while generate() runs: pause first")
        t0 = time.perf_counter()
        seen: set[str] = set()
        pairs = iter(weights)
        closing = contextlib.closing(pairs) if hasattr(pairs, "close") else contextlib.nullcontext()
        with torch.no_grad(), self._on_stream(), closing:
            for name, value in pairs:
                if self._skip is not None and self._skip(name):
                    continue
                check_weight(name, self._targets.get(name), value).copy_(value)
                seen.add(name)
                self.copy_bytes += value.numel() * value.element_size()
            if self.stream is not None:
                self.stream.synchronize()  # the copies read the sender's memory: done before it may be released
        missing = [n for n in self._targets if n not in seen]
        if missing:
            raise missing_weights(missing)
        self.version = version
        self.copy_seconds += time.perf_counter() - t0

    def generate(self, wave: Wave) -> bool:
        if wave.finished:
            return True
        self._running = True
        try:
            with torch.no_grad(), self._on_stream():
                work = wave.to(self.device)
                try:
                    return self._generate(work)
                finally:
                    wave.take_progress(work)  # a blocking copy to the CPU: the stream's work is done after it
        finally:
            self._running = False

    def _generate(self, wave: Wave) -> bool:
        s = self.sampling
        cache = self.lm.new_cache()
        rows = wave.tokens.shape[0]
        dev = wave.tokens.device
        mask = torch.cat([wave.prompt_mask, torch.ones(rows, wave.step, dtype=torch.bool, device=dev)], dim=1)
        ids = torch.cat([wave.prompt_ids, wave.tokens[:, : wave.step]], dim=1)
        logits = self.lm(ids, positions_of(mask), mask, cache)[:, -1]
        while True:
            if self._pause.is_set():
                return False
            tok, logp = draw(logits, s, self.generator)
            live = ~wave.done
            tok = torch.where(live, tok, s.pad_token)
            wave.tokens[:, wave.step] = tok
            wave.logprobs[:, wave.step] = torch.where(live, logp, 0.0)
            wave.versions[:, wave.step] = torch.where(live, self.version, -1)
            if s.stop_token is not None:
                wave.done |= live & (tok == s.stop_token)
            wave.step += 1
            if wave.finished:
                return True
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.bool, device=dev)], dim=1)
            logits = self.lm(tok[:, None], positions_of(mask)[:, -1:], mask, cache)[:, -1]

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
