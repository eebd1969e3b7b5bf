"""Export a plain torch / Hugging Face model's weights under their usual names.

``export_hf(model_or_state, directory)`` writes ``<directory>/model.safetensors``:
every parameter and persistent buffer under its ``state_dict`` name, as a
typed contiguous tensor, tied duplicates written once (the name Hugging Face
``transformers`` declares as tied is dropped, as ``save_pretrained`` does;
otherwise the first name is kept). The file loads with
``safetensors.torch.load_file`` and with ``transformers``'
``from_pretrained`` (next to the model's ``config.json``), as it is.

Values come from a host snapshot, so the model may be on the GPU, offloaded
or mixed; nothing is brought back to the device. The file is written to a
temporary name, fsynced and renamed into place; other files in ``directory``
(``config.json``, tokenizer files) are left alone.
"""

from __future__ import annotations

import os
import re
import secrets
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .atomic import _fsync_dir, _space_error_detail
from .format import (
    CheckpointMismatchError,
    CheckpointWriteError,
    TensorRecord,
    write_safetensors,
)

__all__ = ["export_hf"]


def _module_of(state: Any) -> torch.nn.Module:
    refusals = []
    for b in state.backends:
        facts = b.checkpoint_facts()
        if facts.export_refusal is not None:
            refusals.append(facts.export_refusal)
        elif facts.module is not None:
            return facts.module
    raise CheckpointMismatchError("(model)", refusals[0] if refusals else "no backend of this state exports nn.Module weights")


def _tied_targets(module: torch.nn.Module) -> list[str]:
    """Names (or patterns) that Hugging Face drops when saving tied weights."""
    expanded = getattr(module, "all_tied_weights_keys", None)  # transformers >= 5: {target: source}
    if isinstance(expanded, Mapping):
        return [re.escape(k) for k in expanded]
    keys = getattr(module, "_tied_weights_keys", None)  # transformers 4: list of names/patterns; 5: {target: source}
    if isinstance(keys, Mapping):
        return list(keys)
    if isinstance(keys, (list, tuple, set)):
        return [str(k) for k in keys]
    return []


def export_hf(
    model: Any,
    directory: str | os.PathLike[str],
    *,
    filename: str = "model.safetensors",
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write the weights of ``model`` (an ``nn.Module`` or a ``ModelState``) to ``directory/filename``.

    Returns the file's path. Raises :class:`CheckpointWriteError` (full
    disk ...) with any previous file of that name intact.
    """
    from ..backends.torch import state_dict_names, unwrap
    from ..core.state import ModelState

    own_state = not isinstance(model, ModelState)
    state = ModelState(model, guard=False) if own_state else model
    try:
        module = unwrap(_module_of(state))
        names = state_dict_names(module)  # reads no values: safe while offloaded
        groups = tuple(g for g in ("params", "buffers") if g in state.groups)
        snap = state.snapshot(groups, tag=f"_export-{uuid.uuid4().hex[:12]}", placement="host")
        try:
            snap.wait()
            views = dict(snap.views())
            missing = [n for n in names if n not in views]
            if missing:
                raise CheckpointMismatchError(missing[0], "in the model's state_dict but not tracked by its state")
            tied = [re.compile(p) for p in _tied_targets(module)]
            by_key: dict[tuple[Any, ...], list[str]] = {}
            for n in names:
                v = views[n]
                key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype)
                by_key.setdefault(key, []).append(n)
            keep: set[str] = set()
            for dup in by_key.values():
                free = [n for n in dup if not any(p.fullmatch(n) or p.search(n) for p in tied)]
                keep.add((free or dup)[0])
            records = []
            for n in names:
                if n not in keep:
                    continue
                v = views[n]
                records.append(TensorRecord.from_tensor(n, v if v.is_contiguous() else v.contiguous()))
            meta = {"format": "pt", **dict(metadata or {})}
            return _write_file(Path(directory), filename, records, meta)
        finally:
            state.release(snap)
    finally:
        if own_state:
            state.close()


def _write_file(directory: Path, filename: str, records: list[TensorRecord], meta: dict[str, str]) -> Path:
    if "/" in filename or filename.startswith("."):
        raise ValueError(f"invalid file name {filename!r}")
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / filename
    tmp = directory / f".{filename}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write_safetensors(tmp, records, metadata=meta)
        os.rename(tmp, final)
        _fsync_dir(directory)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        kept = f"The previous '{filename}' is intact." if final.exists() else ""
        raise CheckpointWriteError(final, f"{_space_error_detail(e)} while writing '{filename}'. {kept}".strip(), e.errno) from e
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return final
