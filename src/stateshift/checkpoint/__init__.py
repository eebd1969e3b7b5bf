"""Checkpoints of a model's state: atomic, verified, from any residency, in the background if you like.

    save(state, "ckpt/step-100", tag="step", version=100, update_latest=True)
    handle = async_save(state, "ckpt/step-200", update_latest=True)   # returns once staged
    handle.wait()                                                      # the manifest, or the writer's error
    load(state, "ckpt")                        # the checkpoint 'latest' names: checked, verified, restored
    verify("ckpt/step-100")                    # every byte against its crc32
    export_hf(model, "export/")                # model.safetensors under the usual names
    save_dcp(path, model, opt); load_dcp(path, model, opt, trusted=True)   # resharding via torch DCP
    init_optimizer_state(opt)                  # before loading into a fresh torch optimizer

Inside (``docs/guide/checkpoints.md``): ``format.py`` (safetensors files, a crc32 per tensor, parallel
I/O), ``manifest.py`` (the one schema), ``commit.py`` (fresh directory, fsync, rename, ``latest``),
``collective.py`` (all ranks agree), ``directory.py`` (open, read, verify, write a checkpoint),
``state_io.py`` (save / load of a ``ModelState``), ``dcp.py``, ``hf.py``. The errors live in
``stateshift.errors``.
"""

from .dcp import load_dcp, save_dcp
from .directory import verify
from .hf import export_hf
from .state_io import SaveHandle, async_save, init_optimizer_state, load, save

__all__ = [
    "SaveHandle",
    "async_save",
    "export_hf",
    "init_optimizer_state",
    "load",
    "load_dcp",
    "save",
    "save_dcp",
    "verify",
]
