"""Rewards of ``task.name=file``: a function named by path, or a built-in verifier.

``reward.fn`` is either a built-in name or ``package.module:function``. The
function is imported once, when the task is built (in each process that
scores: the rollouter's), and called as ``fn(response, sample)``:

- ``response``: the decoded response (special tokens, the stop token
  included, left out);
- ``sample``: a read-only mapping of the sample's fields as its file holds
  them, plus ``ground_truth`` (the ``task.answer_key`` field's value, ``None``
  if the record has none).

It returns a number, or a dict with a ``score`` number (and optionally
``acc``, a bool: whether the response counts as correct for the accuracy
metrics; without it, a response is correct when its score is at least
``reward.correct_at``). Built-ins:

- ``exact_match``: 1.0 if the response, stripped, equals the ground truth as
  a string, stripped; else 0.0;
- ``numeric``: 1.0 if the final answer -- the last ``\\boxed{...}`` if there
  is one, else the last number in the response -- equals the ground truth as
  a number (within 1e-6 relative); else 0.0.

A function that raises, or returns something that is not a finite score,
raises ``RunError("reward")`` naming the sample (``'<file>:<line>'``); with
``reward.on_error=zero`` it counts a zero reward instead (``zeroed``, in the
metrics as ``reward_zeroed_total``).
"""

from __future__ import annotations

import importlib
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from stateshift.errors import RunError

#: ``fn(response, sample) -> float | dict``
RewardFn = Callable[[str, Mapping[str, Any]], Any]

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def exact_match(response: str, sample: Mapping[str, Any]) -> float:
    """1.0 if ``response.strip() == str(ground_truth).strip()``, else 0.0."""
    truth = sample.get("ground_truth")
    return 1.0 if truth is not None and response.strip() == str(truth).strip() else 0.0


def final_number(text: str) -> float | None:
    r"""The last ``\boxed{...}``'s number if there is one, else the last number of ``text``; ``None`` if none."""
    boxed = _last_boxed(text)
    found = _NUMBER.findall(boxed if boxed is not None else text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (nested braces matched), or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def numeric(response: str, sample: Mapping[str, Any]) -> float:
    """1.0 if ``final_number(response)`` equals the ground truth as a number (1e-6 relative), else 0.0."""
    got = final_number(response)
    truth = sample.get("ground_truth")
    want = final_number(str(truth)) if truth is not None else None
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) else 0.0


BUILTIN: dict[str, RewardFn] = {"exact_match": exact_match, "numeric": numeric}


def load_reward_fn(spec: str) -> RewardFn:
    """The function ``spec`` names: a key of ``BUILTIN``, or ``package.module:function``.

    Raises:
        RunError("reward"): the spec is malformed, its module does not import, or it has no such callable.
    """
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RunError("reward", f"is neither a built-in ({', '.join(BUILTIN)}) nor 'package.module:function'", fn=spec)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's module's, reported as such
        raise RunError(
            "reward", f"module {module_name!r} does not import: {type(exc).__name__}: {exc}", fn=spec
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RunError("reward", f"module {module_name!r} has no callable {attr!r}", fn=spec)
    return fn


class Reward:
    """``reward.fn`` loaded once, with the error policy and counters (score time, zeroed errors).

    ``__call__`` may run on several threads (the rollouter's, and the trainer's when it evaluates); the
    counters are updated under a lock, so they are exact. The function is reloaded lazily after the
    object is unpickled (a Ray actor builds its own).
    """

    def __init__(self, spec: str, *, on_error: str = "raise", correct_at: float = 1.0) -> None:
        self.spec = spec
        self.on_error = on_error
        self.correct_at = correct_at
        self.fn: RewardFn | None = load_reward_fn(spec)
        self._lock = threading.Lock()
        #: seconds spent in the function, and errors turned into a zero reward (``on_error=zero``)
        self.seconds = 0.0
        self.zeroed = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["fn"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, response: str, sample: Mapping[str, Any], sample_id: str) -> tuple[float, bool]:
        """(score, correct) of ``response``; ``RunError("reward")`` naming ``sample_id`` (or a counted zero) on failure."""
        if self.fn is None:
            self.fn = load_reward_fn(self.spec)
        t0 = time.perf_counter()
        try:
            out = self._checked(self.fn(response, sample))
        except Exception as exc:  # the user's function: any failure is reported with the sample
            with self._lock:
                self.seconds += time.perf_counter() - t0
                if self.on_error != "zero":
                    raise RunError("reward", f"{type(exc).__name__}: {exc}", fn=self.spec, sample=sample_id) from exc
                self.zeroed += 1
            return 0.0, False
        with self._lock:
            self.seconds += time.perf_counter() - t0
        return out

    def _checked(self, value: Any) -> tuple[float, bool]:
        acc = None
        if isinstance(value, Mapping):
            if "score" not in value:
                raise ValueError(f"returned a dict without 'score' (keys: {sorted(value)})")
            acc = value.get("acc")
            value = value["score"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise TypeError(f"returned {type(value).__name__} {value!r}, not a number")
        score = float(value)
        if not math.isfinite(score):
            raise ValueError(f"returned a non-finite score {score}")
        return score, bool(acc) if acc is not None else score >= self.correct_at
