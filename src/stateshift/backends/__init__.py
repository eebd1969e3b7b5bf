"""Backends: the only code that knows a framework's object layout (the contract: ``base.py``).

``REGISTRY`` maps a name to the module that implements a framework, in
detection order (the most specific first). Each module has a
``detect(model, optimizer)`` that returns its backends, or ``None`` when
the objects are not its framework's. Importing this package registers
``detect_backends`` with the engine, which is how ``ModelState(model,
optimizer)`` finds them.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn  # (not ``import torch``: importing the submodule ``backends.torch`` rebinds that name here)

from ..core.source import set_detector
from ..errors import ObjectError
from .base import Backend, CheckpointFacts, Detector, Rebuild

#: detection order: the most specific framework first
REGISTRY: dict[str, str] = {
    "megatron": "stateshift.backends.megatron",
    "fsdp2": "stateshift.backends.fsdp2",
    "torch": "stateshift.backends.torch",
}


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def detect_backends(model: Any, optimizer: Any = None) -> list[Backend]:
    """The backends for ``model`` (and ``optimizer``), by the first registered module that recognises them.

    Raises ``ObjectError("backend")`` naming what was not recognised: the model, or the
    optimizer when the model alone is known.
    """
    for module_path in REGISTRY.values():
        detect: Detector = importlib.import_module(module_path).detect
        found = detect(model, optimizer)
        if found is not None:
            return list(found)
    if optimizer is not None:
        for module_path in REGISTRY.values():
            if importlib.import_module(module_path).detect(model, None) is not None:
                raise ObjectError(
                    "backend",
                    f"the model is known, but no backend knows an optimizer of type {_describe(optimizer)} "
                    "(a torch.optim.Optimizer or a Megatron optimizer is expected)",
                )
    kind = "a list of modules" if isinstance(model, (list, tuple)) else f"a model of type {_describe(model)}"
    hint = "" if isinstance(model, nn.Module) else " (an nn.Module, Megatron chunks or an FSDP2 model is expected)"
    raise ObjectError("backend", f"no backend knows {kind}{hint}")


set_detector(detect_backends)

__all__ = ["REGISTRY", "Backend", "CheckpointFacts", "Detector", "Rebuild", "detect_backends"]
