"""Edge cases of every verb: no value lost, no crash where a Python error belongs.

Budgets running out mid-verb, a model changed between verbs, misuse of the API, states lost while offloaded.
"""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
from fakes.mcore import fake_train_step
from fakes.mcore.setups import _x, after_steps
from helpers import assert_isolated, assert_same, capture, live, make, warm
from raises import raises_kind

from stateshift import BudgetError, ModelState, StateError
from stateshift.core.engine import core_of
from stateshift.core.pool import HostPool
from stateshift.rl import PiOldCycle

# ----------------------------------------------------------------------------- 1. an error changes nothing


def test_restore_out_of_pool_budget_leaves_every_value_in_place():
    """Params and optim offloaded, a host snapshot sharing both homes, room for one params-sized block:
    the restore of a device snapshot must fail before the params' home is swapped for a fresh block."""
    model, opt = make()
    warm(model, opt)
    pool = HostPool()
    state = ModelState(model, opt, pool=pool)
    state.offload(["params", "optim"])
    state.snapshot(["params", "optim"], tag="shared")  # shares both homes copy-on-write
    other = state.snapshot(["params", "optim"], tag="other", placement="device")
    pool.budget_bytes = pool.stats.in_use_bytes + state.layout("params").total
    before, residency = capture(state, ["params", "optim"]), state.residency()
    with raises_kind(BudgetError, "pool"):
        state.restore(other)
    assert state.residency() == residency
    assert_same(capture(state, ["params", "optim"]), before)
    pool.budget_bytes = None
    state.onload()
    assert_same(capture(state, ["params", "optim"]), before)


def test_snapshot_out_of_pool_budget_keeps_the_snapshot_it_would_replace():
    model, opt = make()
    warm(model, opt)
    pool = HostPool()
    state = ModelState(model, opt, pool=pool)
    old = state.snapshot(["params"], tag="s")
    pool.budget_bytes = pool.stats.in_use_bytes  # no room for the optim part of a new "s"
    with raises_kind(BudgetError, "pool"):
        state.snapshot(["params", "optim"], tag="s")
    assert not old.released and core_of(state).snapshots.get("s") is old


# ----------------------------------------------------------------------------- 2. rebuild after the other groups


def _pi_old_then_a_step(config):
    """A fake Megatron state after two steps, pi_old (params and optim) taken, one more step: the state,
    pi_old, the current values and the master-rebuild plug-in."""
    ddp, opt = after_steps(config)
    state = ModelState(ddp, opt)
    pi_old = state.snapshot(["params", "optim"], tag="pi_old")
    fake_train_step(ddp, opt, _x(2))
    return state, pi_old, capture(state, ["params", "optim"]), state.backends[1].rebuild_plugin()


@pytest.mark.parametrize("config", ["dense_float16", "distrib", "distrib_ep"])
def test_swapped_params_and_optim_with_master_rebuild_gives_back_the_current_params(config):
    """The rebuild reads the fp32 masters: it must run after the optim stash is back, not under pi_old's masters."""
    state, pi_old, now, plugin = _pi_old_then_a_step(config)
    assert plugin.available() is None
    with state.swapped(pi_old, rebuild={"params": plugin}):
        pass
    assert_same(capture(state, ["params", "optim"]), now)


@pytest.mark.parametrize("config", ["distrib", "dense_float16"])
def test_swapped_params_with_rebuild_while_optim_is_offloaded_outside(config):
    """Optim offloaded before a swap of params and optim: the rebuild must read the current masters from
    their home (lent to the device for it), and optim stays offloaded afterwards."""
    state, pi_old, now, plugin = _pi_old_then_a_step(config)
    with state.swapped(pi_old, rebuild={"params": plugin}):
        state.offload("buffers")
    state.offload("optim")
    with state.swapped(pi_old, rebuild={"params": plugin}):
        pass
    assert state.residency()["optim"]["device"] == 0
    assert_same(capture(state, ["params", "optim"]), now)


# ----------------------------------------------------------------------------- 3. close and lifetime


def test_close_while_offloaded_brings_the_values_back():
    model, opt = make()
    warm(model, opt)
    want = live(model, opt)
    state = ModelState(model, opt)
    state.offload()
    state.close()
    assert_same(live(model, opt), want)
    with raises_kind(StateError, "closed"):
        state.onload()
    state.close()  # idempotent


def test_a_storage_released_by_user_code_is_not_blamed_on_another_state():
    """A tracked storage resized to 0 outside stateshift (no framework copy, no other state holding it):
    the error says so, instead of naming "another ModelState" -- the state that asks is not another one
    (found by an adversarial session: ``holder`` returned the asking table itself)."""
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt, guard=False)
    core_of(state).slots()
    storage = model.tok.weight.untyped_storage()
    size = storage.nbytes()
    storage.resize_(0)
    with raises_kind(StateError, "foreign", match="released outside stateshift") as err:
        state.snapshot("params", tag="s")
    assert "another ModelState" not in str(err.value)
    storage.resize_(size)  # (the user's code gives it back)
    state.snapshot("params", tag="s")
    state.close()


def test_losing_the_last_reference_to_an_offloaded_state_loses_nothing():
    model, opt = make()
    warm(model, opt)
    want = live(model, opt)
    state = ModelState(model, opt, guard=False)
    state.offload()
    del state
    gc.collect()
    with raises_kind(StateError, "foreign", match="ModelState.owner"):
        ModelState(model, opt)
    owner = ModelState.owner(next(model.parameters()))
    assert owner is not None
    owner.close()
    assert_same(live(model, opt), want)
    assert ModelState.owner(next(model.parameters())) is None
    ModelState(model, opt).offload()  # a new state works


# ----------------------------------------------------------------------------- 4. two threads

_THREADS = textwrap.dedent(
    """
    import sys, threading, torch
    sys.path[:0] = sys.argv[1:3]
    from helpers import capture, make, warm, assert_same
    from stateshift import ModelState
    torch.manual_seed(0)
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    want = capture(state)
    errors = []

    def mover():
        try:
            for _ in range(150):
                state.offload(); state.onload()
        except Exception as e:
            errors.append(repr(e))

    def snapper():
        try:
            for _ in range(150):
                s = state.snapshot(state.groups, tag="t")
                state.restore(s)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=mover), threading.Thread(target=snapper)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors
    state.onload()
    assert_same(capture(state), want)
    print("OK")
    """
)


def test_verbs_from_two_threads_neither_crash_nor_corrupt(tmp_path):
    for _ in range(3):
        assert_isolated(_THREADS, "OK")


# ----------------------------------------------------------------------------- 7. rebuild with params offloaded


@pytest.mark.parametrize("config", ["distrib", "distrib_ep"])
def test_pi_old_cycle_with_params_offloaded_under_the_distributed_optimizer(config):
    ddp, opt = after_steps(config)
    state = ModelState(ddp, opt)
    state.offload("params")
    plugin = state.backends[1].rebuild_plugin()
    assert "offloaded" in plugin.available()  # a reason, not a raw RuntimeError
    cycle = PiOldCycle(state)
    cycle.begin()
    with cycle.old_policy():
        pass
    cycle.end()
    assert state.residency()["params"]["device"] == 0


# ----------------------------------------------------------------------------- 13. input a user gets wrong


def test_unknown_optimizer_is_named_not_the_model():
    model, _ = make()
    with pytest.raises(Exception, match="optimizer of type builtins.object"):
        ModelState(model, object())


@pytest.mark.parametrize("groups", [["params", "params"], []])
def test_duplicate_or_empty_group_lists_are_refused(groups):
    model, opt = make()
    state = ModelState(model, opt)
    for verb in (state.offload, state.onload, state.drop, state.snapshot):
        with pytest.raises(ValueError, match="twice|no groups"):
            verb(groups)


# ----------------------------------------------------------------------------- 5. reads of offloaded state


def _offloaded():
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    state.offload()
    return model, opt, state


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda model, opt: model.state_dict(), id="module.state_dict"),
        pytest.param(lambda model, opt: model.blocks[0].state_dict(keep_vars=True), id="submodule.state_dict"),
        pytest.param(
            lambda model, opt: model.load_state_dict(
                {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in _shapes(model).items()}
            ),
            id="load_state_dict",
        ),
        pytest.param(lambda model, opt: opt.state_dict(), id="optimizer.state_dict"),
        pytest.param(lambda model, opt: opt.load_state_dict(opt.state_dict()), id="optimizer.load_state_dict"),
        pytest.param(lambda model, opt: opt.zero_grad(set_to_none=False), id="zero_grad(set_to_none=False)"),
    ],
)
def test_common_reads_of_offloaded_state_raise_a_python_error(read):
    from stateshift import StateError

    model, opt, state = _offloaded()
    with raises_kind(StateError, "offloaded"):
        read(model, opt)
    state.onload()
    read(model, opt)  # resident: fine


def _shapes(model):
    return {n: t for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()] if n != "mask"}


def test_zero_grad_to_none_with_grads_offloaded_is_allowed():
    model, opt, state = _offloaded()
    opt.zero_grad(set_to_none=True)  # reads nothing
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- 6. state added later


def test_module_added_after_the_state_was_built_is_guarded():
    model, opt = make()
    state = ModelState(model, opt)
    model.blocks[0].adapter = torch.nn.Linear(model.cfg.width, model.cfg.width)  # a LoRA-like adapter
    old_forward = model.blocks[0].forward
    model.blocks[0].forward = lambda x, mask: old_forward(x, mask) + model.blocks[0].adapter(x)
    state.offload("params")
    from stateshift import StateError

    with raises_kind(StateError, "offloaded", match="params"):
        model.blocks[0].adapter(torch.zeros(1, model.cfg.width))


def test_parameter_replaced_by_a_new_object_is_guarded():
    model, opt = make()
    state = ModelState(model, None)
    model.ln_f.weight = torch.nn.Parameter(torch.ones(model.cfg.width))  # a new object, not yet listed
    state.offload("params")
    from stateshift import StateError

    with raises_kind(StateError, "offloaded", match="params"):
        model.ln_f(torch.zeros(1, model.cfg.width))


_UNFROZEN = textwrap.dedent(
    """
    import sys
    sys.path[:0] = sys.argv[1:3]
    import torch
    from stateshift import ModelState, StateError

    model = torch.nn.Linear(4, 1)
    model.requires_grad_(False)  # frozen when the state is built: no gradient hook then
    state = ModelState(model)
    model.weight.requires_grad_(True)  # unfrozen later (progressive unfreezing): same objects, same names
    x = torch.randn(2, 4)
    model(x).sum().backward()
    state.offload("grads")
    try:
        model(x).sum().backward()  # accumulates into the released weight.grad
    except StateError as e:
        if e.kind != "offloaded":
            raise
        print("RAISED", e)
    """
)


def test_parameter_unfrozen_after_the_state_was_built_is_guarded():
    assert_isolated(_UNFROZEN, "RAISED", "weight.grad")


def test_buffers_trading_persistence_between_verbs_are_listed():
    """One buffer made non-persistent and another persistent between two verbs: as many
    non-persistent buffers as before, but the listing must follow ``state_dict``."""
    model = torch.nn.Linear(4, 4)
    model.register_buffer("a", torch.randn(3))
    model.register_buffer("b", torch.randn(3), persistent=False)
    state = ModelState(model)
    state.offload()
    state.onload()
    model.register_buffer("a", model.a, persistent=False)
    model.register_buffer("b", model.b, persistent=True)
    snap = state.snapshot()
    assert set(snap.tensors()) == set(model.state_dict())


def test_submodule_renamed_between_verbs_is_listed_under_its_new_name():
    """Same modules in the same order, same tensors: only a child's key changed. Names are what
    snapshots and checkpoints carry, so they must follow ``state_dict``."""
    model = torch.nn.Sequential()
    model.add_module("first", torch.nn.Linear(2, 2))
    model.add_module("old", torch.nn.Linear(2, 2))
    state = ModelState(model)
    state.offload()
    state.onload()
    model._modules["new"] = model._modules.pop("old")
    assert set(state.snapshot().tensors()) == set(model.state_dict())


@pytest.mark.parametrize("to", ["host", "disk"])
def test_buffer_leaving_the_listing_while_offloaded_gets_its_values_back(tmp_path, to):
    """A buffer made non-persistent while offloaded is no longer stateshift's (non-persistent buffers
    stay put), but the module still holds it: it must get its storage and values back, not stay
    released forever (its values were only in the home that the re-listing let go)."""
    model = torch.nn.Linear(4, 4)
    model.register_buffer("a", torch.arange(6.0))
    state = ModelState(model, disk_dir=tmp_path)
    state.offload(to=to)
    model.register_buffer("a", model.a, persistent=False)
    state.onload()
    nbytes = model.a.untyped_storage().nbytes()
    assert nbytes == 24  # (reading a released storage would be a segfault)
    assert torch.equal(model.a, torch.arange(6.0))
    model(torch.ones(1, 4))


# ----------------------------------------------------------------------------- 8. torch.compile


def test_compiled_model_has_the_plain_models_names():
    model, opt = make()
    plain = {s.name for s in core_of(ModelState(model, opt, guard=False)).slots()}
    compiled = ModelState(torch.compile(model), opt, guard=False)
    assert {s.name for s in core_of(compiled).slots()} == plain
    assert not any("_orig_mod" in m.name for s in core_of(compiled).slots() for m in s.info.members)


def _two_linears() -> torch.nn.Sequential:
    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Identity()), torch.nn.Linear(2, 1, bias=False))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, bias=False), torch.nn.Module(), nested)
    model[0].register_buffer("a", torch.zeros(1))
    model[0].register_buffer("b", torch.zeros(1), persistent=False)
    return model


def _move_to_neighbour(m: torch.nn.Sequential) -> None:
    """The same tensors under the same names in the same order over the whole tree (the walk visits the
    empty module right before ``m[1]``): only which module holds the weight differs."""
    m[2]._parameters["weight"] = m[1]._parameters.pop("weight")


_TREE_CHANGES = {
    "param replaced": lambda m: setattr(m[0], "weight", torch.nn.Parameter(torch.zeros(2, 2))),
    "param added": lambda m: m[1].register_parameter("extra", torch.nn.Parameter(torch.zeros(1))),
    "param removed": lambda m: m[0]._parameters.pop("bias"),
    "param renamed": lambda m: m[0]._parameters.__setitem__("b2", m[0]._parameters.pop("bias")),
    "param moved to the neighbouring module": _move_to_neighbour,
    "param frozen": lambda m: m[0].weight.requires_grad_(False),
    "buffer replaced": lambda m: setattr(m[0], "a", torch.zeros(1)),
    "buffers trading persistence": lambda m: (
        m[0].register_buffer("a", m[0].a, persistent=False),
        m[0].register_buffer("b", m[0].b, persistent=True),
    ),
    "module replaced": lambda m: m.__setitem__(1, torch.nn.Linear(2, 2, bias=False)),
    "module removed": lambda m: m._modules.pop("2"),
    "module added": lambda m: m[2].add_module("relu", torch.nn.ReLU()),
    "module renamed": lambda m: m._modules.__setitem__("z", m._modules.pop("1")),
    "module added two levels down": lambda m: m[3][0].add_module("relu", torch.nn.ReLU()),
    "module replaced two levels down": lambda m: m[3].__setitem__(0, torch.nn.Sequential(torch.nn.Tanh())),
    "param replaced two levels down": lambda m: setattr(m[3][1], "weight", torch.nn.Parameter(torch.zeros(1, 2))),
    "subtrees swapped": lambda m: m._modules.__setitem__("3", torch.nn.Sequential(m[3][1], m[3][0])),
}


@pytest.mark.parametrize("change", sorted(_TREE_CHANGES))
def test_tree_watch_sees_every_kind_of_change(change):
    """The one cheap pass per verb (``TreeWatch``, built column by column in C) sees each change the
    listing depends on, and nothing when nothing changed."""
    from stateshift.backends.torch import TreeWatch

    model = _two_linears()
    watch = TreeWatch((model,))
    assert watch.changed() and not watch.changed()
    model[0].weight.data = torch.ones(2, 2)  # storage changes are the slot table's business, not the watch's
    assert not watch.changed()
    _TREE_CHANGES[change](model)
    assert watch.changed() and not watch.changed()


def test_module_moved_into_an_empty_child_slot_is_listed_under_its_new_name():
    """Found by the adversarial session: a module moved into a child slot that held ``None`` (an optional
    submodule) keeps every id, name and count the walk sees (it skips ``None``); only which key holds
    the module differs. Snapshots must carry the new names."""
    from stateshift.backends.torch import TreeWatch

    def model() -> torch.nn.Module:
        m = torch.nn.Module()
        m.add_module("a", torch.nn.Linear(2, 2))
        m.add_module("b", None)
        return m

    m = model()
    watch = TreeWatch((m,))
    assert watch.changed() and not watch.changed()
    m.b, m.a = m.a, None
    assert watch.changed()
    m = model()
    state = ModelState(m)
    state.offload()
    state.onload()
    m.b, m.a = m.a, None
    assert set(state.snapshot().tensors()) == set(m.state_dict()) == {"b.weight", "b.bias"}


def test_swap_tensors_conversion_works_while_a_state_and_a_snapshot_exist():
    """``model.to(...)`` with torch's swap-on-conversion (what FSDP2's DTensor params always get) swaps a new
    tensor into each ``Parameter`` object and refuses any param with a weak reference: the state's guards
    hold none. The snapshot restores exactly into the swapped-in storages, and a backward still works."""
    model, opt = make()
    warm(model, opt)
    state = ModelState(model, opt)
    want = capture(state)
    snap = state.snapshot(["params", "buffers", "grads", "optim"])
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        old = [p.untyped_storage()._cdata for p in model.parameters()]
        model._apply(lambda t: t.clone().add_(1) if t.is_floating_point() else t.clone())  # a move: new storages
        assert all(p.untyped_storage()._cdata != o for p, o in zip(model.parameters(), old, strict=True))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    state.restore(snap)
    assert_same(capture(state), want)
    warm(model, opt)
