"""Drop-ins for verl 0.9.1's own offload, load, copy and restore functions (``docs/guide/verl.md``).

Either call them directly, under verl's names::

    from stateshift.integrations.verl import copy_megatron_model_to_cpu, restore_megatron_model_from_cpu

or put them in place of verl's, wherever verl's modules bound them::

    from stateshift.integrations import verl as ss_verl
    ss_verl.install()        # logs and returns what it replaced; warns for an untested verl version
    ss_verl.install(functions="all")   # the optimizer and FSDP model offloads too (see docs/guide/verl.md first)
    ...
    ss_verl.uninstall()      # verl's own functions back

or, in every verl process at once (its Ray workers too), through verl's own hook::

    VERL_USE_EXTERNAL_MODULES=stateshift.integrations.verl.autoinstall python3 -m verl.trainer.main_ppo ...

Each model (and each optimizer) verl passes in gets one ``ModelState``,
found again from the object on every call (``registry.py``). What the copy
functions return is an opaque ``SnapshotHandle``; the restore functions
refuse anything else with ``ObjectError("snapshot_handle")``. Importing this package
imports nothing from verl; ``install()`` does.
"""

from __future__ import annotations

from .fsdp import (
    fsdp2_sharded_load_from_cpu,
    fsdp2_sharded_save_to_cpu,
    load_fsdp_model_to_gpu,
    load_fsdp_optimizer,
    offload_fsdp_model_to_cpu,
    offload_fsdp_optimizer,
)
from .install import ON_REQUEST, SAFE, TESTED_VERSIONS, Installation, Replacement, install, installed, uninstall
from .megatron import (
    copy_megatron_model_to_cpu,
    load_megatron_copy_params,
    load_megatron_model_to_gpu,
    load_megatron_optimizer,
    offload_megatron_copy_params,
    offload_megatron_model_to_cpu,
    offload_megatron_optimizer,
    restore_megatron_model_from_cpu,
)
from .registry import SETTINGS, SnapshotHandle, model_state, optimizer_state

__all__ = [
    "SETTINGS",
    "TESTED_VERSIONS",
    "Installation",
    "ON_REQUEST",
    "SAFE",
    "Replacement",
    "SnapshotHandle",
    "copy_megatron_model_to_cpu",
    "fsdp2_sharded_load_from_cpu",
    "fsdp2_sharded_save_to_cpu",
    "install",
    "installed",
    "load_fsdp_model_to_gpu",
    "load_fsdp_optimizer",
    "load_megatron_copy_params",
    "load_megatron_model_to_gpu",
    "load_megatron_optimizer",
    "model_state",
    "offload_fsdp_model_to_cpu",
    "offload_fsdp_optimizer",
    "offload_megatron_copy_params",
    "offload_megatron_model_to_cpu",
    "offload_megatron_optimizer",
    "optimizer_state",
    "restore_megatron_model_from_cpu",
    "uninstall",
]
