"""Direct touches of offloaded state are a Python error, never a crash (``core/touch.py``).

Each touch is something a user could plausibly write while state is
offloaded (logging a gradient norm, reading Adam's moments, a state_dict
taken earlier, ``print``, ``deepcopy``, ``clip_grad_norm_``...). On released
CPU storage each would be a segmentation fault, so they run in a subprocess:
one runs them all in a row and reports each; if it dies, the touches after
the one it died in run in a new one (a crash fails that touch, not pytest).
"""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
from dist_harness import run_distributed
from helpers import DEVICES, make, run_isolated, warm
from raises import raises_kind
from torch import nn

from stateshift import ModelState, StateError
from stateshift.core import touch

_TOUCHES = textwrap.dedent(
    """
    import copy, io, sys, threading
    sys.path[:0] = sys.argv[1:3]
    import torch
    torch.set_num_threads(1)
    from helpers import batch, lm_loss, make, warm
    from stateshift import ModelState, StateError
    from stateshift.core import touch

    dev = sys.argv[4]
    def P(m): return m.tok.weight
    def buf(m): return m.tokens_seen
    def loss_then_offload(m, s):
        loss = lm_loss(m, batch(m.cfg, 1, device=dev)); s.offload("params"); loss.backward()

    def in_watched_thread(m, o, s):
        out, ready, go = {}, threading.Event(), threading.Event()
        def reader():
            touch.watch_thread(); ready.set(); go.wait(10)
            try: P(m).grad.norm()
            except Exception as e: out["e"] = e
        t = threading.Thread(target=reader); t.start(); ready.wait(10)
        s.offload("grads"); go.set(); t.join(10)
        raise out["e"]

    # name -> (the group the error must name, the touch; ``s`` is the state, nothing offloaded yet)
    TOUCHES = {
        "p.grad.norm()": ("grads", lambda m, o, s: (s.offload("grads"), P(m).grad.norm())),
        "exp_avg read": ("optim", lambda m, o, s: (s.offload("optim"), o.state[P(m)]["exp_avg"].sum())),
        "p.add_()": ("params", lambda m, o, s: (s.offload("params"), P(m).data.add_(1.0))),
        "p.copy_()": ("params", lambda m, o, s: (s.offload("params"), P(m).data.copy_(torch.zeros(P(m).shape, device=dev)))),
        "model.to(float64)": ("params", lambda m, o, s: (s.offload("params"), m.to(torch.float64))),
        "model.half()": ("params", lambda m, o, s: (s.offload("params"), m.half())),
        "model.state_dict() before, read after": ("params", lambda m, o, s: (sd := m.state_dict(), s.offload("params"), sd["tok.weight"].clone())),
        "optimizer.state_dict() before, read after": ("optim", lambda m, o, s: (sd := o.state_dict(), s.offload("optim"), sd["state"][0]["exp_avg"].sum())),
        "print(p)": ("params", lambda m, o, s: (s.offload("params"), print(P(m), file=io.StringIO()))),
        "repr(p.grad)": ("grads", lambda m, o, s: (s.offload("grads"), repr(P(m).grad))),
        "p.sum()": ("params", lambda m, o, s: (s.offload("params"), P(m).sum())),
        "p.clone()": ("params", lambda m, o, s: (s.offload("params"), P(m).clone())),
        "copy.deepcopy(model)": ("params", lambda m, o, s: (s.offload("params"), copy.deepcopy(m))),
        "clip_grad_norm_": ("grads", lambda m, o, s: (s.offload("grads"), torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))),
        "p.tolist()": ("params", lambda m, o, s: (s.offload("params"), P(m).tolist())),
        "p.detach().numpy()": ("params", lambda m, o, s: (s.offload("params"), P(m).detach().numpy().sum())),
        "p[0, 0].item()": ("params", lambda m, o, s: (s.offload("params"), P(m)[0, 0].item())),
        "p[index tensor]": ("params", lambda m, o, s: (s.offload("params"), P(m)[torch.tensor([0, 1], device=dev)])),
        "torch.cat([p, p])": ("params", lambda m, o, s: (s.offload("params"), torch.cat([P(m), P(m)]))),
        "F.linear(x, p)": ("params", lambda m, o, s: (s.offload("params"), torch.nn.functional.linear(torch.ones(1, m.cfg.width, device=dev), P(m)))),
        "p.grad.mul_() by hand": ("grads", lambda m, o, s: (s.offload("grads"), P(m).grad.mul_(0.5))),
        "foreach over exp_avg": ("optim", lambda m, o, s: (s.offload("optim"), torch._foreach_mul_([st["exp_avg"] for st in o.state.values()], 0.9))),
        "backward after an offload": ("params", lambda m, o, s: loss_then_offload(m, s)),
        "persistent buffer read": ("buffers", lambda m, o, s: (s.offload("buffers"), buf(m) + 1)),
        "alias made after the offload": ("params", lambda m, o, s: (s.offload("params"), P(m).detach().view(-1)[:3].sum())),
        "torch.equal(p, p)": ("params", lambda m, o, s: (s.offload("params"), torch.equal(P(m), P(m)))),
        "p.to(copy=True)": ("params", lambda m, o, s: (s.offload("params"), P(m).to("cpu", copy=True))),
        "dropped grads read": ("grads", lambda m, o, s: (s.drop("grads"), P(m).grad.sum())),
        "on disk, read": ("params", lambda m, o, s: (s.offload("params", to="disk"), P(m).sum())),
        "in a watched thread": ("grads", in_watched_thread),
    }

    names = sys.argv[5:] if len(sys.argv) > 5 else list(TOUCHES)
    for name in names:
        print("BEGIN", name, flush=True)
        model, opt = make(dev); warm(model, opt)
        state = ModelState(model, opt, disk_dir=sys.argv[3])
        group, fn = TOUCHES[name]
        try:
            fn(model, opt, state)
            print("RESULT", name, "|", "no error", flush=True)
        except StateError as e:
            ok = e.kind == "offloaded"
            print("RESULT", name, "|", ("raised" if e.group == group else f"named {e.group}") if ok else f"other: {e!r}",
                  flush=True)
        except Exception as e:
            print("RESULT", name, "|", "other:", repr(e)[:200], flush=True)
        state.close()
    print("LIST", *TOUCHES, sep="\\n", flush=True)
    """
)


def _run_touches(tmp_path, device: str) -> dict[str, str]:
    """Every touch's outcome; a crash is that touch's outcome, and the others run in a new process."""
    results: dict[str, str] = {}
    todo: list[str] | None = None  # None: all
    for _ in range(40):
        proc = run_isolated(_TOUCHES, str(tmp_path), device, *(todo or []), timeout=240)
        begun = None
        for line in proc.stdout.splitlines():
            if line.startswith("BEGIN "):
                begun = line[6:]
            elif line.startswith("RESULT "):
                name, outcome = line[7:].split(" | ", 1)
                results[name], begun = outcome, None
        if todo is None:
            listed = proc.stdout.split("LIST\n", 1)
            todo = listed[1].split("\n") if len(listed) == 2 else None
        if proc.returncode == 0:
            return results
        assert begun is not None, (proc.returncode, proc.stderr[-2000:])
        results[begun] = f"crashed (return code {proc.returncode})"
        todo = [n for n in (todo or []) if n not in results] or None
        if todo is None:
            return results
    raise AssertionError("too many crashes")


@pytest.mark.parametrize("device", DEVICES)
def test_each_direct_touch_of_offloaded_state_raises_offloaded_state_error(tmp_path, device):
    """On CUDA a released storage read is a sticky illegal-address fault: a crash there ends only its process."""
    results = _run_touches(tmp_path, device)
    assert len(results) >= 30, results
    bad = {k: v for k, v in results.items() if v != "raised"}
    assert not bad, bad


# ----------------------------------------------------------------------------- in process (nothing read)


def _stack_depths() -> tuple[int, int]:
    return torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()


def test_nothing_is_on_the_mode_stacks_while_nothing_is_released():
    """The check costs nothing when nothing is offloaded: its modes are on no stack."""
    gc.collect()  # (states other tests dropped while offloaded are forgotten once collected)
    touch.sync_thread()
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    assert _stack_depths() == (0, 0) and not touch.active()
    state.offload("grads")
    assert _stack_depths() == (1, 1) and touch.active()
    state.onload()
    assert _stack_depths() == (0, 0) and not touch.active()
    state.offload()
    state.close()  # a closed state releases nothing
    assert _stack_depths() == (0, 0) and not touch.active()


def test_a_mode_the_user_enters_meanwhile_keeps_its_place_on_the_stack():
    """The check's modes sit at the bottom: a user's mode entered before an offload and left after the
    onload pops itself, not the check's (and the other way round)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    with Count() as mode:
        state.offload("grads")
        assert torch._C._get_dispatch_stack_at(1) is mode  # on top of the check's
        torch.ones(2).sum()
    assert _stack_depths() == (1, 1) and Count.n >= 1
    with Count():
        state.onload()
    assert _stack_depths() == (0, 0)


def test_a_refused_touch_changes_nothing_and_other_states_are_not_affected():
    model, opt = make()
    warm(model, opt)
    other, _ = make(seed=1)
    state, _ = ModelState(model, opt), ModelState(other)
    want = model.tok.weight.detach().clone()
    state.offload("params")
    with raises_kind(StateError, "offloaded", match="params"), torch.no_grad():
        model.tok.weight.add_(1.0)
    other.tok.weight.sum()  # another state's resident tensors: no error
    torch.ones(3).add_(1.0)  # nor any other tensor's
    state.onload()
    assert torch.equal(model.tok.weight, want)


def test_verbs_still_move_state_while_the_check_is_on():
    from helpers import assert_same, capture

    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    want = capture(state)
    state.offload(["params", "optim"])
    snap = state.snapshot(["params", "optim"], tag="while-offloaded")
    state.restore(snap)
    state.drop("grads")
    state.onload()
    want = {k: (torch.zeros_like(v) if k.endswith(".grad") else v) for k, v in want.items()}
    assert_same(capture(state), want)


# ----------------------------------------------------------------------------- FSDP2 on gloo


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _fsdp2_touches(rank: int, world: int) -> dict[str, str]:
    """FSDP2's own reads of offloaded shards, each in turn: what each raised (a crash kills the rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _Net()
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    state = ModelState(model, opt)
    w = model.blocks[0][0].weight
    touches = {
        "full_tensor()": ("params", lambda sd: w.full_tensor()),
        "clip_grad_norm_": ("grads", lambda sd: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
        "DTensor sum": ("params", lambda sd: w.sum()),
        "to_local() read": ("params", lambda sd: w.to_local() * 2),
        "exp_avg full_tensor()": ("optim", lambda sd: opt.state[w]["exp_avg"].full_tensor()),
        "state_dict() before, read after": ("params", lambda sd: sd["blocks.0.0.weight"].full_tensor()),
    }
    out = {}
    for name, (group, fn) in touches.items():
        sd = model.state_dict()
        state.offload(group)
        try:
            fn(sd)
            out[name] = "no error"
        except StateError as e:
            out[name] = ("raised" if e.group == group else f"named {e.group}") if e.kind == "offloaded" else repr(e)
        state.onload()
    model(torch.ones(4, 8)).sum().backward()  # and training goes on
    return out


def test_fsdp2_reads_of_offloaded_shards_raise_on_every_rank():
    results = run_distributed(_fsdp2_touches, world_size=2, timeout=120)
    for r in results:
        assert r and all(v == "raised" for v in r.values()), r


def test_a_state_dropped_while_offloaded_is_forgotten_once_collected():
    gc.collect()
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    state.offload("grads")
    assert touch.active()
    del model, opt, state
    gc.collect()
    assert not touch.active()
    touch.sync_thread()
    assert _stack_depths() == (0, 0)


def _finalizers_of(obj: object) -> int:
    """Live ``weakref.finalize`` callbacks attached to ``obj``."""
    import weakref

    return sum(1 for f in list(weakref.finalize._registry) if (info := f.peek()) is not None and info[0] is obj)


def test_an_owner_gets_one_finalizer_however_often_it_offloads():
    """The registry forgets a collected owner through one finalizer per owner: offload / onload cycles (a
    trainer parks every step) must not add one each."""
    from stateshift.core.engine import core_of

    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    owner = core_of(state)
    for _ in range(30):
        state.offload()
        state.onload()
    assert _finalizers_of(owner) == 1
    del model, opt, state, owner
    gc.collect()
    touch.active()  # (forgets the collected owners)
    assert all(f.alive for f in touch._watched.values())


def test_an_interrupted_push_leaves_the_mode_stack_as_it_was():
    """``KeyboardInterrupt`` between the pops and the pushes of ``_push_bottom`` (or ``_remove``): the modes
    above are pushed back, and ``_turn_on`` interrupted half way leaves the thread off, as it says."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mine(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    pushes = []

    def push_then_interrupt(mode):
        pushes.append(mode)
        if len(pushes) == 1:
            raise KeyboardInterrupt
        torch._C._push_on_torch_dispatch_stack(mode)

    with Mine() as mine:
        with pytest.raises(KeyboardInterrupt):
            touch._push_bottom(torch._C._len_torch_dispatch_stack, touch._pop_dispatch, push_then_interrupt, object())
        assert _stack_depths()[0] == 1 and torch._C._get_dispatch_stack_at(0) is mine
    assert _stack_depths() == (0, 0)

    real = touch._push_bottom
    calls = []

    def second_fails(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(*args)

    touch._push_bottom = second_fails
    try:
        with pytest.raises(KeyboardInterrupt):
            touch._turn_on()
    finally:
        touch._push_bottom = real
    assert _stack_depths() == (0, 0) and getattr(touch._tls, "modes", None) is None
