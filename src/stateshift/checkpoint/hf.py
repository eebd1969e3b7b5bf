"""Export a plain torch / Hugging Face model's weights under their ``state_dict`` names (``model.safetensors``).

Tied duplicates are written once (the name ``transformers`` declares tied is dropped, as ``save_pretrained``
does); values come from a host snapshot, so the model may live anywhere; the file replaces any previous
one atomically (``commit.replacing``).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..backends.torch import state_dict_names, unwrap
from ..errors import LayoutError
from .commit import make_parents, os_failure, replacing
from .format import Record, write_file


def _module_of(state: Any) -> torch.nn.Module:
    refusals = []
    for b in state.backends:
        facts = b.checkpoint_facts()
        if facts.export_refusal is not None:
            refusals.append(facts.export_refusal)
        elif facts.module is not None:
            return facts.module
    raise LayoutError(
        "checkpoint_mismatch",
        refusals[0] if refusals else "no backend of this state exports nn.Module weights",
        tensor="(model)",
    )


def _tied_targets(module: torch.nn.Module) -> list[re.Pattern[str]]:
    """Names (or patterns) that Hugging Face drops when saving tied weights."""
    expanded = getattr(module, "all_tied_weights_keys", None)  # transformers >= 5: {target: source}
    if isinstance(expanded, Mapping):
        return [re.compile(re.escape(k)) for k in expanded]
    keys = getattr(module, "_tied_weights_keys", None)  # transformers 4: names or patterns; 5: {target: source}
    return [re.compile(str(k)) for k in keys] if isinstance(keys, (Mapping, list, tuple, set)) else []


def _records(module: torch.nn.Module, views: Mapping[str, torch.Tensor]) -> list[Record]:
    """One record per ``state_dict`` name, a tied duplicate once (the name HF does not drop)."""
    names = state_dict_names(module)  # reads no values and passes no guard: safe while offloaded
    missing = [n for n in names if n not in views]
    if missing:
        raise LayoutError(
            "checkpoint_mismatch", "in the model's state_dict but not tracked by its state", tensor=missing[0]
        )
    tied = _tied_targets(module)
    by_place: dict[tuple[Any, ...], list[str]] = {}
    for n in names:
        v = views[n]  # (empty tensors share a pointer and are tied to none)
        by_place.setdefault(
            (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype) if v.numel() else (n,), []
        ).append(n)
    keep = set()
    for dup in by_place.values():
        free = [n for n in dup if not any(p.search(n) for p in tied)]
        keep.add((free or dup)[0])
    records = [Record.from_tensor(n, views[n].contiguous()) for n in names if n in keep]
    for r in records:
        r.validate()
    return records


def export_hf(
    model: Any,
    directory: str | os.PathLike[str],
    *,
    filename: str = "model.safetensors",
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write the weights of ``model`` (an ``nn.Module`` or a ``ModelState``) to ``directory/filename``.

    Returns the file's path. Raises ``CheckpointError("write")`` (full disk ...) with any previous
    file of that name intact; ``LayoutError("checkpoint_mismatch")`` for a sharded model (FSDP2: gather it
    with ``get_model_state_dict(full_state_dict=True)`` first).
    """
    from ..core.state import ModelState

    if "/" in filename or filename.startswith(".") or not filename:
        raise ValueError(f"invalid file name {filename!r}")
    own = not isinstance(model, ModelState)
    state = ModelState(model, guard=False) if own else model
    try:
        module = unwrap(_module_of(state))
        groups = tuple(g for g in ("params", "buffers") if g in state.groups)
        snap = state.snapshot(groups, tag=f"_export-{uuid.uuid4().hex[:12]}", placement="host")
        try:
            records = _records(module, dict(snap.wait().views()))
            final = Path(directory) / filename
            make_parents(final.parent)
            try:
                with replacing(final) as tmp:
                    write_file(str(tmp), records, metadata={"format": "pt", **dict(metadata or {})})
            except OSError as e:
                kept = f" The previous '{filename}' is intact." if final.exists() else ""
                raise os_failure("write", e, f"writing '{filename}'", f".{kept}", final) from e
            return final
        finally:
            state.release(snap)
    finally:
        if own:
            state.close()
