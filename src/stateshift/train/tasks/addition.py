"""The built-in task: procedural 3-digit addition.

Vocabulary of 14 characters: the digits, ``+``, ``=``, ``$`` (end of answer,
the stop token) and ``.`` (padding). A prompt is ``abc+def=`` (always three
digits per operand, leading zeros kept: 8 tokens); the answer is the sum's
four digits **least-significant first**, then ``$`` -- so ``123+459=`` asks
for ``2850$`` (582 read backwards, with the thousands digit 0). Written that
way, each answer digit depends only on the digits already written and the
carry, which a 2-layer model can learn.

Reward: 1 for an exact answer, plus a small credit (``digit_credit``, 0.05)
per correct digit in place, so a group whose members differ in a single
digit still has a signal, plus ``stop_credit`` (0.1) for a response that
ends with the stop token. Accuracy counts exact answers only.

Held-out prompts: the problems ``(a, b)`` whose hash falls in the held-out
tenth of the space. Training prompts are drawn from the other nine tenths
(rejection sampling), so no held-out prompt is ever trained on; the held-out
evaluation set is a fixed sample of the held-out tenth.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

VOCAB = "0123456789+=$."
STOP = VOCAB.index("$")
PAD = VOCAB.index(".")
PROMPT_LEN = 8
ANSWER_DIGITS = 4
#: answer digits plus the stop token
RESPONSE_LEN = ANSWER_DIGITS + 1


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def is_heldout(a: int, b: int) -> bool:
    """One tenth of all problems, spread over the whole space (a multiplicative hash, not a range)."""
    return ((a * 1000 + b) * 2654435761 >> 7) % 10 == 0


def has_carry(a: int, b: int) -> bool:
    return any((a // 10**i % 10) + (b // 10**i % 10) >= 10 for i in range(3))


@dataclass(frozen=True, slots=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> list[int]:
        return encode(f"{self.a:03d}+{self.b:03d}=")

    @property
    def answer(self) -> list[int]:
        return encode(f"{self.a + self.b:04d}"[::-1] + "$")


def draw(rng: random.Random, *, easy: bool = False) -> Problem:
    """A training problem (never a held-out one); ``easy``: no carry in any digit."""
    while True:
        a, b = rng.randrange(1000), rng.randrange(1000)
        if not is_heldout(a, b) and not (easy and has_carry(a, b)):
            return Problem(a, b)


def heldout_set(size: int, seed: int = 12345) -> list[Problem]:
    """``size`` distinct held-out problems (fixed by ``seed``, independent of the run's seed)."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    out: list[Problem] = []
    while len(out) < size:
        a, b = rng.randrange(1000), rng.randrange(1000)
        if is_heldout(a, b) and (a, b) not in seen:
            seen.add((a, b))
            out.append(Problem(a, b))
    return out


def score(
    problem: Problem, response: Sequence[int], digit_credit: float = 0.05, stop_credit: float = 0.0
) -> tuple[float, bool]:
    """(reward, exact) of one response (generated tokens, the stop token included if produced)."""
    want = problem.answer
    exact = list(response[: len(want)]) == want
    digits = sum(1 for i in range(min(len(response), ANSWER_DIGITS)) if response[i] == want[i])
    stopped = len(response) > 0 and response[-1] == STOP
    return (1.0 if exact else 0.0) + digit_credit * digits + stop_credit * stopped, exact


class AdditionTask:
    """The addition task behind the ``Task`` protocol (``train/tasks/base.py``)."""

    vocab_size = len(VOCAB)
    stop_token = STOP
    pad_token = PAD

    #: prompt tokens and the longest answer (the model's positions follow from them)
    max_prompt_len = PROMPT_LEN
    max_response_len = RESPONSE_LEN

    def __init__(self, *, digit_credit: float = 0.05, heldout_size: int = 500, stop_credit: float = 0.0) -> None:
        self.digit_credit = digit_credit
        self.stop_credit = stop_credit
        self.heldout_size = heldout_size

    def sample(self, rng: random.Random) -> Problem:
        return draw(rng)

    def prompt(self, item: Problem) -> list[int]:
        return item.prompt

    def score(self, item: Problem, response: Sequence[int]) -> tuple[float, bool]:
        return score(item, response, self.digit_credit, self.stop_credit)

    def heldout(self) -> list[Problem]:
        return heldout_set(self.heldout_size)

    def warmup_batch(self, rng: random.Random, size: int) -> list[tuple[list[int], list[int]]]:
        """(prompt, answer) pairs of easy (no-carry) training problems for the supervised warm-up."""
        return [(p.prompt, p.answer) for p in (draw(rng, easy=True) for _ in range(size))]
