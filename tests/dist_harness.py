"""Run a function on N gloo ranks from a pytest test (CPU, no accelerator).

Usage::

    from dist_harness import run_distributed

    def _body(rank, world_size, scale):          # module level, not a closure
        t = torch.full((2,), float(rank + 1)) * scale
        dist.all_reduce(t)
        return t.tolist()                        # must be picklable

    def test_sum():
        results = run_distributed(_body, world_size=2, args=(2.0,))
        assert results == [[6.0, 6.0], [6.0, 6.0]]

What each rank gets, before ``fn(rank, world_size, *args, **kwargs)`` runs:

- a fresh process: by default forked from a ``forkserver`` that has imported
  torch, torch.distributed(.tensor/.fsdp) and torch._dynamo once per pytest
  process (first call ~5 s, then ~0.2 s to start N ranks instead of torch's
  3-5 s import per rank on 2 cores); ``start_method="spawn"`` for a clean
  interpreter (e.g. env vars that must be set before ``import torch``);
- ``torch.distributed`` initialised with ``backend`` (gloo) over a TCP
  rendezvous on a free localhost port, ``MASTER_ADDR``/``MASTER_PORT``/
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set, so ``init_device_mesh("cpu",
  (world_size,))`` reuses the group; ``GLOO_SOCKET_IFNAME=lo`` unless set;
  ``env`` applied on top (after torch was imported);
- ``torch.set_num_threads(num_threads)`` (default 1) and interop threads:
  N ranks on a 2-core machine would otherwise oversubscribe badly;
- ``torch.manual_seed(seed)``, ``random.seed(seed)`` (and numpy's) with the
  *same* seed on every rank, so every rank builds the same model before
  ``fully_shard`` (FSDP2 does not broadcast; each rank keeps its chunk of its
  own initial values). Use ``rank`` yourself where ranks must differ;
- stdout/stderr redirected to a per-rank log (echoed by the parent with
  ``show_logs``), ``faulthandler`` enabled;
- the process group destroyed afterwards.

Failures: a rank that raises has its exception type, message and full
traceback re-raised in the parent as :class:`RankError` (an
``AssertionError``, so pytest shows it as a test failure). A rank that dies
without reporting (segfault, ``os._exit``) is reported with its exit code /
signal; this matters because touching a released CPU storage segfaults (see
docs/notes/fsdp2-notes.md), and in a rank it fails one test instead of the whole
pytest run. When one rank fails, the others (usually stuck in a collective)
get ``grace`` seconds to report, then are terminated. The whole run is
bounded by ``timeout`` seconds (``TimeoutError`` naming the silent ranks);
the process group timeout is set to the same value.

Import independence: the child is started through ``runpy.run_path`` on this
file and ``fn`` is located by module name, falling back to the module's file
path, so it works whether pytest imports tests with ``prepend``,
``append`` or ``importlib`` mode and whether ``tests/`` is a package.
``args``/``kwargs``/return values must be picklable from importable modules
(builtins, tensors, dataclasses from src/ ...).
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import importlib.util
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import random
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RankError", "run_distributed", "free_port"]

_RUN_NAME = "__stateshift_dist_worker__"
# Imported once by the forkserver (missing ones are skipped by multiprocessing).
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.optim",
    "torch._dynamo",  # fully_shard imports it on first use (~1 s)
)


class RankError(AssertionError):
    """One or more ranks failed. ``failures`` maps rank -> (exc type name, message, traceback text)."""

    def __init__(self, message: str, failures: dict[int, tuple[str, str, str]]):
        super().__init__(message)
        self.failures = failures


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fn_ref(fn: Callable[..., Any]) -> tuple[str, str | None, str]:
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not qualname or not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"run_distributed needs a module-level function (spawned ranks import it by name), got {fn!r}")
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if module == "__main__" and path is None:
        raise TypeError(f"cannot locate {fn!r}: defined in an interactive __main__")
    return module, path, qualname


def _resolve(ref: tuple[str, str | None, str]) -> Callable[..., Any]:
    module, path, qualname = ref
    mod = None
    if module != "__main__":
        try:
            mod = importlib.import_module(module)
        except ImportError:
            mod = None
    if mod is None:
        if path is None:
            raise ImportError(f"cannot import module {module!r} in a spawned rank")
        name = f"_dist_harness_loaded_{abs(hash(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(job: dict[str, Any]) -> None:
    """Entry point inside a rank. Sends exactly one message on ``conn``, then exits."""
    conn = job["conn"]
    rank, world_size = job["rank"], job["world_size"]
    try:
        # Everything the rank prints, and a faulthandler dump on SIGSEGV/SIGABRT,
        # goes to its log file; the parent shows it.
        log_fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        faulthandler.enable(file=sys.stderr, all_threads=True)
        sys.path[:0] = [p for p in job["sys_path"] if p not in sys.path]
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(job["port"]),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        os.environ.update(job["env"])
        import torch
        import torch.distributed as dist

        torch.set_num_threads(job["num_threads"])
        try:
            torch.set_num_interop_threads(job["num_threads"])
        except RuntimeError:
            pass
        seed = job["seed"]
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            np.random.seed(seed)
        except ImportError:
            pass
        fn = _resolve(job["fn"])
        args, kwargs = pickle.loads(job["payload"])
        dist.init_process_group(
            backend=job["backend"],
            init_method=f"tcp://127.0.0.1:{job['port']}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=job["timeout"]),
        )
        result = fn(rank, world_size, *args, **kwargs)
        msg: tuple[Any, ...] = ("ok", rank, pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        msg = ("error", rank, (type(exc).__name__, str(exc), traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    # Report before tearing down: a peer stuck in a collective must not keep
    # this rank's error from reaching the parent.
    try:
        conn.send(msg)
    except Exception as exc:  # noqa: BLE001 - e.g. a result that pickled but cannot be sent
        conn.send(("error", rank, (type(exc).__name__, str(exc), traceback.format_exc())))
    conn.close()
    if msg[0] == "ok":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _read_log(path: str, limit: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text if len(text) <= limit else "...\n" + text[-limit:]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    grace: float = 3.0,
    backend: str = "gloo",
    seed: int = 0,
    num_threads: int = 1,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
    show_logs: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new processes.

    Returns the ranks' return values, indexed by rank. Blocks until every
    rank has reported (results are safe to read on return). Raises
    :class:`RankError` if any rank raised or died, ``TimeoutError`` if the
    ranks did not all finish within ``timeout`` seconds; stragglers are
    terminated in both cases. With ``show_logs`` each rank's stdout/stderr is
    echoed to this process's stdout afterwards (pytest shows it on failure).
    """
    for attempt in range(3):
        try:
            return _launch(
                fn,
                world_size,
                args=args,
                kwargs=kwargs,
                timeout=timeout,
                grace=grace,
                backend=backend,
                seed=seed,
                num_threads=num_threads,
                env=env,
                start_method=start_method,
                show_logs=show_logs,
            )
        except RankError as err:
            # The free port was taken between probing and binding: try another.
            port_taken = any(
                "address already in use" in f"{text}\n{tb}".lower() and "init_process_group" in tb
                for _, text, tb in err.failures.values()
            )
            if attempt == 2 or not port_taken:
                raise
    raise AssertionError("unreachable")


def _launch(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    grace: float = 3.0,
    backend: str = "gloo",
    seed: int = 0,
    num_threads: int = 1,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
    show_logs: bool = True,
) -> list[Any]:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ref = _fn_ref(fn)
    payload = pickle.dumps((tuple(args), dict(kwargs or {})))
    port = free_port()
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The server imports torch once; every later rank is a fork of it, so
        # a rank starts in ~0.1 s instead of paying torch's ~3-5 s import.
        ctx.set_forkserver_preload(list(_PRELOAD))
    child_env = {} if "GLOO_SOCKET_IFNAME" in os.environ else {"GLOO_SOCKET_IFNAME": "lo"}
    child_env.update(env or {})
    logdir = tempfile.mkdtemp(prefix="dist_harness_")
    logs = [os.path.join(logdir, f"rank{r}.log") for r in range(world_size)]
    procs: list[Any] = []
    conns: list[Any] = []
    results: dict[int, Any] = {}
    failures: dict[int, tuple[str, str, str]] = {}  # in the order they were seen
    pending = set(range(world_size))
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            job = dict(
                conn=send,
                rank=rank,
                world_size=world_size,
                port=port,
                fn=ref,
                payload=payload,
                backend=backend,
                seed=seed,
                num_threads=num_threads,
                timeout=timeout,
                env=child_env,
                sys_path=list(sys.path),
                log=logs[rank],
            )
            p = ctx.Process(
                target=runpy.run_path,
                args=(os.path.abspath(__file__),),
                kwargs=dict(init_globals={"_JOB": job}, run_name=_RUN_NAME),
                name=f"dist-rank{rank}",
                daemon=True,
            )
            p.start()
            send.close()  # the parent keeps only the read end
            procs.append(p)
            conns.append(recv)

        deadline = time.monotonic() + timeout
        fail_deadline: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if fail_deadline is None else min(deadline, fail_deadline)
            if now >= limit:
                break
            waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
            mpc.wait(waitables, timeout=min(limit - now, 0.5))
            for r in sorted(pending):
                conn, proc = conns[r], procs[r]
                if conn.poll():
                    try:
                        kind, _, body = conn.recv()
                    except EOFError:
                        proc.join(1.0)
                        kind, body = "died", None
                elif proc.exitcode is not None:
                    kind, body = "died", None
                else:
                    continue
                pending.discard(r)
                if kind == "ok":
                    results[r] = pickle.loads(body)
                    continue
                if kind == "error":
                    failures[r] = body
                else:
                    failures[r] = (
                        "RankDied",
                        f"rank {r} exited without reporting ({_exit_text(proc.exitcode)})",
                        _read_log(logs[r]),
                    )
                if fail_deadline is None:
                    fail_deadline = time.monotonic() + grace
        if not pending and not failures:  # let finished ranks tear down cleanly
            for p in procs:
                p.join(10.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in conns:
            c.close()
        if show_logs:
            for r, path in enumerate(logs):
                text = _read_log(path)
                if text.strip():
                    print(f"----- rank {r} output -----\n{text.rstrip()}")
        shutil.rmtree(logdir, ignore_errors=True)

    if failures:
        first = next(iter(failures))
        name, text, _ = failures[first]
        lines = [f"{len(failures)} of {world_size} ranks failed; first seen: rank {first} raised {name}: {text}"]
        for r, (name, text, tb) in failures.items():
            lines.append(f"\n--- rank {r}: {name}: {text}\n{tb}".rstrip())
        if pending:
            lines.append(f"\n(ranks {sorted(pending)} terminated after {grace:g}s grace)")
        raise RankError("\n".join(lines), failures)
    if pending:
        raise TimeoutError(f"ranks {sorted(pending)} of {world_size} did not finish within {timeout:g}s (terminated)")
    return [results[r] for r in range(world_size)]


if __name__ == _RUN_NAME:  # inside a rank, started via runpy.run_path
    _worker_main(globals()["_JOB"])
