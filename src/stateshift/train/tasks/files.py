"""``task.name=file``: prompts from the user's own JSONL or Parquet files, a tokenizer, a reward by path.

Records: one JSON object per line (``.jsonl``; blank lines skipped) or one row
per Parquet row (``.parquet``, read with pyarrow). Fields are named by the
config and may be dotted into nested objects (``reward_model.ground_truth``,
verl's layout):

- ``task.prompt_key`` (default ``prompt``): the prompt text, or a list of chat
  messages (``{"role": ..., "content": ...}``);
- ``task.messages_key`` (optional): a field of chat messages to use instead;
- ``task.answer_key`` (default ``answer``): the ground truth handed to the
  reward (and the target of the supervised warm-up), optional per record.

Rendering: with ``task.chat_template`` on and a tokenizer that has a chat
template, the messages (a text prompt becomes one user message) go through
``apply_chat_template(..., add_generation_prompt=True)``; otherwise the text
is encoded as it is (chat messages then need a template: an error). Prompts
longer than ``task.max_prompt_len`` tokens are skipped, counted
(``skipped_long``) and reported in one warning per file: never truncated.

Order: training item number ``p`` of the run (``sample_at(p)``, ``p`` = the
queue's prompt counter) is row ``order(epoch)[offset]`` with ``epoch, offset =
divmod(p, rows)``; ``order(epoch)`` is a permutation seeded by ``(run.seed,
epoch)`` (or the file's order, ``task.shuffle=false``). The position is thus
a pure function of how many prompts were drawn, which checkpoints carry; a
resume continues at the same sample. Items are plain ints (row indices:
training rows first, then held-out rows), so a checkpoint holds no objects of
this module. Held-out rows are never trained on; evaluation reads the first
``task.heldout_size`` of them, greedily.
"""

from __future__ import annotations

import hashlib
import json
import random
import types
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from stateshift.errors import ConfigError

from ..reward import Reward


@dataclass(frozen=True, slots=True)
class FileSpec:
    """How records are read: the field names (``task.*_key``) and the prompt rules."""

    prompt_key: str = "prompt"
    messages_key: str = ""
    answer_key: str = "answer"
    max_prompt_len: int = 128
    chat_template: bool = True


@dataclass(frozen=True, slots=True)
class Row:
    """One usable record: where it is (``'<file>:<line>'``), its prompt tokens, its fields for the reward (a plain
    dict, so the task pickles -- a Ray queue actor receives it; the reward sees a read-only view)."""

    source: str
    prompt: tuple[int, ...]
    fields: dict[str, Any]

    @property
    def answer(self) -> Any:
        return self.fields.get("ground_truth")


def read_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line or row number, record)`` of every record of a JSONL or Parquet file, 1-based.

    Raises:
        ConfigError("data_file"): the file is missing, has an unknown extension, a malformed or non-object JSON line,
            cannot be read as Parquet, or holds no record.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError("data_file", "no such file", path=p)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        out = list(_jsonl(p))
    elif suffix in (".parquet", ".pq"):
        out = _parquet(p)
    else:
        raise ConfigError("data_file", f"unknown extension {suffix!r}: use .jsonl or .parquet", path=p)
    if not out:
        raise ConfigError("data_file", "empty: no records", path=p)
    return out


def _jsonl(p: Path) -> Any:
    with p.open("rb") as fh:  # bytes: a line that is not UTF-8 is named by its number, like any other bad line
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    "data_file", f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=p, line=number
                ) from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (
                ValueError,
                RecursionError,
            ) as exc:  # (nesting too deep, an integer of more digits than Python reads)
                why = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)[:80]
                raise ConfigError("data_file", f"malformed JSON ({why})", path=p, line=number) from None
            if not isinstance(rec, dict):
                raise ConfigError(
                    "data_file", f"a line must hold a JSON object, not {type(rec).__name__}", path=p, line=number
                )
            yield number, rec


def _parquet(p: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("data_file", "reading Parquet needs pyarrow: pip install 'stateshift[rl]'", path=p) from None
    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise ConfigError("data_file", f"not a readable Parquet file ({type(exc).__name__}: {exc})", path=p) from None
    return list(enumerate(rows, 1))


def lookup(record: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """``(found, value)`` of the dotted ``key`` in ``record`` (``a.b``: field ``b`` of the object ``a``)."""
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class PromptRenderer:
    """A record's prompt as token ids, by the ``FileSpec`` rules and the tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, spec: FileSpec) -> None:
        self.tok = tokenizer
        self.spec = spec
        self.templated = spec.chat_template and bool(getattr(tokenizer, "chat_template", None))

    def __call__(self, path: Path, line: int, rec: Mapping[str, Any]) -> list[int]:
        key = self.spec.messages_key or self.spec.prompt_key
        found, value = lookup(rec, key)
        config_key = "task.messages_key" if self.spec.messages_key else "task.prompt_key"
        if not found:
            raise ConfigError("data_file", f"no field {key!r} ({config_key})", path=path, line=line, key=key)
        texts = _texts(value)
        if any(isinstance(t, str) and not _encodable(t) for t in texts):  # (JSON's "\ud800": no tokenizer takes it)
            raise ConfigError("data_file", "a lone surrogate: not text", path=path, line=line, key=key)
        if isinstance(value, str) and not self.spec.messages_key:
            if not value.strip():
                raise ConfigError("data_file", "empty prompt", path=path, line=line, key=key)
            if not self.templated:
                return list(self.tok.encode(value))
            value = [{"role": "user", "content": value}]
        if not _is_messages(value):
            raise ConfigError(
                "data_file",
                f"field {key!r} must be a string or a list of {{'role', 'content'}} messages, "
                f"not {type(value).__name__}",
                path=path,
                line=line,
                key=key,
            )
        if not self.templated:
            raise ConfigError(
                "data_file",
                "chat messages need a chat template, and the tokenizer has none (or task.chat_template=false)",
                path=path,
                line=line,
                key=key,
            )
        text = self.tok.apply_chat_template(list(value), add_generation_prompt=True, tokenize=False)
        return list(self.tok.encode(text, add_special_tokens=False))


def _texts(value: Any) -> list[Any]:
    """The text a prompt field holds: itself, or its messages' contents."""
    if isinstance(value, str):
        return [value]
    return [m.get("content") for m in value if isinstance(m, Mapping)] if isinstance(value, list) else []


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )


def load_rows(path: str | Path, render: PromptRenderer, answer_key: str) -> tuple[list[Row], int]:
    """The usable rows of ``path`` and how many were skipped for a prompt over ``max_prompt_len`` tokens.

    Raises:
        ConfigError("data_file"): as ``read_records``, a missing or malformed prompt field, or every prompt too long.
    """
    p = Path(path)
    rows: list[Row] = []
    skipped: list[str] = []
    limit = render.spec.max_prompt_len
    for line, rec in read_records(p):
        ids = render(p, line, rec)
        if len(ids) > limit:
            skipped.append(f"{p.name}:{line} ({len(ids)} tokens)")
            continue
        fields = dict(rec)
        fields["ground_truth"] = lookup(rec, answer_key)[1]
        rows.append(Row(source=f"{p}:{line}", prompt=tuple(ids), fields=fields))
    if skipped:
        warnings.warn(
            f"{p}: skipped {len(skipped)} prompt(s) longer than task.max_prompt_len={limit} tokens "
            f"(first: {skipped[0]}); they are not truncated",
            stacklevel=2,
        )
    if not rows:
        raise ConfigError(
            "data_file",
            f"every prompt is longer than task.max_prompt_len={limit} tokens",
            path=p,
            key="task.max_prompt_len",
        )
    return rows, len(skipped)


class FileTask:
    """``Task`` over a training file and a held-out file (see the module docstring). Items are row indices."""

    def __init__(
        self,
        train_path: str,
        heldout_path: str,
        tokenizer: Any,
        reward: Reward,
        *,
        spec: FileSpec,
        seed: int,
        shuffle: bool = True,
        heldout_size: int = 500,
    ) -> None:
        render = PromptRenderer(tokenizer, spec)
        self.tokenizer, self.reward, self.spec, self.seed, self.shuffle = tokenizer, reward, spec, seed, shuffle
        self.train_path, self.heldout_path = str(train_path), str(heldout_path)
        train, skip_t = load_rows(train_path, render, spec.answer_key)
        held, skip_h = load_rows(heldout_path, render, spec.answer_key)
        self.rows = train + held
        self.n_train = len(train)
        self.n_heldout = min(len(held), heldout_size)
        #: prompts skipped for length, per file
        self.skipped_long = {"train": skip_t, "heldout": skip_h}
        self.train_sha256 = file_sha256(train_path)
        self.vocab_size = len(tokenizer)
        self.stop_token = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_token = int(pad) if pad is not None else self.stop_token
        self.max_prompt_len = spec.max_prompt_len

    # -- the Task protocol --------------------------------------------------------------------
    def sample(self, rng: random.Random) -> int:
        """A training row drawn uniformly by ``rng`` (the run itself reads them in order: ``sample_at``)."""
        return rng.randrange(self.n_train)

    def sample_at(self, position: int) -> int:
        """Training item number ``position`` of the run: each epoch visits every training row once."""
        epoch, offset = divmod(position, self.n_train)
        return self._order(epoch)[offset]

    def prompt(self, item: int) -> list[int]:
        return list(self.rows[item].prompt)

    def score(self, item: int, response: Sequence[int]) -> tuple[float, bool]:
        """(reward, correct) of ``response`` (token ids, the stop token included if produced), decoded."""
        row = self.rows[item]
        text = self.tokenizer.decode([t for t in response if t != self.stop_token], skip_special_tokens=True)
        return self.reward(text, types.MappingProxyType(row.fields), row.source)  # read-only for the user's function

    def heldout(self) -> list[int]:
        return list(range(self.n_train, self.n_train + self.n_heldout))

    def warmup_batch(self, rng: random.Random, size: int) -> list[tuple[list[int], list[int]]]:
        """(prompt, answer tokens + EOS) pairs of training rows, for the supervised warm-up (``warmup.steps``)."""
        out = []
        for _ in range(size):
            row = self.rows[rng.randrange(self.n_train)]
            if row.answer is None:
                raise ConfigError(
                    "data_file",
                    "the supervised warm-up needs an answer in every training record (or warmup.steps=0)",
                    path=row.source.rpartition(":")[0],
                    line=int(row.source.rpartition(":")[2]),
                    key=self.spec.answer_key,
                )
            ids = self.tokenizer.encode(str(row.answer), add_special_tokens=False)
            out.append((list(row.prompt), [*ids, self.stop_token]))
        return out

    # -- position in the data -------------------------------------------------------------------
    def position(self, drawn: int) -> dict[str, int | str]:
        """Where the run is after ``drawn`` prompts: epoch, offset in it, and the training file's hash."""
        epoch, offset = divmod(drawn, self.n_train)
        return {"samples": drawn, "epoch": epoch, "offset": offset, "train_sha256": self.train_sha256}

    def check_position(self, saved: Mapping[str, Any]) -> None:
        """A checkpoint's ``position`` must be of this training file (else the same position is another sample)."""
        if saved.get("train_sha256") not in (None, self.train_sha256):
            raise ConfigError(
                "data_file",
                "changed since the checkpoint was written (its sha256 differs): "
                "resuming would not continue at the same sample",
                path=self.train_path,
                key="task.train_path",
            )

    def _order(self, epoch: int) -> tuple[int, ...]:
        return _permutation(self.n_train, self.seed, epoch if self.shuffle else -1)


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """A permutation of ``range(n)`` fixed by ``(seed, epoch)``; ``epoch=-1``: the identity (no shuffling)."""
    order = list(range(n))
    if epoch >= 0:
        random.Random(f"stateshift-file-task:{seed}:{epoch}").shuffle(order)
    return tuple(order)
