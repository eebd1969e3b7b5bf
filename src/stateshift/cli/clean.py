"""``stateshift clean [DIR]``: remove the shared-memory files that killed processes left behind.

A process that ends normally removes its files; one that is SIGKILLed (or dies of OOM) cannot, and its files
keep their memory until someone removes them -- the next stateshift process that makes files of the same kind
in the same directory does, and this command does it at once. Three kinds live in ``/dev/shm`` by default, each
named with the process id of its maker: host pool blocks (``stateshift-pool-<pid>-...``: pinned homes,
snapshots, published versions), weight-sync mailboxes (``stateshift-sync-<pid>-...``) and ``stateshift train``'s
weight files for a rollouter process (``stateshift-weights-<pid>-...``). A file is removed only when its
process is gone (a process of another user counts as alive). A dead publisher's mailbox and pool blocks are
kept while one of its receivers lives (it still reads the last version it published); a later run of this
command, or the next publisher's start, removes them once that receiver is gone.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..core.pool import SHARED_FILE, remove_stale_files
from ..rl.sync.mailbox import STALE as SYNC_FILE, Mailbox
from ..train.executors.weights import STALE_FILE as WEIGHTS_FILE

__all__ = ["add_parser", "cmd_clean", "sweep"]


def sweep(directory: str, dry_run: bool = False) -> list[str]:
    """Remove (``dry_run``: list) the stale stateshift files in ``directory``; returns their names.

    Mailboxes go first: what is left of a dead publisher's mailbox after that is read by a live receiver, and
    the pool blocks of that publisher's process are kept with it."""
    names = Mailbox.remove_stale(directory, dry_run=dry_run)
    try:
        left = set(os.listdir(directory)) - set(names)
    except OSError:
        left = set()
    read = {int(m.group(1)) for n in left if (m := SYNC_FILE.fullmatch(n))}

    def kept(name: str) -> bool:
        m = SHARED_FILE.fullmatch(name)
        return m is not None and int(m.group(1)) in read

    names += remove_stale_files(directory, SHARED_FILE, keep=kept, dry_run=dry_run)
    names += remove_stale_files(directory, WEIGHTS_FILE, dry_run=dry_run)
    return names


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``clean`` sub-command to an argparse ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "clean",
        help="remove shared-memory files that killed stateshift processes left behind",
        description=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument("directory", nargs="?", default="/dev/shm", help="where the files are (default: /dev/shm)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.set_defaults(func=cmd_clean)
    return p


def cmd_clean(args: argparse.Namespace) -> int:
    """Run ``stateshift clean``; prints one line per file and a total. Exit status 2 if ``directory`` is not
    a readable directory, else 0."""
    if not os.path.isdir(args.directory) or not os.access(args.directory, os.R_OK | os.X_OK):
        print(f"stateshift clean: {args.directory!r} is not a readable directory", file=sys.stderr)
        return 2
    sizes = {}  # of every file a sweep may remove, taken first: a removed file has none
    for name in os.listdir(args.directory):
        if any(p.fullmatch(name) for p in (SYNC_FILE, SHARED_FILE, WEIGHTS_FILE)):
            try:
                sizes[name] = os.stat(os.path.join(args.directory, name), follow_symlinks=False).st_size
            except OSError:
                pass
    names = sweep(args.directory, dry_run=args.dry_run)
    for name in names:
        print(f"{'would remove' if args.dry_run else 'removed'} {name} ({sizes.get(name, 0):,} bytes)")
    total = sum(sizes.get(n, 0) for n in names)
    verb = "would free" if args.dry_run else "freed"
    print(f"{len(names)} stale files in {args.directory}, {verb} {total:,} bytes")
    return 0
