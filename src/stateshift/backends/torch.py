"""Plain PyTorch: ``nn.Module`` (and torch DDP) and ``torch.optim`` optimizers.

Groups:
- ``params``: every parameter, trainable or frozen. Tied weights are one
  slot (one storage) with several member names.
- ``buffers``: persistent buffers (those in ``state_dict``). Non-persistent
  buffers are derived constants (masks, rotary tables) and stay where they
  are; ``coverage()`` lists them.
- ``grads``: ``param.grad`` of every parameter that has one now, named ``<param name>.grad``.
- ``optim``: every tensor in ``optimizer.state`` (``exp_avg``, ``step``, ...),
  named ``<param name>.<key>``.

``to_local`` and ``meta_of`` let a sharded backend (FSDP2) reuse this
traversal: it maps each (D)Tensor to the local tensor that owns storage, and
adds mesh / placement facts to the fingerprint.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..slot import Entry

if TYPE_CHECKING:
    from ..state import ModelState

ToLocal = Callable[[torch.Tensor], torch.Tensor]
MetaOf = Callable[[torch.Tensor], tuple[Any, ...]]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _no_meta(t: torch.Tensor) -> tuple[Any, ...]:
    return ()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside torch DDP / DataParallel wrappers (names then carry no ``module.`` prefix)."""
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def _walk(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, m in module.named_modules(remove_duplicate=False):
        yield (f"{prefix}{name}" if name else prefix.rstrip(".")), m


def _join(owner: str, leaf: str) -> str:
    return f"{owner}.{leaf}" if owner else leaf


def named_parameters(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Every parameter under every name it has (tied weights appear once per name)."""
    for owner, m in _walk(module, prefix):
        for leaf, p in m._parameters.items():
            if p is not None:
                yield _join(owner, leaf), p


def named_buffers(module: torch.nn.Module, prefix: str = "", *, persistent: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    for owner, m in _walk(module, prefix):
        for leaf, b in m._buffers.items():
            if b is not None and (leaf not in m._non_persistent_buffers_set) == persistent:
                yield _join(owner, leaf), b


@dataclass
class TorchModuleBackend:
    """Lists a module's parameters, persistent buffers and gradients."""

    module: torch.nn.Module
    prefix: str = ""
    to_local: ToLocal = field(default=_identity, repr=False)
    meta_of: MetaOf = field(default=_no_meta, repr=False)
    name: str = "torch"
    groups: tuple[str, ...] = ("params", "buffers", "grads")
    forward_groups: tuple[str, ...] = ("params", "buffers")

    def __post_init__(self) -> None:
        self.module = unwrap(self.module)

    def entries(self, groups: Collection[str] | None = None) -> Iterator[Entry]:
        want = self.groups if groups is None else groups
        local, meta = self.to_local, self.meta_of
        if "params" in want or "grads" in want:
            params = list(named_parameters(self.module, self.prefix))
        if "params" in want:
            for name, p in params:
                yield Entry(name, "params", local(p), meta(p))
        if "buffers" in want:
            for name, b in named_buffers(self.module, self.prefix):
                yield Entry(name, "buffers", local(b), meta(b))
        if "grads" in want:
            for name, p in params:
                if p.grad is not None:
                    yield Entry(f"{name}.grad", "grads", local(p.grad), meta(p.grad))

    def coverage(self) -> dict[str, list[str]]:
        """What is tracked and what deliberately is not."""
        return {
            "params": [n for n, _ in named_parameters(self.module, self.prefix)],
            "buffers": [n for n, _ in named_buffers(self.module, self.prefix)],
            "untracked non-persistent buffers": [n for n, _ in named_buffers(self.module, self.prefix, persistent=False)],
        }

    def install_guards(self, state: ModelState) -> list[Any]:
        handles: list[Any] = []
        local = self.to_local
        for owner, m in _walk(self.module, self.prefix):
            own = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
            if not own:
                continue
            where = f"forward of module {owner or type(m).__name__!r}"

            def pre_hook(mod: torch.nn.Module, args: Any, own: list[torch.Tensor] = own, where: str = where) -> None:
                state.check_resident((local(t) for t in own), where)

            handles.append(m.register_forward_pre_hook(pre_hook))
        seen: set[int] = set()
        for name, p in named_parameters(self.module, self.prefix):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))

            def grad_hook(grad: torch.Tensor, p: torch.nn.Parameter = p, name: str = name) -> None:
                if p.grad is not None:
                    state.check_resident((local(p.grad),), f"backward accumulating into {name}.grad")

            handles.append(p.register_hook(grad_hook))
        return handles


@dataclass
class TorchOptimizerBackend:
    """Lists every tensor in a ``torch.optim.Optimizer``'s state (group ``optim``)."""

    optimizer: torch.optim.Optimizer
    param_names: dict[int, str] = field(default_factory=dict)
    to_local: ToLocal = field(default=_identity, repr=False)
    meta_of: MetaOf = field(default=_no_meta, repr=False)
    name: str = "torch-optim"
    groups: tuple[str, ...] = ("optim",)
    forward_groups: tuple[str, ...] = ()

    def _params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                yield self.param_names.get(id(p), f"param_groups.{gi}.params.{pi}"), p

    def entries(self) -> Iterator[Entry]:
        for pname, p in self._params():
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    yield Entry(f"{pname}.{key}", "optim", self.to_local(value), self.meta_of(value))

    def _touched(self) -> Iterable[torch.Tensor]:
        for _, p in self._params():
            yield self.to_local(p)
            if p.grad is not None:
                yield self.to_local(p.grad)
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    yield self.to_local(value)

    def install_guards(self, state: ModelState) -> list[Any]:
        def pre_step(opt: Any, args: Any, kwargs: Any) -> None:
            state.check_resident(self._touched(), "optimizer.step()")

        return [self.optimizer.register_step_pre_hook(pre_step)]


def param_names(module: torch.nn.Module, prefix: str = "") -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in named_parameters(unwrap(module), prefix):
        names.setdefault(id(p), name)
    return names


def detect(model: Any, optimizer: Any = None) -> list[Any] | None:
    if not isinstance(model, torch.nn.Module):
        return None
    backends: list[Any] = [TorchModuleBackend(model)]
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            return None
        backends.append(TorchOptimizerBackend(optimizer, param_names(model)))
    return backends
