"""``install()`` / ``uninstall()`` on a stand-in ``verl`` package written to a temporary directory.

The stand-in binds the names the way verl 0.9.1 does: its engines import them at module level
(``from verl.utils.megatron_utils import (load_megatron_model_to_gpu, ...)``), the separate-async worker
imports them inside a method at call time, and one module binds an unrelated function under one of
the names (it must be left alone).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import textwrap
from pathlib import Path

import pytest

import stateshift.integrations.verl as V
from stateshift.integrations.verl.install import TARGETS

MEGATRON = TARGETS["verl.utils.megatron_utils"]
FSDP = TARGETS["verl.utils.fsdp_utils"]


#: a stand-in for verl's separate-async worker and its engine: saved models by key, the strategy handlers
#: imported at call time, the engine's offload functions imported at module level
WORKER = textwrap.dedent("""
    from verl.utils.megatron_utils import load_megatron_model_to_gpu, offload_megatron_model_to_cpu


    class Worker:
        def __init__(self, module, param_offload):
            self.module, self.param_offload, self.cpu_saved_models = module, param_offload, {}

        def handlers(self):
            from verl.utils.megatron_utils import copy_megatron_model_to_cpu, restore_megatron_model_from_cpu
            return copy_megatron_model_to_cpu, restore_megatron_model_from_cpu

        def save_model_to_cpu(self, n):
            self.cpu_saved_models[n] = self.handlers()[0](self.module)

        def restore_model_from_cpu(self, n):
            if n in self.cpu_saved_models:
                self.handlers()[1](self.module, self.cpu_saved_models[n])

        def clear_cpu_model(self, n):
            if n in self.cpu_saved_models:
                del self.cpu_saved_models[n]

        def to(self, device, grad=True):
            if not self.param_offload:
                return
            if device == "cuda":
                load_megatron_model_to_gpu(self.module, load_grad=grad)
            else:
                offload_megatron_model_to_cpu(self.module)

        def compute_log_prob(self, forward):
            self.to("cuda", grad=False)
            out = forward()
            self.to("cpu")
            return out

        def compute_old_log_prob(self, k, forward):
            if k == 1:
                self.save_model_to_cpu(1)
                return self.compute_log_prob(forward)
            self.save_model_to_cpu(k)
            self.restore_model_from_cpu(1)
            out = self.compute_log_prob(forward)
            self.restore_model_from_cpu(k)
            self.clear_cpu_model(k)
            return out
    """)


def _stub(names):
    return "\n".join(f"def {n}(*args, **kwargs):\n    return ('verl', {n!r})\n" for n in names)


@pytest.fixture
def fake_verl(tmp_path, monkeypatch):
    """Write the stand-in tree, put it first on sys.path, and drop it (and any installation) afterwards."""

    def write(version: str = "0.9.1", fsdp_importable: bool = True):
        files = {
            "verl/__init__.py": f"__version__ = {version!r}\n",
            "verl/utils/__init__.py": "",
            "verl/utils/megatron_utils.py": _stub(MEGATRON) + "def unwrap_model(m):\n    return m\n",
            "verl/utils/fsdp_utils.py": ("" if fsdp_importable else "import a_module_that_is_not_there\n")
            + _stub(FSDP),
            "verl/workers/__init__.py": "",
            "verl/workers/engine/__init__.py": "",
            "verl/workers/engine/megatron_impl.py": textwrap.dedent("""
                from verl.utils.megatron_utils import (
                    load_megatron_model_to_gpu,
                    load_megatron_optimizer,
                    offload_megatron_model_to_cpu,
                    offload_megatron_optimizer,
                    unwrap_model,
                )
                from verl.utils import megatron_utils as mu

                def to(device, module):
                    return load_megatron_model_to_gpu(module) if device == "cuda" else offload_megatron_model_to_cpu(module)
                """),
            "verl/workers/separation.py": textwrap.dedent("""
                def handlers():
                    from verl.utils.megatron_utils import copy_megatron_model_to_cpu, restore_megatron_model_from_cpu
                    return copy_megatron_model_to_cpu, restore_megatron_model_from_cpu
                """),
            "verl/unrelated.py": "def copy_megatron_model_to_cpu(models):\n    return 'mine'\n",
            "verl/workers/separation_worker.py": WORKER,
        }
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
        for mod in ("verl.workers.engine.megatron_impl", "verl.workers.separation", "verl.unrelated"):
            importlib.import_module(mod)

    yield write
    V.uninstall()
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]


def test_install_replaces_every_binding_and_uninstall_puts_back_exactly_the_originals(fake_verl, caplog):
    fake_verl()
    mu, fu = sys.modules["verl.utils.megatron_utils"], importlib.import_module("verl.utils.fsdp_utils")
    engine, sep, unrelated = (
        sys.modules[m] for m in ("verl.workers.engine.megatron_impl", "verl.workers.separation", "verl.unrelated")
    )
    originals = {n: getattr(mu, n) for n in MEGATRON} | {n: getattr(fu, n) for n in FSDP}
    engine_before = {n: getattr(engine, n) for n in vars(engine) if n in MEGATRON}
    with caplog.at_level(logging.INFO, logger="stateshift.integrations.verl"):
        inst = V.install(functions="all")
    assert inst.version == "0.9.1" and not inst.skipped
    for n in MEGATRON:
        assert getattr(mu, n) is getattr(V, n)
    for n in FSDP:
        assert getattr(fu, n) is getattr(V, n)
    for n in engine_before:
        assert getattr(engine, n) is getattr(V, n), n
    assert engine.unwrap_model(3) == 3  # names that are not verl's offload functions are left alone
    assert sep.handlers() == (V.copy_megatron_model_to_cpu, V.restore_megatron_model_from_cpu)  # imported at call time
    assert unrelated.copy_megatron_model_to_cpu([]) == "mine"  # the same name bound to another function
    replaced = {(r.module, r.name) for r in inst.replaced}
    assert {
        ("verl.workers.engine.megatron_impl", "offload_megatron_model_to_cpu"),
        ("verl.utils.fsdp_utils", "fsdp2_sharded_save_to_cpu"),
    } <= replaced
    assert len(replaced) == len(MEGATRON) + len(FSDP) + len(engine_before)
    assert "verl.workers.engine.megatron_impl.offload_megatron_model_to_cpu" in caplog.text
    assert "verl.workers.engine.megatron_impl.offload_megatron_model_to_cpu" in str(inst)
    assert V.install(functions="all") is inst  # idempotent
    for other in ({"placement": "device", "functions": "all"}, {}):
        with pytest.raises(ValueError, match="other settings"):
            V.install(**other)
    restored = V.uninstall()
    assert len(restored) == len(inst.replaced)
    for n, fn in originals.items():
        assert getattr(mu if n in MEGATRON else fu, n) is fn
    for n, fn in engine_before.items():
        assert getattr(engine, n) is fn
    assert sep.handlers() == (originals["copy_megatron_model_to_cpu"], originals["restore_megatron_model_from_cpu"])
    assert V.uninstall() == [] and V.installed() is None


def test_by_default_only_the_safe_functions_are_replaced(fake_verl):
    fake_verl()
    mu, fu = sys.modules["verl.utils.megatron_utils"], importlib.import_module("verl.utils.fsdp_utils")
    before = {n: getattr(mu if n in MEGATRON else fu, n) for n in MEGATRON + FSDP}
    inst = V.install()
    for n in MEGATRON + FSDP:
        now = getattr(mu if n in MEGATRON else fu, n)
        assert (now is getattr(V, n)) == (n in V.SAFE) and (now is before[n]) == (n not in V.SAFE), n
    assert {"offload_megatron_optimizer", "offload_fsdp_model_to_cpu"} <= set(V.ON_REQUEST)
    assert "left to verl" in str(inst) and "offload_megatron_optimizer" in str(inst)
    assert inst.verl["offload_fsdp_model_to_cpu"] is before["offload_fsdp_model_to_cpu"]  # kept for FSDP1
    V.uninstall()
    V.install(functions=["offload_megatron_optimizer"])
    assert mu.offload_megatron_optimizer is V.offload_megatron_optimizer
    assert mu.copy_megatron_model_to_cpu is before["copy_megatron_model_to_cpu"]


def test_an_unknown_function_name_is_refused_before_anything_is_imported():
    with pytest.raises(ValueError, match="offload_everything"):
        V.install(functions=["offload_everything"])
    assert "verl" not in sys.modules and V.installed() is None


def test_an_untested_version_warns_naming_it(fake_verl):
    fake_verl(version="0.8.2")
    with pytest.warns(UserWarning, match="not 0.8.2"):
        inst = V.install()
    assert inst.version == "0.8.2" and inst.replaced


def test_a_module_that_cannot_be_imported_is_reported_not_skipped_silently(fake_verl):
    fake_verl(fsdp_importable=False)
    with pytest.warns(UserWarning, match="verl.utils.fsdp_utils left as is"):
        inst = V.install()
    assert "a_module_that_is_not_there" in inst.skipped["verl.utils.fsdp_utils"]
    assert all(r.module != "verl.utils.fsdp_utils" for r in inst.replaced)
    assert sys.modules["verl.utils.megatron_utils"].copy_megatron_model_to_cpu is V.copy_megatron_model_to_cpu


def test_a_binding_changed_after_install_is_left_as_is_with_a_warning(fake_verl):
    fake_verl()
    V.install()
    engine = sys.modules["verl.workers.engine.megatron_impl"]
    engine.offload_megatron_model_to_cpu = mine = lambda models: None
    with pytest.warns(UserWarning, match="no longer holds"):
        V.uninstall()
    assert engine.offload_megatron_model_to_cpu is mine


def test_placement_is_checked():
    with pytest.raises(ValueError, match="placement"):
        V.install(placement="disk")


def test_import_brings_in_nothing_from_verl():
    import subprocess

    code = "import sys, stateshift.integrations.verl; assert not any(m == 'verl' or m.startswith('verl.') for m in sys.modules); print('ok')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_stand_in_worker_runs_verls_sequence_on_the_drop_ins_unchanged(fake_verl):
    """After install(), a worker written against verl's functions (its stand-in above: nothing of it knows
    stateshift) runs the fully-async pi_old sequence with param offload on the fake Megatron MoE model: old
    log-probs and final weights equal a twin whose pi_old is a plain clone and which never moves."""
    import torch
    from fakes.mcore import fake_train_step
    from fakes.mcore.setups import _x, after_steps

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from verl_sequence import reference_fns, weights

    fake_verl()
    V.install()
    worker = importlib.import_module("verl.workers.separation_worker")
    ddp, opt = after_steps("distrib_ep", 1)
    twin, twin_opt = after_steps("distrib_ep", 1)
    w, ref = worker.Worker([ddp], param_offload=True), reference_fns()
    w.to("cpu")
    pi_old, got, want = None, [], []
    for step in range(6):
        k = step % 3 + 1
        got.append(w.compute_old_log_prob(k, lambda: ddp(_x(50 + step)).detach().clone()))  # noqa: B023 - called at once
        if k == 1:  # the current weights are pi_old: computed as they are (the forward's buffer updates stay)
            pi_old = ref.copy([twin])
            want.append(twin(_x(50 + step)).detach().clone())
        else:
            current = ref.copy([twin])
            ref.restore([twin], pi_old)
            want.append(twin(_x(50 + step)).detach().clone())
            ref.restore([twin], current)
        w.to("cuda")
        loss = fake_train_step(ddp, opt, _x(step))
        assert loss == fake_train_step(twin, twin_opt, _x(step))
        w.to("cpu")
    assert all(isinstance(h, V.SnapshotHandle) for h in w.cpu_saved_models.values()) and list(w.cpu_saved_models) == [1]
    w.to("cuda")
    assert [torch.equal(a, b) for a, b in zip(got, want, strict=True)] == [True] * 6
    final, ref_final = weights([ddp]), weights([twin])
    assert final.keys() == ref_final.keys() and all(torch.equal(final[k], ref_final[k]) for k in final)


def test_autoinstall_through_verls_external_modules_hook(tmp_path):
    """``VERL_USE_EXTERNAL_MODULES=stateshift.integrations.verl.autoinstall``: the stand-in ``verl/__init__.py``
    imports the named modules at its end, as verl 0.9.1's does; an engine imported afterwards runs the drop-ins."""
    import subprocess

    init = textwrap.dedent("""
        import importlib, os
        __version__ = "0.9.1"
        for name in filter(None, os.getenv("VERL_USE_EXTERNAL_MODULES", "").split(",")):
            importlib.import_module(name)
        """)
    files = {
        "verl/__init__.py": init,
        "verl/utils/__init__.py": "",
        "verl/utils/megatron_utils.py": _stub(MEGATRON),
        "verl/utils/fsdp_utils.py": _stub(FSDP),
        "verl/workers/__init__.py": "",
        "verl/workers/separation_worker.py": WORKER,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    code = textwrap.dedent("""
        import verl.workers.separation_worker as w, verl.utils.fsdp_utils as fu
        import stateshift.integrations.verl as V
        from stateshift.integrations.verl.autoinstall import INSTALLATION
        assert w.offload_megatron_model_to_cpu is V.offload_megatron_model_to_cpu
        assert w.Worker(None, False).handlers() == (V.copy_megatron_model_to_cpu, V.restore_megatron_model_from_cpu)
        assert fu.offload_fsdp_optimizer is V.offload_fsdp_optimizer  # STATESHIFT_VERL_FUNCTIONS=all
        assert V.SETTINGS.placement == "device" and INSTALLATION is V.installed()
        print("ok")
        """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), *(p for p in sys.path if p)]),
        "VERL_USE_EXTERNAL_MODULES": "stateshift.integrations.verl.autoinstall",
        "STATESHIFT_VERL_FUNCTIONS": "all",
        "STATESHIFT_VERL_PLACEMENT": "device",
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]
