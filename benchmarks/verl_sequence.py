"""verl's fully-async non-bypass pi_old sequence, driven through any set of verl-named functions.

verl 0.9.1's separate-async trainer (``fully_async_trainer._compute_old_log_prob``,
``trainer_separate_async``) recomputes old log-probs under pi_old, the weights of
the cycle's first mini-batch, through its worker's ``save_model_to_cpu(n)`` /
``restore_model_from_cpu(n)`` / ``clear_cpu_model(n)`` (``copy_*`` / ``restore_*``
underneath). Per mini-batch ``k`` of a cycle of ``n``::

    k == 1: saved[1] = copy(model)                       # pi_old
    k  > 1: saved[k] = copy(model); restore(model, saved[1])
    load; old_logprob = forward(batch_k); offload        # the engine, when param_offload is on
    k  > 1: restore(model, saved[k]); del saved[k]
    load model + optimizer; train step; offload both     # update_actor

``run_sequence`` runs it with the functions given (verl's, stateshift's, or
``reference`` ones that keep plain clones and never move anything), records
each old log-prob, the time of each call, and the first exception where it
happens (later steps are not run). ``mix`` picks who offloads between phases:
``device`` (param_offload off), ``offloaded`` (the offload functions),
``native`` (Megatron's own ``offload_to_cpu`` on every DDP buffer; loads
through the load function), ``mixed`` (the two alternately).

Used by ``tests/integrations/test_verl.py`` (CPU, fake Megatron and FSDP2 on gloo),
``tests/gpu/test_verl_gpu.py`` and ``benchmarks/verl_bench.py``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

MIXES = ("device", "offloaded", "native", "mixed")


@dataclass
class Fns:
    """The functions under test, with verl's calling conventions (FSDP2's save returns a pair: unpacked)."""

    copy: Callable[[Any], Any]
    restore: Callable[[Any, Any], None]
    offload_model: Callable[[Any], None]
    load_model: Callable[[Any], None]
    offload_opt: Callable[[Any], None]
    load_opt: Callable[[Any], None]


def megatron_fns(mod: Any) -> Fns:
    """``mod``: ``verl.utils.megatron_utils`` or ``stateshift.integrations.verl``."""
    return Fns(
        mod.copy_megatron_model_to_cpu,
        mod.restore_megatron_model_from_cpu,
        mod.offload_megatron_model_to_cpu,
        mod.load_megatron_model_to_gpu,
        mod.offload_megatron_optimizer,
        mod.load_megatron_optimizer,
    )


def fsdp2_fns(mod: Any, device_id: Any) -> Fns:
    """``mod``: ``verl.utils.fsdp_utils`` or ``stateshift.integrations.verl``; restore as verl's worker calls it."""
    return Fns(
        mod.fsdp2_sharded_save_to_cpu,
        lambda m, saved: mod.fsdp2_sharded_load_from_cpu(m, *saved),
        mod.offload_fsdp_model_to_cpu,
        mod.load_fsdp_model_to_gpu,
        mod.offload_fsdp_optimizer,
        lambda o: mod.load_fsdp_optimizer(o, device_id),
    )


def _weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    """Every param and buffer by name; FSDP2 modules resharded first (after a forward with
    ``reshard_after_forward=False`` the root's parameters are the all-gathered copies, not the shards)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for c in chunks:
        for m in c.modules():
            if callable(getattr(m, "reshard", None)) and hasattr(m, "unshard"):
                m.reshard()
    out = []
    for i, c in enumerate(chunks):
        inner = getattr(c, "module", c) if isinstance(getattr(c, "buffers", None), list) else c
        out += [(f"{i}.{n}", t) for n, t in inner.named_parameters()] + [
            (f"{i}.{n}", t) for n, t in inner.named_buffers()
        ]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def reference_fns() -> Fns:
    """Plain clones of every param and buffer (local shards), written back with ``copy_``; nothing ever moves."""

    def copy(model: Any) -> dict[str, torch.Tensor]:
        return {n: _local(t).detach().clone() for n, t in _weights(model)}

    @torch.no_grad()
    def restore(model: Any, saved: dict[str, torch.Tensor]) -> None:
        for n, t in _weights(model):
            _local(t).copy_(saved[n])

    def nothing(_: Any) -> None:
        return None

    return Fns(copy, restore, nothing, nothing, nothing, nothing)


def weights(model: Any) -> dict[str, torch.Tensor]:
    """Every param and buffer (local shards) now, copied to the CPU (all must be resident)."""
    return {n: _local(t).detach().cpu().clone() for n, t in _weights(model)}


def megatron_native_offload(model: Any) -> None:
    """Megatron's own offload of every DDP buffer (params to ``param_data_cpu``, grads released)."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            b.offload_to_cpu(move_params=True, move_grads=True)


@dataclass
class SequenceResult:
    """Old log-probs per mini-batch (in order), call times by function, the first error and where."""

    old: list[torch.Tensor] = field(default_factory=list)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None
    where: str | None = None


class _Timed:
    def __init__(self, result: SequenceResult, sync: Callable[[], None]) -> None:
        self.result, self.sync = result, sync
        self.step, self.where = "", ""

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.where = name
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args)
        self.sync()
        self.result.seconds.setdefault(name, []).append(time.perf_counter() - t0)
        return out


def run_sequence(
    fns: Fns,
    model: Any,
    opt: Any,
    *,
    forward: Callable[[int], torch.Tensor],
    train: Callable[[int], None],
    n: int,
    cycles: int,
    mix: str = "offloaded",
    native_offload: Callable[[Any], None] | None = None,
    sync: Callable[[], None] = lambda: None,
) -> SequenceResult:
    """Run ``cycles`` cycles of ``n`` mini-batches (module docstring); ``forward(step)`` returns the old log-probs of
    mini-batch ``step`` (under ``torch.no_grad()``), ``train(step)`` is one training step."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, not {mix!r}")
    result = SequenceResult()
    call, calls = _Timed(result, sync), [0]

    def offload() -> None:
        if mix == "device":
            return
        calls[0] += 1
        native = mix == "native" or (mix == "mixed" and calls[0] % 2 == 0)
        call("native_offload" if native else "offload_model", native_offload if native else fns.offload_model, model)

    def load() -> None:
        if mix != "device":
            call("load_model", fns.load_model, model)

    saved: dict[int, Any] = {}
    try:
        offload()
        for step in range(cycles * n):
            k = step % n + 1
            call.step = f"cycle {step // n} mini-batch {k}"
            saved[k] = call("copy", fns.copy, model)
            if k > 1:
                call("restore", fns.restore, model, saved[1])
            load()
            result.old.append(forward(step))
            offload()
            if k > 1:
                call("restore", fns.restore, model, saved.pop(k))
            load()
            if mix != "device":
                call("load_opt", fns.load_opt, opt)
            train(step)
            offload()
            if mix != "device":
                call("offload_opt", fns.offload_opt, opt)
        load()
        if mix != "device":
            call("load_opt", fns.load_opt, opt)
    except Exception as exc:  # noqa: BLE001 - recorded as it happens: the comparison reports it
        result.error = f"{type(exc).__name__}: {exc}"
        result.where = f"{call.step or 'start'}, in {call.where}: {traceback.format_exc(limit=-3)}"
    return result


def compare(
    got: SequenceResult, ref: SequenceResult, final: dict[str, torch.Tensor] | None, ref_final: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Mismatching old log-probs (of those computed), whether the final weights equal the reference's, the error.
    ``final`` is ``None`` after an error (the weights may be released: reading them would fault)."""
    wrong = sum(not torch.equal(a.cpu(), b.cpu()) for a, b in zip(got.old, ref.old, strict=True))
    final = final or {}
    same = final.keys() == ref_final.keys() and all(torch.equal(final[k], ref_final[k]) for k in final)
    differ = sorted(k for k in final if k in ref_final and not torch.equal(final[k], ref_final[k]))
    return {
        "old_logprobs": len(ref.old),
        "computed": len(got.old),
        "mismatches": wrong,
        "final_equal": bool(same and got.error is None),
        "final_differ": differ[:5],
        "error": got.error,
        "where": got.where,
    }
