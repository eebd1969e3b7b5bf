"""Checks of tests/fakes/mcore/: the fake itself, and (when megatron-core 0.16.1 is
importable) the fake against the real classes' source and, on CPU, the real DDP layout.

Nothing here reads a released storage: on CPU that is a segmentation fault, not an error.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from fakes.mcore import (
    MCORE_VERSION,
    FakeChainedOptimizer,
    FakeDenseModel,
    FakeDistributedOptimizer,
    FakeFloat16Module,
    FakeFloat16OptimizerWithFloat16Params,
    FakeMoEModel,
    FakeProxyDict,
    FakeTopKRouter,
    build_fake_ddp,
    build_fake_optimizer,
    fake_finalize_model_grads,
    fake_train_step,
)

HIDDEN = 16


def _x(seed=1, n=8):
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _all_buffers(ddp):
    return ddp.buffers + ddp.expert_parallel_buffers


def _storage_ptr(t):
    return t.untyped_storage().data_ptr()


def _is_expert(name, _p):
    return ".experts." in name


def _moe_ddp(**kw):
    return build_fake_ddp(FakeMoEModel(HIDDEN, seed=0), **kw)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("bucket_size", [None, 200])
def test_params_and_main_grads_are_views_into_the_flat_buffers(bucket_size):
    ddp = _moe_ddp(bucket_size=bucket_size)
    for buf in _all_buffers(ddp):
        assert buf.param_data.dtype == torch.bfloat16 and buf.grad_data.dtype == torch.float32
        for p in buf.params:
            start, end, _ = buf.param_index_map[p]
            assert _storage_ptr(p) == _storage_ptr(buf.param_data)
            assert p.data_ptr() == buf.param_data.data_ptr() + start * p.element_size()
            assert p.numel() == end - start
            assert _storage_ptr(p.main_grad) == _storage_ptr(buf.grad_data)
            assert p.main_grad.data_ptr() == buf.grad_data.data_ptr() + start * 4
            assert p.main_grad.shape == p.shape
        # writing through the flat buffer is visible through the param
        p = buf.params[0]
        start, end, _ = buf.param_index_map[p]
        buf.param_data[start:end] = 3.0
        assert bool((p.detach() == 3.0).all())
        for b in buf.buckets:
            assert _storage_ptr(b.param_data) == _storage_ptr(buf.param_data)
            assert _storage_ptr(b.grad_data) == _storage_ptr(buf.grad_data)
            assert b.param_data.data_ptr() == buf.param_data.data_ptr() + b.offset * 2
            assert b.grad_data.numel() == b.param_data.numel()


def test_distributed_optimizer_padding_and_reverse_order():
    ddp = build_fake_ddp(FakeDenseModel(HIDDEN), bf16=True)
    (buf,) = ddp.buffers
    assert ddp.expert_parallel_buffers == []
    # the last param of the module comes first in the buffer
    last = [p for p in ddp.module.parameters() if p.requires_grad][-1]
    assert buf.param_index_map[last][0] == 0
    for start, _end, _b in buf.param_index_map.values():
        assert start % 64 == 0
    assert buf.numel % 128 == 0
    # "unpadded" still includes the 64-element gaps between params; only the bucket tail is cut
    assert buf.numel_unpadded == max(end for _s, end, _b in buf.param_index_map.values())
    assert buf.numel_unpadded > sum(p.numel() for p in buf.params)
    assert len(buf.buckets) == 1 and buf.buckets[0].offset == 0
    assert buf.buckets[0].numel_unpadded == buf.numel_unpadded


def test_bucket_size_splits_buffer_into_aligned_buckets():
    ddp = _moe_ddp(bucket_size=200)
    (buf,) = ddp.buffers
    assert len(buf.buckets) > 1
    for b, (s, e) in zip(buf.buckets, buf.bucket_indices, strict=True):
        assert b.offset == s and s % 128 == 0 and e % 128 == 0
        for p in b.params_list:
            assert buf.param_to_bucket[p] is b
            assert ddp.param_to_bucket_group[p].param_to_bucket[p] is b
    assert len(ddp.bucket_groups) == len(buf.buckets)


def test_param_data_is_none_without_distributed_optimizer():
    ddp = build_fake_ddp(FakeDenseModel(HIDDEN), use_distributed_optimizer=False)
    (buf,) = ddp.buffers
    assert buf.param_data is None
    assert all(b.param_data is None for b in buf.buckets)
    assert buf.numel == buf.numel_unpadded == sum(p.numel() for p in buf.params)
    ptrs = {_storage_ptr(p) for p in buf.params}
    assert len(ptrs) == len(buf.params)  # each param keeps its own storage
    for p in buf.params:
        assert _storage_ptr(p.main_grad) == _storage_ptr(buf.grad_data)
    # the native offload has nothing to do for params
    buf.offload_to_cpu(move_params=True, move_grads=False)
    assert buf.param_data_cpu is None and buf.param_data_size == 0


def test_frozen_params_are_outside_every_buffer():
    ddp = _moe_ddp(expert_parallel_param_filter=_is_expert)
    inner = ddp.module.module
    frozen = [inner.frozen.weight, inner.frozen.bias]
    in_buffers = {p for b in _all_buffers(ddp) for p in b.params}
    for p in frozen:
        assert not p.requires_grad
        assert p not in in_buffers
        assert p not in ddp.param_to_bucket_group
        assert not hasattr(p, "main_grad")
        assert p.dtype == torch.bfloat16  # cast by the Float16Module like everything else
    trainable = {p for p in ddp.parameters() if p.requires_grad}
    assert in_buffers == trainable


def test_expert_parallel_params_get_their_own_buffers():
    ddp = _moe_ddp(expert_parallel_param_filter=_is_expert)
    inner = ddp.module.module
    experts = set(inner.moe.experts.parameters())
    assert {p for b in ddp.expert_parallel_buffers for p in b.params} == experts
    assert not experts & {p for b in ddp.buffers for p in b.params}
    assert all(getattr(p, "allreduce", True) is False for p in experts)
    assert len(ddp.expert_parallel_bucket_groups) == sum(len(b.buckets) for b in ddp.expert_parallel_buffers)


def test_state_dict_keys_have_no_wrapper_prefix_but_named_parameters_do():
    ddp = _moe_ddp()
    names = [n for n, _ in ddp.named_parameters()]
    assert all(n.startswith("module.module.") for n in names)
    keys = list(ddp.state_dict().keys())
    assert "moe.router.expert_bias" in keys and "inp.weight" in keys
    assert "moe.router.local_tokens_per_expert" not in keys  # persistent=False


# ----------------------------------------------------------------------------- expert_bias


def test_expert_bias_is_a_buffer_cast_then_restored_to_fp32_and_updated_at_finalize():
    ddp = _moe_ddp()
    router = ddp.module.module.moe.router
    assert isinstance(router, FakeTopKRouter)
    assert "expert_bias" in dict(router.named_buffers())
    assert "expert_bias" not in dict(router.named_parameters())
    bias = router.expert_bias
    assert bias.dtype == torch.bfloat16  # Float16Module replaced the buffer with a bf16 one
    old_ptr = _storage_ptr(bias)
    out = ddp(_x())
    assert router.expert_bias is bias and bias.dtype == torch.float32  # .data swapped in place
    assert _storage_ptr(bias) != old_ptr
    assert float(router.local_tokens_per_expert.sum()) == 8 * router.topk
    out.float().pow(2).mean().backward()
    before = bias.clone()
    fake_finalize_model_grads([ddp])
    assert not torch.equal(before, bias)
    assert float(router.local_tokens_per_expert.sum()) == 0.0
    with torch.no_grad():  # no accumulation without grad
        ddp(_x())
    assert float(router.local_tokens_per_expert.sum()) == 0.0


# ----------------------------------------------------------------------------- native offload


def test_offload_to_cpu_and_reload_from_cpu_round_trip():
    ddp = _moe_ddp(bucket_size=200)
    fake_train_step(ddp, build_fake_optimizer(ddp), _x())
    (buf,) = ddp.buffers
    p0 = buf.params[0]
    want = buf.param_data.clone()
    numel = buf.numel
    assert float(buf.grad_data.abs().sum()) > 0
    buf.offload_to_cpu()
    assert buf.param_data.untyped_storage().nbytes() == 0
    assert buf.grad_data.untyped_storage().nbytes() == 0
    assert buf.param_data_size == numel and buf.grad_data_size == numel
    assert buf.param_data.shape == (numel,)  # tensor objects keep their shapes
    home = buf.param_data_cpu
    assert home is not None and home.device.type == "cpu"
    assert torch.equal(home, want)
    buf.offload_to_cpu()  # already offloaded: nothing happens
    assert buf.param_data_cpu is home
    buf.reload_from_cpu()
    assert torch.equal(buf.param_data, want)
    assert float(buf.grad_data.abs().sum()) == 0.0  # grads come back zeroed
    assert buf.grad_data_size == 0
    assert buf.param_data_size == numel  # not reset by reload
    assert buf.param_data_cpu is home  # kept (the host copy lives on)
    start, end, _ = buf.param_index_map[p0]
    assert torch.equal(p0.detach().reshape(-1), want[start:end])
    assert _storage_ptr(p0.main_grad) == _storage_ptr(buf.grad_data)
    for b in buf.buckets:
        assert torch.equal(b.param_data, want[b.offset : b.offset + b.param_data.numel()])
    # the second offload copies into the same host tensor
    buf.param_data.add_(1)
    buf.offload_to_cpu()
    assert buf.param_data_cpu is home and torch.equal(home, want + 1)
    buf.reload_from_cpu()


def test_reload_from_cpu_restores_stale_values_after_someone_else_released_params():
    """Pitfall recorded in docs/notes/megatron-layout.md: param_data_cpu outlives the offload."""
    ddp = _moe_ddp()
    opt = build_fake_optimizer(ddp)
    (buf,) = ddp.buffers
    buf.offload_to_cpu()
    buf.reload_from_cpu()
    stale = buf.param_data_cpu.clone()
    fake_train_step(ddp, opt, _x())
    assert not torch.equal(buf.param_data, stale)
    # another library releases the storage in place, keeping values elsewhere ...
    elsewhere = buf.param_data.clone()
    buf.param_data.untyped_storage().resize_(0)
    # ... and a caller then uses Megatron's own reload: the old values come back.
    buf.reload_from_cpu()
    assert torch.equal(buf.param_data, stale)
    assert not torch.equal(buf.param_data, elsewhere)


def test_offload_grad_buffers_and_restore():
    ddp = _moe_ddp(expert_parallel_param_filter=_is_expert)
    ddp(_x()).float().sum().backward()
    ddp.offload_grad_buffers()
    for b in _all_buffers(ddp):
        assert b.grad_data.untyped_storage().nbytes() == 0
        assert b.param_data.untyped_storage().nbytes() > 0
    ddp.restore_grad_buffers()
    for b in _all_buffers(ddp):
        assert float(b.grad_data.abs().sum()) == 0.0


# ----------------------------------------------------------------------------- hooks & steps


def test_backward_hooks_accumulate_into_main_grad():
    ddp = _moe_ddp()
    ddp.zero_grad_buffer()
    ddp(_x()).float().pow(2).mean().backward()
    for buf in ddp.buffers:
        for p in buf.params:
            assert p.grad is None
        assert float(buf.grad_data.abs().sum()) > 0
    first = ddp.buffers[0].grad_data.clone()
    ddp(_x()).float().pow(2).mean().backward()  # accumulates
    assert torch.allclose(ddp.buffers[0].grad_data, 2 * first)
    ddp.zero_grad_buffer()
    assert float(ddp.buffers[0].grad_data.abs().sum()) == 0.0


def test_distributed_optimizer_step_goes_through_fp32_master_shards():
    ddp = _moe_ddp()
    opt = build_fake_optimizer(ddp, "distrib")
    assert isinstance(opt, FakeDistributedOptimizer)
    (buf,) = ddp.buffers
    masters = [m for g in opt.shard_fp32_from_float16_groups for m in g]
    models = [p for g in opt.model_float16_groups for p in g]
    shards = [s for g in opt.shard_float16_groups for s in g]
    assert len(masters) == len(models) == len(buf.params)
    assert opt.shard_fp32_groups == [[] for _ in opt.shard_fp32_groups]
    for m, p, s in zip(masters, models, shards, strict=True):
        assert m.dtype == torch.float32 and _storage_ptr(m) != _storage_ptr(buf.param_data)
        assert p.main_param is m and p.main_param_sharded is True
        assert _storage_ptr(s) == _storage_ptr(buf.param_data) and s.dtype == torch.bfloat16
    assert [q for g in opt.optimizer.param_groups for q in g["params"]] == masters
    assert isinstance(opt.optimizer, torch.optim.Adam)
    assert len(opt.state) == 0  # moments exist only after the first step
    before = buf.param_data.clone()
    fake_train_step(ddp, opt, _x())
    assert not torch.equal(before, buf.param_data)
    for m, p in zip(masters, models, strict=True):
        st = opt.optimizer.state[m]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == m.shape
        assert torch.equal(p.detach().reshape(-1), m.to(torch.bfloat16))
        assert _storage_ptr(m.grad) == _storage_ptr(buf.grad_data)  # fp32 main_grad aliased
    opt.zero_grad()
    assert all(m.grad is None for m in masters)


def test_distributed_optimizer_fp32_params_are_views_into_param_data():
    ddp = build_fake_ddp(FakeDenseModel(HIDDEN), bf16=False)
    opt = build_fake_optimizer(ddp, "distrib")
    (buf,) = ddp.buffers
    assert buf.param_data.dtype == torch.float32
    shards = [s for g in opt.shard_fp32_groups for s in g]
    assert opt.shard_fp32_from_float16_groups == [[] for _ in opt.shard_fp32_from_float16_groups]
    assert [q for g in opt.optimizer.param_groups for q in g["params"]] == shards
    assert all(_storage_ptr(s) == _storage_ptr(buf.param_data) for s in shards)
    before = buf.param_data.clone()
    fake_train_step(ddp, opt, _x())
    assert not torch.equal(before, buf.param_data)
    for s in shards:
        assert _storage_ptr(opt.optimizer.state[s]["exp_avg"]) != _storage_ptr(buf.param_data)


@pytest.mark.parametrize("udo", [False, True])
def test_float16_optimizer_masters(udo):
    ddp = _moe_ddp(use_distributed_optimizer=udo)
    opt = build_fake_optimizer(ddp, "float16")
    assert isinstance(opt, FakeFloat16OptimizerWithFloat16Params)
    masters = [m for g in opt.fp32_from_float16_groups for m in g]
    models = [p for g in opt.float16_groups for p in g]
    assert {id(p) for p in models} == {id(p) for p in ddp.parameters() if p.requires_grad}
    assert opt.fp32_from_fp32_groups == [[] for _ in opt.fp32_from_fp32_groups]
    before = [p.detach().clone() for p in models]
    fake_train_step(ddp, opt, _x())
    for m, p in zip(masters, models, strict=True):
        assert p.main_param is m and m.dtype == torch.float32
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
        assert m.grad is p.main_grad  # .float() of an fp32 main_grad is the same tensor
        assert m in opt.state
    assert any(not torch.equal(p.detach(), b) for p, b in zip(models, before, strict=True))


def test_chained_optimizer_dense_and_expert():
    ddp = _moe_ddp(expert_parallel_param_filter=_is_expert)
    opt = build_fake_optimizer(ddp, "chained")
    assert isinstance(opt, FakeChainedOptimizer)
    assert len(opt.chained_optimizers) == 2
    dense, expert = opt.chained_optimizers
    assert dense.buffers == ddp.buffers and expert.buffers == ddp.expert_parallel_buffers
    with pytest.raises(AssertionError):
        opt.optimizer  # noqa: B018  (only with one chained optimizer)
    fake_train_step(ddp, opt, _x())
    state = opt.state
    assert isinstance(state, FakeProxyDict)
    assert not hasattr(state, "values") and not hasattr(state, "keys")
    keys = list(state)
    assert {i for i, _ in keys} == {0, 1}
    assert len(state) == len(opt.get_parameters())
    i, m = keys[0]
    assert state[(i, m)] is opt.chained_optimizers[i].optimizer.state[m]
    assert state[(0, torch.zeros(1))] is None  # a missing key is None, not KeyError
    single = build_fake_optimizer(_moe_ddp(), "chained")
    assert len(single.chained_optimizers) == 1 and single.optimizer is single.chained_optimizers[0].optimizer


def test_distrib_kind_needs_param_data():
    ddp = _moe_ddp(use_distributed_optimizer=False)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        build_fake_optimizer(ddp, "distrib")
    with pytest.raises(ValueError, match="unknown kind"):
        build_fake_optimizer(_moe_ddp(), "sgd")


def test_optimizer_step_after_buffer_tensor_replacement_writes_to_the_old_storage():
    """Pitfall: the step writes through bucket.param_data views, not buffer.param_data."""
    ddp = _moe_ddp()
    opt = build_fake_optimizer(ddp)
    (buf,) = ddp.buffers
    old = buf.param_data
    buf.param_data = old.clone()  # what a library must NOT do (it should resize_ in place)
    replacement_before = buf.param_data.clone()
    fake_train_step(ddp, opt, _x())
    assert torch.equal(buf.param_data, replacement_before)  # the new tensor never sees the step
    assert not torch.equal(old, replacement_before)


@pytest.mark.parametrize("kind", ["distrib", "float16", "chained"])
def test_training_is_deterministic(kind):
    def run():
        ddp = _moe_ddp(expert_parallel_param_filter=_is_expert)
        opt = build_fake_optimizer(ddp, kind)
        losses = [fake_train_step(ddp, opt, _x(s)) for s in range(3)]
        return losses, torch.cat([b.param_data.float() for b in _all_buffers(ddp)])

    l1, p1 = run()
    l2, p2 = run()
    assert l1 == l2 and torch.equal(p1, p2)
    assert l1[-1] != l1[0]


def test_float16_module_wraps_like_the_real_one():
    m = FakeDenseModel(HIDDEN)
    w = FakeFloat16Module(m)
    assert w.module is m and all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert w(_x()).dtype == torch.float32


def test_optimizer_offload_replaces_state_tensors_only_off_cpu():
    ddp = _moe_ddp()
    opt = build_fake_optimizer(ddp)
    fake_train_step(ddp, opt, _x())
    m = next(iter(opt.state))
    before = opt.state[m]["exp_avg"]
    opt.offload_to_cpu()  # everything is already on the CPU: nothing moves
    opt.restore_from_cpu()
    assert opt.state[m]["exp_avg"] is before


# ----------------------------------------------------------------------------- against the real one

_HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
needs_mcore = pytest.mark.skipif(
    not _HAVE_MCORE,
    reason="megatron-core is not installed (pip install 'megatron-core==0.16.1'); the fake is checked against it only when it is",
)


def _mcore_version():
    import megatron.core

    return getattr(megatron.core, "__version__", "?")


@needs_mcore
def test_real_source_has_the_attributes_the_fake_mirrors():
    import inspect
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import distributed_data_parallel as ddp_mod, param_and_grad_buffer as buf_mod
        from megatron.core.optimizer import distrib_optimizer as do_mod, optimizer as opt_mod
        from megatron.core.transformer import module as module_mod
        from megatron.core.transformer.moe import router as router_mod
    if _mcore_version() != MCORE_VERSION:
        pytest.skip(f"fake mirrors megatron-core {MCORE_VERSION}, found {_mcore_version()}")
    expect = {
        buf_mod._ParamAndGradBuffer: [
            "self.param_data = None",
            "self.grad_data = torch.zeros",
            "self.param_data_cpu = None",
            "self.param_index_map = {}",
            "self.buckets = []",
            "self.param_to_bucket = {}",
            "self.numel = ",
            "self.numel_unpadded = ",
            "self.grad_data_size = 0",
            "self.param_data_size = 0",
            "param.data = new_param_data",
            "param.main_grad = self._get(",
            "def offload_to_cpu(",
            "def reload_from_cpu(",
            ".storage().resize_(0)",
            "self.param_data_cpu = self.param_data.cpu().pin_memory()",
            "if self.ddp_config.use_distributed_optimizer:\n                    self.param_data = torch.zeros(",
        ],
        buf_mod._ParamAndGradBucket: [
            "self.param_data = param_data",
            "self.grad_data = grad_data",
            "self.offset = offset",
            "self.params_list = params",
        ],
        buf_mod._ParamAndGradBucketGroup: ["self.cached_param_buffer_shard_list", "self.cached_grad_buffer_shard_list"],
        ddp_mod.DistributedDataParallel: [
            "self.buffers, self.bucket_groups = ",
            "self.expert_parallel_buffers, self.expert_parallel_bucket_groups",
            "self.param_to_bucket_group = {}",
            "if not param.requires_grad:\n                continue",
            "getattr(param, 'allreduce', True)",
            "param.main_grad.add_(param.grad.data)",
            "def zero_grad_buffer(",
            "def offload_grad_buffers(",
            "def restore_grad_buffers(",
            "self.grad_accs = []",
        ],
        do_mod.DistributedOptimizer: [
            "self.shard_fp32_from_float16_groups",
            "self.shard_float16_groups",
            "self.shard_fp32_groups",
            "self.model_float16_groups",
            "self.model_fp32_groups",
            "self.buffers = list(",
            "shard_main_param = shard_model_param.clone().float()",
            "model_param.main_param = shard_main_param",
            "def _copy_main_params_to_model_params(",
            "def _copy_model_params_to_main_params(",
            ".buckets[bucket_id].param_data",
        ],
        opt_mod.MegatronOptimizer: [
            "self.optimizer = optimizer",
            "state = property(",
            "def offload_to_cpu(",
            "p.data = p.data.cpu()",
            "state_dict[k] = v.cpu()",
        ],
        opt_mod.Float16OptimizerWithFloat16Params: [
            "self.float16_groups = []",
            "self.fp32_from_float16_groups = []",
            "self.fp32_from_fp32_groups = []",
            "main_param = param.detach().clone().float()",
            "param.main_param = main_param",
            "main_param.grad = model_param.main_grad.float()",
        ],
        opt_mod.ChainedOptimizer: ["self.chained_optimizers = chained_optimizers", "return ProxyDict("],
        opt_mod.FP32Optimizer: ["param.grad = param.main_grad"],
        router_mod.TopKRouter: [
            "'expert_bias'",
            "'local_tokens_per_expert'",
            "persistent=False",
            "self.expert_bias.data = self.expert_bias.data.to(torch.float32)",
            "self.local_tokens_per_expert += ",
        ],
        module_mod.Float16Module: ["self.add_module('module', module.bfloat16())"],
    }
    missing = []
    for cls, needles in expect.items():
        src = inspect.getsource(cls)
        missing += [f"{cls.__name__}: {n!r}" for n in needles if n not in src]
    assert not missing, "real megatron-core source differs from what the fake mirrors:\n" + "\n".join(missing)


_REAL_LAYOUT_SCRIPT = textwrap.dedent(
    r"""
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[1])
    import torch
    # the real buffers allocate on torch.cuda.current_device() (param_and_grad_buffer.py:800)
    torch.cuda.current_device = lambda: "cpu"
    # the real offload pins (":976"); pinning raises without an accelerator
    torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    import fakes.mcore as F

    def layout(ddp):
        names = {p: n for n, p in ddp.named_parameters()}
        out = {}
        for kind in ("buffers", "expert_parallel_buffers"):
            bufs = []
            for b in getattr(ddp, kind):
                pd = b.param_data
                bufs.append({
                    "dtypes": [str(b.param_dtype), str(b.grad_dtype)],
                    "numel": b.numel, "numel_unpadded": b.numel_unpadded,
                    "param_data_none": pd is None,
                    "index": [[names[p], *v] for p, v in b.param_index_map.items()],
                    "params": [names[p] for p in b.params],
                    "buckets": [[bk.offset, bk.grad_data.numel(), bk.numel_unpadded, bk.param_data is None,
                                 [names[p] for p in bk.params_list]] for bk in b.buckets],
                    "views": [[names[p],
                               None if pd is None else (p.data_ptr() - pd.data_ptr()) // p.element_size(),
                               (p.main_grad.data_ptr() - b.grad_data.data_ptr()) // 4,
                               p.data._base is not None] for p in b.params],
                })
            out[kind] = bufs
        out["groups"] = len(ddp.bucket_groups), len(ddp.expert_parallel_bucket_groups)
        return out

    def offload_round_trip(ddp):
        b = ddp.buffers[0]
        want = None if b.param_data is None else b.param_data.clone()
        b.offload_to_cpu()
        r = {"sizes": [b.param_data_size, b.grad_data_size],
             "nbytes": [None if b.param_data is None else b.param_data.untyped_storage().nbytes(),
                        b.grad_data.untyped_storage().nbytes()],
             "home": None if b.param_data_cpu is None else bool(torch.equal(b.param_data_cpu, want))}
        b.reload_from_cpu()
        r["after"] = [b.param_data_size, b.grad_data_size,
                      None if want is None else bool(torch.equal(b.param_data, want)),
                      float(b.grad_data.abs().sum())]
        return r

    is_expert = lambda n, p: ".experts." in n
    results = []
    for udo, bucket_size, ep in [(True, None, False), (False, None, False), (True, 200, True), (False, 200, True)]:
        tc = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, bf16=True,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
        cfg = DistributedDataParallelConfig(use_distributed_optimizer=udo, grad_reduce_in_fp32=True,
                                            overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size)
        model = F.FakeMoEModel(16, seed=0)
        if ep:
            for n, p in model.named_parameters():
                if is_expert(n, p):
                    p.allreduce = False
        real = DistributedDataParallel(tc, cfg, module=Float16Module(tc, model))
        fake = F.build_fake_ddp(F.FakeMoEModel(16, seed=0), use_distributed_optimizer=udo,
                                expert_parallel_param_filter=is_expert if ep else None, bucket_size=bucket_size)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        grads = []
        for d in (real, fake):
            d.zero_grad_buffer()
            d(x).float().pow(2).mean().backward()
            grads.append(torch.cat([b.grad_data for b in d.buffers + d.expert_parallel_buffers]))
        results.append({"real": layout(real), "fake": layout(fake),
                        "grads_equal": bool(torch.equal(grads[0], grads[1])),
                        "off_real": offload_round_trip(real), "off_fake": offload_round_trip(fake)})
    print("RESULT" + json.dumps(results))
    """
)


@needs_mcore
def test_real_ddp_layout_matches_the_fake_on_cpu(tmp_path):
    """Builds the real DistributedDataParallel on CPU (patching torch.cuda.current_device and
    pin_memory in a subprocess) and compares buffers, buckets, views, grads and the native
    offload round trip with the fake's."""
    if _mcore_version() != MCORE_VERSION:
        pytest.skip(f"fake mirrors megatron-core {MCORE_VERSION}, found {_mcore_version()}")
    script = tmp_path / "real_layout.py"
    script.write_text(_REAL_LAYOUT_SCRIPT)
    port = str(29500 + os.getpid() % 1000)
    proc = subprocess.run(
        [sys.executable, str(script), os.path.dirname(os.path.dirname(os.path.abspath(__file__))), port],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    for case in json.loads(line[0][len("RESULT") :]):
        assert case["real"] == case["fake"]
        assert case["grads_equal"]
        assert case["off_real"] == case["off_fake"]
