"""FSDP2: models wrapped with ``torch.distributed.fsdp.fully_shard``.

Slots are the *local shards*: each parameter's padded shard storage (one per
``FSDPParam``), the gradient storages (one reduce-scatter output per FSDP
param group, or one per parameter under ``CPUOffloadPolicy`` on a GPU), and
every optimizer state tensor's local storage (``exp_avg``, ``exp_avg_sq``:
DTensors; ``step``: a plain tensor). Buffers are not sharded by FSDP and are
listed as plain tensors. The traversal is the plain-torch backend's
(``TorchModuleBackend`` / ``TorchOptimizerBackend``); this module only maps a
DTensor to the local tensor that owns storage (``to_local``) and adds its
mesh and placements to the layout fingerprint (``meta_of``).

Facts this relies on are in ``docs/notes/fsdp2-notes.md``; what it means for a
user is in ``docs/guide/fsdp2.md``. In short:

- **Resharded before every verb.** After a forward, modules with
  ``reshard_after_forward=False`` -- the root, by default -- stay UNSHARDED:
  their ``_parameters`` hold all-gathered plain tensors, not the shards. Every
  verb (and ``residency()``, ``slots()``, ``nbytes()``, ``layout()``) first
  calls ``prepare()``, which calls ``reshard()`` on every FSDP module that is
  not sharded, so only shard storage is ever moved. This is safe between a forward and its backward
  (FSDP all-gathers again in the pre-backward hook, as it does for
  ``reshard_after_forward=True``). A verb called *during* a forward or
  backward (from a hook) raises ``StateError("fsdp2")`` and changes nothing.
  The exit of ``swapped()`` calls ``prepare()`` too, so no all-gathered
  copy of the snapshot's values outlives the context (the next forward
  would otherwise reuse it: stale weights).
- **Guards run before FSDP's hooks.** FSDP's own pre-forward hook all-gathers
  the shard storage; reading a released storage is a segfault on the CPU and
  an illegal-address fault on CUDA. Each FSDP module gets a forward pre-hook
  registered with ``prepend=True`` (after ``fully_shard``, so it runs first)
  and a forward post-hook, also prepended, that puts a gradient hook on the
  module's outputs ahead of FSDP's pre-backward hook: forward, backward and
  ``optimizer.step()`` on released state raise ``StateError("offloaded")``.
- **Never aliasing.** Under ``CPUOffloadPolicy`` the shards already live in
  host memory; they are still ``device`` slots (their own storage holds the
  values) and a snapshot copies their bytes into a pool block, never keeps a
  reference to the live tensor (the verl-omni #645 failure). With
  ``pin_memory=True`` (on a GPU) FSDP pins them with ``Tensor.pin_memory()``,
  whose storage cannot be resized: ``offload`` and ``drop`` leave those in
  place (the engine's rule for non-resizable host storage). On a GPU,
  verbs first wait for the current stream (FSDP's non-blocking host-to-device
  copies may still read the host shards) and ``optimizer.step()`` (on the
  CPU) waits for the device.
- **Same mesh, same placements.** The fingerprint of a DTensor carries the
  mesh (device type, rank layout, dim names, this rank's coordinate and
  process-group ranks: FSDP picks its chunk by the latter), the placements and the global shape and stride; a snapshot restored onto
  anything else raises ``LayoutError("mismatch")`` naming the tensor.
  Resharding belongs to checkpoints.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..core.source import Check, Handle
from ..errors import StateError
from .base import CheckpointFacts
from .torch import TorchModuleBackend, TorchOptimizerBackend, named_parameters, unwrap

try:  # torch without torch.distributed (or an old one) has no FSDP2
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - depends on the torch build
    FSDPModule = None  # type: ignore[assignment,misc]
    TrainingState = None  # type: ignore[assignment,misc]
    DTensor = None  # type: ignore[assignment,misc]


# -- DTensor -> local storage, and its fingerprint -----------------------------------------


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns storage: a DTensor's persistent ``_local_tensor`` (``to_local()`` makes a new alias)."""
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor
    return t


def _placement(p: Any) -> str:
    fields = [f"{k}={getattr(p, k)}" for k in ("dim", "split_factor", "reduce_op") if hasattr(p, k)]
    return f"{type(p).__name__}({', '.join(fields)})"


def _nested_tuple(x: Any) -> Any:
    return tuple(_nested_tuple(v) for v in x) if isinstance(x, list) else x


class _MeshCache:
    """``(device type, rank layout, dim names)`` and this rank's coordinate, once per mesh object."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[Any, tuple[Any, ...]]] = {}

    def describe(self, mesh: Any) -> tuple[Any, ...]:
        hit = self._items.get(id(mesh))
        if hit is not None and hit[0] is mesh:
            return hit[1]
        coord = mesh.get_coordinate()
        try:  # FSDP picks its chunk by the rank in each dim's process group, not by the coordinate
            group_ranks: tuple[int, ...] | None = tuple(mesh.get_group(d).rank() for d in range(mesh.ndim))
        except Exception:  # noqa: BLE001 - a rank outside the mesh, or a mesh without groups
            group_ranks = None
        desc = (
            ("mesh", (mesh.device_type, _nested_tuple(mesh.mesh.tolist()), tuple(mesh.mesh_dim_names or ()))),
            ("coordinate", tuple(coord) if coord is not None else None),
            ("group_ranks", group_ranks),
        )
        self._items[id(mesh)] = (mesh, desc)  # keeps the mesh alive: ids are never reused while cached
        return desc


_MESHES = _MeshCache()
_META: dict[Any, tuple[Any, ...]] = {}


def meta_of(t: torch.Tensor) -> tuple[Any, ...]:
    """Fingerprint items of a DTensor: mesh, this rank's place in it, placements, global shape and stride.

    A tuple of ``(key, value)`` pairs, hashable, so a mismatch reads plainly in
    ``LayoutError("mismatch")``. Plain tensors have none (``()``).
    """
    if DTensor is None or not isinstance(t, DTensor):
        return ()
    spec = t._spec
    meta = _META.get(spec)  # equal specs (mesh, placements, global shape/stride/dtype): equal meta
    if meta is None:
        meta = (
            *_MESHES.describe(spec.mesh),
            ("placements", tuple(_placement(p) for p in spec.placements)),
            ("global_shape", tuple(spec.shape)),
            ("global_stride", tuple(spec.stride)),
        )
        if len(_META) > 1 << 16:
            _META.clear()
        _META[spec] = meta
    return meta


# -- FSDP state ----------------------------------------------------------------------------


def is_fsdp2(model: Any) -> bool:
    """True when ``model`` is, or contains, a module wrapped with ``fully_shard``."""
    return (
        FSDPModule is not None
        and isinstance(model, nn.Module)
        and any(isinstance(m, FSDPModule) for m in model.modules())
    )


def _param_groups(fsdp_state: Any) -> list[Any]:
    groups = getattr(fsdp_state, "_fsdp_param_groups", None)
    if groups is None:  # torch versions with one group per state
        group = getattr(fsdp_state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _unreduced_grad(fp: Any) -> bool:
    """A gradient FSDP keeps unsharded between backwards without gradient sync."""
    if getattr(fp, "unsharded_accumulated_grad", None) is not None:
        return True
    unsharded = getattr(fp, "_unsharded_param", None)
    return unsharded is not None and unsharded.grad is not None


@dataclass(eq=False)
class _Unit:
    """One FSDP state (a ``fully_shard`` call) and the module names it covers."""

    names: list[str]
    modules: list[Any]
    state: Any
    top: bool  # no FSDP module above it inside the model: its forward runs every unit below

    @property
    def label(self) -> str:
        return ", ".join(repr(n or "<root>") for n in self.names)

    def groups(self) -> list[Any]:
        return _param_groups(self.state)

    def fsdp_params(self) -> Iterator[Any]:
        for g in self.groups():
            yield from g.fsdp_params


def _units(model: nn.Module) -> list[_Unit]:
    units: dict[int, _Unit] = {}
    fsdp_names: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        top = not any(name.startswith(f"{p}.") or p == "" for p in fsdp_names)
        fsdp_names.append(name)
        st = m._get_fsdp_state()
        unit = units.get(id(st))
        if unit is None:
            units[id(st)] = _Unit([name], [m], st, top)
        else:  # fully_shard([a, b]): one state, several modules
            unit.names.append(name)
            unit.modules.append(m)
            unit.top = unit.top and top
    return list(units.values())


# -- module backend ------------------------------------------------------------------------


@dataclass
class FSDP2ModuleBackend(TorchModuleBackend):
    """Lists the local shards of an FSDP2 model's parameters and gradients, and its buffers.

    Before listing, reshards every FSDP module that is not sharded (see the
    module docstring); raises ``StateError("fsdp2")`` during a forward/backward.
    """

    to_local: Any = field(default=to_local, repr=False)
    meta_of: Any = field(default=meta_of, repr=False)
    name: str = "fsdp2"
    tree_guard: bool = False  # the root unit's pre-forward checks every unit's shards (``install_guards``)
    _units: list[_Unit] = field(default_factory=list, repr=False)
    _below_cache: dict[int, list[_Unit]] = field(default_factory=dict, repr=False)
    _warned_accumulation: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_fsdp2(self.module):
            raise TypeError(f"{type(self.module).__name__} contains no module wrapped with fully_shard")
        self._units = _units(self.module)
        #: the accelerator whose parameters ``CPUOffloadPolicy`` keeps in host memory (``None`` if none)
        self.host_shards_on: torch.device | None = next(
            (
                torch.device(fp.device)
                for unit in self._units
                for fp in unit.fsdp_params()
                if getattr(fp, "offload_to_cpu", False) and torch.device(fp.device).type != "cpu"
            ),
            None,
        )

    # listing --------------------------------------------------------------------------
    def ensure_sharded(self) -> None:
        """Reshard every FSDP module that holds unsharded parameters; refuse during forward/backward.

        Safe between a forward and its backward: FSDP all-gathers again before
        the backward needs the parameters. Changes nothing when it raises.
        """
        todo: list[Any] = []
        for unit in self._units:
            busy = [g for g in unit.groups() if g._training_state != TrainingState.IDLE]
            if busy or unit.state._training_state != TrainingState.IDLE:
                state = busy[0]._training_state if busy else unit.state._training_state
                raise StateError(
                    "fsdp2",
                    f"FSDP module {unit.label} is in training state {state.name}: a stateshift verb was called "
                    "during a forward or backward (from a hook?). Call it before the forward or after the "
                    "backward; after an exception inside a forward/backward, call reset_iter_state() on the root",
                )
            todo.extend(g for g in unit.groups() if not g.is_sharded or g._all_gather_result is not None)
        for g in todo:
            if g._all_gather_result is not None:  # unshard(async_op=True) not yet waited on
                g.wait_for_unshard()
            g.reshard()
        device = self.host_shards_on
        if device is not None and device.type == "cuda":
            # CPUOffloadPolicy: FSDP copies the host shards to the device with non_blocking
            # copies; a verb may write them on the host right away (host-to-host copies are
            # synchronous), so it must wait for copies still reading them.
            torch.cuda.current_stream(device).synchronize()
        if not self._warned_accumulation and any(_unreduced_grad(fp) for u in self._units for fp in u.fsdp_params()):
            self._warned_accumulation = True
            warnings.warn(
                "FSDP2 holds gradients accumulated without reduction (set_requires_gradient_sync(False)) on its "
                "unsharded parameters; those are not slots: stateshift neither moves nor snapshots them until the "
                "next synced backward reduces them into the sharded grads",
                stacklevel=3,
            )

    def prepare(self, groups: Collection[str]) -> None:
        """Reshard (``ensure_sharded``), so only shard storage is listed and moved; then the torch guards' cover.
        Local shards swapped in under the same parameters since the last look are listed afresh (``_moved``)."""
        self.ensure_sharded()
        if self._moved():
            self._watch.forget()
        super().prepare(groups)

    def _moved(self) -> bool:
        """Whether a parameter's local tensor is no longer the one listed. ``model.to(...)`` (verl's FSDP2
        offload and load) moves a DTensor parameter by swapping a new DTensor into the same ``Parameter``
        object (``torch.utils.swap_tensors``: ``Module._apply`` does it for every wrapper subclass), so the
        module tree's objects stay the same while the local shard, and its storage, are new; a listing
        kept from before would read and write the old shard."""
        listed = self._lists.get("params")
        if listed is None or len(listed) != len(self._named):
            return False
        local = self.to_local
        return not all(e.tensor is local(p) for e, (_, p) in zip(listed, self._named, strict=True))

    def coverage(self) -> dict[str, list[str]]:
        self.prepare(self.groups)
        out = super().coverage()
        out["fsdp units"] = [u.label for u in self._units]
        return out

    def checkpoint_facts(self) -> CheckpointFacts:
        return CheckpointFacts(
            sharded=True,
            module=self.module,
            export_refusal=(
                "export_hf needs whole tensors, and this FSDP2 model holds shards on each rank: gather them with "
                "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options="
                "StateDictOptions(full_state_dict=True, cpu_offload=True)) and save that, or use save_dcp"
            ),
        )

    # guards ---------------------------------------------------------------------------
    def _shard_storages(self, units: Iterable[_Unit]) -> Iterator[torch.Tensor]:
        """The 1-D views FSDP all-gathers from (``_sharded_param_data``: the whole padded storage)."""
        for unit in units:
            for fp in unit.fsdp_params():
                yield fp._sharded_param_data

    def _grads(self, units: Iterable[_Unit]) -> Iterator[torch.Tensor]:
        for unit in units:
            for fp in unit.fsdp_params():
                grad = fp.sharded_param.grad
                if grad is not None:
                    yield to_local(grad)

    def _plain(self, unit: _Unit) -> Iterator[torch.Tensor]:
        """Buffers and parameters FSDP does not manage (``ignored_params``) in the unit's modules' subtrees."""
        for module in unit.modules:
            for m in module.modules():
                for t in (*m._parameters.values(), *m._buffers.values()):
                    if t is not None and not (DTensor is not None and isinstance(t, DTensor)):
                        yield t

    def _below(self, unit: _Unit) -> list[_Unit]:
        """Units whose modules lie inside ``unit``'s (its own included)."""
        below = self._below_cache.get(id(unit))
        if below is None:
            names = unit.names
            below = [
                u
                for u in self._units
                if u is unit or any(n == "" or m.startswith(f"{n}.") for n in names for m in u.names)
            ]
            self._below_cache[id(unit)] = below
        return below

    def _units_of_states(self, states: Iterable[Any]) -> list[_Unit]:
        ids = {id(s) for s in states}
        return [u for u in self._units if id(u.state) in ids]

    def _forward_needs(self, unit: _Unit) -> list[_Unit]:
        """A top unit's forward runs every unit below it; others need their own and their prefetch targets."""
        needs = self._below(unit) if unit.top else [unit]
        return needs + self._units_of_states(getattr(unit.state, "_states_to_forward_prefetch", ()))

    def _backward_needs(self, unit: _Unit) -> list[_Unit]:
        needs = self._below(unit) if unit.top else [unit]
        needs += self._units_of_states(getattr(unit.state, "_states_to_backward_prefetch", ()))
        # implicit backward prefetch: the group that ran forward just before this one
        groups = unit.groups()
        order = getattr(getattr(groups[0], "comm_ctx", None), "post_forward_order", []) if groups else []
        prev = {
            id(order[i - 1]) for g in groups for i in getattr(g, "_post_forward_indices", ()) if 0 < i <= len(order)
        }
        if prev:
            needs += [u for u in self._units if any(id(g) in prev for g in u.groups())]
        return needs

    def install_guards(self, check: Check) -> list[Handle]:
        """Forward, backward and (through the optimizer backend) ``step()`` on released state raise ``StateError("offloaded")``.

        Registered after ``fully_shard`` with ``prepend=True``, so they run
        before FSDP's own hooks read the shards.
        """
        handles: list[Any] = []
        enter, leave = getattr(check, "enter", None), getattr(check, "leave", None)

        def leave_forward(mod: nn.Module, *args: Any) -> None:
            if leave is not None:
                leave(sys._getframe(1))

        for unit in self._units:
            for owner, module in zip(unit.names, unit.modules, strict=True):
                label = repr(owner) if owner else f"<root {type(module).__name__}>"

                def pre_forward(mod: nn.Module, args: Any, unit: _Unit = unit, label: str = label) -> None:
                    where = f"forward of FSDP module {label}"
                    if enter is not None:  # before FSDP's all-gather reads the shards (``ReaderGate``)
                        enter(sys._getframe(1), where)
                    check(self._shard_storages(self._forward_needs(unit)), where)
                    check(self._plain(unit), where)

                def post_forward(
                    mod: nn.Module, args: Any, output: Any, unit: _Unit = unit, label: str = label
                ) -> None:
                    if not torch.is_grad_enabled():
                        return

                    def before_backward(grad: torch.Tensor) -> None:
                        needs = self._backward_needs(unit)
                        where = f"backward through FSDP module {label}"
                        check(self._shard_storages(needs), where)
                        check(self._grads(needs), where)

                    # registered before FSDP's post-forward puts its pre-backward hook on the same
                    # tensors, so this one runs first in the backward
                    for t in tree_leaves(output):
                        if isinstance(t, torch.Tensor) and t.requires_grad:
                            t.register_hook(before_backward)

                # prepend: ahead of FSDP's own hooks (registered by fully_shard, before us)
                handles.append(module.register_forward_pre_hook(pre_forward, prepend=True))
                handles.append(module.register_forward_hook(post_forward, prepend=True))
                handles.append(module.register_forward_hook(leave_forward, always_call=True))
        handles.extend(super().install_guards(check))  # per-module checks of the plain torch backend
        return handles


@dataclass
class FSDP2OptimizerBackend(TorchOptimizerBackend):
    """The optimizer's state tensors (DTensors: their local shards; ``step``: as is), group ``optim``.

    ``host_shards_on``: the accelerator, when ``CPUOffloadPolicy`` keeps the
    shards in host memory next to it. ``optimizer.step()`` then runs on the
    host, outside any stream order, so a pre-step hook waits for the device
    (a restore from a device-placed snapshot writes host shards asynchronously).
    """

    to_local: Any = field(default=to_local, repr=False)
    meta_of: Any = field(default=meta_of, repr=False)
    name: str = "fsdp2-optim"
    host_shards_on: torch.device | None = None

    def install_guards(self, check: Check) -> list[Handle]:
        handles = super().install_guards(check)
        device = self.host_shards_on
        if device is not None and device.type == "cuda":

            def wait_for_device(opt: Any, args: Any, kwargs: Any) -> None:
                torch.cuda.current_stream(device).synchronize()

            handles.append(self.optimizer.register_step_pre_hook(wait_for_device))
        return handles

    def checkpoint_facts(self) -> CheckpointFacts:
        return CheckpointFacts(sharded=True)


def param_names(model: nn.Module) -> dict[int, str]:
    """Names of the sharded (DTensor) parameters, by id; call after ``ensure_sharded``."""
    names: dict[int, str] = {}
    for name, p in named_parameters(unwrap(model)):
        names.setdefault(id(p), name)
    return names


def detect(model: Any, optimizer: Any = None) -> list[Any] | None:
    """The FSDP2 backends, or ``None`` when no module of ``model`` was wrapped with ``fully_shard``.

    Reshards the model (``FSDP2ModuleBackend.ensure_sharded``) so that the
    optimizer's parameters are named after the sharded parameters.
    """
    if not is_fsdp2(model):
        return None
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        return None
    module = FSDP2ModuleBackend(model)
    backends: list[Any] = [module]
    if optimizer is not None:
        module.ensure_sharded()
        backends.append(FSDP2OptimizerBackend(optimizer, param_names(model), host_shards_on=module.host_shards_on))
    return backends


__all__ = ["FSDP2ModuleBackend", "FSDP2OptimizerBackend", "detect", "is_fsdp2", "meta_of", "to_local"]
