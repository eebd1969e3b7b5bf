"""The pi_old cycle helper (stateshift.rl.PiOldCycle): generic over backends, with the Megatron
master rebuild as a plug-in. CPU: plain PyTorch (the built-in model) and the Megatron fake."""

from __future__ import annotations

import copy

import pytest
import torch
from fakes.mcore import FakeDenseModel, build_fake_ddp, build_fake_optimizer, fake_train_step
from fakes.mcore.setups import _x, build, pretend_cuda_engine
from helpers import SMALL, batch, make, one_torch_thread, train_step
from raises import raises_kind

from stateshift import DiskError, LayoutError, ModelState
from stateshift.backends.megatron import MasterRebuild
from stateshift.core.engine import core_of
from stateshift.rl import PiOldCycle, Rebuild, default_groups, find_rebuild

N = 4

#: the copy engine as ModelState built it (a GPU wherever CUDA is present), or pretending to be on
#: cuda:0 (what a machine with CUDA gives these CPU models): the checks must hold on either
ENGINES = ["as_built", "on_cuda"]


def _engine(state, engine, monkeypatch):
    if engine == "on_cuda":
        pretend_cuda_engine(state, monkeypatch)
    return state


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@torch.no_grad()
def _old_logits(model, ids):
    was = model.training
    model.eval()  # the built-in model counts tokens in training mode; old log-probs must not
    try:
        return model(ids).clone()
    finally:
        model.train(was)


def _torch_setup():
    model, opt = make()
    train_step(model, opt, 0)
    return model, opt


# ----------------------------------------------------------------------------- plain PyTorch


@pytest.mark.parametrize(
    ("placement", "engine"),
    # (an explicit "device" with a pretended cuda engine would allocate on a GPU: not pretended)
    [("host", "as_built"), ("device", "as_built"), ("auto", "as_built"), ("host", "on_cuda"), ("auto", "on_cuda")],
)
def test_run_computes_old_logits_under_pi_old_and_trains_the_current_weights(placement, engine, monkeypatch):
    model, opt = _torch_setup()
    twin, twin_opt = _torch_setup()
    frozen = copy.deepcopy(model)  # what pi_old is
    state = _engine(ModelState(model, opt), engine, monkeypatch)
    cycle = PiOldCycle(state, placement=placement)
    steps = [10 + i for i in range(N)]  # mini-batch i is batch(SMALL, 10 + i)
    olds = cycle.run(steps, lambda s: _old_logits(model, batch(SMALL, s)), lambda s: train_step(model, opt, s))
    for s, got in zip(steps, olds, strict=True):
        assert torch.equal(got, _old_logits(frozen, batch(SMALL, s)))
    for i in range(N):
        train_step(twin, twin_opt, 10 + i)
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    # the model lives on the CPU: "auto" keeps pi_old in CPU memory (host), GPU or not
    assert cycle.stats.placement == ("host" if placement == "auto" else placement)
    if placement != "device" or core_of(state).engine.device is None:
        assert cycle.stats.pcie_bytes == cycle.stats.device_bytes == 0 and cycle.stats.host_bytes > 0
    assert (cycle.stats.snapshots, cycle.stats.swaps, cycle.stats.skipped_swaps, cycle.stats.rebuilds) == (
        1,
        N - 1,
        1,
        0,
    )
    assert find_rebuild(state) is None and cycle.rebuild is None
    assert "pi_old" not in {t for t, _ in core_of(state).snapshots.keys()}  # noqa: SIM118  # released at the end


@pytest.mark.parametrize("engine", ENGINES)
def test_old_policy_while_params_are_offloaded(engine, monkeypatch):
    model, opt = _torch_setup()
    state = _engine(ModelState(model, opt), engine, monkeypatch)
    probe = batch(SMALL, 99)
    want = _old_logits(model, probe)
    state.offload()
    cycle = PiOldCycle(state)
    cycle.begin()  # from the offloaded home: zero-copy
    assert cycle.stats.placement == "host"
    assert cycle.stats.host_bytes == cycle.stats.pcie_bytes == cycle.stats.device_bytes == 0
    state.onload()
    train_step(model, opt, 1)
    now = {k: v.clone() for k, v in model.state_dict().items()}
    state.offload("params")
    with cycle.old_policy():
        assert torch.equal(_old_logits(model, probe), want)
    assert state.residency()["params"]["device"] == 0
    state.onload()
    for k, v in model.state_dict().items():
        assert torch.equal(v, now[k]), k
    cycle.end()


def test_one_minibatch_needs_no_snapshot_and_skip_first_can_be_turned_off():
    model, opt = _torch_setup()
    state = ModelState(model, opt)
    cycle = PiOldCycle(state)
    cycle.run([batch(SMALL, 1)], lambda ids: _old_logits(model, ids), lambda ids: train_step(model, opt, 1))
    assert cycle.stats.snapshots == 0 and cycle.stats.swaps == 0
    cycle.run(
        [batch(SMALL, 2)] * 2,
        lambda ids: _old_logits(model, ids),
        lambda ids: train_step(model, opt, 2),
        skip_first=False,
    )
    assert cycle.stats.snapshots == 1 and cycle.stats.swaps == 2 and cycle.stats.skipped_swaps == 1


def test_bad_arguments_are_refused():
    model, opt = _torch_setup()
    state = ModelState(model, opt)
    with pytest.raises(ValueError, match="placement"):
        PiOldCycle(state, placement="gpu")  # type: ignore[arg-type]  ("disk" is a placement since the disk tier)
    with raises_kind(DiskError, "tier", match="disk_dir"):
        PiOldCycle(state, placement="disk")  # but only for a state with a disk tier
    with raises_kind(LayoutError, "unknown_group"):
        PiOldCycle(state, groups=["params", "weights"])
    with pytest.raises(TypeError, match="Rebuild"):
        PiOldCycle(state, rebuild=lambda: None)  # type: ignore[arg-type]
    cycle = PiOldCycle(state)
    with pytest.raises(RuntimeError, match="begin"), cycle.old_policy():
        pass


# ----------------------------------------------------------------------------- Megatron (fake)


def test_megatron_default_groups_and_plugin():
    ddp, opt = build("distrib_ep")
    state = ModelState(ddp, opt)
    assert default_groups(state) == ("params", "buffers")  # frozen weights never change: not in pi_old
    plugin = find_rebuild(state)
    assert isinstance(plugin, MasterRebuild) and isinstance(plugin, Rebuild) and plugin.group == "params"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("config", ["distrib_ep", "float16_no_param_data"])
def test_megatron_cycle_with_rebuild_is_exact_and_moves_fewer_bytes(config, engine, monkeypatch):
    results = {}
    for rebuild in ("auto", None):
        ddp, opt = build(config)
        fake_train_step(ddp, opt, _x(0))
        frozen_ddp, frozen_opt = build(config)
        fake_train_step(frozen_ddp, frozen_opt, _x(0))
        state = _engine(ModelState(ddp, opt), engine, monkeypatch)
        cycle = PiOldCycle(state, rebuild=rebuild)  # type: ignore[arg-type]
        router = ddp.module.module.moe.router
        biases = []

        def old_fn(x, ddp=ddp, router=router, biases=biases):
            biases.append(router.expert_bias.clone())
            with torch.no_grad():
                return ddp(x).clone()

        batches = [_x(10 + i) for i in range(N)]
        olds = cycle.run(batches, old_fn, lambda x, ddp=ddp, opt=opt: fake_train_step(ddp, opt, x))
        for x, got, bias in zip(batches, olds, biases, strict=True):
            with torch.no_grad():
                assert torch.equal(got, frozen_ddp(x))
            assert torch.equal(bias, frozen_ddp.module.module.moe.router.expert_bias)  # pi_old's expert_bias
        results[rebuild] = (cycle.stats, {k: v.clone() for k, v in ddp.state_dict().items()})
    (with_rb, weights_rb), (without, weights) = results["auto"], results[None]
    for k in weights:
        assert torch.equal(weights_rb[k], weights[k]), k
    assert with_rb.rebuilds == N - 1 and without.rebuilds == 0 and not with_rb.fallbacks
    assert with_rb.placement == without.placement == "host"  # CPU model: pi_old in CPU memory
    params = ModelState(*build(config)).nbytes("params")
    assert without.stashed_bytes - with_rb.stashed_bytes == (N - 1) * params  # no stash of the params
    assert without.host_bytes - with_rb.host_bytes == 2 * (N - 1) * params  # (on CPU every copy is host to host)


def test_megatron_falls_back_to_the_stash_when_rebuild_is_not_exact():
    ddp = build_fake_ddp(FakeDenseModel(16), bf16=False)  # fp32 params: they are their own masters
    opt = build_fake_optimizer(ddp, "distrib")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    cycle = PiOldCycle(state)
    assert cycle.rebuild is not None
    pi_old = {k: v.clone() for k, v in ddp.state_dict().items()}
    cycle.begin()
    fake_train_step(ddp, opt, _x(1))
    now = {k: v.clone() for k, v in ddp.state_dict().items()}
    with pytest.warns(UserWarning, match="fp32 model params"), cycle.old_policy():
        assert all(torch.equal(v, pi_old[k]) for k, v in ddp.state_dict().items())
    assert all(torch.equal(v, now[k]) for k, v in ddp.state_dict().items())
    assert cycle.stats.rebuilds == 0 and cycle.stats.fallbacks


@pytest.mark.parametrize("engine", ENGINES)
def test_megatron_cycle_accounting_matches_the_bytes(engine, monkeypatch):
    ddp, opt = build("distrib")
    fake_train_step(ddp, opt, _x(0))
    state = _engine(ModelState(ddp, opt), engine, monkeypatch)
    cycle = PiOldCycle(state)
    p, b = state.nbytes("params"), state.nbytes("buffers")
    cycle.run([_x(i) for i in range(N)], lambda x: None, lambda x: fake_train_step(ddp, opt, x))
    # snapshot (p + b), then each of N-1 swaps writes p + b and stashes b out and back
    assert cycle.stats.host_bytes == (p + b) + (N - 1) * (p + b + 2 * b)
    assert cycle.stats.stashed_bytes == (N - 1) * b
    assert cycle.stats.pcie_bytes == cycle.stats.device_bytes == 0  # a CPU model: nothing crosses to a GPU
    assert cycle.stats.rebuilds == N - 1 and not cycle.stats.fallbacks


# ----------------------------------------------------------------------------- the placement decision


def test_auto_placement_follows_where_the_state_lives_and_that_devices_free_memory(monkeypatch):
    """Simulated GPU residency (no tensor is touched: only ``choose_placement`` runs)."""
    ddp, opt = build("distrib")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    cycle = PiOldCycle(state)
    asked = []
    free = {"bytes": 0}
    gib = 1 << 30

    def mem_get_info(dev):
        asked.append(torch.device(dev))
        return free["bytes"], 80 * gib

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 0)
    monkeypatch.setattr(core_of(state).engine, "device", torch.device("cuda", 0))
    assert cycle.state_device() == torch.device("cpu")
    assert cycle.choose_placement() == "host" and asked == []  # CPU-resident: CPU memory, no GPU asked
    slots = [s for g in cycle.groups for s in core_of(state).groups[g].slots]
    for s in slots:
        monkeypatch.setattr(s, "device", torch.device("cuda", 0))
    assert cycle.state_device() == torch.device("cuda", 0)
    free["bytes"] = 80 * gib
    assert cycle.choose_placement() == "device" and asked == [torch.device("cuda", 0)]
    free["bytes"] = 4 * gib  # under the default headroom (max(1 GiB, 5 % of 80 GiB) = 4 GiB) once pi_old is in
    assert cycle.choose_placement() == "host"
    for s in slots:  # params on another GPU than the engine's (where device snapshots would go)
        monkeypatch.setattr(s, "device", torch.device("cuda", 1))
    free["bytes"], asked[:] = 80 * gib, []
    assert cycle.choose_placement() == "host" and asked == []
    monkeypatch.setattr(slots[0], "device", torch.device("cuda", 0))  # spread over two GPUs
    assert cycle.state_device() is None and cycle.choose_placement() == "host"


def test_auto_rebuild_stashes_on_the_device_when_a_stash_fits_and_rebuilds_when_only_pi_old_does(monkeypatch):
    """With pi_old on the GPU a device stash (6P device bytes, no host sync) is cheaper than a rebuild
    (5P plus the exactness check and its sync): ``rebuild="auto"`` rebuilds only where memory asks for it,
    an explicit plug-in always; pi_old on the host always rebuilds (the stash would cross PCIe twice)."""
    ddp, opt = build("distrib")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    gib = 1 << 30
    free = {"bytes": 80 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (free["bytes"], 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 0)
    monkeypatch.setattr(core_of(state).engine, "device", torch.device("cuda", 0))
    for s in [s for g in default_groups(state) for s in core_of(state).groups[g].slots]:
        monkeypatch.setattr(s, "device", torch.device("cuda", 0))
    p = state.layout("params").total
    need = sum(state.layout(g).total for g in default_groups(state))
    headroom = 4 * gib  # the default: max(1 GiB, 5 % of 80 GiB)
    auto, forced, never = (
        PiOldCycle(state),
        PiOldCycle(state, rebuild=find_rebuild(state)),
        PiOldCycle(state, rebuild=None),
    )
    assert (
        auto._decide() == ("device", False)
        and forced._decide() == ("device", True)
        and never._decide() == ("device", False)
    )
    free["bytes"] = headroom + 2 * need - p  # pi_old and the buffers' stash fit, a stash of the params too does not
    assert (
        auto._decide() == ("device", True)
        and forced._decide() == ("device", True)
        and never._decide() == ("host", False)
    )
    free["bytes"] = headroom + need - 1  # not even pi_old
    assert auto._decide() == ("host", True) and never._decide() == ("host", False)
    assert PiOldCycle(state, placement="host")._decide() == ("host", True)
    free["bytes"] = 80 * gib
    assert PiOldCycle(state, placement="device")._decide() == ("device", False)  # room: the stash
    free["bytes"] = headroom + need  # explicit device placement without room for a stash: the rebuild
    assert PiOldCycle(state, placement="device")._decide() == ("device", True)


def _ranks_with_unequal_gpu_memory(rank, world_size):
    """Rank 0's GPU has room for a device stash, rank 1's only for pi_old; with data parallelism the
    rebuild's check and all-gather are collectives, so both must take the same way (they hung before)."""
    import torch.distributed as dist

    real = MasterRebuild._prepare

    def prepare(self):  # data parallelism > 1: some param is not wholly this rank's shard (the fake has DP 1)
        real(self)
        self._gather = True

    MasterRebuild._prepare = prepare
    ddp, opt = build("distrib")
    fake_train_step(ddp, opt, _x(0))
    state = ModelState(ddp, opt)
    cycle = PiOldCycle(state)
    need = sum(state.layout(g).total for g in cycle.groups)
    cycle._device_room = (lambda: 10**12) if rank == 0 else (lambda: 2 * need - 1)  # per-rank free GPU memory
    local = cycle._decide()  # what each rank alone would do
    cycle.begin()
    fake_train_step(ddp, opt, _x(1))
    with cycle.old_policy():
        pass
    grad = torch.full((4,), 100.0 + rank)
    dist.all_reduce(grad)  # the next training step's collective comes after the same ones on both ranks
    return {"local": local, "rebuilding": cycle.rebuilding, "rebuilds": cycle.stats.rebuilds, "grad": grad.tolist()}


def test_data_parallel_ranks_agree_to_rebuild_when_one_has_no_room_for_a_stash():
    from dist_harness import run_distributed

    out = run_distributed(_ranks_with_unequal_gpu_memory, 2, timeout=60)
    assert [r["local"][1] for r in out] == [False, True]  # alone, rank 0 would stash and rank 1 rebuild
    assert all(r["rebuilding"] and r["rebuilds"] == 1 and r["grad"] == [201.0] * 4 for r in out), out


def test_host_placement_counts_the_swaps_host_stash_against_the_pool_budget(tmp_path):
    """pi_old fits the pool's budget but pi_old and a host stash of the current weights do not: ``auto``
    goes to disk (it chose host, and the first swap raised ``BudgetError("pool")``)."""
    from stateshift.core.pool import HostPool

    model = make()[0]
    need = ModelState(model).layout("params").total + ModelState(model).layout("buffers").total
    state = ModelState(
        model, pool=HostPool(budget_bytes=need + need // 2), disk_dir=tmp_path / "d", disk_window_bytes=4 << 10
    )
    cycle = PiOldCycle(state)
    assert cycle.choose_placement() == "disk"
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    cycle.begin()
    with cycle.old_policy():
        pass
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_begin_that_fails_counts_nothing():
    from stateshift import BudgetError
    from stateshift.core.pool import HostPool

    model = make()[0]
    state = ModelState(model, pool=HostPool(budget_bytes=100))
    cycle = PiOldCycle(state, placement="host")
    with raises_kind(BudgetError, "pool"):
        cycle.begin()
    assert cycle.stats.as_dict() == PiOldCycle(state).stats.as_dict()  # nothing counted


def test_a_cycle_lists_the_model_once_per_begin_and_once_per_swap_beyond_the_verbs(monkeypatch):
    """Each listing walks the whole module tree (what an isolated device-placed swap waits for on the
    host): ``begin()`` lists the cycle's groups once for its decision and accounting (it listed each
    group again for each layout it asked for), ``old_policy()`` once before its ``swapped()``."""
    model, opt = make()
    state = ModelState(model, opt)
    cycle = PiOldCycle(state, placement="host")
    walks = []
    real = core_of(state).table.refresh
    monkeypatch.setattr(core_of(state).table, "refresh", lambda groups=None: (walks.append(groups), real(groups))[1])
    cycle.begin()
    begin = len(walks)
    with cycle.old_policy():
        pass
    assert begin == 2  # the listing and the snapshot (an explicit host placement needs no layouts to decide)
    assert len(walks) - begin == 2  # the listing, and swapped()'s entry (its exit puts back the slots it recorded)
    cycle.end()


def test_a_host_stash_counts_the_bytes_that_cross_both_ways_at_once():
    """A swap with a host stash sends the current values out while pi_old comes in; the bench counts those
    pairs at the bidirectional ceiling (``both_ways_bytes``), the rest of PCIe one way at a time. Before,
    the Megatron bench counted all PCIe bytes one way and reported 1.3x of its bound."""
    from types import SimpleNamespace

    from stateshift import Residency

    model, opt = _torch_setup()
    cycle = PiOldCycle(ModelState(model, opt))
    gpu = torch.device("cuda", 0)
    resident = [SimpleNamespace(nbytes=n, device=gpu, residency=Residency.DEVICE) for n in (100, 28)]
    slots = {"params": resident}
    host_part = SimpleNamespace(group="params", device=None, host=SimpleNamespace(pinned=True))
    cycle._account_swap(SimpleNamespace(parts=[host_part]), {}, slots)
    s = cycle.stats
    # in: 128 bytes of pi_old while the 128 current ones go out to the stash; then back
    assert (s.pcie_bytes, s.both_ways_bytes, s.stashed_bytes, s.device_bytes) == (3 * 128, 128, 128, 0)
    device_part = SimpleNamespace(group="params", device=SimpleNamespace(device=gpu), host=None)
    cycle._account_swap(SimpleNamespace(parts=[device_part]), {}, slots)  # a device stash crosses nothing
    assert (s.pcie_bytes, s.both_ways_bytes, s.device_bytes) == (3 * 128, 128, 3 * 128)


def test_a_disk_pi_old_counts_no_bytes_both_ways_at_once(tmp_path):
    """Found by the review of this change: a disk part never takes the overlapping path (the swap stashes,
    then reads the part through the staging windows, one after the other), yet ``at_dev`` is False for any
    part without a device tensor and its bytes were counted both ways at once."""
    from types import SimpleNamespace

    from stateshift import Residency

    model, opt = make()
    train_step(model, opt, 0)
    state = ModelState(model, opt, disk_dir=tmp_path / "d", disk_window_bytes=4 << 10)
    cycle = PiOldCycle(state, placement="disk")
    snap = cycle.begin()
    assert snap.placement == "disk" and all(p.disk is not None and p.host is None for p in snap.parts)
    gpu = torch.device("cuda", 0)  # the same slots as on a CUDA machine: resident on the GPU
    slots = {p.group: [SimpleNamespace(nbytes=128, device=gpu, residency=Residency.DEVICE)] for p in snap.parts}
    cycle._account_swap(snap, {}, slots)
    cycle.end()
    state.close()
    assert cycle.stats.both_ways_bytes == 0, cycle.stats.as_dict()
