"""The FSDP2 backend on several gloo processes (CPU): every verb in every residency.

Each test is one launch of ``run_distributed`` whose ranks check many things
(a launch costs ~1-2 s on 2 cores; see docs/notes/fsdp2-notes.md). The rank bodies
take a ``device`` argument: ``tests/gpu/test_fsdp2_gpu.py`` runs the same
bodies on CUDA with NCCL (world size 1), and ``test_world_size_one_suite``
runs them here at world size 1, so the GPU run executes code already known
to pass on the CPU.

Values are compared bit for bit against values read straight from the live
tensors (``direct``: the DTensors' local shards), not through stateshift.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from torch import nn

try:
    from dist_harness import run_distributed
except ImportError:  # tests/ not on sys.path (importlib mode)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dist_harness import run_distributed
from helpers import (
    capture,
    perturb as shared_perturb,
)
from raises import raises_kind

from stateshift import LayoutError, ModelState, Residency
from stateshift.core.engine import core_of

pytestmark = pytest.mark.slow

VOCAB, HIDDEN, WIDE = 13, 8, 12  # 13 rows: uneven shards on 2 and 4 ranks


# -- the model and its training (module level: ranks import these by name) -------------------


class Net(nn.Module):
    """Tied embedding/head (one slot, two names), uneven and empty shards, a buffer updated in forward."""

    def __init__(self, layers: int = 2, buffers: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)  # (13, 8): 7/6 rows on 2 ranks, 4/4/4/1 on 4
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, WIDE), nn.Tanh(), nn.Linear(WIDE, HIDDEN)) for _ in range(layers)
        )
        self.tiny = nn.Parameter(torch.randn(1, 3) * 0.1)  # (1, 3): empty local shard but a 12-byte storage
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        if buffers:
            self.register_buffer("seen", torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.training and "seen" in self._buffers:
            self.seen += ids.numel()
        x = self.embed(ids.flatten()) + self.tiny.sum()
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def ids_for(step: int, device: str) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1000 + step)).to(device)


def loss_of(model: nn.Module, step: int, device: str) -> torch.Tensor:
    ids = ids_for(step, device)
    return nn.functional.cross_entropy(model(ids).float(), ids.roll(-1, dims=1).flatten())


def train_step(model, opt, step: int, device: str, *, set_to_none: bool = False) -> float:
    opt.zero_grad(set_to_none=set_to_none)
    loss = loss_of(model, step, device)
    loss.backward()
    opt.step()
    return loss.item()


def eval_loss(model: nn.Module, step: int, device: str) -> torch.Tensor:
    """A loss with grad but without the training-mode buffer update (for forwards whose backward fails)."""
    model.eval()
    try:
        return loss_of(model, step, device)
    finally:
        model.train()


def logits(model: nn.Module, device: str, step: int = 7) -> torch.Tensor:
    model.eval()
    try:
        with torch.no_grad():
            return model(ids_for(step, device)).detach().cpu().clone()
    finally:
        model.train()


def setup_device(rank: int, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def make_mesh(device: str, world: int, shape=None):
    """``(world,)`` by default; a 2-D shape is an HSDP mesh (replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(shape or (world,))
    return init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)


def mesh_1d(device: str, world: int, *, ranks=None, names=None):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device, list(range(world)) if ranks is None else list(ranks), mesh_dim_names=names)


def build(
    device: str,
    mesh,
    *,
    reshard=None,
    offload: bool = False,
    seed: int = 0,
    wrap_root: bool = True,
    buffers: bool = True,
):
    """``fully_shard`` each block, then the root; Adam. Same seed: the same model on every rank."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(seed)
    model = Net(buffers=buffers).to(device)
    kw = {"mesh": mesh}
    if reshard is not None:
        kw["reshard_after_forward"] = reshard
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device != "cpu")
    for block in model.blocks:
        fully_shard(block, **kw)
    if wrap_root:
        fully_shard(model, **kw)
    if offload and device == "cpu":
        unresizable_host_shards(model)
    return model, adam(model, foreach=not offload)


def adam(model: nn.Module, *, foreach: bool):
    """Adam with the kernels CUDA picks by default, on every device.

    On CUDA Adam defaults to the foreach kernels (``torch._foreach_*``) for
    tensors on the GPU and to the per-tensor loop for tensors on the CPU
    (``CPUOffloadPolicy``); on the CPU it always defaults to the loop. Passing
    ``foreach`` explicitly makes the CPU suite run the optimizer path the GPU
    suite runs. torch's foreach kernels refuse a list that mixes DTensors and
    plain tensors ("got mixed torch.Tensor and DTensor"), and Adam groups the
    tensors of a param group by device and dtype only: a model whose root is
    not wrapped (its own parameters stay plain) needs them in a param group of
    their own -- a torch requirement, stateshift or not.
    """
    from torch.distributed.tensor import DTensor

    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    groups = [{"params": ps} for ps in (sharded, plain) if ps]
    return torch.optim.Adam(groups, lr=1e-2, foreach=foreach)


def unresizable_host_shards(model: nn.Module) -> None:
    """The CPU's stand-in for ``CPUOffloadPolicy(pin_memory=True)`` on a GPU: host shards that cannot be resized.

    On a GPU, FSDP pins each parameter's host shard with ``Tensor.pin_memory()``,
    whose storage (torch's caching host allocator) is not resizable, so
    stateshift cannot release it: offload and drop leave it where it is. Here
    each shard storage is moved, values and tensor objects kept, into a
    non-resizable one (``torch.frombuffer``), so the CPU suite runs that path too.
    """
    from torch.distributed.fsdp import FSDPModule

    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, FSDPModule):
                continue
            for g in _groups_of(m):
                for fp in g.fsdp_params:
                    old = fp._sharded_param_data.untyped_storage()
                    if old.nbytes() == 0 or not old.resizable():
                        continue
                    frozen = torch.frombuffer(bytearray(old.nbytes()), dtype=torch.uint8).untyped_storage()
                    frozen.copy_(old)
                    for t in (fp._sharded_param_data, fp.sharded_param._local_tensor):
                        assert t.untyped_storage().data_ptr() == old.data_ptr()
                        t.set_(frozen, t.storage_offset(), t.shape, t.stride())


# -- reading values ----------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def direct(model: nn.Module, opt=None) -> dict[str, torch.Tensor]:
    """Every tracked value read straight from the objects (all must be resident and sharded)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for owner, m in model.named_modules(remove_duplicate=False):
        for leaf, p in m._parameters.items():
            if p is None:
                continue
            name = f"{owner}.{leaf}" if owner else leaf
            assert isinstance(p, DTensor) or not any(isinstance(q, DTensor) for q in model.parameters()), (
                f"{name} is not sharded: reshard before reading"
            )
            names.setdefault(id(p), name)
            out[name] = _local(p).detach().cpu().clone()
            if p.grad is not None:
                out[f"{name}.grad"] = _local(p.grad).cpu().clone()
        for leaf, b in m._buffers.items():
            if b is not None and leaf not in m._non_persistent_buffers_set:
                out[f"{owner}.{leaf}" if owner else leaf] = b.cpu().clone()
    if opt is not None:
        for p, st in opt.state.items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"{names[id(p)]}.{key}"] = _local(v).cpu().clone()
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str = "") -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())[:6]}"
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, f"{what}: {k} dtype/shape"
        assert torch.equal(got[k], w), f"{what}: values differ at {k}"


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Global parameter values (all-gathered); a collective: every rank calls it."""
    return {k: p.full_tensor().detach().cpu().clone() for k, p in model.named_parameters()}


def perturb(model: nn.Module, opt=None, amount: float = 0.5) -> None:
    """In-place change of every resident local tensor (params, grads, buffers, optimizer state)."""
    shared_perturb(model, opt, amount, local=_local)


def _block0(name: str) -> bool:
    return name.startswith("blocks.0.")


MIXES = {
    "resident": lambda st: None,
    "params_offloaded": lambda st: st.offload("params"),
    "all_offloaded": lambda st: st.offload(),
    "grads_dropped": lambda st: st.drop("grads"),
    "partial": lambda st: st.offload(["params", "optim"], only=_block0),
    "mixed": lambda st: (st.offload(["params", "buffers", "optim"]), st.drop("grads")),
}


def expected(values: dict[str, torch.Tensor], state: ModelState) -> dict[str, torch.Tensor]:
    """``values`` with the tensors of dropped slots zeroed (what onload gives back).

    Slots whose storage cannot be resized (pinned host shards under
    ``CPUOffloadPolicy``) are never released: a drop leaves them, and their
    values, as they are.
    """
    zeroed = {m.name for s in core_of(state).slots() if s.residency is Residency.DROPPED for m in s.info.members}
    return {k: (torch.zeros_like(v) if k in zeroed else v) for k, v in values.items()}


def fixed_storages(state: ModelState) -> dict[int, tuple[int, int]]:
    """Slots whose storage cannot be resized: key -> (address, size). No verb may release or move them."""
    return {
        s.key: (s.storage.data_ptr(), s.storage.nbytes()) for s in core_of(state).slots() if not s.storage.resizable()
    }


def assert_fixed_in_place(state: ModelState, fixed: dict[int, tuple[int, int]], what: str) -> None:
    for s in core_of(state).slots():
        if s.key in fixed:
            assert s.residency is Residency.DEVICE, f"{what}: {s.name} is {s.residency} (storage not resizable)"
            assert (s.storage.data_ptr(), s.storage.nbytes()) == fixed[s.key], f"{what}: {s.name} moved"


def _groups_of(module: nn.Module) -> list:
    from stateshift.backends.fsdp2 import _param_groups

    return _param_groups(module._get_fsdp_state())


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return all(g.is_sharded for m in model.modules() if isinstance(m, FSDPModule) for g in _groups_of(m))


# -- rank bodies -------------------------------------------------------------------------------


def every_verb_in_every_residency(rank, world, device="cpu", mesh_shape=None, mixes=None, offload_policy=False):
    """snapshot / offload+onload / restore / swapped (with a forward inside) / drop, from every mix."""
    from torch.distributed.tensor import DTensor

    setup_device(rank, device)
    mesh = make_mesh(device, world, mesh_shape)
    # the reference: a model that never moved, trained on the same steps
    ref, ref_opt = build(device, mesh, offload=offload_policy)
    ref_losses = [train_step(ref, ref_opt, step, device) for step in (0, 1, 2)]
    ref_end = direct(ref, ref_opt)
    checked = []
    for mix in mixes or MIXES:
        model, opt = build(device, mesh, offload=offload_policy)
        train_step(model, opt, 0, device)
        state = ModelState(model, opt)
        assert [b.name for b in state.backends] == ["fsdp2", "fsdp2-optim"]
        assert all(isinstance(p, DTensor) for p in model.parameters())
        base = direct(model, opt)
        assert_same(capture(state), base, f"{mix}: capture of resident state")
        saved = state.snapshot(state.groups, tag="saved")
        # pinned host shards (CPUOffloadPolicy): already host memory, never released, always copied
        fixed = fixed_storages(state)
        if offload_policy:
            assert any(s.key in fixed for s in core_of(state).slots("params")), (
                "CPUOffloadPolicy: resizable host shards"
            )
        else:
            assert not fixed

        # snapshot in the mix
        MIXES[mix](state)
        released = [s for s in core_of(state).slots() if s.residency is not Residency.DEVICE]
        assert all(s.storage.nbytes() == 0 for s in released), f"{mix}: an offloaded slot kept its storage"
        assert_fixed_in_place(state, fixed, mix)
        want = expected(base, state)
        assert_same(capture(state), want, f"{mix}: snapshot")

        # onload from the mix: the same tensor objects hold the values
        state.onload()
        assert all(c["host"] == 0 and c["dropped"] == 0 for c in state.residency().values())
        assert_same(direct(model, opt), want, f"{mix}: onload")

        # restore into the mix
        perturb(model, opt)
        MIXES[mix](state)
        assert_fixed_in_place(state, fixed, f"{mix}: before restore")
        before = state.residency()
        state.restore(saved)
        after = state.residency()
        assert all(after[g]["device"] == before[g]["device"] for g in state.groups), f"{mix}: restore moved slots"
        assert_same(capture(state), base, f"{mix}: restore")
        state.onload()
        assert_same(direct(model, opt), base, f"{mix}: onload after restore")

        # swapped, with a forward under pi_old inside (it leaves the root unsharded)
        pi_old = state.snapshot(tag="pi_old")
        old_out = logits(model, device)
        train_step(model, opt, 1, device)
        cur_out = logits(model, device)
        assert not torch.equal(cur_out, old_out)
        MIXES[mix](state)
        before = state.residency()
        current = capture(state)
        with state.swapped(pi_old):
            assert torch.equal(logits(model, device), old_out), f"{mix}: forward inside swapped()"
        if all(before[g]["host"] == 0 and before[g]["dropped"] == 0 for g in ("params", "buffers")):
            # no verb in between: an unsharded copy left from inside would still serve pi_old
            assert torch.equal(logits(model, device), cur_out), f"{mix}: stale weights right after swapped()"
        assert state.residency() == before, f"{mix}: swapped() changed residency"
        assert_same(capture(state), current, f"{mix}: values after swapped()")
        state.onload()
        assert torch.equal(logits(model, device), cur_out), f"{mix}: stale weights after swapped()"

        # the same objects still train, and identically to a model that never moved
        assert train_step(model, opt, 2, device) == ref_losses[2], f"{mix}: training after the moves"
        assert_same(direct(model, opt), ref_end, f"{mix}: state after a step")
        state.close()
        checked.append(mix)
    return checked


def training_with_moves_equals_training_without(rank, world, device="cpu", mesh_shape=None, configs=None):
    """Offload/onload/drop between steps and between forward and backward: bit-identical training."""
    setup_device(rank, device)
    mesh = make_mesh(device, world, mesh_shape)
    configs = configs or [(None, False), (None, True), (True, False), (False, True)]
    out = {}
    for reshard, set_to_none in configs:
        ref, ref_opt = build(device, mesh, reshard=reshard)
        model, opt = build(device, mesh, reshard=reshard)
        state = ModelState(model, opt)
        state.offload()  # before FSDP's lazy init (the first forward): it must find the same shards
        state.onload()
        ref_losses, losses = [], []
        for step in range(3):
            ref_losses.append(train_step(ref, ref_opt, step, device, set_to_none=set_to_none))
            # model: a no-grad pass (leaves the root unsharded), moves, then forward / moves / backward
            logits(model, device, step)
            state.offload(["params", "buffers", "optim"])
            state.onload()
            opt.zero_grad(set_to_none=set_to_none)
            loss = loss_of(model, step, device)
            state.offload("params")  # between forward and backward: reshards the root first
            assert _sharded(model)
            state.onload("params")
            loss.backward()
            state.offload("optim")
            state.onload("optim")
            opt.step()
            losses.append(loss.item())
            if set_to_none:
                state.offload("grads")
            else:
                state.drop("grads")  # comes back zeroed: what zero_grad(set_to_none=False) does next step
            state.onload()
        assert losses == ref_losses, f"reshard={reshard} set_to_none={set_to_none}: {losses} != {ref_losses}"
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        assert_same(direct(model, opt), direct(ref, ref_opt), f"reshard={reshard} set_to_none={set_to_none}")
        assert_same(full_params(model), full_params(ref), "full parameters")
        out[f"{reshard}/{set_to_none}"] = losses
        state.close()
    return out


def aliasing_and_restore_after_steps(rank, world, device="cpu", mesh_shape=None, policies=(False, True)):
    """verl-omni #645: save current -> restore pi_old -> restore current gives current, bit for bit.

    With ``CPUOffloadPolicy`` the shards already live in host memory (the
    case where ``.cpu()`` returned the live tensor itself), and with params
    offloaded by stateshift (the snapshot shares the home copy-on-write).
    Under the policy the pinned host shards cannot be resized: ``offload()``
    leaves them live where they are, so even then the snapshot must copy them.
    """

    setup_device(rank, device)
    mesh = make_mesh(device, world, mesh_shape)
    for policy in policies:
        model, opt = build(device, mesh, offload=policy)
        train_step(model, opt, 0, device)
        state = ModelState(model, opt)
        if policy:
            p = model.blocks[0][0].weight
            assert _local(p).device.type == "cpu"
            assert _local(p).cpu().data_ptr() == _local(p).data_ptr()  # the trap: .cpu() is the live tensor
        fixed = fixed_storages(state)
        assert bool(fixed) == policy
        pi_old = state.snapshot(tag="pi_old")
        old = pi_old.tensors()
        for how in ("live", "offloaded"):
            for step in (1, 2):
                train_step(model, opt, step, device)
            if how == "offloaded":
                state.offload()
                assert_fixed_in_place(state, fixed, f"policy={policy} offload")
            current = state.snapshot(tag="current")
            want = current.tensors()
            assert not torch.equal(want["embed.weight"], old["embed.weight"].to(want["embed.weight"].device))
            # the snapshot's memory is not any live storage (offloaded: only the pinned shards are live)
            snap_ranges = [(b.data.data_ptr(), b.data.data_ptr() + b.nbytes) for b in (p.host for p in current.parts)]
            live = 0
            for t in model.parameters():
                st = _local(t).untyped_storage()
                if st.nbytes() == 0:
                    continue  # released by offload()
                live += 1
                ptr = st.data_ptr()
                assert not any(lo <= ptr < hi for lo, hi in snap_ranges), f"{how}: snapshot aliases a live shard"
            assert live > 0 if how == "live" or policy else live == 0
            state.restore(pi_old)
            state.restore(current)
            state.onload()
            got = {k: v for k, v in direct(model).items() if k in want}
            assert_same(got, {k: v.cpu() for k, v in want.items()}, f"policy={policy} {how}: current after restores")
            # restoring twice gives the same values twice; training moves on from them
            state.restore(current)
            assert_same({k: v for k, v in direct(model).items() if k in want}, got, "restore twice")
            before = direct(model)["embed.weight"]
            train_step(model, opt, 3, device)
            assert not torch.equal(direct(model)["embed.weight"], before), "training froze"
            state.release(current)

        # restore after optimizer steps is bit-identical: everything (params, buffers, grads, optim)
        for step in (4, 5):
            train_step(model, opt, step, device)
        k = state.snapshot(state.groups, tag="k")
        first = [train_step(model, opt, s, device) for s in (6, 7, 8)]
        end = direct(model, opt)
        state.offload()  # restore while offloaded, then onload
        state.restore(k)
        state.onload()
        again = [train_step(model, opt, s, device) for s in (6, 7, 8)]
        assert again == first, f"policy={policy}: losses after restore {again} != {first}"
        assert_same(direct(model, opt), end, f"policy={policy}: state after restore and the same steps")
        state.close()
    return True


def guards_and_fsdp_states(rank, world, device="cpu", mesh_shape=None, recover_api=True):
    """Typed errors (never a crash) for compute on released state; FSDP's own states handled."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    from stateshift.backends.fsdp2 import StateError

    setup_device(rank, device)
    mesh = make_mesh(device, world, mesh_shape)
    model, opt = build(device, mesh)
    ref, ref_opt = build(device, mesh)
    train_step(model, opt, 0, device)
    train_step(ref, ref_opt, 0, device)
    state = ModelState(model, opt)
    out0 = logits(model, device)  # leaves the root unsharded

    def idle() -> bool:
        units = (model, *model.blocks)
        return all(m._get_fsdp_state()._training_state == TrainingState.IDLE for m in units) and all(
            g._training_state == TrainingState.IDLE for m in units for g in _groups_of(m)
        )

    # forward with the params offloaded: the guard runs before FSDP's all-gather
    state.offload("params")
    with raises_kind(StateError, "offloaded", match="group 'params'") as err:
        model(ids_for(0, device))
    assert err.value.group == "params" and "FSDP module" in str(err.value)
    assert idle()
    state.onload("params")
    assert torch.equal(logits(model, device), out0)

    # only block 1 offloaded: the root's forward names it before anything runs
    state.offload("params", only=lambda n: n.startswith("blocks.1."))
    with raises_kind(StateError, "offloaded", match="blocks.1."):
        model(ids_for(0, device))
    with raises_kind(StateError, "offloaded", match="blocks.1."):
        model.blocks[1](torch.zeros(2, HIDDEN, device=device))
    state.onload()

    # buffers offloaded: caught before FSDP's pre-forward too (FSDP's state stays idle)
    state.offload("buffers")
    with raises_kind(StateError, "offloaded", match="group 'buffers'"):
        model(ids_for(0, device))
    assert idle()
    state.onload()

    # backward with the params offloaded between forward and backward
    loss = eval_loss(model, 1, device)
    state.offload("params")
    with raises_kind(StateError, "offloaded", match="backward through FSDP module"):
        loss.backward()
    assert idle()
    state.onload("params")
    del loss

    # backward into dropped grads (they are accumulated into in place)
    state.drop("grads")
    with raises_kind(StateError, "offloaded", match="group 'grads'"):
        eval_loss(model, 1, device).backward()
    assert idle()
    state.onload("grads")  # zeros

    # optimizer step on offloaded optimizer state
    state.offload("optim")
    with raises_kind(StateError, "offloaded", match="group 'optim'"):
        opt.step()
    state.onload()

    # nothing above changed anything: the next step equals the reference's
    assert train_step(model, opt, 1, device) == train_step(ref, ref_opt, 1, device)
    assert_same(direct(model, opt), direct(ref, ref_opt), "after the refused calls")

    # explicit unshard, also asynchronous and not waited on: a verb reshards first
    model.unshard()
    assert not _sharded(model)
    state.residency()
    assert _sharded(model)
    handle = model.blocks[0].unshard(async_op=True)
    snap = state.snapshot(tag="after-async-unshard")
    assert _sharded(model)
    if handle is not None:
        handle.wait()
    got = {k: v.cpu() for k, v in snap.tensors().items()}
    assert_same(got, {k: v for k, v in direct(model).items() if k in got}, "snapshot after an async unshard")

    # a verb during a forward (from a hook) is refused and changes nothing: one that releases storage by
    # the state's reader gate (it would release what the running forward reads), any other by FSDP's state
    if recover_api and hasattr(model, "reset_iter_state"):
        before = state.residency()
        for verb, kind, match in (
            (lambda: state.offload("params"), "inside_compute", "from inside forward"),
            (lambda: state.snapshot(tag="in-forward"), "fsdp2", "during a forward or backward"),
        ):
            hook = model.blocks[0].register_forward_pre_hook(lambda m, a, verb=verb: verb())
            with raises_kind(StateError, kind, match=match):
                eval_loss(model, 0, device)
            hook.remove()
            model.reset_iter_state()
            assert state.residency() == before
        assert train_step(model, opt, 2, device) == train_step(ref, ref_opt, 2, device)

    # gradients accumulated without reduction are not slots: said once, loudly
    model.set_requires_gradient_sync(False)
    loss_of(model, 3, device).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.residency()
    assert any("accumulated without reduction" in str(w.message) for w in caught)
    model.set_requires_gradient_sync(True)
    state.close()

    # only the blocks wrapped, the root's own parameters plain: still this backend, still guarded
    plain_root, plain_opt = build(device, mesh, wrap_root=False)
    train_step(plain_root, plain_opt, 0, device)
    st2 = ModelState(plain_root, plain_opt)
    assert st2.backends[0].name == "fsdp2"
    want = capture(st2)
    st2.offload()
    with raises_kind(StateError, "offloaded"):
        plain_root(ids_for(0, device))
    st2.onload()
    assert_same(capture(st2), want, "blocks-only wrapping")
    st2.close()
    return True


def sharding_mismatch(rank, world, device="cpu", variants=None):
    """A snapshot restores only onto the same mesh and placements; otherwise a typed error naming the tensor."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    setup_device(rank, device)
    mesh = init_device_mesh(device, (world,))
    model, opt = build(device, mesh)
    train_step(model, opt, 0, device)
    state = ModelState(model, opt)
    snap = state.snapshot(state.groups, tag="a")
    others = {
        "dim_names": lambda: mesh_1d(device, world, names=("dp",)),
        "hsdp_1xN": lambda: DeviceMesh(device, [list(range(world))], mesh_dim_names=("replicate", "shard")),
    }
    if world > 1:
        others["reversed_ranks"] = lambda: mesh_1d(device, world, ranks=reversed(range(world)))
    reasons = {}
    for name in variants or others:
        other, other_opt = build(device, others[name](), seed=1)
        train_step(other, other_opt, 0, device)
        st = ModelState(other, other_opt)
        before = capture(st)
        for offloaded in (False, True):
            if offloaded:
                st.offload()
            residency = st.residency()
            with raises_kind(LayoutError, "mismatch") as err:
                st.restore(snap)
            assert err.value.tensor == "tiny", f"{name}: named {err.value.tensor!r}"
            shapes_differ = tuple(_local(other.tiny).shape) != tuple(_local(model.tiny).shape)
            assert ("shape" if shapes_differ else "meta") in err.value.reason, err.value.reason
            with raises_kind(LayoutError, "mismatch"), st.swapped(snap):
                raise AssertionError("swapped() entered with a foreign snapshot")
            assert st.residency() == residency, f"{name}: a refused restore moved slots"
            assert_same(capture(st), before, f"{name}: a refused restore changed values")
        st.onload()
        reasons[name] = err.value.reason
        st.close()
    state.restore(snap)  # the same mesh: fine
    return reasons


def hsdp_four_ranks(rank, world, device="cpu"):
    """HSDP on a (2, 2) mesh: placements (Replicate, Shard(0)); fingerprints differ from a flat mesh."""
    out = {}
    out["verbs"] = every_verb_in_every_residency(
        rank, world, device, mesh_shape=(2, 2), mixes=["all_offloaded", "mixed"]
    )
    out["training"] = training_with_moves_equals_training_without(
        rank, world, device, mesh_shape=(2, 2), configs=[(None, False)]
    )
    # reshard_after_forward=2 on a flat mesh of 4: a third state between forward and backward
    # (SHARDED_POST_FORWARD, its own storage), which the verbs reshard away first
    out["training_int"] = training_with_moves_equals_training_without(rank, world, device, configs=[(2, True)])
    flat = make_mesh(device, world)
    hsdp = make_mesh(device, world, (2, 2))
    a, a_opt = build(device, hsdp)
    b, b_opt = build(device, flat)
    sa, sb = ModelState(a, a_opt), ModelState(b, b_opt)
    meta = dict(next(m for s in core_of(sa).slots("params") for m in s.info.members if m.name == "embed.weight").meta)
    assert meta["placements"] == ("Replicate()", "Shard(dim=0)") and meta["mesh"][1] == ((0, 1), (2, 3))
    snap = sa.snapshot(tag="hsdp")
    with raises_kind(LayoutError, "mismatch") as err:
        sb.restore(snap)
    out["mismatch"] = (err.value.tensor, err.value.reason)
    return out


# -- tests -------------------------------------------------------------------------------------


def test_every_verb_in_every_residency_2_ranks():
    results = run_distributed(every_verb_in_every_residency, 2, timeout=120)
    assert results == [list(MIXES)] * 2


def test_training_with_moves_equals_training_without_2_ranks():
    results = run_distributed(training_with_moves_equals_training_without, 2, timeout=120)
    assert len(results[0]) == 4
    assert results[0] == results[1]  # the same data on both ranks: the same losses


def test_no_aliasing_and_restore_after_steps_2_ranks():
    assert run_distributed(aliasing_and_restore_after_steps, 2, timeout=120) == [True, True]


def test_guards_and_fsdp_states_2_ranks():
    assert run_distributed(guards_and_fsdp_states, 2, timeout=120) == [True, True]


def test_sharding_mismatch_is_a_typed_error_2_ranks():
    reasons = run_distributed(sharding_mismatch, 2, timeout=120)
    for r in reasons:
        assert set(r) == {"dim_names", "hsdp_1xN", "reversed_ranks"}
        # the reason shows what differs: the model's fingerprint, then the snapshot's
        assert "('dp',)" in r["dim_names"] and "'Replicate()', 'Shard(dim=0)'" in r["hsdp_1xN"]
        assert "(1, 0)" in r["reversed_ranks"]


def test_hsdp_four_ranks():
    results = run_distributed(hsdp_four_ranks, 4, timeout=180)
    for r in results:
        assert r["verbs"] == ["all_offloaded", "mixed"]
        assert r["mismatch"][0] == "tiny"


def test_world_size_one_suite():
    """The bodies the GPU suite runs (world size 1), here on gloo/CPU."""
    assert run_distributed(world_size_one_suite, 1, timeout=120) == ["ok"] * 1


def world_size_one_suite(rank, world, device="cpu"):
    every_verb_in_every_residency(rank, world, device, mixes=["resident", "all_offloaded", "mixed"])
    every_verb_in_every_residency(rank, world, device, mixes=["partial"], offload_policy=True)
    training_with_moves_equals_training_without(rank, world, device, configs=[(None, False), (True, True)])
    aliasing_and_restore_after_steps(rank, world, device)
    guards_and_fsdp_states(rank, world, device)
    sharding_mismatch(rank, world, device)
    return "ok"


def test_detect_leaves_plain_models_to_the_torch_backend():
    from stateshift.backends import fsdp2

    model = Net()
    assert fsdp2.detect(model) is None
    assert not fsdp2.is_fsdp2(model)
    assert [b.name for b in ModelState(model, torch.optim.Adam(model.parameters())).backends] == [
        "torch",
        "torch-optim",
    ]
