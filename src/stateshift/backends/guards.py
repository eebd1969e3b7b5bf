"""Guard hooks shared by the module backends: compute on released state raises, never crashes.

A kernel that reads a released storage is a segmentation fault on the CPU
and a sticky illegal-address fault on CUDA. ``ModuleGuards`` puts a forward
pre-hook, a ``state_dict`` pre-hook and a ``load_state_dict`` pre-hook on
every module that owns parameters or buffers, and a gradient hook on every
trainable parameter, each calling the engine's ``check`` first.

What torch offers no hook for (reading a tensor directly: ``print(p)``,
``p.sum()``, ``copy.deepcopy(model)``, ``model.to(...)``, free functions such
as ``clip_grad_norm_``) is checked operator by operator while anything is
released (``core/touch.py``).

Order across threads: the forward pre-hooks (and ``MethodGuard``) enter the
state's ``ReaderGate`` before they check, and an ``always_call`` forward hook
leaves it, so a verb in another thread waits for a running forward instead
of releasing what it reads (``core/locking.py``). ``check`` is the engine's
``Guard``: ``check(tensors, where)``, ``check.enter(frame, what)``,
``check.leave(frame)``; a plain ``Check`` without them (a test's) orders nothing.

Why nothing added later escapes: the hooks read the module's tensors when
they run (a replaced parameter is seen), and ``cover()`` is called again by
the backend's ``prepare()`` before every verb, which hooks modules and
parameters created since (a LoRA adapter, a resized embedding). A tensor can
only be released by a verb, and that verb's ``prepare()`` has hooked it.

No weak reference to a parameter is kept (``torch.utils.swap_tensors``, which
``model.to(...)`` uses for DTensor params, refuses a tensor that has one). A
swap takes a parameter's gradient hook with its old ``TensorImpl``; the next
``cover()`` hooks it again (``_Hooked``), but the module tree does not change
in a swap, so until then a backward into that parameter is not checked.
"""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..core.source import Check

ToLocal = Callable[[torch.Tensor], torch.Tensor]
#: the tensor a backward accumulates into for a parameter, and its name suffix ("grad", "main_grad")
GradOf = Callable[[nn.Parameter], tuple[Any, str]]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def plain_grad(p: nn.Parameter) -> tuple[Any, str]:
    return p.grad, "grad"


def _seen(index: dict[int, weakref.ref[Any]], obj: Any) -> bool:
    """Whether ``obj`` (not merely an object that once had its id) is in ``index``; adds it if not."""
    ref = index.get(id(obj))
    if ref is not None and ref() is obj:
        return True
    index[id(obj)] = weakref.ref(obj)
    return False


@dataclass(eq=False)
class _Hooked:
    """A parameter the guards hooked, held strongly, never through a weak reference: ``torch.utils.
    swap_tensors`` (``model.to(...)`` on FSDP2's DTensor params, or with torch's swap-on-conversion
    future) refuses any tensor that has one. ``impl``: its ``TensorImpl`` when hooked -- a swap keeps the
    ``Parameter`` object and gives it another ``TensorImpl``, and the hook stays with the old one, so a
    param whose ``impl`` changed is hooked again."""

    param: nn.Parameter
    impl: int


def _hooked(index: dict[int, _Hooked], p: nn.Parameter) -> bool:
    held = index.get(id(p))
    return held is not None and held.param is p and held.impl == p._cdata


@dataclass(eq=False)
class ModuleGuards:
    """The hooks of one backend (see the module docstring); ``remove()`` takes them all off."""

    check: Check
    local: ToLocal = _identity
    grad_of: GradOf = plain_grad
    handles: list[Any] = field(default_factory=list)
    _modules: dict[int, weakref.ref[Any]] = field(default_factory=dict, repr=False)
    #: hooked params by id (strong references, like ``TreeWatch``'s: see ``_Hooked``)
    _params: dict[int, _Hooked] = field(default_factory=dict, repr=False)

    def cover(self, modules: Iterable[tuple[str, nn.Module]], params: Iterable[tuple[str, nn.Parameter]]) -> None:
        """Hook every module that owns tensors, and every trainable parameter, not hooked yet.

        ``params`` is the backend's whole current listing: a param held from an earlier listing that is not in
        it any more (replaced, e.g. ``load_state_dict(..., assign=True)``) is let go, so the guards never keep
        a tensor the model dropped (and its storage) alive."""
        for owner, m in modules:
            if (m._parameters or m._buffers) and not _seen(self._modules, m):
                label = owner or type(m).__name__
                self.handles.append(m.register_forward_pre_hook(self._forward_hook(f"forward of module {label!r}")))
                self.handles.append(m.register_forward_hook(self._leave_hook(), always_call=True))
                self.handles.append(
                    m.register_state_dict_pre_hook(self._module_hook(f"state_dict() of module {label!r}"))
                )
                self.handles.append(
                    m.register_load_state_dict_pre_hook(self._module_hook(f"load_state_dict() into module {label!r}"))
                )
        listed: set[int] = set()
        for name, p in params:
            listed.add(id(p))
            if p.requires_grad and not _hooked(self._params, p):
                held = self._params[id(p)] = _Hooked(p, p._cdata)
                self.handles.append(p.register_hook(self._grad_hook(held, name)))
        for gone in self._params.keys() - listed:
            del self._params[gone]

    def cover_tree(self, root: nn.Module, label: str) -> None:
        """A forward pre-hook on ``root`` (run first) that checks every tensor of its tree.

        The per-module hooks alone would let a forward run the modules before
        the first released one (updating buffers a forward writes: token
        counts, a router's load statistics) and then raise; checked at the
        root, a refused forward changes nothing. The per-module hooks stay
        for modules called on their own."""
        check, local, where = self.check, self.local, f"forward of {label}"
        enter = getattr(check, "enter", None)

        def tree_hook(mod: nn.Module, *args: Any) -> None:
            if enter is not None:
                enter(sys._getframe(1), where)  # (the frame of torch's module call: its post-hooks leave)
            # (unbound: Megatron's DDP wrapper has a list attribute named ``buffers``)
            check((local(t) for t in itertools.chain(nn.Module.parameters(mod), nn.Module.buffers(mod))), where)

        self.handles.append(root.register_forward_pre_hook(tree_hook, prepend=True))
        self.handles.append(root.register_forward_hook(self._leave_hook(), always_call=True))
        params = functools.partial(nn.Module.parameters, root)
        self.handles.append(
            root.register_forward_hook(backward_guard(check, lambda: map(local, params()), f"backward through {label}"))
        )

    def _forward_hook(self, where: str) -> Callable[..., None]:
        """A forward pre-hook that enters the reader gate (``check.enter``), then checks the module's own tensors."""
        check, local = self.check, self.local
        enter = getattr(check, "enter", None)

        def pre_hook(mod: nn.Module, *args: Any) -> None:
            if enter is not None:
                enter(sys._getframe(1), where)
            own = (*mod._parameters.values(), *mod._buffers.values())
            check((local(t) for t in own if t is not None), where)

        return pre_hook

    def _leave_hook(self) -> Callable[..., None]:
        """An ``always_call`` forward hook: the forward (returned or raised) leaves the reader gate."""
        leave = getattr(self.check, "leave", None)

        def post_hook(mod: nn.Module, *args: Any) -> None:
            if leave is not None:
                leave(sys._getframe(1))

        return post_hook

    def _module_hook(self, where: str) -> Callable[..., None]:
        """A hook (forward, state_dict or load_state_dict pre-hook) that checks the module's own tensors."""
        check, local = self.check, self.local

        def pre_hook(mod: nn.Module, *args: Any) -> None:
            own = (*mod._parameters.values(), *mod._buffers.values())
            check((local(t) for t in own if t is not None), where)

        return pre_hook

    def _grad_hook(self, held: _Hooked, name: str) -> Callable[[torch.Tensor], None]:
        """The hook lives in the param's ``TensorImpl``: it reaches the param through a weak reference to
        ``held`` (which the guards own), never to the param (``_Hooked``) nor strongly (a cycle through C++)."""
        check, local, grad_of = self.check, self.local, self.grad_of
        ref = weakref.ref(held)

        def grad_hook(grad: torch.Tensor) -> None:
            h = ref()
            param = h.param if h is not None else None
            target, leaf = grad_of(param) if param is not None else (None, "grad")
            if isinstance(target, torch.Tensor):
                check((local(target),), f"backward accumulating into {name}.{leaf}")

        return grad_hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self._modules.clear()
        self._params.clear()


def backward_guard(check: Check, tensors: Callable[[], Iterable[torch.Tensor]], where: str) -> Callable[..., None]:
    """A forward hook that puts a hook on the outputs a backward starts from: when the backward reaches
    them it enters the reader gate (left when that backward ends: ``queue_callback``) and checks
    ``tensors()`` -- the parameters the forward saved for it. An offload between a forward and its
    backward then raises ``StateError("offloaded")`` instead of a crash, and one from another thread
    during the backward waits for it. (Entered only where the backward runs on a Python thread: the
    CPU; on CUDA the hook runs on the engine's device thread, and the check alone is made.)"""
    enter, leave = getattr(check, "enter", None), getattr(check, "leave", None)

    def before_backward(grad: torch.Tensor) -> None:
        try:
            frame = sys._getframe(1)  # the frame that called the engine (on the CPU)
        except ValueError:  # no Python frame under the hook: the engine's device thread (CUDA)
            frame = None
        if enter is not None and leave is not None and frame is not None:
            enter(frame, where)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(leave, frame))
        check(tensors(), where)

    def post_forward(mod: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                    t.register_hook(before_backward)

    return post_forward


class MethodGuard:
    """An instance-level wrapper of ``obj.<method>`` that checks ``tensors()`` first; ``remove()`` undoes it.

    For methods torch offers no hook for (``Optimizer.zero_grad``, Megatron's
    ``offload_to_cpu``). ``when(*args, **kwargs)`` says whether a call reads
    the tensors at all (default: always); ``writes``: the call steps them (``Check``).
    """

    def __init__(
        self,
        check: Check,
        obj: Any,
        method: str,
        tensors: Callable[[], Iterable[torch.Tensor]],
        what: str | None = None,
        when: Callable[..., bool] | None = None,
        writes: bool = False,
    ) -> None:
        self.obj, self.method = obj, method
        original = getattr(obj, method)
        what = what or f"{type(obj).__name__}.{method}()"

        enter, leave = getattr(check, "enter", None), getattr(check, "leave", None)

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe()
            if enter is not None and leave is not None:
                enter(frame, what)  # (until the method returns, a verb in another thread waits: even a call
                # that reads nothing, such as zero_grad(set_to_none=True), changes what a verb lists)
            try:
                if when is None or when(*args, **kwargs):
                    check(tensors(), what, writes=writes)
                return original(*args, **kwargs)
            finally:
                if leave is not None:
                    leave(frame)

        self.guarded = guarded
        obj.__dict__[method] = guarded

    def remove(self) -> None:
        if self.obj.__dict__.get(self.method) is self.guarded:
            del self.obj.__dict__[self.method]
