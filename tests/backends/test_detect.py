"""Backend detection: what no backend knows is a ``ObjectError("backend")`` saying what was given and what is expected."""

from __future__ import annotations

import pytest
from helpers import make
from raises import raises_kind

from stateshift import ModelState
from stateshift.errors import ObjectError


@pytest.mark.parametrize(
    "model", [42, "a string", [1, 2], None, object()], ids=["int", "str", "list", "None", "object"]
)
def test_model_state_of_something_that_is_not_a_module_is_a_backend_error(model):
    with raises_kind(ObjectError, "backend", match="nn.Module"):
        ModelState(model)


def test_model_state_of_a_module_with_an_unknown_optimizer_is_a_backend_error():
    model, _ = make("cpu")
    with raises_kind(ObjectError, "backend", match="optimizer of type builtins.int"):
        ModelState(model, 7)
