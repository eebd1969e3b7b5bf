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

Names are relative to the innermost module: torch DDP / DataParallel
wrappers and ``torch.compile``'s ``OptimizedModule`` are stripped, so a
compiled model and the plain one share names (checkpoints, HF export).
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.slot import Entry
from ..core.source import Check, Handle
from .base import CheckpointFacts, Rebuild
from .guards import MethodGuard, ModuleGuards, ToLocal, _identity

MetaOf = Callable[[torch.Tensor], tuple[Any, ...]]


def _no_meta(t: torch.Tensor) -> tuple[Any, ...]:
    return ()


def _compiled_inner(model: Any) -> torch.nn.Module | None:
    """The module a ``torch.compile``d model wraps (``OptimizedModule._orig_mod``), else ``None``."""
    inner = model.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if type(model).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module) else None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside torch DDP / DataParallel / ``torch.compile`` wrappers (names carry no wrapper prefix)."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif (inner := _compiled_inner(model)) is not None:
            model = inner
        else:
            return model


def modules_of(root: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module under ``root`` (a shared one once per path, like ``walk``) without building names:
    the cheap traversal a verb runs to see whether anything changed."""
    out: list[torch.nn.Module] = []
    stack: list[torch.nn.Module | None] = [root]
    while stack:
        m = stack.pop()
        if m is not None:
            out.append(m)
            if m._modules:
                stack.extend(m._modules.values())
    return out


_REQUIRES_GRAD, _FALSE = itertools.repeat("requires_grad"), itertools.repeat(False)
_CHILDREN, _PARAMS, _BUFFERS = map(operator.attrgetter, ("_modules", "_parameters", "_buffers"))
_NON_PERSISTENT, _values, _flat = (
    operator.attrgetter("_non_persistent_buffers_set"),
    dict.values,
    itertools.chain.from_iterable,
)


def tree_signature(mods: list[torch.nn.Module]) -> tuple[Any, ...]:
    """What ``TreeWatch`` compares: per module (in ``modules_of`` order) its id, its children's names and ids (a
    renamed child renames its tensors; the walk skips a ``None`` child, so a module moved into an empty slot
    shows only there), its parameters' names, ids and ``requires_grad`` (the guards hook gradients of
    trainable params only: one unfrozen later needs its hook), its buffers' names and ids, and which buffers are
    non-persistent (which, not how many: two trading persistence keep the count).

    Built column by column with ``map`` and ``chain`` (no Python code per module or tensor: about half the cost
    of a tuple per module); each flattened column comes with the per-module counts that cut it back into
    modules, so a name moving from one module to the next is a change. A set's order may differ between two
    equal sets: at worst a change is seen where there is none, which costs one re-read.
    """
    children, params, buffers = list(map(_CHILDREN, mods)), list(map(_PARAMS, mods)), list(map(_BUFFERS, mods))
    non_persistent = list(map(_NON_PERSISTENT, mods))
    pvals = list(_flat(map(_values, params)))
    return (
        tuple(map(id, mods)),
        tuple(map(len, children)),
        tuple(_flat(children)),
        tuple(map(id, _flat(map(_values, children)))),  # which key holds which child (None ones included)
        tuple(map(len, params)),
        tuple(_flat(params)),
        tuple(map(id, pvals)),
        tuple(map(getattr, pvals, _REQUIRES_GRAD, _FALSE)),
        tuple(map(len, buffers)),
        tuple(_flat(buffers)),
        tuple(map(id, _flat(map(_values, buffers)))),
        tuple(map(len, non_persistent)),
        tuple(_flat(non_persistent)),
    )


@dataclass
class TreeWatch:
    """Says whether a module tree changed since the last look: a module, parameter or buffer added,
    removed, replaced or renamed, a parameter frozen or unfrozen, a buffer made (non-)persistent
    (``param.data = ...`` keeps the parameter: storage changes are the slot table's business). One
    cheap pass per look (``tree_signature``: ids and names, built in C); what it saw is held, so no id
    in the signature can be reused by a new object while it is kept."""

    roots: tuple[torch.nn.Module, ...]
    _signature: tuple[Any, ...] | None = field(default=None, repr=False)
    _held: list[Any] = field(default_factory=list, repr=False)

    def changed(self) -> bool:
        mods = [m for root in self.roots for m in modules_of(root)]
        sig = tree_signature(mods)
        if sig == self._signature:
            return False
        self._signature = sig
        self._held = [(m, tuple(m._parameters.values()), tuple(m._buffers.values())) for m in mods]
        return True

    @property
    def looked(self) -> bool:
        return self._signature is not None

    def forget(self) -> None:
        """The next ``changed()`` says True (re-read everything)."""
        self._signature, self._held = None, []


def walk(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, m in module.named_modules(remove_duplicate=False):
        yield (f"{prefix}{name}" if name else prefix.rstrip(".")), m


def join(owner: str, leaf: str) -> str:
    return f"{owner}.{leaf}" if owner else leaf


def named_parameters(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Every parameter under every name it has (tied weights appear once per name)."""
    for owner, m in walk(module, prefix):
        for leaf, p in m._parameters.items():
            if p is not None:
                yield join(owner, leaf), p


def named_buffers(
    module: torch.nn.Module, prefix: str = "", *, persistent: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    for owner, m in walk(module, prefix):
        for leaf, b in m._buffers.items():
            if b is not None and (leaf not in m._non_persistent_buffers_set) == persistent:
                yield join(owner, leaf), b


def state_dict_names(module: torch.nn.Module) -> list[str]:
    """The keys ``module.state_dict()`` would have, in its order, without calling it (so without reading
    any value, and without its guard: safe while the state is offloaded)."""
    names: list[str] = []
    for owner, m in walk(module, ""):
        names += [join(owner, leaf) for leaf, p in m._parameters.items() if p is not None]
        names += [
            join(owner, leaf)
            for leaf, b in m._buffers.items()
            if b is not None and leaf not in m._non_persistent_buffers_set
        ]
    return names


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
    static_groups: tuple[str, ...] = ()
    #: check the whole tree before the root's forward (``ModuleGuards.cover_tree``); FSDP2 checks its own way
    tree_guard: bool = True
    _guards: ModuleGuards | None = field(default=None, repr=False)
    _watch: TreeWatch = field(init=False, repr=False)
    _lists: dict[str, list[Entry]] = field(default_factory=dict, repr=False)
    _named: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list, repr=False)
    _last_grads: list[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.module = unwrap(self.module)
        self._watch = TreeWatch((self.module,))

    def prepare(self, groups: Collection[str]) -> None:
        """Re-read the module tree if a module, parameter or buffer was added or replaced since the last
        verb; hook what is new (the guards cover what can be released)."""
        if not self._watch.changed():
            return
        self._lists = {}
        self._named = list(named_parameters(self.module, self.prefix))
        self._last_grads = []
        if self._guards is not None:
            self._guards.cover(walk(self.module, self.prefix), self._named)

    def entries(self, group: str) -> Sequence[Entry]:
        """The group's tensors; the same list object while nothing changed (``prepare`` decides)."""
        if not self._watch.looked:
            self.prepare((group,))
        if group == "grads":
            return self._grad_entries()
        cached = self._lists.get(group)
        if cached is None:
            local, meta = self.to_local, self.meta_of
            named = self._named if group == "params" else list(named_buffers(self.module, self.prefix))
            cached = self._lists[group] = [Entry(n, group, local(t), meta(t)) for n, t in named]
        return cached

    def _grad_entries(self) -> list[Entry]:
        grads = [p.grad for _, p in self._named]
        if "grads" not in self._lists or not all(map(operator.is_, grads, self._last_grads)):
            local, meta = self.to_local, self.meta_of
            self._last_grads = grads
            self._lists["grads"] = [
                Entry(f"{n}.grad", "grads", local(g), meta(g))
                for (n, _), g in zip(self._named, grads, strict=True)
                if g is not None
            ]
        return self._lists["grads"]

    def coverage(self) -> dict[str, list[str]]:
        """What is tracked and what deliberately is not."""
        return {
            "params": [n for n, _ in named_parameters(self.module, self.prefix)],
            "buffers": [n for n, _ in named_buffers(self.module, self.prefix)],
            "untracked non-persistent buffers": [
                n for n, _ in named_buffers(self.module, self.prefix, persistent=False)
            ],
        }

    def install_guards(self, check: Check) -> list[Handle]:
        self._guards = ModuleGuards(check, local=self.to_local)
        if self.tree_guard:
            self._guards.cover_tree(self.module, f"model {self.prefix or type(self.module).__name__!r}")
        self._watch.forget()  # re-read the tree now, so what exists is hooked before any verb
        self.prepare(self.groups)
        return [self._guards]

    def checkpoint_facts(self) -> CheckpointFacts:
        return CheckpointFacts(sharded=False, module=self.module)

    def rebuild_plugin(self) -> Rebuild | None:
        return None


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
    static_groups: tuple[str, ...] = ()

    def _params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                yield self.param_names.get(id(p), f"param_groups.{gi}.params.{pi}"), p

    def prepare(self, groups: Collection[str]) -> None:
        """Nothing to prepare: an optimizer's state is listed as it is."""

    def entries(self, group: str) -> Sequence[Entry]:
        return [
            Entry(f"{pname}.{key}", "optim", self.to_local(value), self.meta_of(value))
            for pname, p in self._params()
            for key, value in self.optimizer.state.get(p, {}).items()
            if isinstance(value, torch.Tensor)
        ]

    def touched(self) -> Iterable[torch.Tensor]:
        """Every tensor ``step()`` reads or writes: params, their grads, the state."""
        for _, p in self._params():
            yield self.to_local(p)
            if p.grad is not None:
                yield self.to_local(p.grad)
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    yield self.to_local(value)

    def coverage(self) -> dict[str, list[str]]:
        return {"optim": [e.name for e in self.entries("optim")]}

    def state_tensors(self) -> Iterable[torch.Tensor]:
        for _, p in self._params():
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    yield self.to_local(value)

    def grads(self) -> Iterable[torch.Tensor]:
        for _, p in self._params():
            if p.grad is not None:
                yield self.to_local(p.grad)

    def install_guards(self, check: Check) -> list[Handle]:
        """``step()``, ``state_dict()``, ``load_state_dict()`` and ``zero_grad(set_to_none=False)`` on released state raise."""
        opt = self.optimizer
        enter, leave = getattr(check, "enter", None), getattr(check, "leave", None)

        def pre_step(o: Any, args: Any, kwargs: Any) -> None:
            if enter is not None:
                enter(sys._getframe(1), "optimizer.step()")  # (left by the post-hook, from the same frame)
            check(self.touched(), "optimizer.step()", writes=True)

        def post_step(o: Any, args: Any, kwargs: Any) -> None:
            if leave is not None:
                leave(sys._getframe(1))

        def pre_state_dict(o: Any, *args: Any) -> None:
            check(self.state_tensors(), "optimizer.state_dict()")

        def pre_load(o: Any, *args: Any) -> None:
            check(self.state_tensors(), "optimizer.load_state_dict()")

        def zero_grad_checks(*args: Any, **kwargs: Any) -> bool:
            set_to_none = kwargs.get("set_to_none", args[0] if args else True)
            return not set_to_none  # writing zeros reads the grads' storage; setting None does not

        return [
            opt.register_step_pre_hook(pre_step),
            opt.register_step_post_hook(post_step),
            opt.register_state_dict_pre_hook(pre_state_dict),
            opt.register_load_state_dict_pre_hook(pre_load),
            MethodGuard(
                check, opt, "zero_grad", self.grads, "optimizer.zero_grad(set_to_none=False)", when=zero_grad_checks
            ),
        ]

    def checkpoint_facts(self) -> CheckpointFacts:
        return CheckpointFacts(sharded=False)

    def rebuild_plugin(self) -> Rebuild | None:
        return None


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
