"""The backward guard's hook as the autograd engine calls it: from a Python thread (the CPU) or from a
thread with no Python frame under it (CUDA's device threads)."""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable

import torch

from stateshift.backends.guards import backward_guard


def _hook_of(check: Callable[..., None]) -> Callable[..., None]:
    """The hook ``backward_guard`` registers on a forward's output."""
    hooks = []
    out = torch.ones(2, requires_grad=True) * 2
    out.register_hook = hooks.append  # type: ignore[method-assign]
    backward_guard(check, list, "test")(torch.nn.Identity(), (), out)
    return hooks[0]


def test_backward_hook_on_a_thread_without_python_frames_checks_and_does_not_raise():
    checked, done = [], threading.Event()

    def check(tensors, where) -> None:
        checked.append(where)
        done.set()

    hook = _hook_of(check)
    _thread.start_new_thread(hook, (torch.zeros(2),))  # the hook is the thread's only Python frame
    assert done.wait(5), "the hook raised before its check (see the unraisable exception above)"
    assert checked == ["test"]
