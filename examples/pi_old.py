"""The README's example, runnable: offload and onload, drop the grads, a pi_old snapshot, compute under it, restore it.

A small model and its Adam optimizer; one ``ModelState`` over both. Each
check compares values bit for bit with copies taken by hand, which is what a
user would otherwise write (``{k: v.clone() ...}``, ``load_state_dict``).

Run it: ``python examples/pi_old.py``; ``run()`` returns a dict of checks (all true).
"""

from __future__ import annotations

from typing import Any

import torch

from stateshift import ModelState


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(device: str | None = None) -> dict[str, Any]:
    """Every verb of the README's example, each checked against a hand-made copy."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 32, device=device)
    _train_step(model, optimizer, x)  # the optimizer has state now
    state = ModelState(model, optimizer)  # groups: params, buffers, grads, optim
    checks: dict[str, Any] = {"groups": sorted(state.groups)}
    try:
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state.offload()  # device storage released, values in pinned homes
        checks["offloaded"] = state.residency()["params"]["host"] > 0
        state.onload()  # same tensor objects, same values
        checks["onload_exact"] = _same(before, dict(model.state_dict()))
        state.drop("grads")  # released without values; onload zero-fills
        checks["grads_dropped"] = state.residency()["grads"]["dropped"] > 0
        state.onload()
        checks["grads_zero_filled"] = all(p.grad is not None and not p.grad.any() for p in model.parameters())

        pi_old = state.snapshot(tag="pi_old")  # params + buffers
        with torch.no_grad():
            old_out = model(x).clone()
        _train_step(model, optimizer, x)  # train: the snapshot does not change
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with state.swapped(pi_old), torch.no_grad():  # compute under pi_old ...
            checks["swapped_exact"] = torch.equal(model(x), old_out)
        checks["back_after_swap"] = _same(trained, dict(model.state_dict()))  # ... and the current weights are back
        state.restore(pi_old)  # or make pi_old the current weights
        checks["restore_exact"] = _same(before, dict(model.state_dict()))
        state.release(pi_old)  # memory back to the pool
    finally:
        state.close()
    return checks


if __name__ == "__main__":
    print(run())
