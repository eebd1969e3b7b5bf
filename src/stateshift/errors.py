"""Typed errors: ten classes, each with a ``kind`` and its detail in attributes.

Every error raised for bad input is raised *before* anything is changed, so a
caught error leaves the model, its homes and every snapshot as they were.
Messages name the first offending tensor or setting.

A class covers one family; ``kind`` (a short string, one of the class's ``kinds``) says which case it is,
so a caller catches the family and tests the kind where it cares::

    try:
        load(state, path)
    except CheckpointError as e:
        if e.kind != "not_found":
            raise

==================  ======================  ==================================================================
class               also a                  covers
==================  ======================  ==================================================================
``StateError``      ``RuntimeError``        a verb or compute meets state it cannot act on
``LayoutError``     ``ValueError``          values that do not fit a model's layout
``ObjectError``     ``TypeError``           an object no backend knows, not a snapshot handle
``BudgetError``     ``MemoryError``         a pool, snapshot store or publisher would pass its byte budget
``DiskError``       ``OSError``             the disk tier cannot act; an OS error moving bytes
``CheckpointError`` ``OSError``             a checkpoint missing, damaged, incomplete, unreadable, unwritable
``SyncError``       ``RuntimeError``        publishing weights to other processes
``ConfigError``     ``ValueError``          a bad setting, command-line value, data file or model directory
``RunError``        ``RuntimeError``        the ``stateshift train`` application cannot go on
==================  ======================  ==================================================================

and ``StateShiftError``, the base of them all.
"""

from __future__ import annotations

import errno as errno_mod
import os
import reprlib
from typing import Any, ClassVar, Literal, get_args


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


def _rebuild(cls: type[StateShiftError], args: tuple[Any, ...]) -> StateShiftError:
    """An error of ``cls`` with ``args``, its ``__init__`` not called (its attributes come as pickled state).
    (``BaseException.__new__``: ``MemoryError``'s own one refuses a class whose first base is not it.)"""
    return (OSError if issubclass(cls, OSError) else BaseException).__new__(cls, *args)


class StateShiftError(Exception):
    """Base class of every error raised by stateshift.

    ``kind`` is one of the class's ``kinds``; the message is built from the attributes (bounded where a value
    comes from untrusted input). Every error pickles whole, attributes included (it may cross a process or a
    Ray actor).
    """

    kinds: ClassVar[tuple[str, ...]] = ()

    def __init__(self, kind: str, *args: Any) -> None:
        if kind not in self.kinds:
            raise ValueError(f"{type(self).__name__}: unknown kind {kind!r}; one of {', '.join(self.kinds)}")
        self.kind = kind
        super().__init__(*args)

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        if isinstance(self, OSError):
            state.update(args=self.args, errno=self.errno, strerror=self.strerror, filename=self.filename)
        return _rebuild, (type(self), self.args), state


StateKind = Literal[
    "offloaded",
    "closed",
    "swap_active",
    "inside_compute",
    "foreign",
    "released",
    "not_releasable",
    "address_stable",
    "fsdp2",
    "no_pinning",
]


class StateError(StateShiftError, RuntimeError):
    """A verb, or compute, met state it cannot act on. Raised before anything changed.

    ``kind``:

    - ``"offloaded"``: compute (``reason``, e.g. ``"forward"``) touched a group whose device storage is
      released (``group``, ``tensor`` the first such, ``residency`` where it is). Raised from hooks before any kernel runs, so the process (and
      its CUDA context) stays healthy: a kernel reading released storage is a sticky illegal-address fault on
      CUDA and a segmentation fault on the CPU.
    - ``"closed"``: a verb was called on a ``ModelState`` after ``close()``.
    - ``"swap_active"``: a verb touched groups that a ``swapped`` context holds.
    - ``"inside_compute"``: a verb that releases storage (``verb``) was called from inside compute that reads
      it (a forward or an optimizer step, ``compute``) on the same thread; from another thread the verb
      would wait instead, on the same thread it would wait for ever.
    - ``"foreign"``: a tensor's device storage was released by someone else and no values can be found for it.
    - ``"released"``: the snapshot was released; its memory may already hold other values.
    - ``"not_releasable"``: a device tensor's storage cannot be resized in place, so it cannot be released.
    - ``"address_stable"``: the address-stable mode cannot do what was asked (torch_memory_saver missing, a
      partial move of an address-stable group, too little free memory to map a group back).
    - ``"fsdp2"``: FSDP2 is in a state in which its shards cannot be moved (a forward or backward runs).
    - ``"no_pinning"``: pinned host memory was asked for explicitly where it cannot be had.
    """

    kinds = get_args(StateKind)

    def __init__(
        self,
        kind: StateKind,
        reason: str = "",
        *,
        group: str | None = None,
        tensor: str | None = None,
        residency: str | None = None,
        verb: str | None = None,
        compute: str | None = None,
    ) -> None:
        self.reason = reason
        self.group, self.tensor, self.residency, self.verb, self.compute = group, tensor, residency, verb, compute
        if kind == "offloaded":
            reason = (
                f"{reason} needs group {group!r} on the device, but it is not resident (first: {tensor!r} is "
                f"{residency}); call onload({group!r}) first"
            )
        elif kind == "inside_compute":
            reason = (
                f"{verb}() was called from inside {compute} on the same thread: it would release storage "
                f"that the running computation reads. Call {verb}() after it returns"
            )
        elif tensor is not None and kind in ("foreign", "not_releasable"):
            reason = f"tensor {tensor!r}: {reason}"
        super().__init__(kind, reason)


LayoutKind = Literal["unknown_group", "mismatch", "checkpoint_mismatch"]


class LayoutError(StateShiftError, ValueError):
    """Values that do not fit a model's layout. Raised before anything changed.

    ``kind``:

    - ``"unknown_group"``: a group name (``group``) the model state does not have; ``valid`` lists its groups.
    - ``"mismatch"``: a snapshot does not fit the model it is applied to.
    - ``"checkpoint_mismatch"``: a checkpoint does not fit the model, or tensors cannot be written to or read
      from a checkpoint as given (unknown name, wrong byte count or dtype, not contiguous).

    ``tensor`` names the first offending tensor; ``reason`` says what differs; ``field`` is what kind of
    difference it is (``"missing"``, ``"extra"``, ``"shape"``, ``"dtype"``, ``"stride"``, ``"offset"``,
    ``"meta"``, ``"sharing"``, ``"nbytes"``, or ``"layout"`` for anything else).
    """

    kinds = get_args(LayoutKind)

    def __init__(
        self,
        kind: LayoutKind,
        reason: str = "",
        *,
        tensor: str | None = None,
        field: str = "layout",
        group: str | None = None,
        valid: tuple[str, ...] = (),
    ) -> None:
        self.tensor, self.reason, self.field, self.group, self.valid = tensor, reason, field, group, valid
        if kind == "unknown_group":  # (names may come from a file or a handle: shown bounded, kept whole)
            message = f"unknown group {show(group)}; valid groups: {', '.join(valid) or '(none)'}"
        elif kind == "mismatch":
            message = f"layout mismatch at tensor {show(tensor)}: {reason}"
        else:
            message = f"tensor {show(tensor)}: {reason}"
        super().__init__(kind, message)


ObjectKind = Literal["backend", "snapshot_handle"]


class ObjectError(StateShiftError, TypeError):
    """An object stateshift cannot act on. Raised before anything changed.

    ``kind``:

    - ``"backend"``: no backend knows the object, or a backend was given an object it cannot handle.
    - ``"snapshot_handle"``: a restore of ``stateshift.integrations`` (e.g. verl's
      ``restore_megatron_model_from_cpu``, the ``function``) was handed something that is not a live snapshot
      handle of that model (``got`` is its type; ``reason`` says what is wrong: not a handle -- e.g. a dict from
      the framework's own copy function --, a handle of another model or of the other kind, or one whose model
      state was closed).
    """

    kinds = get_args(ObjectKind)

    def __init__(self, kind: ObjectKind, reason: str, *, function: str | None = None, got: str | None = None) -> None:
        self.reason, self.function, self.got = reason, function, got
        super().__init__(kind, f"{function}: {reason} (got {got})" if kind == "snapshot_handle" else reason)


BudgetKind = Literal["pool", "snapshot", "sync"]


class BudgetError(StateShiftError, MemoryError):
    """Memory would pass a byte budget; nothing was allocated and nothing changed.

    ``kind``: ``"pool"`` (the pinned host pool), ``"snapshot"`` (the snapshot store) or ``"sync"`` (a weight
    publisher, because receivers still hold older versions: ``holders`` lists ``(receiver, version)``).
    """

    kinds = get_args(BudgetKind)

    def __init__(self, kind: BudgetKind, reason: str, *, holders: tuple[tuple[str, int], ...] = ()) -> None:
        self.reason, self.holders = reason, holders
        super().__init__(kind, reason)


DiskKind = Literal["tier", "transfer"]


class DiskError(StateShiftError, OSError):
    """The disk cannot do what was asked. Also an ``OSError``.

    ``kind``:

    - ``"tier"``: the disk tier cannot act (no directory configured, a full disk, an I/O error); raised before
      anything changed residency: the values are still where they were.
    - ``"transfer"``: an OS error (ENOSPC, EFBIG, EIO, ...) moving the bytes of the file ``filename`` (also
      ``path``), with the original ``errno`` and ``strerror``; ``tensor`` names the tensor whose bytes failed
      (``None``: a header, or bytes of no named tensor). The checkpoint code turns it into a
      ``CheckpointError`` of kind ``"write"`` or ``"read"``.
    """

    kinds = get_args(DiskKind)

    def __init__(
        self,
        kind: DiskKind,
        reason: str,
        *,
        path: str | None = None,
        tensor: str | None = None,
        errno: int | None = None,
    ) -> None:
        self.reason, self.path, self.tensor = reason, path, tensor
        if errno is None:
            super().__init__(kind, reason)
        else:
            super().__init__(kind, errno, reason, path)

    @staticmethod
    def from_os_error(e: OSError, path: str, tensor: str | None) -> DiskError:
        """The ``"transfer"`` error of the OS error ``e`` moving bytes of ``path`` (of ``tensor``)."""
        return DiskError("transfer", e.strerror or str(e), path=path, tensor=tensor, errno=e.errno)

    @staticmethod
    def tensor_of(e: BaseException) -> str | None:
        """The tensor whose bytes failed, where the error knows it."""
        return e.tensor if isinstance(e, DiskError) else None


CheckpointKind = Literal["corrupt", "incomplete", "not_found", "untrusted", "write", "read", "failed"]


class CheckpointError(StateShiftError, OSError):
    """A checkpoint that cannot be read or written. Also an ``OSError`` (``errno`` is the OS error number
    where there is one; ``ENOENT`` for ``"not_found"``).

    ``path`` names the checkpoint or the offending file, ``tensor`` the offending tensor where one is known,
    ``reason`` what is wrong. ``kind``:

    - ``"corrupt"``: a file is damaged or malformed: checksum mismatch, truncated, bad header or manifest, a
      file that is not a regular file inside the checkpoint directory, an input over a size or depth limit.
    - ``"incomplete"``: a directory whose write never finished (its manifest, written last, is missing).
    - ``"not_found"``: no stateshift checkpoint at ``path``: nothing there, an empty directory, a Hugging Face
      export, a directory of other files.
    - ``"untrusted"``: loading would unpickle a file of the checkpoint (DCP's ``.metadata``) that the caller has
      not said it trusts; unpickling can run arbitrary code.
    - ``"write"``: writing failed (ENOSPC, EDQUOT, EFBIG, EIO, ...); the message says whether the previous
      checkpoint at ``path`` is intact.
    - ``"read"``: reading failed with an OS error (EIO from a failing disk, a file system gone away, ...);
      raised before anything of the model changed.
    - ``"failed"``: a collective save or load failed on another rank, or DCP failed.

    A checkpoint that does not fit the model is a ``LayoutError`` of kind ``"checkpoint_mismatch"``.
    """

    kinds = get_args(CheckpointKind)

    def __init__(
        self,
        kind: CheckpointKind,
        reason: str,
        *,
        path: str | os.PathLike[str] | None = None,
        tensor: str | None = None,
        errno: int | None = None,
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.reason, self.tensor = reason, tensor
        where = {
            "corrupt": "corrupt checkpoint file '{}': ",
            "incomplete": "incomplete checkpoint '{}': ",
            "not_found": "no stateshift checkpoint at '{}': ",
            "write": "cannot write checkpoint '{}': ",
            "read": "cannot read checkpoint file '{}': ",
        }.get(kind, "")
        super().__init__(kind, where.format(self.path) + reason)
        self.errno = errno_mod.ENOENT if kind == "not_found" and errno is None else errno


SyncKind = Literal["receiver_lost", "reclaimed", "timeout", "mailbox", "closed", "broadcast", "failed", "reentrant"]


class SyncError(StateShiftError, RuntimeError):
    """Weights published by one process to others (``stateshift.rl.sync``) could not be.

    ``kind``:

    - ``"receiver_lost"``: a receiver (``receiver``) died, hung or lagged past the publisher's timeout
      (``cause``: ``"died"`` or ``"timeout"``); the publisher reclaimed the ``version`` it held (``None``: none),
      records it (``WeightPublisher.lost``) and goes on.
    - ``"reclaimed"``: the ``version`` a receiver read was reclaimed by the publisher meanwhile (it held it past
      the timeout): what it read may mix versions and must be discarded.
    - ``"timeout"``: no version at least ``min_version`` became visible within the receiver's timeout
      (``publisher_alive`` says whether the publisher still runs).
    - ``"mailbox"``: a sync handle or the publisher's mailbox/manifest holds something a receiver refuses to act
      on (bad JSON, a file name outside the sync directory, sizes past a file's end, an unknown dtype); ``path``
      names the file, ``field`` the offending entry. Nothing was read or mapped past the check.
    - ``"closed"``: the publisher or receiver was closed.
    - ``"broadcast"``: the broadcast group is full, or ended.
    - ``"failed"``: the publisher's thread failed.
    - ``"reentrant"``: a receive, or the receiver's close, was called inside a receive on the same thread.

    A publish past the publisher's byte budget is a ``BudgetError`` of kind ``"sync"``.
    """

    kinds = get_args(SyncKind)

    def __init__(
        self,
        kind: SyncKind,
        reason: str = "",
        *,
        receiver: str | None = None,
        version: int | None = None,
        cause: str | None = None,
        min_version: int | None = None,
        publisher_alive: bool = True,
        path: str | None = None,
        field: str | None = None,
    ) -> None:
        self.reason, self.receiver, self.version, self.cause = reason, receiver, version, cause
        self.min_version, self.publisher_alive, self.path, self.field = min_version, publisher_alive, path, field
        detail = f": {reason}" if reason else ""
        if kind == "receiver_lost":
            held = f"holding version {version}" if version is not None else "holding no version"
            message = f"weight receiver {receiver!r} {cause} ({held}){detail}"
        elif kind == "reclaimed":
            message = (
                f"version {version} held by weight receiver {receiver!r} was reclaimed by the publisher"
                f"{detail}; read it again"
            )
        elif kind == "mailbox":
            message = f"sync mailbox {path!r}: {field}: {reason}"
        else:
            message = reason
        super().__init__(kind, message)


ConfigKind = Literal["config", "usage", "weight_sync", "data_file", "model_dir", "metrics_log"]


class ConfigError(StateShiftError, ValueError):
    """A setting, a command-line value or a file named by one that cannot be used. Raised before any work
    that depends on it starts.

    ``reason`` says what is wrong. ``kind``:

    - ``"config"``: a config key (``key``, dotted) that does not exist, or a value of the wrong type or range.
      The message is built from bounded reprs (``show``): a value of any size, a YAML alias bomb included,
      gives a message of a few hundred characters.
    - ``"usage"``: a bad command-line value of ``stateshift bench`` (printed as ``error: ...``, exit status 2).
    - ``"weight_sync"``: weights sent to a rollouter do not match its model; ``name`` is the first offending
      weight.
    - ``"data_file"``: a prompt file (``path``) of ``task.name=file`` that cannot be read as the config says;
      ``line`` is the 1-based line (JSONL) or row (Parquet) at fault (``None``: the whole file), ``key`` the
      config key or record field involved.
    - ``"model_dir"``: a local model directory (``path``, ``model.hf_path``) lacks a file the run needs
      (``name``), or its tokenizer lacks a token. Nothing is downloaded.
    - ``"metrics_log"``: ``metrics.jsonl`` (``path``) has a line (``line``, 1-based) that is not a step record
      (and is not a last line cut short by a kill).
    """

    kinds = get_args(ConfigKind)

    def __init__(
        self,
        kind: ConfigKind,
        reason: str,
        *,
        key: str | None = None,
        name: str | None = None,
        path: str | os.PathLike[str] | None = None,
        line: int | None = None,
    ) -> None:
        self.reason, self.key, self.name, self.line = reason, key, name, line
        self.path = None if path is None else os.fspath(path)
        if kind == "config":
            message = f"config key {show(key)}: {reason}"
        elif kind == "weight_sync":
            message = f"weight {name!r}: {reason}"
        elif kind == "data_file":
            where = f"{self.path}:{line}" if line is not None else self.path
            message = f"{where}: {reason}" + (f" (field {key!r})" if key else "")
        elif kind == "model_dir":
            message = f"model directory {self.path!r}: {name}: {reason}"
        elif kind == "metrics_log":
            message = (
                f"{self.path}, line {line}: {reason}; a resume keeps the records up to its checkpoint from "
                "this file: repair or remove that line"
            )
        else:
            message = reason
        super().__init__(kind, message)


RunKind = Literal[
    "stall", "stopped", "rollout_died", "trainer_died", "actor_start", "link_closed", "run_dir_busy", "reward"
]


class RunError(StateShiftError, RuntimeError):
    """The ``stateshift train`` application cannot go on; ``reason`` says why.

    ``kind``:

    - ``"stall"``: nothing moved for ``run.stall_timeout_s`` seconds; the message says what each side waited for.
    - ``"stopped"``: raised in a waiting thread when the run was stopped without an error (end of run, Ctrl-C).
    - ``"rollout_died"``: the rollout side is gone for good: a rollouter died more often than
      ``ray.max_rollout_restarts`` allows, could not be restarted, or the queue actor died.
    - ``"trainer_died"``: the trainer actor died (killed, OOM, its node lost); the message names the checkpoint
      to resume from.
    - ``"actor_start"``: the placement group or an actor did not come up within ``ray.ready_timeout_s``.
    - ``"link_closed"``: the process at the other end of a rollouter's pipe (``executors/link.py``) is gone.
    - ``"run_dir_busy"``: another process is training into the same run directory ``path``.
    - ``"reward"``: a reward function (``fn``, the ``reward.fn`` value) could not be loaded, raised, or returned
      something that is not a finite score; ``sample`` is the sample's id in its file (``'<file>:<line>'``;
      ``None`` when loading). It stops the run (unless ``reward.on_error=zero``).
    """

    kinds = get_args(RunKind)

    def __init__(
        self,
        kind: RunKind,
        reason: str = "",
        *,
        path: str | os.PathLike[str] | None = None,
        fn: str | None = None,
        sample: str | None = None,
    ) -> None:
        self.reason, self.fn, self.sample = reason, fn, sample
        self.path = None if path is None else os.fspath(path)
        if kind == "run_dir_busy":
            message = f"{self.path} is in use by another `stateshift train` (run.lock is held)"
        elif kind == "reward":
            message = f"reward.fn={fn!r}{f' on sample {sample}' if sample else ''}: {reason}"
        else:
            message = reason
        super().__init__(kind, message)
