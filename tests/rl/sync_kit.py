"""Helpers of the weight-sync tests: a model with every kind of tensor, and the bodies of child processes
(started with the ``spawn`` method, so they import this module by name: keep them at module level)."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

SPAWN = mp.get_context("spawn")
STEP_S = 30.0  # the longest any one reply from a child may take (spawning imports torch: seconds on 2 cores)


def model(seed: int = 0) -> torch.nn.Module:
    """Float32 and bfloat16 params, float and int64 buffers (BatchNorm), one tensor small, one not."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.BatchNorm1d(48), torch.nn.Linear(48, 512))
    m[2].to(torch.bfloat16)
    m[1].running_mean.uniform_(-1, 1)
    m[1].num_batches_tracked.fill_(seed + 3)
    return m


def values(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Host copies of every value (``state_dict`` order)."""
    return {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}


def step(m: torch.nn.Module, k: int) -> None:
    """Change every value (a stand-in for an optimizer step)."""
    with torch.no_grad():
        for t in m.state_dict().values():
            t.add_(k) if t.dtype != torch.bool else None


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit (NaN-safe: compares the bytes)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def model_without_buffers(seed: int = 0) -> torch.nn.Module:
    """Two float32 linear layers: params only."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))


def receiver_main(handle: str, name: str, device: str | None, conn: Any) -> None:
    """A receiver process driven by commands on ``conn``: ``("load", min_version)`` replies the version and
    the values loaded into a fresh model; ``("pairs", min_version)`` the version, the pairs ``receive``
    yields (host copies) and the devices they were on; ``("hold", min_version)`` holds the version mid-read and replies,
    then sleeps (to be killed); ``("within", min_version, timeout)`` loads with that timeout and replies the version,
    or ``("timeout", seconds waited)``; ``("stop",)`` closes and replies."""
    _serve(handle, name, device, conn, model)


def receiver_without_buffers_main(handle: str, name: str, device: str | None, conn: Any) -> None:
    """``receiver_main`` loading into ``model_without_buffers``."""
    _serve(handle, name, device, conn, model_without_buffers)


def _serve(handle: str, name: str, device: str | None, conn: Any, build: Callable[[int], torch.nn.Module]) -> None:
    torch.set_num_threads(1)
    from stateshift.rl.sync import SyncError, WeightReceiver

    rx = WeightReceiver(handle, name=name, device=device, timeout_s=STEP_S)
    target = build(99).to(device or "cpu")
    conn.send(("ready", os.getpid()))
    while True:
        cmd = conn.recv()
        if cmd[0] == "load":
            v = rx.load_into(target, min_version=cmd[1])
            conn.send((v, values(target), rx.last_receipt))
        elif cmd[0] == "pairs":
            with rx.receive(min_version=cmd[1]) as (v, pairs):
                got = {n: (t.detach().cpu().clone(), str(t.device)) for n, t in pairs}
            conn.send((v, {n: t for n, (t, _) in got.items()}, sorted({d for _, d in got.values()})))
        elif cmd[0] == "within":
            t0 = time.monotonic()
            try:
                conn.send((rx.load_into(target, min_version=cmd[1], timeout=cmd[2]), values(target)))
            except SyncError as e:
                conn.send((e.kind, time.monotonic() - t0))
        elif cmd[0] == "hold":
            with rx.receive(min_version=cmd[1]) as (v, pairs):
                next(pairs)
                conn.send(("holding", v))
                time.sleep(3600)
        else:
            rx.close()
            conn.send(("bye",))
            return


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``cond`` until it holds; ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)


def start(fn: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    """Start ``fn(*args, conn)`` in a spawned process; returns (process, parent end). Waits for its first message."""
    return start_many(fn, [args])[0]


def start_many(
    fn: Callable[..., None], args: list[tuple[Any, ...]], ready: Callable[[], None] | None = None
) -> list[tuple[Any, Any]]:
    """Start ``fn(*a, conn)`` for each ``a`` at once (call ``ready()`` meanwhile, if given); then wait for each
    one's first message (``"ready"``)."""
    out = []
    for a in args:
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=fn, args=(*a, child), daemon=True)
        proc.start()
        out.append((proc, parent))
    if ready is not None:
        ready()
    for _, parent in out:
        first = ask(parent, None)
        assert first[0] == "ready", first
    return out


def ask(conn: Any, cmd: tuple[Any, ...] | None, timeout: float = STEP_S) -> Any:
    if cmd is not None:
        conn.send(cmd)
    if not conn.poll(timeout):
        raise TimeoutError(f"no reply to {cmd} in {timeout} s")
    return conn.recv()


def stop(procs: list[Any]) -> None:
    """Kill what is still running (tests end their children this way whatever happened)."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)


def shm_files(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/stateshift-*-{pid}-*")


def publisher_main(conn: Any, delay_second_s: float) -> None:
    """A publisher process: publishes version 1 of ``model(0)`` (through a shared pool), replies its
    handle; on ``("publish2",)`` steps the model and publishes version 2 with the listing delayed by
    ``delay_second_s`` (the test kills it meanwhile), replying once version 2 is enqueued."""
    torch.set_num_threads(1)
    from stateshift import ModelState
    from stateshift.core.pool import HostPool
    from stateshift.rl.sync import WeightPublisher

    m = model(0)
    state = ModelState(m, pool=HostPool(shared=True))
    pub = WeightPublisher(state, name="dying", ack_timeout_s=STEP_S)
    pub.publish(1).wait(STEP_S)
    conn.send(("ready", pub.handle().to_json()))
    conn.recv()
    step(m, 1)
    os.environ["STATESHIFT_SYNC_TEST_DELAY_LISTING_S"] = str(delay_second_s)
    pub.publish(2)
    conn.send(("enqueued",))
    time.sleep(3600)


def mapper_main(conn: Any) -> None:
    """Opens every ``cuda_ipc`` share it is sent (``("open", ipc)``) and keeps them all mapped, replying each
    one's bytes summed (int64): two receivers of one process holding mappings of one segment at once."""
    from stateshift.rl.sync import cuda_ipc

    kept = []
    conn.send(("ready",))
    while (cmd := conn.recv())[0] == "open":
        kept.append(cuda_ipc.open_shared(cmd[1], "test"))
        conn.send(int(kept[-1].sum(dtype=torch.int64)))
