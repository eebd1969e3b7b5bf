"""A built-in long-tail task: running sums of k two-digit numbers, every partial sum written out.

The response length is set by the prompt: ``7k`` tokens for ``k`` terms, with
``k`` log-uniform in ``[min_terms, max_terms]`` (2 and 64 by default: 14 to
448 tokens, most responses short, a long tail of long ones). It is the task
on which a fully-asynchronous trainer can show what it buys: a synchronous
step waits for its longest response.

Vocabulary of 16 characters: the digits, ``+``, ``=``, ``,``, ``$`` (the stop
token), ``.`` (padding) and ``_`` (filler). Numbers are written
least-significant digit first throughout. A prompt has ``max_terms`` slots of
7 tokens, as many as the answer spends per term: a term's two digits, ``+``
(``=`` after the last term) and four ``_``; the slots after the last term
are all ``_``. Every prompt is thus ``7 * max_terms`` tokens long. The answer
is, for each ``i = 1..k``, the term ``a_i`` copied, then the partial sum
``a_1 + .. + a_i`` as four digits, then ``,`` (``$`` after the last one).
The copy of a term digit sits exactly ``7 * max_terms`` positions after the
digit in the prompt (one constant offset, which learned absolute positions
find), and every input of a sum digit is a fixed few tokens back (the copied
term's digit, the previous partial sum's digit 7 back, the carry out of the
digit just written), as in the addition task::

    prompt   21+____70+____99=____ _______...      (12, 07, 99: k = 3 of max_terms slots)
    answer   212100,709100,998110$                 (21|2100, 70|9100, 99|8110: 12, 19, 118)

Reward: 1 for the exact answer (every copy and partial sum right, ending with
``$``), plus ``partial_credit`` times the fraction of partial sums right in place,
plus ``stop_credit`` for a response ending with the stop token. Accuracy
counts exact answers only.

Held-out problems: those whose terms hash into one tenth of the space;
training and warm-up draws reject them. The supervised warm-up's easy cases
have at most ``warmup_max_terms`` terms (log-uniform below that).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

VOCAB = "0123456789+=,$._"
STOP = VOCAB.index("$")
PAD = VOCAB.index(".")
SEP = VOCAB.index(",")
EMPTY = VOCAB.index("_")
#: digits of each partial sum (99 * 101 < 10**4)
SUM_DIGITS = 4
#: digits of a term
TERM_DIGITS = 2
#: tokens per term in the answer: the term copied, the partial sum's digits, the separator (or the stop token)
PER_TERM = TERM_DIGITS + SUM_DIGITS + 1
MAX_TERMS_LIMIT = 101


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def is_heldout(terms: Sequence[int]) -> bool:
    """One tenth of all problems, by a multiplicative hash of the terms."""
    h = 0
    for t in terms:
        h = (h * 131 + t + 1) % (1 << 61)
    return (h * 2654435761 >> 7) % 10 == 0


def log_uniform_k(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]`` with ``P(k) ~ log((k + 1) / k)`` (uniform in log k)."""
    return min(int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))), hi)


@dataclass(frozen=True, slots=True)
class Sums:
    """One problem: its terms, and the prompt's number of slots."""

    terms: tuple[int, ...]
    slots: int

    @property
    def prompt(self) -> list[int]:
        fill = "_" * (PER_TERM - TERM_DIGITS - 1)
        parts = [f"{t:02d}"[::-1] + "+" + fill for t in self.terms[:-1]] + [f"{self.terms[-1]:02d}"[::-1] + "=" + fill]
        return encode("".join(parts) + "_" * (PER_TERM * (self.slots - len(self.terms))))

    @property
    def partials(self) -> list[int]:
        out, total = [], 0
        for t in self.terms:
            total += t
            out.append(total)
        return out

    @property
    def answer(self) -> list[int]:
        parts = [f"{t:02d}"[::-1] + f"{s:0{SUM_DIGITS}d}"[::-1] for t, s in zip(self.terms, self.partials, strict=True)]
        return encode(",".join(parts) + "$")


def score(problem: Sums, response: Sequence[int], partial_credit: float, stop_credit: float) -> tuple[float, bool]:
    """(reward, exact) of one response (generated tokens, the stop token included if produced)."""
    want = problem.answer
    exact = list(response[: len(want)]) == want and len(response) >= len(want)
    right = 0
    for i in range(len(problem.terms)):
        at = i * PER_TERM + TERM_DIGITS
        right += list(response[at : at + SUM_DIGITS]) == want[at : at + SUM_DIGITS]
    stopped = len(response) > 0 and response[-1] == STOP
    return (1.0 if exact else 0.0) + partial_credit * right / len(problem.terms) + stop_credit * stopped, exact


class LongTailTask:
    """The long-tail task behind the ``Task`` protocol (``train/tasks/base.py``)."""

    vocab_size = len(VOCAB)
    stop_token = STOP
    pad_token = PAD

    def __init__(
        self,
        *,
        min_terms: int = 2,
        max_terms: int = 64,
        warmup_max_terms: int = 8,
        partial_credit: float = 0.2,
        stop_credit: float = 0.1,
        heldout_size: int = 500,
    ) -> None:
        if not 1 <= min_terms <= warmup_max_terms <= max_terms <= MAX_TERMS_LIMIT:
            raise ValueError(
                f"need 1 <= min_terms ({min_terms}) <= warmup_max_terms ({warmup_max_terms}) <= "
                f"max_terms ({max_terms}) <= {MAX_TERMS_LIMIT}"
            )
        self.min_terms, self.max_terms, self.warmup_max_terms = min_terms, max_terms, warmup_max_terms
        self.partial_credit, self.stop_credit, self.heldout_size = partial_credit, stop_credit, heldout_size

    @property
    def max_prompt_len(self) -> int:
        return PER_TERM * self.max_terms

    @property
    def max_response_len(self) -> int:
        return PER_TERM * self.max_terms

    def draw(self, rng: random.Random, hi: int | None = None) -> Sums:
        """A training problem (never a held-out one) of at most ``hi`` (default ``max_terms``) terms."""
        while True:
            k = log_uniform_k(rng, self.min_terms, hi or self.max_terms)
            terms = tuple(rng.randrange(100) for _ in range(k))
            if not is_heldout(terms):
                return Sums(terms, self.max_terms)

    def sample(self, rng: random.Random) -> Sums:
        return self.draw(rng)

    def prompt(self, item: Sums) -> list[int]:
        return item.prompt

    def score(self, item: Sums, response: Sequence[int]) -> tuple[float, bool]:
        return score(item, response, self.partial_credit, self.stop_credit)

    def heldout(self) -> list[Sums]:
        """``heldout_size`` held-out problems, fixed (seed 12345, independent of the run's seed)."""
        rng = random.Random(12345)
        out: list[Sums] = []
        while len(out) < self.heldout_size:
            k = log_uniform_k(rng, self.min_terms, self.max_terms)
            terms = tuple(rng.randrange(100) for _ in range(k))
            if is_heldout(terms):
                out.append(Sums(terms, self.max_terms))
        return out

    def warmup_batch(self, rng: random.Random, size: int) -> list[tuple[list[int], list[int]]]:
        """(prompt, answer) pairs of easy training problems (at most ``warmup_max_terms`` terms)."""
        return [(p.prompt, p.answer) for p in (self.draw(rng, self.warmup_max_terms) for _ in range(size))]
