"""The pi_old rebuild plug-in: bf16 params recomputed from the fp32 masters on the device."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol

import torch

from ...core.ranks import on_every_rank
from .objects import master_pairs, storage_bytes


class MastersOwner(Protocol):
    """What the rebuild reads of the Megatron optimizer backend (``MegatronOptimizerBackend`` is one):
    its model backend, its leaf optimizers, their masters' plan and the signature that keys it."""

    model: Any

    @property
    def leaves(self) -> list[Any]: ...

    def signature(self) -> tuple[Any, ...]: ...

    def plan(
        self,
    ) -> list[tuple[Any, list[tuple[str, torch.Tensor, tuple[Any, ...]]], list[tuple[str, torch.Tensor]]]]: ...


class MasterRebuild:
    """Recompute the current bf16 params from the fp32 masters instead of stashing and copying them back.

    After every Megatron optimizer step the model params equal the masters
    cast to bf16 (``_copy_main_params_to_model_params``), so inside a
    ``swapped(pi_old)`` the current params need not be stashed: on exit one
    multi-tensor cast writes them back from the masters on the device (and,
    with data parallelism, the param all-gather completes the shards other
    ranks own). ``available`` says when this is exact; otherwise the caller
    falls back to the stash.
    """

    group = "params"

    def __init__(self, backend: MastersOwner) -> None:
        self.backend = backend
        self._sig: Any = None
        self._views: list[torch.Tensor] | None = None

    def _prepare(self) -> None:
        """Where each master goes in the model's storage, and whether the rebuild can be exact at all.

        Cached until the optimizers' param groups change. Reads no storage:
        the destination views are made by ``_destinations`` once the params
        are resident (a view of a released storage cannot be made). With
        data parallelism some param in a DDP buffer is not wholly covered by
        a master of this rank, so the DistributedOptimizer's param
        all-gather completes the rebuild (``_gather``).
        """
        sig = self.backend.signature()
        if sig == self._sig:
            return
        targets: list[
            tuple[torch.Tensor, int | None, int | None]
        ] = []  # each master's destination: (tensor, start, end)
        srcs: list[torch.Tensor] = []
        whole: set[int] = set()
        for opt in self.backend.leaves:
            distributed = hasattr(opt, "shard_fp32_from_float16_groups")
            for p, master in master_pairs(opt):
                if distributed:
                    world = opt._get_model_param_range_map(p)["gbuf_world_in_bucket"]
                    gi, _, bi = opt.model_param_gbuf_map[p]
                    targets.append((opt.buffers[gi].buckets[bi].param_data, world.start, world.end))
                else:
                    targets.append((p, None, None))  # the whole param, in its own shape
                srcs.append(master)
                if master.numel() == p.numel():
                    whole.add(id(p))
        model = self.backend.model
        self._gather = model is not None and any(
            id(p) not in whole for ref in model.ddp_buffers() for p in ref.buffer.params
        )
        self._targets, self._masters, self._views = targets, srcs, None
        self._nbytes = (
            sum(m.numel() * m.element_size() for m in srcs),
            sum((t.numel() if start is None else end - start) * t.element_size() for t, start, end in targets),  # type: ignore[operator]
        )
        self._static = self._static_reason()
        self._sig = sig

    def _destinations(self) -> list[torch.Tensor]:
        """The views the masters are cast into (made once while resident; a view follows its storage
        through release and re-growth)."""
        if self._views is None:
            self._views = [
                t.detach() if start is None else t.detach().view(-1)[start:end] for t, start, end in self._targets
            ]
        return self._views

    def _static_reason(self) -> str | None:
        model = self.backend.model
        if model is None:
            return "no Megatron model backend for this optimizer"
        leaves = self.backend.leaves
        for opt in leaves:
            cfg = getattr(opt, "config", None)
            if getattr(cfg, "use_precision_aware_optimizer", False) or getattr(
                getattr(opt, "ddp_config", None), "use_megatron_fsdp", False
            ):
                return f"{type(opt).__name__} keeps its masters elsewhere (precision-aware optimizer / Megatron-FSDP)"
            if not hasattr(opt, "shard_fp32_from_float16_groups") and not hasattr(opt, "fp32_from_float16_groups"):
                return f"{type(opt).__name__} has no fp32 masters (the model params are the optimizer's own values)"
            fp32 = getattr(opt, "model_fp32_groups", None) or getattr(opt, "fp32_from_fp32_groups", None) or []
            if any(len(g) for g in fp32):
                return f"{type(opt).__name__} steps fp32 model params directly (they are their own masters)"
        for name, p in model.outside_params():
            if p.requires_grad:
                return f"param {name!r} is trainable but outside every DDP buffer: no master for it"
        covered = {id(p) for opt in leaves for p, _ in master_pairs(opt)}
        distributed = any(hasattr(o, "shard_fp32_from_float16_groups") for o in leaves)
        for ref in model.ddp_buffers():
            if getattr(ref.buffer, "param_data", None) is None and distributed:
                return "a DDP buffer has no param_data, which a DistributedOptimizer needs"
            for p in ref.buffer.params:
                if id(p) not in covered and not distributed:  # (distributed: another rank's shard, gathered)
                    return f"param {model.param_name(p, '?')!r} has no fp32 master in this optimizer"
        return None

    def available(self) -> str | None:
        """``None`` when rebuilding the params group from masters is exact now; otherwise why not.

        "On the device" means resident where the params they rebuild live:
        each master must be on its destination's own device (not the copy
        engine's: a CPU model on a CUDA machine has CPU masters and CPU
        params, and rebuilds on the CPU) and hold its storage (not released by
        ``state.offload("optim")``). Megatron's own ``offload_to_cpu`` moves
        the masters to the CPU (``p.data = p.data.cpu()``) while the params
        stay on the GPU: a rebuild would then cross PCIe, so the stash is used.
        Never raises for a residency: offloaded params have nothing to rebuild.

        Exact means the params *are* the masters' cast now, which is checked
        (one comparison on the device, one host sync): a restore of a
        params-only snapshot, a ``load(..., "params")``, a ``swapped()`` of
        ``optim`` or any write outside an optimizer step makes them differ,
        and a rebuild would then replace the current params with other
        values. With data parallelism (the rebuild all-gathers) the ranks
        agree on the answer (one all-reduce over the default group), so call
        it on every rank, as the rebuild itself is.
        """
        self._prepare()
        reason = self._static or self._residency_reason() or self._value_reason()
        if self._gather and torch.distributed.is_available() and torch.distributed.is_initialized():
            reason = self._agree(reason)
        return reason

    def _residency_reason(self) -> str | None:
        for (dst, _, _), m in zip(self._targets, self._masters, strict=True):
            if storage_bytes(dst) == 0:
                return "the params are offloaded (their storage is released): there is nothing on the device to rebuild"
            if storage_bytes(m) == 0:
                return "the fp32 masters are not on the device (optimizer offloaded: their storage is released)"
            if m.device != dst.device:
                return f"the fp32 masters are not on the device of the params ({m.device}, params on {dst.device}: optimizer offloaded)"
        return None

    def _value_reason(self) -> str | None:
        """Whether every param (this rank's part) equals its master's cast (NaN equal to NaN: the CPU's
        vectorised and scalar casts give a NaN different bits). Three kernels per master and one host
        sync; only when some value differs, a second pass that lets NaN match NaN."""
        if self._differ(nan_equal=False) and self._differ(nan_equal=True):
            return (
                "the params are not the fp32 masters' cast (written since the last optimizer step: a restore or "
                "load of params, a swapped() of optim, or a write outside the optimizer)"
            )
        return None

    def _differ(self, *, nan_equal: bool) -> bool:
        flags: dict[torch.device, list[torch.Tensor]] = {}
        with torch.no_grad():
            for d, m in zip(self._destinations(), self._masters, strict=True):
                cast = m.detach().to(d.dtype).view(d.shape)
                differ = cast.ne(d)
                if nan_equal and d.is_floating_point():
                    differ &= ~(cast.isnan() & d.isnan())
                flags.setdefault(d.device, []).append(differ.any())
            return any(bool(torch.stack(f).any()) for f in flags.values())

    def _agree(self, reason: str | None) -> str | None:
        """Every rank gets a reason if any rank has one (the rebuild's all-gather needs them all)."""
        if not on_every_rank(reason is None) and reason is None:
            return "another data-parallel rank cannot rebuild exactly (its available() gives the reason)"
        return reason

    def reads(self) -> Mapping[str, Collection[str]]:
        """The masters, by name in group ``optim``: the engine makes them resident for the rebuild."""
        self._prepare()
        keys = {id(m) for m in self._masters}
        return {
            "optim": frozenset(name for _, masters, _ in self.backend.plan() for name, m, _ in masters if id(m) in keys)
        }

    def nbytes(self) -> tuple[int, int]:
        """(bytes read from masters, bytes written into params) per rebuild."""
        self._prepare()
        return self._nbytes

    def __call__(self) -> None:
        """Cast every master into its param (on the params' devices, the current stream), then all-gather if sharded."""
        self._prepare()
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for d, m in zip(self._destinations(), self._masters, strict=True):
            pair = by_device.setdefault(d.device, ([], []))
            pair[0].append(d)
            pair[1].append(m)
        with torch.no_grad():
            for d_list, s_list in by_device.values():
                torch._foreach_copy_(d_list, s_list)
            if self._gather:
                for opt in self.backend.leaves:
                    for chunk in getattr(opt, "model_chunks", []):
                        sync = getattr(chunk, "start_param_sync", None)
                        if callable(sync):
                            sync(force_sync=True)
