"""Weights from a trainer to a rollouter in another process, from any residency: ``stateshift.rl.sync``.

The trainer (this process) trains a small model, offloads its params between
steps as a colocated trainer would, and publishes each version; a rollouter
(a ``spawn``ed process, as vLLM's or SGLang's workers are) loads every version
it sees into its own copy of the model, in place, and reports a checksum of
what it loaded. Each checksum must equal the trainer's for that version: a
version arrives whole or not at all.

On a CPU machine the transport is ``shared_host`` over plain shared memory;
on one GPU ``transport="auto"`` picks ``cuda_ipc``. With the params offloaded
into a shared pool, publishing copies nothing (the homes are the published
memory).

Run it: ``python examples/weight_sync.py``; ``run()`` returns a dict.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch

from stateshift import HostPool, ModelState
from stateshift.rl.sync import WeightPublisher, WeightReceiver


def make_model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)


def checksum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def rollouter(handle_json: str, device: str, versions: int, out: Any) -> None:
    """The receiving process: load each new version in place, report ``(version, checksum)``."""
    model = make_model(device)
    rx = WeightReceiver(handle_json, name="rollout-0", device=device)
    seen: list[tuple[int, float]] = []
    version = -1
    while version < versions - 1:
        version = rx.load_into(model, min_version=version + 1)  # waits for a newer one; in place, by name
        seen.append((version, checksum(model)))
    rx.close()
    out.put(seen)


def run(versions: int = 4, device: str | None = None) -> dict[str, Any]:
    """Train and publish ``versions`` versions; returns what the rollouter loaded against what was published (it
    may skip a version that a newer one replaced before it looked; it always gets the last)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ModelState(model, optimizer, pool=HostPool(shared=True))  # homes other processes can map
    pub = WeightPublisher(state, groups=("params",), transport="auto")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=rollouter, args=(pub.handle().to_json(), device, versions, results))
    child.start()
    published: dict[int, float] = {}
    try:
        for version in range(versions):
            state.onload()
            loss = model(torch.randn(16, 32, device=device)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            published[version] = checksum(model)
            state.offload("params")  # offloaded while "the rollouter generates"
            pub.publish(version).wait(timeout=60)  # from the homes: nothing copied on the trainer
        loaded = results.get(timeout=120)
        child.join(timeout=60)
    finally:
        if child.is_alive():
            child.kill()
        pub.close()
        state.close()
    return {
        "transport": pub.transport,
        "published": published,
        "loaded": dict(loaded),
        "exact": all(published[v] == c for v, c in loaded) and loaded[-1][0] == versions - 1,
    }


if __name__ == "__main__":
    print(run())
