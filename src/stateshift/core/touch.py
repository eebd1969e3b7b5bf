"""Any tensor operation on released storage raises ``StateError("offloaded")`` (rule 8, beyond the hooks).

The guard hooks cover what torch has hooks for (a module's forward, a
backward into a gradient, an optimizer's step, ``state_dict``). Everything
else -- ``p.grad.norm()``, ``p.add_(...)``, ``print(p)``, ``model.to(...)``,
``copy.deepcopy(model)``, ``clip_grad_norm_``, a ``state_dict()`` taken
before an offload and read after, FSDP2's ``full_tensor()`` -- reaches a
kernel through torch's dispatcher, and a kernel reading released storage is
a segmentation fault on the CPU and a sticky illegal-address fault on CUDA.

While some state has released storage, this module keeps two modes on the
mode stacks of the threads that use stateshift:

- a ``TorchDispatchMode`` that looks up each operator's tensor arguments
  (and the local tensors of a DTensor) among the released storages
  (``publish``: every verb publishes its state's, under its lock) and raises
  ``StateError("offloaded")`` naming the group before the kernel runs;
  ``detach``, ``alias`` and the ``*_like`` factories read no values and pass
  (other views of released storage fail torch's own bounds check anyway: they
  raise ``StateError("offloaded")`` too);
- a ``TorchFunctionMode`` for the few reads that bypass the dispatcher:
  ``repr``/``print``, ``tolist()``, ``numpy()``, ``__array__``, ``__dlpack__``.

Cost: nothing while no storage is released -- the modes are not on any
stack, and a thread drops them at its next hook or verb once nothing is.
While something is released, every operator of a thread that has them
pays two Python calls and a dictionary lookup per tensor argument
(``benchmarks/guard_overhead.py``).

Threads: mode stacks are per thread in torch, and nothing in torch runs
code on a thread from outside. The modes are put on a thread when it calls
a verb or runs a guarded hook (a forward, a backward into a gradient, an
optimizer step) while something is released -- in practice every thread
that trains or moves a model -- and ``watch_thread()`` puts them on any
other thread (a logging thread that reads gradient norms). Modes are put at
the bottom of the stacks, so a mode the user enters and leaves meanwhile
pops its own. Ops ``torch.compile`` fused into a compiled graph are not
seen (the mode's ``ignore_compile_internals``); the guard hooks still run.

The engine's verbs touch released storage on purpose (``resize_``, copies
into re-grown storage): they run inside ``unchecked()``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..errors import StateError
from .slot import Slot

#: storage key -> slot, of every state's released storages (replaced whole, so a reader sees one version)
_released: Mapping[int, Slot] = {}
_by_owner: dict[int, dict[int, Slot]] = {}
#: keys of address-stable storages that are paused: their size stays, their memory is unmapped
_paused: frozenset[int] = frozenset()
_paused_by_owner: dict[int, frozenset[int]] = {}
_registry = threading.Lock()
_tls = threading.local()

#: operators that read no values of their tensor arguments
_NO_READ = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "detach",
        "alias",
        "lift_fresh",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "is_pinned",
        "record_stream",
        "set_",
        "resize_",
        "resize_as_",
        "result_type",
        "is_same_size",
        "size",
        "stride",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "_has_compatible_shallow_copy_type",
    )
    if hasattr(torch.ops.aten, name)
)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STORAGE_ID = getattr(torch._C, "_storage_id", None)


def _key(t: torch.Tensor) -> int | None:
    try:
        return _STORAGE_ID(t) if _STORAGE_ID is not None else t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage (a wrapper subclass): nothing to read
        return None


def _slot_of(t: torch.Tensor, released: Mapping[int, Slot]) -> Slot | None:
    """The released slot ``t`` reads, if any (a DTensor: through its local tensors)."""
    if type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        for name in inner:
            x = getattr(t, name, None)
            slot = _slot_of(x, released) if isinstance(x, torch.Tensor) else None
            if slot is not None:
                return slot
        return None
    key = _key(t)
    slot = None if key is None else released.get(key)
    if slot is None or t.numel() == 0:
        return None
    if slot.storage.nbytes() > 0 and key not in _paused:
        return None  # re-grown by its framework since the last verb (Megatron's own reload): readable
    return slot


def _first_in(values: Any, released: Mapping[int, Slot]) -> Slot | None:
    for a in values:
        if isinstance(a, torch.Tensor):
            slot = _slot_of(a, released)
        elif isinstance(a, (list, tuple)):
            slot = next(
                (r for x in a if isinstance(x, torch.Tensor) and (r := _slot_of(x, released)) is not None), None
            )
        else:
            continue
        if slot is not None:
            return slot
    return None


def first_released(args: Any, kwargs: Mapping[str, Any] | None, released: Mapping[int, Slot]) -> Slot | None:
    """The first released slot among the tensors of ``args`` and ``kwargs`` (and of lists among them)."""
    return _first_in(args, released) or (_first_in(kwargs.values(), released) if kwargs else None)


def _refuse(slot: Slot, what: str) -> StateError:
    return StateError(
        "offloaded",
        f"{what} (a direct read or write)",
        group=slot.info.group,
        tensor=slot.name,
        residency=slot.residency.value,
    )


class _DispatchCheck(TorchDispatchMode):
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        released = _released
        if released and getattr(func, "_overloadpacket", _NO_READ) not in _NO_READ:  # (a higher-order op has none)
            slot = first_released(args, kwargs, released)
            if slot is not None:
                raise _refuse(slot, str(func))
        return func(*args, **(kwargs or {}))


_RAW_READS = frozenset(
    f
    for f in (
        torch.Tensor.__repr__,
        torch.Tensor.__str__,
        torch.Tensor.__format__,
        torch.Tensor.__array__,
        torch.Tensor.__dlpack__,
        torch.Tensor.numpy,
        torch.Tensor.tolist,
        torch._C.TensorBase.numpy,
        torch._C.TensorBase.tolist,
    )
)


class _FunctionCheck(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _RAW_READS:
            released = _released
            if released:
                slot = first_released(args, kwargs, released)
                if slot is not None:
                    raise _refuse(slot, getattr(func, "__qualname__", str(func)))
        return func(*args, **(kwargs or {}))


def publish(owner: object, released: dict[int, Slot], paused: frozenset[int] = frozenset()) -> None:
    """``owner``'s released storages are now ``released`` (key -> slot; ``paused``: those of them whose
    size stays while their memory is unmapped); turns the check on or off on this thread.

    An owner that is garbage-collected without saying ``{}`` first (a model and its state dropped while
    offloaded) is forgotten then: its storages are gone with it."""
    with _registry:
        _reap()  # first: an owner collected since the last merge may have had this id
        if _by_owner.get(id(owner), {}) != released or _paused_by_owner.get(id(owner), frozenset()) != paused:
            if released and id(owner) not in _watched:  # one finalizer per owner, however often it offloads
                _watched[id(owner)] = weakref.finalize(owner, _dead.append, id(owner))
                _watched[id(owner)].atexit = False
            if released:
                _by_owner[id(owner)], _paused_by_owner[id(owner)] = released, paused
            else:
                _by_owner.pop(id(owner), None)
                _paused_by_owner.pop(id(owner), None)
            _merge()
    sync_thread()


#: owners collected since the last merge (a finalizer may run inside ``publish``: it only appends here)
_dead: list[int] = []
#: id -> the finalizer of each live owner that ever published released storage (one each)
_watched: dict[int, weakref.finalize] = {}


def _reap() -> None:
    """Forget the owners collected since the last call (with ``_registry`` held)."""
    while _dead:
        gone = _dead.pop()
        _by_owner.pop(gone, None)
        _paused_by_owner.pop(gone, None)
        _watched.pop(gone, None)


def _merge() -> None:
    """Rebuild ``_released`` from every owner's (called with ``_registry`` held)."""
    global _released, _paused
    _reap()
    merged: dict[int, Slot] = {}
    for d in _by_owner.values():
        merged.update(d)
    _released, _paused = merged, frozenset().union(*_paused_by_owner.values())


def active() -> bool:
    """Whether any state has released storage now."""
    if _dead:
        with _registry:
            _merge()
    return bool(_released)


def sync_thread() -> None:
    """Put the modes on this thread's stacks while any storage is released (or the thread is watched,
    ``watch_thread``); take them off once none is. Nothing inside ``unchecked()``."""
    if _dead and _registry.acquire(blocking=False):
        try:
            _merge()
        finally:
            _registry.release()
    if getattr(_tls, "bypass", 0):
        return
    on = getattr(_tls, "modes", None) is not None
    if on != (bool(_released) or getattr(_tls, "watched", False)):
        _turn_off() if on else _turn_on()


def _turn_off() -> None:
    """Take this thread's modes off its stacks. Interrupted half way, ``_tls.modes`` still names them: the next
    call removes what is left (``_remove`` of a mode not on the stack changes nothing)."""
    modes = getattr(_tls, "modes", None)
    if modes is not None:
        _remove(torch._C._len_torch_dispatch_stack, _pop_dispatch, torch._C._push_on_torch_dispatch_stack, modes[0])
        _remove(
            torch._C._len_torch_function_stack,
            torch._C._pop_torch_function_stack,
            torch._C._push_on_torch_function_stack,
            modes[1],
        )
        _tls.modes = None


def _pop_dispatch() -> Any:
    return torch._C._pop_torch_dispatch_stack(None)


def _turn_on() -> None:
    """Put the modes at the bottom of this thread's stacks. An exception half way (Ctrl-C) takes off whichever
    is on already: the thread is then off, as ``_tls.modes`` says, and the next ``sync_thread`` tries again."""
    modes = (_DispatchCheck(), _FunctionCheck())
    _tls.modes = modes
    try:
        _push_bottom(
            torch._C._len_torch_dispatch_stack, _pop_dispatch, torch._C._push_on_torch_dispatch_stack, modes[0]
        )
        _push_bottom(
            torch._C._len_torch_function_stack,
            torch._C._pop_torch_function_stack,
            torch._C._push_on_torch_function_stack,
            modes[1],
        )
    except BaseException:
        _turn_off()
        raise


def watch_thread() -> None:
    """Check this thread's tensor operations for released storage from now on, whether or not anything
    is released now (a thread that neither calls verbs nor runs a guarded model, e.g. one that logs
    gradient norms). While nothing is released, its operators pay the modes' pass-through."""
    _tls.watched = True
    sync_thread()


def _push_bottom(length: Any, pop: Any, push: Any, mode: Any) -> None:
    """``mode`` under the modes on a stack: they are popped, and pushed back whatever happens (``finally``)."""
    above: list[Any] = []
    try:
        while length():
            above.append(pop())
        push(mode)
    finally:
        for m in reversed(above):
            push(m)


def _remove(length: Any, pop: Any, push: Any, mode: Any) -> None:
    """``mode`` out of a stack (if there); the modes above it are pushed back whatever happens (``finally``)."""
    above: list[Any] = []
    try:
        while length():
            m = pop()
            if m is mode:
                break
            above.append(m)
    finally:
        for m in reversed(above):
            push(m)


@contextmanager
def unchecked() -> Iterator[None]:
    """Inside, this thread's operators are not checked, and cost nothing: the modes are off its stacks.

    The engine's verbs run inside (they touch released storage on purpose: ``resize_``, copies into
    re-grown storage); so may a hot loop that knows it touches no offloaded state (e.g. a rollout
    engine generating in the trainer's process while the trainer's state is offloaded)."""
    depth = getattr(_tls, "bypass", 0)
    _tls.bypass = depth + 1
    try:  # (``_turn_off`` inside: whatever it raises, the bypass count goes back)
        if depth == 0:
            _turn_off()
        yield
    finally:
        _tls.bypass = depth
        if depth == 0:
            sync_thread()
