"""A local Hugging Face model directory: its tokenizer and its weight files, checked before anything loads.

Nothing is ever downloaded (``local_files_only=True`` everywhere). A directory
holds ``config.json``, weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (or ``pytorch_model.bin``; none at all: the
model is initialised from the config), and a tokenizer (``tokenizer.json``
and/or ``tokenizer_config.json`` with its vocabulary files). A missing file
raises ``ConfigError("model_dir")`` naming it, before transformers is asked to load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stateshift.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of the model directory ``path`` (empty: none, initialise from ``config.json``).

    Raises:
        ConfigError("model_dir"): no ``config.json``, an unreadable shard index, or a shard it lists is missing.
    """
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ConfigError(
            "model_dir", "missing (model.hf_path must be a local model directory)", path=root, name="config.json"
        )
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                "model_dir", f"not a shard index ({type(exc).__name__}: {exc})", path=root, name=index.name
            ) from None
        for shard in shards:
            if not (root / shard).is_file():
                raise ConfigError("model_dir", f"listed in {index.name} but missing", path=root, name=shard)
        return [root / s for s in shards]
    return sorted(root.glob("*.safetensors")) or sorted(root.glob("pytorch_model*.bin"))


def refuse_own_code(root: Path, *names: str) -> None:
    """``ConfigError("model_dir")`` if one of the JSON files ``names`` of the model directory ``root`` asks for code of
    the directory's own (``auto_map``): transformers would run it (asking first on a terminal), stateshift never does."""
    for name in names:
        if not (root / name).is_file():  # (missing, or a FIFO that a read would wait on: transformers says which)
            continue
        try:
            conf = json.loads((root / name).read_text())
        except (OSError, ValueError, RecursionError):
            continue  # (not JSON: what transformers then says is the error)
        if isinstance(conf, dict) and "auto_map" in conf:
            raise ConfigError(
                "model_dir",
                "asks for code of the directory's own (auto_map), which stateshift never runs: use a model of a type "
                "transformers knows",
                path=root,
                name=name,
            )


def load_tokenizer(path: str | Path) -> Any:
    """``AutoTokenizer`` of the local directory ``path``, which must name an end-of-sequence token.

    Returns:
        A transformers tokenizer; its ``eos_token_id`` is the rollouts' stop token.
    Raises:
        ConfigError("model_dir"): the directory has no tokenizer file, transformers cannot load it, it has no EOS
            token, or it asks for code of its own (``refuse_own_code``).
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError("model_dir", "not a directory", path=root, name=".")
    if not any((root / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            "model_dir",
            f"missing (no tokenizer file: one of {', '.join(TOKENIZER_FILES)})",
            path=root,
            name="tokenizer.json",
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # a generic tokenizer (tokenizer.json as it is): loaded as such, not as the class config.json's model type
    # suggests (transformers 5 would rebuild it as e.g. a Qwen2 BPE tokenizer from the vocabulary alone)
    generic = _tokenizer_class(root) in ("TokenizersBackend", "PreTrainedTokenizerFast")
    refuse_own_code(root, "tokenizer_config.json", "config.json")
    try:
        tok = (PreTrainedTokenizerFast if generic else AutoTokenizer).from_pretrained(
            root, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # (whatever a broken file makes transformers or tokenizers raise)
        raise ConfigError(
            "model_dir", f"transformers cannot load the tokenizer: {str(exc)[:300]}", path=root, name="tokenizer.json"
        ) from exc
    if tok.eos_token_id is None:
        raise ConfigError(
            "model_dir",
            "the tokenizer has no eos_token (the rollouts stop on it): set eos_token there",
            path=root,
            name="tokenizer_config.json",
        )
    return tok


def _tokenizer_class(root: Path) -> str | None:
    try:
        return json.loads((root / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
