"""Typed errors.

Every error raised for bad input is raised *before* anything is changed, so a
caught error leaves the model, its homes and every snapshot as they were.
Messages name the first offending tensor or setting.
"""

from __future__ import annotations


class StateShiftError(Exception):
    """Base class of every error raised by stateshift."""


class UnknownGroupError(StateShiftError, ValueError):
    """A group name that the model state does not have; the message lists the valid ones."""

    def __init__(self, group: str, valid: tuple[str, ...]) -> None:
        self.group = group
        self.valid = valid
        super().__init__(f"unknown group {group!r}; valid groups: {', '.join(valid) or '(none)'}")


class LayoutMismatchError(StateShiftError, ValueError):
    """A snapshot (or checkpoint) does not fit the model it is applied to.

    ``tensor`` names the first offending tensor; ``reason`` says what differs.
    """

    def __init__(self, tensor: str, reason: str) -> None:
        self.tensor = tensor
        self.reason = reason
        super().__init__(f"layout mismatch at tensor {tensor!r}: {reason}")


class ReleasedSnapshotError(StateShiftError, RuntimeError):
    """The snapshot was released; its memory may already hold other values."""


class OffloadedStateError(StateShiftError, RuntimeError):
    """Compute touched state whose device storage is released.

    Raised from hooks before any kernel runs, so the process (and its CUDA
    context) stays healthy: reading released storage from a kernel would be a
    sticky illegal-address fault on CUDA and a segmentation fault on the CPU.
    """

    def __init__(self, group: str, slot: str, residency: str, where: str) -> None:
        self.group = group
        self.slot = slot
        self.residency = residency
        super().__init__(
            f"{where} needs group {group!r} on the device, but it is not resident "
            f"(first: {slot!r} is {residency}); call onload({group!r}) first"
        )


class PinningUnavailableError(StateShiftError, RuntimeError):
    """Pinned host memory was asked for explicitly on a machine without an accelerator."""


class PoolBudgetError(StateShiftError, MemoryError):
    """The pinned host pool would exceed its byte budget."""


class SnapshotBudgetError(StateShiftError, MemoryError):
    """The snapshot store would exceed its byte budget."""


class SwapActiveError(StateShiftError, RuntimeError):
    """A verb touched groups that a ``swapped`` context currently holds."""


class ForeignStateError(StateShiftError, RuntimeError):
    """A tensor's device storage was released by someone else and no values can be found for it."""

    def __init__(self, tensor: str, detail: str) -> None:
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r}: {detail}")


class BackendError(StateShiftError, TypeError):
    """No backend knows the object, or a backend was given an object it cannot handle."""


class NotReleasableError(StateShiftError, RuntimeError):
    """A device tensor's storage cannot be resized in place, so it cannot be released."""

    def __init__(self, tensor: str, detail: str) -> None:
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r}: {detail}")
