"""Compute in one thread, verbs in another: ordered, never a crash (docs/design/design.md, "Threads").

A forward, backward or optimizer step reads a state's storage; ``offload``
and ``drop`` release it. Without an order between them a forward that passed
its residency check could be reading storage an offload in another thread
just released: a segmentation fault on the CPU (an illegal memory access on
a GPU). The run is in a subprocess, so a crash fails the test instead of
ending pytest.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from helpers import DEVICES, assert_isolated, make, warm
from raises import raises_kind

from stateshift import ModelState, StateError
from stateshift.core.engine import core_of

#: seconds the races run (three phases, a third each). The crash it guards against came within a second or two on the 2-core CI
#: machine (a forward takes ~1 ms there, each offload/onload pair ~1 ms: hundreds of interleavings a
#: second), so 8 s is many times that margin while keeping the file well under a minute; set
#: STATESHIFT_RACE_SECONDS=20 (or more) for a longer run.
RACE_SECONDS = 8.0

_RACE = textwrap.dedent(
    """
    import os, random, sys, threading, time
    sys.path[:0] = sys.argv[1:3]
    seconds = float(os.environ.get("STATESHIFT_RACE_SECONDS", sys.argv[3]))
    import torch
    torch.set_num_threads(1)
    from helpers import batch, lm_loss, make, warm
    from stateshift import ModelState, StateError

    device = sys.argv[4]
    model, opt = make(device)
    warm(model, opt)
    ids = batch(model.cfg, 3, device=device)
    with torch.no_grad():
        want = model(ids)
    state = ModelState(model, opt)
    rng = random.Random(0)
    stop, errors, counts = threading.Event(), [], {"ok": 0, "refused": 0, "moves": 0, "steps": 0, "backwards": 0}

    def forwards():
        while not stop.is_set():
            try:
                with torch.no_grad():
                    got = model(ids)
            except StateError as e:
                if e.kind != "offloaded":
                    errors.append(repr(e)); return
                counts["refused"] += 1
                continue
            except Exception as e:
                errors.append(repr(e)); return
            if not torch.equal(got, want):
                errors.append("a forward returned wrong values"); return
            counts["ok"] += 1

    def steps():
        # an optimizer step reads params, grads and optim state: it runs whole or is refused
        while not stop.is_set():
            try:
                opt.step()
                counts["steps"] += 1
            except StateError as e:
                if e.kind != "offloaded":
                    errors.append(repr(e)); return
            except Exception as e:
                errors.append(repr(e)); return

    def trains():
        # a forward and its backward: an offload between them must not release what the backward reads
        while not stop.is_set():
            try:
                opt.zero_grad(set_to_none=True)  # (guarded: ordered against verbs; model.zero_grad() is not)
                lm_loss(model, ids).backward()
                counts["backwards"] += 1
            except StateError as e:
                if e.kind != "offloaded":
                    errors.append(repr(e)); return
            except Exception as e:
                errors.append(repr(e)); return

    def mover():
        groups = [["params"], ["params", "buffers"], None]
        i = 0
        while not stop.is_set():
            try:
                state.offload(groups[i % 3]); state.onload()
            except Exception as e:
                errors.append(repr(e)); return
            i += 1
            counts["moves"] += 1
            # a pause of 0-2 ms, at random, between moves: back to back, the mover's next offload claims the gate
            # between nearly every forward and its backward on an idle machine, and no backward is ever tried
            # whole (every interleaving still races: an offload can land inside any forward, step or backward)
            time.sleep(rng.random() * 0.002)

    # phase 1: forwards against offload/onload; phase 2 adds optimizer steps (lr 0: values unchanged);
    # phase 3: forwards with their backwards
    for g in opt.param_groups:
        g["lr"] = 0.0
    for workers in ([forwards, mover], [forwards, mover, steps], [trains, mover]):
        stop.clear()
        threads = [threading.Thread(target=w) for w in workers]
        for t in threads: t.start()
        time.sleep(seconds / 3)
        stop.set()
        for t in threads: t.join(60)
        assert not any(t.is_alive() for t in threads), "a thread hangs"
    assert not errors, errors
    state.onload()
    with torch.no_grad():
        assert torch.equal(model(ids), want)
    print("COUNTS", counts)
    assert counts["ok"] > 10 and counts["moves"] > 10 and counts["backwards"] > 10, counts
    print("OK")
    """
)


@pytest.mark.parametrize("device", DEVICES)
def test_forwards_and_steps_against_offload_and_onload_in_another_thread_never_crash(device):
    """Every forward returns the right values or raises ``StateError("offloaded")``; every step runs or is refused
    (on CUDA the crash was an illegal memory access: the process ends there too)."""
    assert_isolated(_RACE, "OK", args=(str(RACE_SECONDS), device), timeout=240)


class _Gated(torch.nn.Module):
    """A linear layer whose forward waits for ``go`` (set ``entered`` first): a forward held open."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.entered, self.go = __import__("threading").Event(), __import__("threading").Event()
        self.hook = None  # called inside the forward, on its thread

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.go.wait(30)
        if self.hook is not None:
            self.hook()
        return self.lin(x)


def test_offload_from_another_thread_waits_for_a_running_forward():
    import threading

    model = _Gated()
    state = ModelState(model)
    want = model.lin(torch.ones(1, 4)).detach()
    out: dict[str, object] = {}
    fwd = threading.Thread(target=lambda: out.setdefault("y", model(torch.ones(1, 4))))
    fwd.start()
    assert model.entered.wait(10)
    mover = threading.Thread(target=lambda: out.setdefault("moved", state.offload()))
    mover.start()
    mover.join(0.5)
    # waiting, nothing released (asked of the storage: every verb, residency() too, waits for the forward)
    assert mover.is_alive() and model.lin.weight.untyped_storage().nbytes() == 64
    model.go.set()
    fwd.join(10)
    mover.join(10)
    assert not mover.is_alive() and torch.equal(out["y"], want)
    assert state.residency()["params"]["host"] == 2
    state.onload()


@pytest.mark.parametrize("verb", ["offload", "drop"])
def test_releasing_verb_from_inside_a_forward_on_the_same_thread_is_an_error_not_a_hang(verb):
    model = _Gated()
    model.go.set()
    state = ModelState(model)
    model.hook = lambda: getattr(state, verb)("params")
    with raises_kind(StateError, "inside_compute", match=rf"{verb}\(\) was called from inside forward"):
        model(torch.ones(1, 4))
    assert state.residency()["params"] == {"device": 2, "host": 0, "dropped": 0}  # nothing changed
    model.hook = None
    model(torch.ones(1, 4))  # the raised forward left the gate
    state.offload()  # and a verb runs (same thread)
    state.onload()


def test_verbs_that_release_nothing_run_from_inside_a_forward():
    model = _Gated()
    model.go.set()
    state = ModelState(model)
    seen = {}
    model.hook = lambda: seen.update(res=state.residency(), snap=state.snapshot(tag="inside"))
    model(torch.ones(1, 4))
    assert seen["res"]["params"]["device"] == 2 and seen["snap"].tag == "inside"


def test_a_forward_that_raises_leaves_the_gate_for_other_threads():
    import threading

    model = _Gated()
    model.go.set()
    state = ModelState(model)

    def boom() -> None:
        raise ValueError("inside the forward")

    model.hook = boom
    t = threading.Thread(target=lambda: pytest.raises(ValueError, model, torch.ones(1, 4)))
    t.start()
    t.join(10)
    done = threading.Event()
    threading.Thread(target=lambda: (state.offload(), done.set())).start()
    assert done.wait(5), "an offload waits for a forward that already raised"
    state.onload()


def test_an_optimizer_step_that_raises_does_not_block_verbs():
    """A step raising inside ``step()`` skips the post-hook that leaves the gate: the verb finds the
    reader gone (its frame ended) and runs -- on the same thread at once, on another within a second."""
    import threading

    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)

    def closure():
        raise ValueError("a closure that fails")

    with pytest.raises(ValueError):
        opt.step(closure)
    state.offload("optim")  # same thread
    state.onload()
    t = threading.Thread(target=lambda: pytest.raises(ValueError, opt.step, closure))
    t.start()
    t.join(10)
    done = threading.Event()
    threading.Thread(target=lambda: (state.offload("optim"), done.set())).start()
    assert done.wait(5)
    state.onload()


def test_a_forward_interrupted_by_a_base_exception_does_not_block_verbs():
    """``KeyboardInterrupt`` skips torch's ``always_call`` hooks (they run for ``Exception`` only)."""
    model = _Gated()
    model.go.set()
    state = ModelState(model)

    def interrupt() -> None:
        raise KeyboardInterrupt

    model.hook = interrupt
    with pytest.raises(KeyboardInterrupt):
        model(torch.ones(1, 4))
    model.hook = None
    state.offload()  # the reader left behind is found stale
    with raises_kind(StateError, "offloaded"):
        model(torch.ones(1, 4))
    state.onload()
    model(torch.ones(1, 4))


def test_two_forwards_each_calling_a_verb_from_a_hook_do_not_wait_for_each_other():
    """Each forward is a reader; a verb from inside a reader does not wait for other readers (that could
    be the other forward, waiting for this one): both finish."""
    import threading

    model = _Gated()
    state = ModelState(model)
    both = threading.Barrier(2, timeout=10)
    model.hook = lambda: (both.wait(), state.residency(), state.snapshot(tag=threading.current_thread().name))
    model.go.set()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            model(torch.ones(1, 4))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, name=f"t{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert {"t0", "t1"} <= {s.tag for s in core_of(state).snapshots}
