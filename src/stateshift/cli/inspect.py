"""``stateshift inspect PATH``: a checkpoint's manifest and tensors, every checksum verified.

Exit status 0 when the checkpoint is whole by every check ``load`` (or ``load_dcp``) makes of the
checkpoint itself -- the manifest against its schema and seal, every file a regular file inside the
directory with the recorded size and header, every crc32 -- and 1 otherwise, with the typed error
(naming the file, and the tensor) on stderr. Never unpickles anything: a DCP checkpoint's tensors
are listed from the manifest and its files only hashed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from ..checkpoint.directory import Checkpoint
from ..errors import CheckpointError

__all__ = ["add_parser", "cmd_inspect"]

_DESCRIPTION = (
    "Print a checkpoint's manifest (tag, version, backend, layout, versions) and every stored tensor (name, dtype, "
    "shape, bytes, file), and verify every file against it: sizes, headers, a crc32 per tensor. PATH is a checkpoint "
    "directory (written by stateshift.checkpoint.save, async_save or save_dcp) or a directory whose 'latest' names one. "
    "Exit status 1 when load would refuse the checkpoint (corrupt, truncated, malformed, incomplete, not a checkpoint); "
    "the error names the file. DCP checkpoints: their .metadata is a Python pickle, which can run code when loaded; "
    "inspect never opens it (the tensors come from the JSON manifest), and load_dcp opens it only with trusted=True, "
    "after verifying its checksum."
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``inspect`` sub-command to an argparse ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "inspect", help="show a checkpoint's manifest and tensors, and verify its checksums", description=_DESCRIPTION
    )
    p.add_argument("path", help="checkpoint directory, or a directory whose 'latest' names one")
    p.add_argument(
        "--no-verify", action="store_true", help="skip hashing the data (manifest, sizes and headers are still checked)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--limit", type=int, default=0, help="print at most this many tensors (0: all)")
    p.set_defaults(func=cmd_inspect)
    return p


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _tensors(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """Every stored tensor, file by file (a DCP checkpoint's from its manifest: nothing is unpickled)."""
    from ..core.layout import dtype_of

    if ckpt.manifest.dcp_tensors:
        return [
            {
                "name": n,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "bytes": math.prod(t.shape) * dtype_of(t.dtype).itemsize,
                "file": "(dcp)",
            }
            for n, t in ckpt.manifest.dcp_tensors.items()
        ]
    return [
        {
            "name": t.name,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "bytes": t.nbytes,
            "file": name,
        }
        for name, e in ckpt.manifest.files.items()
        for t in e.tensors
    ]


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        ckpt = Checkpoint.open(args.path)  # resolved, manifest decoded, every file opened and its header checked
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    info = ckpt.manifest.to_json()
    layout = info.pop("layout")
    info.pop("dcp_tensors", None)
    info.update(path=os.fspath(ckpt.path), layout_format=layout.get("format"), world_size=layout.get("world_size", 1))
    tensors = _tensors(ckpt)
    verified, error, t0 = None, None, time.perf_counter()
    if not args.no_verify:
        try:
            ckpt.verify()
            verified = True
        except (CheckpointError, OSError) as e:
            verified, error = False, str(e)
    if args.json:
        print(json.dumps({"manifest": info, "tensors": tensors, "verified": verified, "error": error}, indent=1))
    else:
        _print_tables(info, tensors, args.limit)
        if verified:
            print(
                f"\nchecksums OK: {len(info['files'])} files, {_human(sum(f['bytes'] for f in info['files'].values()))} "
                f"verified (crc32) in {time.perf_counter() - t0:.2f} s"
            )
        elif verified is None:
            print("\nchecksums not verified (--no-verify)")
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _print_tables(info: dict[str, Any], tensors: list[dict[str, Any]], limit: int) -> None:
    print(f"checkpoint  {info['path']}")
    for key in (
        "tag",
        "version",
        "backend",
        "layout_format",
        "world_size",
        "total_bytes",
        "created",
        "library_version",
        "torch_version",
        "checksum_algorithm",
    ):
        value = info.get(key)
        print(f"{key:<20}{value} ({_human(value)})" if key == "total_bytes" else f"{key:<20}{value}")
    if info.get("extra"):
        print(f"{'extra':<20}{json.dumps(info['extra'])}")
    print("\nfiles")
    width = max([len(n) for n in info["files"]] + [4])
    for name, f in info["files"].items():
        count = f"{len(f['tensors']):>6} tensors" if "tensors" in f else " " * 14
        print(f"  {name:<{width}}  {f['bytes']:>14}  {count}  {f['checksum']}")
    shown = tensors if limit <= 0 else tensors[:limit]
    print(f"\ntensors ({len(tensors)})")
    if shown:
        nw = max(len(t["name"]) for t in shown)
        for t in shown:
            print(f"  {t['name']:<{nw}}  {t['dtype']:<9} {t['shape']!s:<18} {t['bytes']:>12}  {t['file']}")
    if len(shown) < len(tensors):
        print(f"  ... {len(tensors) - len(shown)} more (--limit 0 shows all)")
