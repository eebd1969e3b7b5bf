"""What the loop needs from a task: prompts to draw, a score, a held-out set, its special tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Task(Protocol):
    """A prompt distribution with a verifiable reward."""

    #: tokens the model must have
    vocab_size: int
    stop_token: int
    pad_token: int
    #: longest prompt in tokens: a policy sizes its positions as this plus ``rollout.max_new_tokens``
    max_prompt_len: int

    def sample(self, rng: random.Random) -> Any:
        """A training item (never a held-out one)."""
        ...

    def prompt(self, item: Any) -> list[int]: ...

    def score(self, item: Any, response: Sequence[int]) -> tuple[float, bool]:
        """(reward, exact) of one response."""
        ...

    def heldout(self) -> list[Any]: ...


def training_item(task: Task, rng: random.Random, position: int) -> Any:
    """Training item number ``position`` of a run: ``task.sample_at(position)`` for a task that reads its prompts
    in a fixed order (``task.name=file``: the position is then all a checkpoint needs to continue at the same
    sample), else ``task.sample(rng)``."""
    at = getattr(task, "sample_at", None)
    return at(position) if at is not None else task.sample(rng)
