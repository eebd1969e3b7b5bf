"""Fake of megatron-core 0.16.1: DistributedOptimizer and ChainedOptimizer (optimizer/distrib_optimizer.py, optimizer/optimizer.py). See ``__init__.py``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .buffers import FakeOptimizerConfig, FakeParamAndGradBuffer, fake_partition_buckets
from .modules import FakeDistributedDataParallel
from .optimizers import FakeMegatronOptimizer, FakeMixedPrecisionOptimizer, _is_float16, _zero_grad_group_helper


@dataclass
class _Range:
    """optimizer/distrib_optimizer.py:62 ``Range``."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


class FakeDistributedOptimizer(FakeMixedPrecisionOptimizer):
    """optimizer/distrib_optimizer.py:97 ``DistributedOptimizer`` with dp world size 1 (this
    rank owns every bucket whole, so each shard is the whole param)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: FakeOptimizerConfig,
        model_chunks: list[FakeDistributedDataParallel],
        per_model_buffers: dict[int, list[FakeParamAndGradBuffer]],
    ):
        super().__init__(optimizer, config)
        #: :528
        self.model_chunks = model_chunks
        self.ddp_config = model_chunks[0].ddp_config
        #: :534 the same buffer objects as ``ddp.buffers`` / ``ddp.expert_parallel_buffers``.
        self.buffers: list[FakeParamAndGradBuffer] = [b for bs in per_model_buffers.values() for b in bs]
        self.per_model_buffers = per_model_buffers
        #: :548-550 a second set of bucket-group objects over the same buckets.
        #: (Partitioned buffer by buffer, which for non-fp8 buffers gives the same groups and
        #: lets the fake's "distrib" kind hold dense and expert buffers of one dtype together.)
        self.per_model_bucket_groups = {
            i: [g for b in bs for g in fake_partition_buckets([b])] for i, bs in per_model_buffers.items()
        }
        #: :552-569 per buffer {(param_dtype, grad_dtype): [per-bucket {"param_map": {param: ranges}}]}
        self.gbuf_ranges: list[dict] = []
        for buffer in self.buffers:
            per_bucket = []
            for bucket in buffer.buckets:
                world = _Range(bucket.offset, bucket.offset + bucket.grad_data.numel())
                pmap = {}
                for p, (s, e, _b) in buffer.param_index_map.items():
                    lo, hi = max(s, world.start), min(e, world.end)
                    if hi > lo:
                        pmap[p] = {
                            "gbuf_world": _Range(lo, hi),
                            "gbuf_world_in_bucket": _Range(lo - bucket.offset, hi - bucket.offset),
                            "gbuf_local": _Range(lo - world.start, hi - world.start),
                            "param": _Range(lo - s, hi - s),
                        }
                per_bucket.append({"param_map": pmap})
            self.gbuf_ranges.append({(buffer.param_dtype, buffer.grad_dtype): per_bucket})
        #: :570 param -> (gbuf_index, dtype key, bucket_index)
        self.model_param_gbuf_map: dict[torch.nn.Parameter, tuple] = {}
        for gi, rm in enumerate(self.gbuf_ranges):
            for key, buckets in rm.items():
                for bi, r in enumerate(buckets):
                    for p in r["param_map"]:
                        self.model_param_gbuf_map[p] = (gi, key, bi)

        # :576-584 every 16-bit param gets main_param=None / main_param_sharded=True first.
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.requires_grad and _is_float16(p):
                    p.main_param = None
                    p.main_param_sharded = True

        # :587-589 ``_build_optimizer_group_ranges``: group params in *buffer* order.
        world_group = {p: gi for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        self.model_param_group_index_map: dict = {}
        self.opt_group_ranges = [{"params": []} for _ in self.optimizer.param_groups]
        for rm in self.gbuf_ranges:
            for buckets in rm.values():
                for r in buckets:
                    for p in r["param_map"]:
                        gi = world_group[p]
                        self.opt_group_ranges[gi]["params"].append(p)
                        self.model_param_group_index_map[p] = (gi, len(self.opt_group_ranges[gi]["params"]) - 1)
        for gi, gr in enumerate(self.opt_group_ranges):
            gr["orig_group"] = self.optimizer.param_groups[gi]
            gr["orig_group_idx"] = self.optimizer.param_groups[gi]

        #: :592-600 the five group lists (``_build_model_and_main_param_groups`` :307-457):
        #: model_float16_groups   model bf16 params (views into param_data)
        #: model_fp32_groups      model fp32 params (views into an fp32 param_data)
        #: shard_float16_groups   ``model_param.detach().view(-1)[range]``: views into param_data
        #: shard_fp32_groups      ``model_param.view(-1)[range]``: views into param_data, and
        #:                        *these* are the inner optimizer's params for fp32 model params
        #: shard_fp32_from_float16_groups  ``shard_model_param.clone().float()``: fp32 masters
        #:                        with their own storage (:399)
        self.model_float16_groups: list[list[torch.nn.Parameter]] = []
        self.model_fp32_groups: list[list[torch.nn.Parameter]] = []
        self.shard_float16_groups: list[list[torch.Tensor]] = []
        self.shard_fp32_groups: list[list[torch.Tensor]] = []
        self.shard_fp32_from_float16_groups: list[list[torch.Tensor]] = []
        for gr in self.opt_group_ranges:
            mf16, mf32, sf16, sf32, smain = [], [], [], [], []
            for mp in gr["params"]:
                prange = self._get_model_param_range_map(mp)["param"]
                if _is_float16(mp):
                    shard_model = mp.detach().view(-1)[prange.start : prange.end]
                    shard_main = shard_model.clone().float()
                    if hasattr(mp, "shared"):
                        shard_model.shared = mp.shared
                        shard_main.shared = mp.shared
                    mp.main_param = shard_main  # :411
                    mp.main_param_sharded = True  # :412
                    mf16.append(mp)
                    sf16.append(shard_model)
                    smain.append(shard_main)
                elif mp.dtype == torch.float32:
                    shard_model = mp.view(-1)[prange.start : prange.end]  # :421 (keeps grad_fn)
                    mf32.append(mp)
                    sf32.append(shard_model)
                else:
                    raise TypeError(f"Wrapped parameters must be fp32/fp16/bf16, got {mp.dtype}")
            gr["orig_group"]["params"] = [*sf32, *smain]  # :441-444
            self.model_float16_groups.append(mf16)
            self.model_fp32_groups.append(mf32)
            self.shard_float16_groups.append(sf16)
            self.shard_fp32_groups.append(sf32)
            self.shard_fp32_from_float16_groups.append(smain)
        # :607-608 assigned directly (bypasses add_param_group's leaf check), then a state round trip.
        self.optimizer.param_groups = [g["orig_group"] for g in self.opt_group_ranges]
        self.optimizer.load_state_dict(self.optimizer.state_dict())

    def _get_model_param_range_map(self, param):
        """:610-618"""
        gi, key, bi = self.model_param_gbuf_map[param]
        return self.gbuf_ranges[gi][key][bi]["param_map"][param]

    def zero_grad(self, set_to_none: bool = True):
        """:2269-2298"""
        for groups in (
            self.model_float16_groups,
            self.model_fp32_groups,
            self.shard_float16_groups,
            self.shard_fp32_groups,
            self.shard_fp32_from_float16_groups,
        ):
            for g in groups:
                _zero_grad_group_helper(g, set_to_none)

    def _copy_model_grads_to_main_grads(self):
        """:2386-2427 ``shard_main.grad = main_grad.view(-1)[range].float()``: a view of
        grad_data (no copy) when grad_data is fp32."""

        def copy(model_groups, shard_groups):
            for mg, sg in zip(model_groups, shard_groups, strict=True):
                for mp, sp in zip(mg, sg, strict=True):
                    r = self._get_model_param_range_map(mp)["param"]
                    assert r.size == sp.nelement()
                    sp.grad = mp.main_grad.view(-1)[r.start : r.end].float()

        copy(self.model_float16_groups, self.shard_fp32_from_float16_groups)
        copy(self.model_fp32_groups, self.shard_fp32_groups)

    def _copy_main_params_to_model_params(self):
        """:2429-2479 writes each master into ``buffers[g].buckets[b].param_data`` (the bucket's
        view), not through ``param.data``."""

        def copy(shard_groups, model_groups):
            for sg, mg in zip(shard_groups, model_groups, strict=True):
                for sp, mp in zip(sg, mg, strict=True):
                    wr = self._get_model_param_range_map(mp)["gbuf_world_in_bucket"]
                    assert wr.size == sp.nelement()
                    gi, _k, bi = self.model_param_gbuf_map[mp]
                    bucket_pd = self.buffers[gi].buckets[bi].param_data
                    bucket_pd.view(-1)[wr.start : wr.end].data.copy_(sp)

        copy(self.shard_fp32_from_float16_groups, self.model_float16_groups)
        copy(self.shard_fp32_groups, self.model_fp32_groups)

    def _copy_model_params_to_main_params(self, state_dict=None):
        """:2541-2595"""

        def copy(model_groups, shard_groups):
            for mg, sg in zip(model_groups, shard_groups, strict=True):
                for mp, sp in zip(mg, sg, strict=True):
                    r = self._get_model_param_range_map(mp)["param"]
                    sp.data.copy_(mp.view(-1)[r.start : r.end])

        copy(self.model_float16_groups, self.shard_fp32_from_float16_groups)
        copy(self.model_fp32_groups, self.shard_fp32_groups)

    def step_with_ready_grads(self) -> bool:
        """:2598-2623 parent step, then param all-gather (nothing to gather with one rank)."""
        ok = super().step_with_ready_grads()
        for chunk in self.model_chunks:
            chunk.start_param_sync()
        return ok

    def state_dict(self):
        """:628-688 only the non-parameter state (param groups without ``params``, plus a
        common ``step``); per-param state is saved through other methods."""
        inner = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in inner["state"].values()}
        out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for g in out["optimizer"]["param_groups"]:
            del g["params"]
            g["step"] = steps.pop() if len(steps) == 1 else None
        return out


class FakeProxyDict:
    """optimizer/optimizer.py:1038-1073 ``ProxyDict``: keys are ``(optimizer_index, key)``;
    a missing key returns None (``.get``); there is no ``keys``/``values``/``__contains__``."""

    def __init__(self, inner_dicts: list[dict]):
        self._inner_dicts = inner_dicts

    def __getitem__(self, key):
        idx, inner_key = key
        return self._inner_dicts[idx].get(inner_key)

    def __setitem__(self, key, value):
        idx, inner_key = key
        self._inner_dicts[idx][inner_key] = value

    def __len__(self) -> int:
        return sum(len(d) for d in self._inner_dicts)

    def __iter__(self) -> Iterator:
        for idx, d in enumerate(self._inner_dicts):
            for k in d:
                yield (idx, k)

    def items(self):
        for idx, d in enumerate(self._inner_dicts):
            for k, v in d.items():
                yield (idx, k), v


class FakeChainedOptimizer(FakeMegatronOptimizer):
    """optimizer/optimizer.py:1076 ``ChainedOptimizer``. ``get_megatron_optimizer`` always
    returns one (optimizer/__init__.py:689), even around a single optimizer."""

    def __init__(self, chained_optimizers: list[FakeMegatronOptimizer]):
        #: :1087-1097
        self.model_chunks: list = []
        self.config = chained_optimizers[0].config if chained_optimizers else None
        for o in chained_optimizers:
            for c in getattr(o, "model_chunks", []):
                if c not in self.model_chunks:
                    self.model_chunks.append(c)
        self.is_stub_optimizer = all(getattr(o, "is_stub_optimizer", False) for o in chained_optimizers)
        #: :1105
        self.chained_optimizers = chained_optimizers

    @property
    def optimizer(self):
        """:1107-1115 only valid with exactly one chained optimizer."""
        assert len(self.chained_optimizers) == 1, "ChainedOptimizer has more than one optimizer"
        return self.chained_optimizers[0].optimizer

    @property
    def param_groups(self) -> list[dict]:
        """:1117-1123"""
        return [g for o in self.chained_optimizers for g in o.param_groups]

    @property
    def state(self) -> FakeProxyDict:
        """:1125-1131"""
        return FakeProxyDict([o.state for o in self.chained_optimizers])

    def get_parameters(self):
        return [p for o in self.chained_optimizers for p in o.get_parameters()]

    def zero_grad(self, set_to_none: bool = True):
        for o in self.chained_optimizers:
            o.zero_grad(set_to_none)

    def prepare_grads(self) -> bool:
        """:1233-1239"""
        found = False
        for o in self.chained_optimizers:
            found |= o.prepare_grads()
        return found

    def step_with_ready_grads(self) -> bool:
        """:1242-1252"""
        ok = True
        for o in self.chained_optimizers:
            ok &= o.step_with_ready_grads()
        return ok

    def get_grad_norm(self) -> float:
        """:1269-1286"""
        return math.sqrt(sum(o.get_grad_norm() ** 2 for o in self.chained_optimizers))

    @torch.no_grad()
    def step(self):
        """:1308-1337 prepare all, one global norm, clip each with it, step all."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.get_grad_norm()
        for o in self.chained_optimizers:
            if o.config.clip_grad > 0.0:
                coef = o.config.clip_grad / (grad_norm + 1.0e-6)
                if coef < 1.0:
                    for g in o.get_main_grads_for_grad_norm():
                        g.mul_(coef)
        return self.step_with_ready_grads(), grad_norm, None

    def reload_model_params(self, state_dict=None):
        for o in self.chained_optimizers:
            o.reload_model_params()

    def state_dict(self):
        """:1178-1182 a single optimizer's dict, or a list of them."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [o.state_dict() for o in self.chained_optimizers]

    def offload_to_cpu(self):
        """:1414-1417"""
        for o in self.chained_optimizers:
            o.offload_to_cpu()

    def restore_from_cpu(self):
        """:1419-1422"""
        for o in self.chained_optimizers:
            o.restore_from_cpu()
