"""``stateshift inspect PATH``: a checkpoint's manifest, tensors and a checksum verification.

Wired into ``stateshift.cli`` with::

    from .checkpoint.inspect_cmd import add_parser as _inspect_parser
    _inspect_parser(sub)

Exit status: 0 when every file verifies, 1 on a corrupt, incomplete or
missing checkpoint (the typed error's message on stderr, naming the file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

__all__ = ["add_parser", "cmd_inspect"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``inspect`` sub-command to an argparse ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "inspect",
        help="show a checkpoint's manifest and tensors, and verify its checksums",
        description=(
            "Print a checkpoint's manifest (tag, version, backend, layout, versions), every stored tensor "
            "(name, dtype, shape, bytes, file) and verify every file's checksum. Exit status 1 if the checkpoint "
            "is corrupt, truncated or incomplete; the error names the file."
        ),
    )
    p.add_argument("path", help="checkpoint directory (written by stateshift save, async_save or save_dcp)")
    p.add_argument("--no-verify", action="store_true", help="skip re-hashing the files (sizes and headers are still checked)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--limit", type=int, default=0, help="print at most this many tensors (0: all)")
    p.set_defaults(func=cmd_inspect)
    return p


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _dcp_tensors(path: str) -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = []
    for name, md in meta.items():
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            nbytes = md.properties.dtype.itemsize
            for d in md.size:
                nbytes *= d
            out.append({"name": name, "dtype": dtype, "shape": list(md.size), "bytes": nbytes, "file": f"({len(md.chunks)} chunks)"})
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    from .atomic import list_tensors, read_manifest, resolve_checkpoint, verify
    from .format import CheckpointError

    try:
        root = resolve_checkpoint(args.path)
        manifest = read_manifest(root)
        layout = manifest.layout if isinstance(manifest.layout, dict) else {}
        if layout.get("format") == "dcp":
            tensors = _dcp_tensors(os.fspath(root))
        else:
            tensors = [
                {"name": t.name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "bytes": t.nbytes, "file": t.file}
                for t in list_tensors(root)
            ]
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    info = manifest.to_json()
    info.pop("layout", None)
    info["path"] = os.fspath(root)
    info["layout_format"] = layout.get("format")
    info["world_size"] = layout.get("world_size", 1)
    verified: bool | None = None
    error: str | None = None
    seconds = 0.0
    if not args.no_verify:
        t0 = time.perf_counter()
        try:
            verify(root)
            verified = True
        except (CheckpointError, OSError) as e:
            verified, error = False, str(e)
        seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"manifest": info, "tensors": tensors, "verified": verified, "error": error}, indent=1))
    else:
        _print_tables(info, tensors, args.limit)
        if verified:
            print(f"\nchecksums OK: {len(manifest.files)} files, {_human(sum(f.bytes for f in manifest.files.values()))} "
                  f"verified ({manifest.checksum_algorithm}) in {seconds:.2f} s")
        elif verified is None:
            print("\nchecksums not verified (--no-verify)")
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _print_tables(info: dict[str, Any], tensors: list[dict[str, Any]], limit: int) -> None:
    print(f"checkpoint  {info['path']}")
    for key in ("tag", "version", "backend", "layout_format", "world_size", "total_bytes", "created",
                "library_version", "torch_version", "checksum_algorithm"):
        value = info.get(key)
        if key == "total_bytes":
            value = f"{value} ({_human(value)})"
        print(f"{key:<20}{value}")
    if info.get("extra"):
        print(f"{'extra':<20}{json.dumps(info['extra'])}")
    print("\nfiles")
    width = max([len(n) for n in info["files"]] + [4])
    for name, f in info["files"].items():
        count = f"{f['tensors']:>6} tensors" if name.endswith(".safetensors") else f"{'':>6}        "
        print(f"  {name:<{width}}  {f['bytes']:>14}  {count}  {f['checksum']}")
    shown = tensors if limit <= 0 else tensors[:limit]
    print(f"\ntensors ({len(tensors)})")
    if shown:
        nw = max(len(t["name"]) for t in shown)
        for t in shown:
            print(f"  {t['name']:<{nw}}  {t['dtype']:<9} {t['shape']!s:<18} {t['bytes']:>12}  {t['file']}")
    if len(shown) < len(tensors):
        print(f"  ... {len(tensors) - len(shown)} more (--limit 0 shows all)")
