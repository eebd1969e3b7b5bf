"""Disk layer of checkpoints: safetensors files, verified checksums, atomic directories.

Engine-independent: it writes and reads raw bytes of contiguous CPU tensors
(typically pinned homes) and knows nothing about slots or backends.

Write::

    manifest = write_checkpoint(path, {"params.safetensors": [TensorRecord(...), ...]},
                                backend="megatron", layout=fingerprint, tag="step", version=100)

Read::

    reader = open_checkpoint(path)
    reader.records()                      # names, dtypes, shapes, sizes, files
    reader.read_into({"w": pinned_uint8}) # verified before it returns

Model state (any residency, any backend)::

    save(state, "ckpt/step-100", tag="step", version=100)      # atomic, durable on return
    handle = async_save(state, "ckpt/step-200")                 # returns once staged
    load(state, "ckpt/step-100")                                # checked, verified, then restored
    export_hf(model, "export/")                                 # model.safetensors, usual names
    save_dcp(path, model, opt) / load_dcp(path, model, opt)     # resharding via torch DCP
"""

from .atomic import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointReader,
    FileEntry,
    Manifest,
    list_tensors,
    open_checkpoint,
    read_latest,
    read_manifest,
    recover_checkpoint,
    resolve_checkpoint,
    set_latest,
    verify,
    write_checkpoint,
    write_checkpoint_distributed,
)
from .dcp import check_dcp, load_dcp, save_dcp
from .format import (
    CHECKSUM_ALGORITHMS,
    DEFAULT_CHECKSUM,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointWriteError,
    TensorInfo,
    TensorRecord,
    read_header,
    read_safetensors_into,
    write_safetensors,
)
from .hf import export_hf
from .model_io import (
    LAYOUT_FORMAT,
    SaveHandle,
    async_save,
    default_groups,
    init_optimizer_state,
    load,
    save,
)

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "DEFAULT_CHECKSUM",
    "FORMAT_VERSION",
    "LAYOUT_FORMAT",
    "MANIFEST_NAME",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CheckpointReader",
    "CheckpointWriteError",
    "FileEntry",
    "Manifest",
    "SaveHandle",
    "TensorInfo",
    "TensorRecord",
    "async_save",
    "check_dcp",
    "default_groups",
    "export_hf",
    "init_optimizer_state",
    "list_tensors",
    "load",
    "load_dcp",
    "open_checkpoint",
    "read_header",
    "read_latest",
    "read_manifest",
    "read_safetensors_into",
    "recover_checkpoint",
    "resolve_checkpoint",
    "save",
    "save_dcp",
    "set_latest",
    "verify",
    "write_checkpoint",
    "write_checkpoint_distributed",
    "write_safetensors",
]
