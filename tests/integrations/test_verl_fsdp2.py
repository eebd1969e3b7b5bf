"""The verl FSDP drop-ins on FSDP2 (``fully_shard``) over gloo ranks: round trips bit for bit in every
residency, the handle errors, and verl's fully-async pi_old sequence against a reference that never moved.

The rank bodies take ``device``: ``tests/gpu/test_verl_gpu.py`` runs them on CUDA (world size 1).
The model, its training and the direct reads of local shards are ``tests/backends/test_fsdp2.py``'s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parents[1]
for _p in (_TESTS, _TESTS / "backends", _TESTS.parent / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import test_fsdp2 as F  # noqa: E402
from dist_harness import run_distributed  # noqa: E402
from raises import raises_kind  # noqa: E402
from verl_sequence import compare, fsdp2_fns, reference_fns, run_sequence, weights  # noqa: E402

pytestmark = pytest.mark.slow


def _model_values(model, opt=None):
    return F.direct(model, opt)


def _put(model, residency):
    """``offloaded``: by the drop-in; ``mixed``: block 0's params only (through the model's state)."""
    import stateshift.integrations.verl as V

    if residency == "offloaded":
        V.offload_fsdp_model_to_cpu(model)
    elif residency == "mixed":
        V.model_state(model).offload("params", only=F._block0)


def round_trips(rank, world, device="cpu", policies=(False, True)):
    """offload/load of model and optimizer, save/load of pi_old at every pair of residencies; with and without
    ``CPUOffloadPolicy`` (shards already in host memory: a save must copy them, never alias them)."""
    import stateshift.integrations.verl as V

    F.setup_device(rank, device)
    mesh = F.make_mesh(device, world)
    for policy in policies:
        model, opt = F.build(device, mesh, offload=policy)
        F.train_step(model, opt, 0, device)
        truth = _model_values(model, opt)
        V.offload_fsdp_model_to_cpu(model)
        V.offload_fsdp_optimizer(opt)
        if not policy:
            assert all(F._local(p).untyped_storage().nbytes() == 0 for p in model.parameters() if F._local(p).numel())
        V.load_fsdp_model_to_gpu(model)
        V.load_fsdp_optimizer(opt, device)
        F.assert_same(_model_values(model, opt), truth, f"policy={policy} offload/load")
        for at_save in ("device", "offloaded", "mixed"):
            for at_load in ("device", "offloaded", "mixed"):
                want = {k: v for k, v in _model_values(model).items() if not k.endswith(".grad")}
                _put(model, at_save)
                handle, spec = V.fsdp2_sharded_save_to_cpu(model)
                V.load_fsdp_model_to_gpu(model)
                for step in (1, 2):
                    F.train_step(model, opt, step, device)
                _put(model, at_load)
                V.fsdp2_sharded_load_from_cpu(model, handle, spec)
                V.fsdp2_sharded_load_from_cpu(model, handle, spec)  # twice: the same values twice
                V.load_fsdp_model_to_gpu(model)
                got = {k: v for k, v in _model_values(model).items() if k in want}
                F.assert_same(got, want, f"policy={policy} {at_save} -> {at_load}")
    return True


def handle_errors(rank, world, device="cpu"):
    import stateshift.integrations.verl as V
    from stateshift.errors import LayoutError, ObjectError

    F.setup_device(rank, device)
    mesh = F.make_mesh(device, world)
    model, opt = F.build(device, mesh)
    F.train_step(model, opt, 0, device)
    before = _model_values(model, opt)
    handle, spec = V.fsdp2_sharded_save_to_cpu(model)
    verl_like = {n: (F._local(p).detach().cpu(), getattr(p, "_spec", None)) for n, p in model.named_parameters()}
    errors = []
    for bad in (verl_like, None, (handle, spec)):
        try:
            V.fsdp2_sharded_load_from_cpu(model, bad, spec)
        except ObjectError as e:
            errors.append(e.function if e.kind == "snapshot_handle" else repr(e))
    other = F.mesh_1d(device, world, names=("other",))
    try:
        V.fsdp2_sharded_load_from_cpu(model, handle, type("Spec", (), {"device_mesh": other})())
    except LayoutError as e:
        errors.append("mesh" if e.kind == "mismatch" else repr(e))
    F.assert_same(_model_values(model, opt), before, "after refused loads")
    return errors


def sequence(rank, world, device="cpu", mixes=("device", "offloaded")):
    """verl's fully-async non-bypass sequence: old log-probs and final weights equal the reference's."""
    import stateshift.integrations.verl as V

    F.setup_device(rank, device)
    mesh = F.make_mesh(device, world)
    out = {}
    ref_model, ref_opt = F.build(device, mesh)

    def run(model, opt, fns, mix):
        return run_sequence(
            fns,
            model,
            opt,
            forward=lambda s: F.logits(model, device, 100 + s),
            train=lambda s: F.train_step(model, opt, s, device),
            n=3,
            cycles=2,
            mix=mix,
        )

    ref = run(ref_model, ref_opt, reference_fns(), "device")
    ref_final = weights(ref_model)
    for mix in mixes:
        model, opt = F.build(device, mesh)
        got = run(model, opt, fsdp2_fns(V, device), mix)
        report = compare(got, ref, weights(model) if got.error is None else None, ref_final)
        assert report["error"] is None, report["where"]
        assert report["mismatches"] == 0 and report["computed"] == 6 and report["final_equal"], report
        out[mix] = report["mismatches"]
    return out


def _verl_like_fns(V, device, model):
    """What ``install()`` gives by default on FSDP2: our pi_old pair beside verl's own offload functions, which
    move the model with ``model.to(...)`` (FSDP2's ``_apply``: every param is a DTensor, so torch swaps the new
    tensor into the same ``Parameter`` object: ``torch.utils.swap_tensors``, which refuses a tensor that has a
    weak reference) and replace each optimizer state tensor with ``value.to(...)``. On the CPU a move to the
    same device returns the tensor itself; a clone stands for the copy a real move makes (new storage)."""

    def move(t):
        return t.clone() if device == "cpu" else t.to(device if t.device.type == "cpu" else "cpu", non_blocking=True)

    def move_model(m):
        m._apply(move)

    def move_opt(o):
        for st in o.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim():
                    st[k] = move(v)

    ours = fsdp2_fns(V, device)
    return type(ours)(ours.copy, ours.restore, move_model, move_model, move_opt, move_opt)


def default_install_sequence(rank, world, device="cpu", buffers=True):
    """verl's sequence with install()'s default functions (the pi_old pair ours, the offload verl's).
    ``buffers=False``: a model without buffers, so nothing but the DTensors' local tensors changes when verl's
    offload moves it (a moved buffer is a new object, which made every listing be read again)."""
    import stateshift.integrations.verl as V

    F.setup_device(rank, device)
    mesh = F.make_mesh(device, world)
    ref_model, ref_opt = F.build(device, mesh, buffers=buffers)

    def run(model, opt, fns, mix):
        return run_sequence(
            fns,
            model,
            opt,
            forward=lambda s: F.logits(model, device, 100 + s),
            train=lambda s: F.train_step(model, opt, s, device),
            n=3,
            cycles=2,
            mix=mix,
        )

    ref = run(ref_model, ref_opt, reference_fns(), "device")
    model, opt = F.build(device, mesh, buffers=buffers)
    got = run(model, opt, _verl_like_fns(V, device, model), "offloaded")
    report = compare(got, ref, weights(model) if got.error is None else None, weights(ref_model))
    assert report["error"] is None, report["where"]
    assert report["mismatches"] == 0 and report["computed"] == 6 and report["final_equal"], report
    return True


def test_default_install_beside_verls_model_to_offload_2_ranks():
    """Our pi_old snapshot alive while verl's offload moves the model with ``model.to`` (swap_tensors on
    every DTensor param): no ``Cannot swap t1 because it has weakref associated with it``, values exact."""
    assert run_distributed(default_install_sequence, 2, timeout=120) == [True, True]


def test_default_install_on_a_model_without_buffers_follows_the_moved_local_shards():
    """verl's ``model.to`` swaps new local tensors into the same DTensor parameters: with no buffer to replace,
    no parameter, buffer or module object changes, and the pi_old save and restore must still find the new
    local tensors (they read and wrote the old ones: 4 of 6 old log-probs were the current policy's)."""
    assert run_distributed(default_install_sequence, 1, kwargs={"buffers": False}, timeout=120) == [True]


def test_round_trips_in_every_residency_2_ranks():
    assert run_distributed(round_trips, 2, timeout=120) == [True, True]


def test_load_refuses_what_is_not_its_handle_2_ranks():
    results = run_distributed(handle_errors, 2, timeout=120)
    assert results == [["fsdp2_sharded_load_from_cpu"] * 3 + ["mesh"]] * 2  # verl's dict, nothing, the unsplit pair


def test_fully_async_sequence_equals_a_reference_2_ranks():
    assert run_distributed(sequence, 2, timeout=180) == [{"device": 0, "offloaded": 0}] * 2


def test_fsdp1_without_install_is_a_backend_error():
    import stateshift.integrations.verl as V
    from stateshift import ObjectError

    class FullyShardedDataParallel(torch.nn.Module):  # recognised by class name, as verl's fsdp_version does by type
        pass

    with raises_kind(ObjectError, "backend", match="FSDP1"):
        V.offload_fsdp_model_to_cpu(FullyShardedDataParallel())
    assert os.environ.get("RANK") is None


def test_plain_module_round_trip_and_the_ignored_device_id_is_said():
    """verl sends modules that are not FSDP (``fsdp_version`` 0) down the same path; ``device_id`` names a device
    the state did not come from: the state goes back where it lived, with a warning naming both."""
    import stateshift.integrations.verl as V

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [v.clone() for st in opt.state.values() for v in st.values()]
    V.offload_fsdp_model_to_cpu(model)
    V.offload_fsdp_optimizer(opt)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    V.load_fsdp_model_to_gpu(model)
    with pytest.warns(UserWarning, match="goes back to cpu, where it lived, not to cuda:0"):
        V.load_fsdp_optimizer(opt, 0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(
        torch.equal(a, b) for a, b in zip([v for st in opt.state.values() for v in st.values()], moments, strict=True)
    )
