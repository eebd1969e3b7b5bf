"""``raises_kind``: ``pytest.raises`` for a stateshift error of one class *and* one kind."""

from __future__ import annotations

from typing import Any

import pytest


def raises_kind(cls: type[BaseException], kind: str, *, match: str | None = None) -> Any:
    """``pytest.raises(cls, match=match)`` that also requires ``error.kind == kind`` (the failure names the kind
    that came instead)."""

    def check(e: BaseException) -> bool:
        assert getattr(e, "kind", None) == kind, (
            f"{type(e).__name__} of kind {getattr(e, 'kind', None)!r}, expected {kind!r}: {e}"
        )
        return True

    return pytest.raises(cls, match=match, check=check)
