"""The lock every verb of a ``ModelState`` runs under (verbs may be called from several threads)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ClosedStateError

_F = TypeVar("_F", bound=Callable[..., Any])


def locked(fn: _F) -> _F:
    """Run a verb under the state's lock, after checking the state is open."""

    @functools.wraps(fn)
    def verb(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                raise ClosedStateError(f"ModelState was closed; {fn.__name__}() needs a new one")
            return fn(self, *args, **kwargs)

    return verb  # type: ignore[return-value]
