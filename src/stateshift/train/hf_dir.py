"""A local Hugging Face model directory: its tokenizer and its weight files, checked before anything loads.

Nothing is ever downloaded (``local_files_only=True`` everywhere). A directory
holds ``config.json``, weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (or ``pytorch_model.bin``; none at all: the
model is initialised from the config), and a tokenizer (``tokenizer.json``
and/or ``tokenizer_config.json`` with its vocabulary files). A missing file
raises ``ModelDirError`` naming it, before transformers is asked to load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stateshift.errors import ModelDirError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of the model directory ``path`` (empty: none, initialise from ``config.json``).

    Raises:
        ModelDirError: no ``config.json``, an unreadable shard index, or a shard it lists is missing.
    """
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ModelDirError(root, "config.json", "missing (model.hf_path must be a local model directory)")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelDirError(root, index.name, f"not a shard index ({type(exc).__name__}: {exc})") from None
        for shard in shards:
            if not (root / shard).is_file():
                raise ModelDirError(root, shard, f"listed in {index.name} but missing")
        return [root / s for s in shards]
    return sorted(root.glob("*.safetensors")) or sorted(root.glob("pytorch_model*.bin"))


def load_tokenizer(path: str | Path) -> Any:
    """``AutoTokenizer`` of the local directory ``path``, which must name an end-of-sequence token.

    Returns:
        A transformers tokenizer; its ``eos_token_id`` is the rollouts' stop token.
    Raises:
        ModelDirError: the directory has no tokenizer file, transformers cannot load it, or it has no EOS token.
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelDirError(root, ".", "not a directory")
    if not any((root / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(root, "tokenizer.json", f"missing (no tokenizer file: one of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # a generic tokenizer (tokenizer.json as it is): loaded as such, not as the class config.json's model type
    # suggests (transformers 5 would rebuild it as e.g. a Qwen2 BPE tokenizer from the vocabulary alone)
    generic = _tokenizer_class(root) in ("TokenizersBackend", "PreTrainedTokenizerFast")
    try:
        tok = (PreTrainedTokenizerFast if generic else AutoTokenizer).from_pretrained(root, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelDirError(root, "tokenizer.json", f"transformers cannot load the tokenizer: {exc}") from exc
    if tok.eos_token_id is None:
        raise ModelDirError(root, "tokenizer_config.json",
                            "the tokenizer has no eos_token (the rollouts stop on it): set eos_token there")
    return tok


def _tokenizer_class(root: Path) -> str | None:
    try:
        return json.loads((root / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
