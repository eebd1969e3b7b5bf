"""Typed errors.

Every error raised for bad input is raised *before* anything is changed, so a
caught error leaves the model, its homes and every snapshot as they were.
Messages name the first offending tensor or setting.
"""

from __future__ import annotations

import os
import reprlib
from typing import Any


def _bounded_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxlong, r.maxother = 2, 60, 40, 60
    r.maxtuple = r.maxlist = r.maxarray = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = 4
    return r


_REPR = _bounded_repr()


def show(value: Any) -> str:
    """A repr of ``value`` of at most ~200 characters, in bounded time and memory, whatever its size or nesting
    (for error messages about untrusted input)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 96:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        return _REPR.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too long to convert, nested in a list: say what it is
        return f"<a {type(value).__name__}>"


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

    ``tensor`` names the first offending tensor; ``reason`` says what differs;
    ``field`` is what kind of difference it is (``"missing"``, ``"extra"``,
    ``"shape"``, ``"dtype"``, ``"stride"``, ``"offset"``, ``"meta"``,
    ``"sharing"``, ``"nbytes"``, or ``"layout"`` for anything else).
    """

    def __init__(self, tensor: str, reason: str, field: str = "layout") -> None:
        self.tensor = tensor
        self.reason = reason
        self.field = field
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


class AddressStableError(StateShiftError, RuntimeError):
    """The address-stable mode cannot do what was asked (torch_memory_saver missing, a partial move
    of an address-stable group, too little free memory to map a group back)."""


class DiskTierError(StateShiftError, OSError):
    """The disk tier cannot do what was asked: no directory configured, a full disk, an I/O error.
    Raised before anything changed residency: the values are still where they were."""


class ClosedStateError(StateShiftError, RuntimeError):
    """A verb was called on a ``ModelState`` after ``close()``."""


class SwapActiveError(StateShiftError, RuntimeError):
    """A verb touched groups that a ``swapped`` context currently holds."""


class VerbInsideComputeError(StateShiftError, RuntimeError):
    """A verb that releases storage was called from inside compute that reads it, on the same thread.

    A forward (or an optimizer step) of a guarded model holds the state's storage until it returns;
    ``offload``, ``drop`` or a ``swapped()`` exit called from inside it (a hook) would release storage
    the running forward still reads. From another thread the verb waits instead; on the same thread
    it would wait for ever, so it raises, before anything changed.
    """

    def __init__(self, verb: str, compute: str) -> None:
        self.verb = verb
        self.compute = compute
        super().__init__(
            f"{verb}() was called from inside {compute} on the same thread: it would release storage that "
            f"the running computation reads. Call {verb}() after it returns"
        )


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


class FSDP2StateError(StateShiftError, RuntimeError):
    """FSDP2 is in a state in which its shards cannot be moved (a forward or backward is running)."""


class SnapshotHandleError(StateShiftError, TypeError):
    """A restore was handed something that is not a live snapshot handle of that model.

    Raised by the drop-ins of ``stateshift.integrations`` (e.g. verl's
    ``restore_megatron_model_from_cpu``) before anything changes: ``function``
    is the function called, ``got`` the type of what it was given, ``reason``
    what is wrong (not a handle -- e.g. a dict from the framework's own copy
    function --, a handle of another model, a handle of the other kind, or one
    whose model state was closed).
    """

    def __init__(self, function: str, got: str, reason: str) -> None:
        self.function = function
        self.got = got
        self.reason = reason
        super().__init__(f"{function}: {reason} (got {got})")


# --------------------------------------------------------------------------- checkpoints


class CheckpointError(StateShiftError):
    """Base class of every checkpoint error (a ``stateshift.errors.StateShiftError``)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is damaged or malformed: checksum mismatch, truncated, bad header or manifest,
    a file that is not a regular file inside the checkpoint directory, an input over a size or depth limit.

    ``path`` names the offending file; ``tensor`` the offending tensor when one is known; ``detail``
    says what is wrong.
    """

    def __init__(self, path: str | os.PathLike[str], detail: str, tensor: str | None = None) -> None:
        self.path = os.fspath(path)
        self.detail = detail
        self.tensor = tensor
        super().__init__(f"corrupt checkpoint file '{self.path}': {detail}")


class CheckpointIncompleteError(CheckpointError):
    """A checkpoint directory whose write never finished (its manifest, written last, is missing)."""

    def __init__(self, path: str | os.PathLike[str], detail: str) -> None:
        self.path = os.fspath(path)
        self.detail = detail
        super().__init__(f"incomplete checkpoint '{self.path}': {detail}")


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No stateshift checkpoint at a path: nothing there, an empty directory, a Hugging Face export,
    a directory of other files. Also a ``FileNotFoundError``."""

    def __init__(self, path: str | os.PathLike[str], detail: str) -> None:
        self.path = os.fspath(path)
        self.detail = detail
        super().__init__(f"no stateshift checkpoint at '{self.path}': {detail}")

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointUntrustedError(CheckpointError):
    """Loading would unpickle a file of the checkpoint (DCP's ``.metadata``) that the caller has not
    said it trusts; unpickling can run arbitrary code."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (ENOSPC, EDQUOT, EFBIG, EIO, ...).

    ``errno`` is the OS error number (None if not an OS error).  The message
    says whether the previous checkpoint at ``path`` is intact.
    """

    def __init__(self, path: str | os.PathLike[str], detail: str, errno: int | None = None) -> None:
        self.path = os.fspath(path)
        self.detail = detail
        self.errno = errno
        super().__init__(f"cannot write checkpoint '{self.path}': {detail}")


class CheckpointReadError(CheckpointError, OSError):
    """Reading a checkpoint failed with an OS error (EIO from a failing disk, a file system gone away, ...).

    ``path`` names the file, ``tensor`` the tensor whose bytes failed (``None``: a header, or the whole
    file's hash), ``errno`` the OS error number. Raised before anything of the model changed. Also an
    ``OSError``.
    """

    def __init__(self, path: str | os.PathLike[str], detail: str, errno: int | None = None,
                 tensor: str | None = None) -> None:
        self.path = os.fspath(path)
        self.detail = detail
        self.tensor = tensor
        super().__init__(f"cannot read checkpoint file '{self.path}': {detail}")
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointMismatchError(CheckpointError, LayoutMismatchError):
    """Bad input: unknown tensor name, wrong byte count / dtype, non-contiguous data.

    Raised before any byte is read or written; ``name`` is the first offending
    tensor.  Also a ``stateshift.errors.LayoutMismatchError`` (and ``ValueError``).
    """

    def __init__(self, name: str, detail: str, field: str = "layout") -> None:
        self.name = self.tensor = name
        self.detail = self.reason = detail
        self.field = field
        Exception.__init__(self, f"tensor '{name}': {detail}")


class ShapeError(StateShiftError, ValueError):
    """A stored shape that is not one (``checkpoint.format.shape_bytes``); its message is built from bounded
    values. Turned into ``CheckpointCorruptError`` naming the file where a checkpoint is read."""


class TransferError(StateShiftError, OSError):
    """An OS error (ENOSPC, EFBIG, EIO, ...) moving the bytes of the file ``filename``; ``tensor`` names
    the tensor whose bytes failed (``None``: a header, or bytes of no named tensor). Also an ``OSError``
    with the original ``errno`` and ``strerror``; the checkpoint code turns it into
    ``CheckpointWriteError`` / ``CheckpointReadError``."""

    def __init__(self, e: OSError, path: str, tensor: str | None) -> None:
        super().__init__(e.errno, e.strerror, path)
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (OSError(self.errno, self.strerror), self.filename, self.tensor)

    @staticmethod
    def tensor_of(e: BaseException) -> str | None:
        """The tensor whose bytes failed, where the error knows it."""
        return e.tensor if isinstance(e, TransferError) else None


# --------------------------------------------------------------------------- weight sync (stateshift.rl.sync)


class SyncError(StateShiftError, RuntimeError):
    """Base class of every weight-sync error: weights published by one process to others."""


class ReceiverLostError(SyncError):
    """A receiver died, hung or lagged past the publisher's timeout; the publisher reclaimed what it held.

    ``receiver`` is the receiver's name, ``version`` the version it held (``None`` if none), ``reason``
    one of ``"died"`` or ``"timeout"``. The publisher records it (``WeightPublisher.lost``) and goes on.
    """

    def __init__(self, receiver: str, version: int | None, reason: str, detail: str = "") -> None:
        self.receiver = receiver
        self.version = version
        self.reason = reason
        held = f"holding version {version}" if version is not None else "holding no version"
        super().__init__(f"weight receiver {receiver!r} {reason} ({held}){': ' + detail if detail else ''}")


class VersionReclaimedError(SyncError):
    """A receiver's version was reclaimed by the publisher while the receiver read it (it held it past
    the timeout): what it read may mix versions and must be discarded. ``receiver`` and ``version`` name it."""

    def __init__(self, receiver: str, version: int, detail: str = "") -> None:
        self.receiver = receiver
        self.version = version
        super().__init__(f"version {version} held by weight receiver {receiver!r} was reclaimed by the publisher"
                         f"{': ' + detail if detail else ''}; read it again")


class SyncBudgetError(SyncError, MemoryError):
    """Publishing would exceed the publisher's byte budget because receivers still hold older versions.
    ``holders`` lists ``(receiver, version)``; nothing was published and nothing changed."""

    def __init__(self, message: str, holders: tuple[tuple[str, int], ...] = ()) -> None:
        self.holders = holders
        super().__init__(message)


class SyncTimeoutError(SyncError, TimeoutError):
    """No version at least ``min_version`` became visible within the receiver's timeout
    (``publisher_alive`` says whether the publisher still runs)."""

    def __init__(self, message: str, min_version: int | None = None, publisher_alive: bool = True) -> None:
        self.min_version = min_version
        self.publisher_alive = publisher_alive
        super().__init__(message)


class MailboxError(SyncError, ValueError):
    """A sync handle or the publisher's mailbox/manifest holds something a receiver refuses to act on
    (bad JSON, a file name outside the sync directory, sizes past a file's end, an unknown dtype).
    ``path`` names the file, ``field`` the offending entry. Nothing was read or mapped past the check."""

    def __init__(self, path: str, field: str, reason: str) -> None:
        self.path = path
        self.field = field
        super().__init__(f"sync mailbox {path!r}: {field}: {reason}")


# --------------------------------------------------------------------------- stateshift train on one's own files


class DataFileError(StateShiftError, ValueError):
    """A prompt file of ``task.name=file`` that cannot be read as the config says.

    ``path`` names the file, ``line`` the 1-based line (JSONL) or row (Parquet) at fault (``None``: the whole
    file), ``key`` the config key or record field involved (``None`` if none), ``reason`` what is wrong.
    Raised while the task is built, before any model is built or anything trained.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str, *, line: int | None = None,
                 key: str | None = None) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.key = key
        self.reason = reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}" + (f" (field {key!r})" if key else ""))


class RewardError(StateShiftError, RuntimeError):
    """A reward function could not be loaded, raised, or returned something that is not a finite score.

    ``fn`` is the ``reward.fn`` value, ``sample`` the sample's id in its file (``'<file>:<line>'``; ``None``
    when loading), ``reason`` what went wrong. Raised on the rollout side; it stops the run (unless
    ``reward.on_error=zero``, which counts a zero reward instead).
    """

    def __init__(self, fn: str, reason: str, *, sample: str | None = None) -> None:
        self.fn = fn
        self.sample = sample
        self.reason = reason
        at = f" on sample {sample}" if sample else ""
        super().__init__(f"reward.fn={fn!r}{at}: {reason}")


class ModelDirError(StateShiftError, FileNotFoundError):
    """A local model directory (``model.hf_path``) lacks a file the run needs, or its tokenizer lacks a token.

    ``path`` is the directory, ``file`` the missing file (or the tokenizer's file, for a missing special
    token), ``reason`` what is missing. Nothing is downloaded: every file must be in the directory.
    """

    def __init__(self, path: str | os.PathLike[str], file: str, reason: str) -> None:
        self.path = os.fspath(path)
        self.file = file
        self.reason = reason
        super().__init__(f"model directory {self.path!r}: {file}: {reason}")

    def __str__(self) -> str:
        return str(self.args[0])


class UsageError(StateShiftError, ValueError):
    """A bad command-line value of ``stateshift bench``: printed as ``error: ...`` with exit status 2, before
    any work starts."""


# --------------------------------------------------------------------------- the stateshift train application


class ConfigError(StateShiftError, ValueError):
    """A config key that does not exist, or a value of the wrong type or range; ``key`` is the dotted name.

    The message is built from bounded reprs (``show``): a value of any size, a YAML alias bomb included,
    gives a message of a few hundred characters."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"config key {show(key)}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:  # (pickled whole, across a process or a Ray actor)
        return type(self), (self.key, self.reason)


class WeightSyncError(StateShiftError, ValueError):
    """Weights sent to a rollouter do not match its model; ``name`` is the first offending weight."""

    def __init__(self, name: str, detail: str) -> None:
        self.name = name
        self.detail = detail
        super().__init__(f"weight {name!r}{detail}")

    def __reduce__(self) -> tuple[Any, ...]:  # (raised in a rollouter process or actor, re-raised by the trainer)
        return type(self), (self.name, self.detail)


class MetricsLogError(StateShiftError, ValueError):
    """``metrics.jsonl`` has a line that is not a step record (and is not a last line cut short by a kill);
    ``path`` and ``line`` (1-based) name it."""

    def __init__(self, path: str | os.PathLike[str], line: int, detail: str) -> None:
        self.path, self.line, self.detail = path, line, detail
        super().__init__(f"{path}, line {line}: {detail}; a resume keeps the records up to its checkpoint from this "
                         "file: repair or remove that line")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.line, self.detail)


class RunDirBusyError(StateShiftError, RuntimeError):
    """Another process is training into the same run directory ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        super().__init__(f"{self.path} is in use by another `stateshift train` (run.lock is held)")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path,)


class StallError(StateShiftError, RuntimeError):
    """Nothing moved for ``run.stall_timeout_s`` seconds; the message says what each side was waiting for."""


class StoppedError(StateShiftError, RuntimeError):
    """Raised in a waiting thread when the run was stopped without an error (end of run, Ctrl-C)."""


class RolloutDiedError(StateShiftError, RuntimeError):
    """The rollout side is gone for good: a rollouter died more often than ``ray.max_rollout_restarts`` allows,
    could not be restarted, or the queue actor died (the message says which, and why)."""


class LinkClosedError(StateShiftError, EOFError):
    """The process at the other end of a rollouter's pipe (``executors/link.py``) is gone (its end closed)."""


class TrainerDiedError(StateShiftError, RuntimeError):
    """The trainer actor died (killed, OOM, its node lost); the message names the checkpoint to resume from."""


class ActorStartError(StateShiftError, RuntimeError):
    """The placement group or an actor did not come up within ``ray.ready_timeout_s`` (the cluster lacks room)."""
