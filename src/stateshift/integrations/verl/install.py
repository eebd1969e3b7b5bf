"""``install()`` / ``uninstall()``: put the drop-ins in place of verl's functions, and back.

``install()`` imports ``verl.utils.megatron_utils`` and ``verl.utils.fsdp_utils``
(the first import of verl stateshift makes), keeps each original function,
and replaces the chosen ones (``SAFE`` by default; ``ON_REQUEST`` says why the
others are not) wherever they are bound: in its own module (so a later
``from verl.utils.megatron_utils import ...``, e.g. inside a worker method,
gets the drop-in) and in every module already in ``sys.modules`` that bound
the same function object under the same name (``from ... import
offload_megatron_model_to_cpu`` at the top of verl's engines). It logs each
replacement and returns them. A target module that cannot be imported (e.g.
megatron-core missing on an FSDP-only setup) is reported (a warning, and
``Installation.skipped``), never passed over in silence.

``uninstall()`` puts every original back where it replaced one, and warns
about any place that no longer holds the drop-in (someone rebound it since),
which it leaves as it is.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import fsdp, megatron
from .registry import SETTINGS, Placement

_log = logging.getLogger("stateshift.integrations.verl")

#: verl versions whose functions these drop-ins were written and tested against
TESTED_VERSIONS = ("0.9.1",)

#: the functions replaced, by the verl module that defines them
TARGETS: dict[str, tuple[str, ...]] = {
    "verl.utils.megatron_utils": (
        "offload_megatron_model_to_cpu",
        "load_megatron_model_to_gpu",
        "copy_megatron_model_to_cpu",
        "restore_megatron_model_from_cpu",
        "offload_megatron_copy_params",
        "load_megatron_copy_params",
        "offload_megatron_optimizer",
        "load_megatron_optimizer",
    ),
    "verl.utils.fsdp_utils": (
        "offload_fsdp_model_to_cpu",
        "load_fsdp_model_to_gpu",
        "offload_fsdp_optimizer",
        "load_fsdp_optimizer",
        "fsdp2_sharded_save_to_cpu",
        "fsdp2_sharded_load_from_cpu",
    ),
}
_OURS = {"verl.utils.megatron_utils": megatron, "verl.utils.fsdp_utils": fsdp}

#: replaced by default: no code path of verl 0.9.1 that we read touches what they leave offloaded
#: without loading it first (docs/guide/verl.md, "What install() leaves to verl")
SAFE = (
    "offload_megatron_model_to_cpu",
    "load_megatron_model_to_gpu",
    "copy_megatron_model_to_cpu",
    "restore_megatron_model_from_cpu",
    "fsdp2_sharded_save_to_cpu",
    "fsdp2_sharded_load_from_cpu",
)
#: replaced only on request (``functions="all"`` or by name): verl 0.9.1 reads what they offload in place
#: -- the optimizer state in ``save_checkpoint`` / ``load_checkpoint`` (only the model is loaded first), the
#: FSDP2 params in ``FSDPEngine.get_per_tensor_param`` (non-LoRA, param offload: lazily, unloaded)
ON_REQUEST = tuple(n for names in TARGETS.values() for n in names if n not in SAFE)


@dataclass(frozen=True)
class Replacement:
    """One name in one module that now holds a drop-in."""

    module: str
    name: str
    original: Any
    replacement: Any


@dataclass
class Installation:
    """What ``install()`` did: the verl version, each replacement, and what it could not replace (and why)."""

    version: str | None
    #: the names asked for (``install(functions=...)``); the others stay verl's
    functions: frozenset[str] = frozenset()
    replaced: list[Replacement] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    #: verl's own function by name (from its defining module), replaced or not
    verl: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        where = sorted({r.module for r in self.replaced})
        lines = [
            f"stateshift replaced {len(self.replaced)} bindings of verl {self.version or '(unknown version)'} in {len(where)} modules:"
        ]
        lines += [f"  {r.module}.{r.name}" for r in self.replaced]
        lines += [f"  skipped {m}: {why}" for m, why in self.skipped.items()]
        kept = sorted(set(SAFE + ON_REQUEST) - self.functions)
        if kept:
            lines.append(f"  left to verl (install(functions=...) to replace): {', '.join(kept)}")
        return "\n".join(lines)


_CURRENT: Installation | None = None


def _verl_version() -> str | None:
    mod = sys.modules.get("verl")
    version = getattr(mod, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None


def _originals(inst: Installation) -> dict[str, tuple[str, Any, Any]]:
    """verl's functions by name -> (defining module, original, drop-in); unimportable modules go to ``skipped``."""
    found: dict[str, tuple[str, Any, Any]] = {}
    for modname, names in TARGETS.items():
        try:
            mod = importlib.import_module(modname)
        except Exception as exc:  # noqa: BLE001 - an import of verl's module runs its module-level imports (megatron, peft, ...)
            inst.skipped[modname] = f"not importable: {type(exc).__name__}: {exc}"
            continue
        for name in names:
            fn = getattr(mod, name, None)
            if fn is None:
                inst.skipped[f"{modname}.{name}"] = "not defined in this verl version"
                continue
            found[name] = (modname, fn, getattr(_OURS[modname], name))
    return found


def _bind_everywhere(inst: Installation, found: dict[str, tuple[str, Any, Any]]) -> None:
    by_original = {id(orig): (name, ours) for name, (_, orig, ours) in found.items()}
    for modname, mod in list(sys.modules.items()):
        if mod is None or modname.startswith("stateshift"):
            continue
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            hit = by_original.get(id(value))
            if hit is not None and hit[0] == name:
                setattr(mod, name, hit[1])
                inst.replaced.append(Replacement(modname, name, value, hit[1]))
                _log.info("stateshift: %s.%s now runs stateshift.integrations.verl.%s", modname, name, name)


def _selected(functions: str | Iterable[str]) -> frozenset[str]:
    if functions == "safe":
        return frozenset(SAFE)
    if functions == "all":
        return frozenset(SAFE + ON_REQUEST)
    names = frozenset([functions] if isinstance(functions, str) else functions)
    unknown = sorted(names - set(SAFE + ON_REQUEST))
    if unknown:
        raise ValueError(f"not a function install() replaces: {unknown}; choose from {sorted(SAFE + ON_REQUEST)}")
    return names


def install(
    *, placement: Placement = "host", guard: bool = True, functions: str | Iterable[str] = "safe"
) -> Installation:
    """Replace verl's offload, load, copy and restore functions with stateshift's, wherever they are bound.

    Args:
        placement: where copies (pi_old snapshots) live: ``"host"`` (pinned memory, verl's choice) or
            ``"device"`` (GPU memory: no PCIe crossing, the params' bytes per live handle).
        guard: stateshift's guards (a forward on offloaded params raises ``StateError("offloaded")``).
        functions: ``"safe"`` (``SAFE``: the Megatron model functions and both pi_old pairs), ``"all"``
            (the optimizer and FSDP model offloads too: ``ON_REQUEST`` says which verl paths then meet
            released state), or names.

    Returns:
        The ``Installation`` (also logged): every module and name replaced, and what was skipped and why.
        Calling it again while installed returns the same one (settings must match).

    Raises:
        ValueError: a bad ``placement`` or function name, or settings that differ from the current installation's.
    """
    global _CURRENT
    if placement not in ("host", "device"):
        raise ValueError(f"placement must be 'host' or 'device', not {placement!r}")
    chosen = _selected(functions)
    if _CURRENT is not None:
        if (SETTINGS.placement, SETTINGS.guard, _CURRENT.functions) != (placement, guard, chosen):
            raise ValueError("already installed with other settings: uninstall() first")
        return _CURRENT
    inst = Installation(version=None, functions=chosen)
    every = _originals(inst)
    inst.verl = {name: orig for name, (_, orig, _) in every.items()}
    found = {name: hit for name, hit in every.items() if name in chosen}
    inst.version = _verl_version()
    if inst.version not in TESTED_VERSIONS:
        warnings.warn(
            f"stateshift.integrations.verl was tested with verl {', '.join(TESTED_VERSIONS)}, not {inst.version}",
            stacklevel=2,
        )
    for what, why in inst.skipped.items():
        warnings.warn(f"stateshift.integrations.verl.install: {what} left as is ({why})", stacklevel=2)
    SETTINGS.placement, SETTINGS.guard, SETTINGS.verl = placement, guard, inst.verl
    _bind_everywhere(inst, found)
    _CURRENT = inst
    _log.info("%s", inst)
    return inst


def uninstall() -> list[Replacement]:
    """Put verl's own functions back wherever ``install()`` replaced them; returns what it put back.

    A place that no longer holds the drop-in (rebound since) is left as it is, with a warning.
    States, homes and snapshot handles made meanwhile stay valid for the drop-ins, called directly.
    """
    global _CURRENT
    inst, _CURRENT = _CURRENT, None
    if inst is None:
        return []
    restored = []
    for r in inst.replaced:
        mod = sys.modules.get(r.module)
        if mod is None or getattr(mod, r.name, None) is not r.replacement:
            warnings.warn(f"{r.module}.{r.name} no longer holds the stateshift drop-in; left as is", stacklevel=2)
            continue
        setattr(mod, r.name, r.original)
        restored.append(r)
    SETTINGS.placement, SETTINGS.guard, SETTINGS.verl = "host", True, {}
    _log.info("stateshift: put back %d verl bindings", len(restored))
    return restored


def installed() -> Installation | None:
    """The current installation, or ``None``."""
    return _CURRENT
