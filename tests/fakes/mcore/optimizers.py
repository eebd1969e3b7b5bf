"""Fake of megatron-core 0.16.1: the Megatron optimizer base, Float16 and FP32 optimizers (optimizer/optimizer.py). See ``__init__.py``."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import torch

from .buffers import FakeOptimizerConfig


def _zero_grad_group_helper(group: Iterable[torch.Tensor], set_to_none: bool) -> None:
    """optimizer/optimizer.py:57-75 (reading ``.grad`` of the non-leaf fp32 shard views warns in
    the real code too; the fake silences that one warning)."""
    for p in group:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            has_grad = getattr(p, "grad", None) is not None
        if has_grad:
            if set_to_none:
                p.grad = None
            else:
                g = p.grad
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()


def _is_float16(t: torch.Tensor) -> bool:
    """Stand-in for ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']``
    (distrib_optimizer.py:361, optimizer.py:671), which is False on CPU in the real code."""
    return t.dtype in (torch.float16, torch.bfloat16)


def _build_param_groups(model_chunks: Sequence[torch.nn.Module], expert: bool | None) -> list[dict]:
    """optimizer/__init__.py:108-229 ``_get_param_groups`` with the standard overrides (:70-96):
    trainable params only; bias / 1-D params get ``wd_mult=0``; groups sorted default-first;
    ``expert`` selects dense (False), expert-parallel (True) or both (None)."""
    groups: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            is_ep = not getattr(p, "allreduce", True)
            if expert is not None and is_ep != expert:
                continue
            wd_mult = 0.0 if (len(p.shape) == 1 or name.endswith(".bias")) else 1.0
            groups.setdefault((wd_mult, is_ep), []).append(p)
    out = []
    for wd_mult, is_ep in sorted(groups, key=lambda k: (k[0] != 1.0, k[1])):
        out.append(
            {"params": groups[(wd_mult, is_ep)], "is_expert_parallel": is_ep, "wd_mult": wd_mult, "lr_mult": 1.0}
        )
    return out


def _make_inner_adam(param_groups: list[dict], config: FakeOptimizerConfig) -> torch.optim.Optimizer:
    """optimizer/__init__.py:345-378: without TE/Apex the inner optimizer is
    ``torch.optim.AdamW`` (decoupled_weight_decay defaults to True); it is a subclass of
    ``torch.optim.Adam``. The per-group weight decay is ``weight_decay * wd_mult`` (set by the
    real param scheduler)."""
    for g in param_groups:
        g["weight_decay"] = config.weight_decay * g["wd_mult"]
    return torch.optim.AdamW(
        param_groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        foreach=False,
    )


class FakeMegatronOptimizer:
    """optimizer/optimizer.py:99 ``MegatronOptimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, config: FakeOptimizerConfig):
        #: :116 the inner torch optimizer; its ``.state`` is keyed by master tensors.
        self.optimizer = optimizer
        #: :122
        self.config = config
        self.is_stub_optimizer = optimizer is None

    # :278-285 ``state`` is the inner optimizer's state (a property).
    def _get_state(self):
        return self.optimizer.state

    def _set_state(self, value):
        self.optimizer.state = value

    state = property(_get_state, _set_state)

    # :287-300
    def _get_param_groups(self):
        return [] if self.is_stub_optimizer else self.optimizer.param_groups

    def _set_param_groups(self, value):
        self.optimizer.param_groups = value

    param_groups = property(_get_param_groups, _set_param_groups)

    def get_parameters(self) -> list[torch.Tensor]:
        """:125-134 the inner optimizer's params (masters / shards)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer else []

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """:136 (no dedup of shared / TP-duplicated params needed with one rank)."""
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def get_grad_norm(self) -> float:
        """:195"""
        grads = self.get_main_grads_for_grad_norm()
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    def clip_grad_norm(self, clip_grad: float) -> float:
        """:203"""
        norm = self.get_grad_norm()
        coef = clip_grad / (norm + 1.0e-6)
        if coef < 1.0:
            for g in self.get_main_grads_for_grad_norm():
                g.mul_(coef)
        return norm

    def count_zeros(self) -> float:
        """:223"""
        return float(sum((g == 0).sum().item() for g in self.get_main_grads_for_grad_norm()))

    def offload_to_cpu(self) -> None:
        """:344-362 moves every inner-optimizer param (``p.data = p.data.cpu()``) and *replaces*
        every state tensor (``state[k] = v.cpu()``) with a pageable CPU copy. Fake: "device" is
        wherever the tensor is; CPU tensors are left alone (as with ``is_cuda`` False)."""
        if self.optimizer is None or self.is_stub_optimizer:
            return
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if isinstance(p, torch.Tensor) and p.device.type != "cpu":
                    self._offloaded_device = p.device
                    p.data = p.data.cpu()
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    self._offloaded_device = v.device
                    st[k] = v.cpu()

    def restore_from_cpu(self) -> None:
        """:364-381 the reverse (``p.data = p.data.cuda()``, ``state[k] = v.cuda()``), which in
        the real code also moves the CPU ``step`` scalars to CUDA. Fake: back to the device
        recorded by offload_to_cpu; a no-op if nothing was moved."""
        dev = getattr(self, "_offloaded_device", None)
        if self.optimizer is None or self.is_stub_optimizer or dev is None:
            return
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if isinstance(p, torch.Tensor) and p.device.type == "cpu":
                    p.data = p.data.to(dev)
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    st[k] = v.to(dev)


class FakeMixedPrecisionOptimizer(FakeMegatronOptimizer):
    """optimizer/optimizer.py:437 ``MixedPrecisionOptimizer`` (bf16, no grad scaler)."""

    def __init__(self, optimizer, config):
        super().__init__(optimizer, config)
        #: :462 None for bf16 without loss scale.
        self.grad_scaler = None

    def prepare_grads(self) -> bool:
        """:524-557"""
        if not self.is_stub_optimizer:
            self._copy_model_grads_to_main_grads()
        return False

    def step_with_ready_grads(self) -> bool:
        """:560-590 inner ``optimizer.step()`` then ``_copy_main_params_to_model_params()``."""
        if not self.is_stub_optimizer:
            self.optimizer.step()
            self._copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self):
        """:593-623 returns (success, grad_norm, num_zeros_in_grad)."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = 0.0
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else 0
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def reload_model_params(self, state_dict=None):
        """:492"""
        if self.param_groups:
            self._copy_model_params_to_main_params()


class FakeFloat16OptimizerWithFloat16Params(FakeMixedPrecisionOptimizer):
    """optimizer/optimizer.py:626 ``Float16OptimizerWithFloat16Params``."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: FakeOptimizerConfig):
        super().__init__(optimizer, config)
        #: :657 model bf16/fp16 params (views into param_data if the DDP has one).
        self.float16_groups: list[list[torch.nn.Parameter]] = []
        #: :658 fp32 masters ``param.detach().clone().float()`` (:674); own storage; these
        #: replace the model params in the inner optimizer's param_groups (:680).
        self.fp32_from_float16_groups: list[list[torch.Tensor]] = []
        #: :659 fp32 model params themselves (no master copy).
        self.fp32_from_fp32_groups: list[list[torch.nn.Parameter]] = []
        for group in self.optimizer.param_groups:
            f16, f32, masters = [], [], []
            for i, p in enumerate(group["params"]):
                if not p.requires_grad:
                    continue
                if _is_float16(p):
                    f16.append(p)
                    main = p.detach().clone().float()
                    if hasattr(p, "shared"):
                        main.shared = p.shared
                    group["params"][i] = main
                    p.main_param = main  # :683
                    masters.append(main)
                    if p in self.optimizer.state:
                        self.optimizer.state[main] = self.optimizer.state.pop(p)
                elif p.dtype == torch.float32:
                    f32.append(p)
                else:
                    raise TypeError(f"Wrapped parameters must be fp32/fp16/bf16, got {p.dtype}")
            self.float16_groups.append(f16)
            self.fp32_from_float16_groups.append(masters)
            self.fp32_from_fp32_groups.append(f32)

    def zero_grad(self, set_to_none: bool = True):
        """:710-723"""
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for g in groups:
                _zero_grad_group_helper(g, set_to_none)

    def _get_model_and_main_params_data_float16(self):
        """:745-752"""
        model_data, main_data = [], []
        for mg, sg in zip(self.float16_groups, self.fp32_from_float16_groups, strict=True):
            for m, s in zip(mg, sg, strict=True):
                model_data.append(m.data)
                main_data.append(s.data)
        return model_data, main_data

    def _copy_model_grads_to_main_grads(self):
        """:754-772 ``main.grad = model.main_grad.float()`` (the *same tensor* as main_grad,
        i.e. a view of grad_data, when grads are fp32); fp32 params get ``grad = main_grad``."""
        for mg, sg in zip(self.float16_groups, self.fp32_from_float16_groups, strict=True):
            for m, s in zip(mg, sg, strict=True):
                if hasattr(m, "main_grad"):
                    s.grad = m.main_grad.float()
                elif m.grad is not None:
                    s.grad = m.grad.float()
                m.grad = None
        for mg in self.fp32_from_fp32_groups:
            for m in mg:
                m.grad = m.main_grad

    def _copy_main_params_to_model_params(self):
        """:774-779 plain loop copy for bf16 (``overflow_buf`` is None, :78-95)."""
        model_data, main_data = self._get_model_and_main_params_data_float16()
        for this, that in zip(main_data, model_data, strict=True):
            that.copy_(this)

    def _copy_model_params_to_main_params(self, state_dict=None):
        """:781-787"""
        model_data, main_data = self._get_model_and_main_params_data_float16()
        for this, that in zip(model_data, main_data, strict=True):
            that.copy_(this)

    def state_dict(self):
        """:789-797"""
        return {"optimizer": self.optimizer.state_dict(), "fp32_from_fp16_params": self.fp32_from_float16_groups}


class FakeFP32Optimizer(FakeMegatronOptimizer):
    """optimizer/optimizer.py:890 ``FP32Optimizer`` (no masters: the inner optimizer updates
    the model params directly; ``param.grad = param.main_grad`` at :936)."""

    def zero_grad(self, set_to_none: bool = True):
        for g in self.optimizer.param_groups:
            _zero_grad_group_helper(g["params"], set_to_none)

    def prepare_grads(self) -> bool:
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if hasattr(p, "main_grad"):
                    p.grad = p.main_grad
        return False

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    @torch.no_grad()
    def step(self):
        self.prepare_grads()
        grad_norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0.0 else None
        return self.step_with_ready_grads(), grad_norm, None

    def reload_model_params(self, state_dict=None):
        pass

    def state_dict(self):
        return self.optimizer.state_dict()
