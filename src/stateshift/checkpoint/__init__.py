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
)
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

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "DEFAULT_CHECKSUM",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CheckpointReader",
    "CheckpointWriteError",
    "FileEntry",
    "Manifest",
    "TensorInfo",
    "TensorRecord",
    "list_tensors",
    "open_checkpoint",
    "read_header",
    "read_latest",
    "read_manifest",
    "read_safetensors_into",
    "recover_checkpoint",
    "resolve_checkpoint",
    "set_latest",
    "verify",
    "write_checkpoint",
    "write_safetensors",
]
