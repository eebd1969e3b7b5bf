"""The ``stateshift`` command.

stateshift train            # the fully-async RL trainer on its built-in task (stateshift train --help)
stateshift bench            # the verbs on a built-in GPT, params resident and offloaded
stateshift bench --help     # sizes, device, output files
stateshift inspect PATH     # a checkpoint's manifest and tensors, checksums verified
stateshift clean [DIR]      # remove the /dev/shm files that killed stateshift processes left behind
"""

from __future__ import annotations

import argparse

from .bench import add_parser as _bench_parser
from .clean import add_parser as _clean_parser
from .inspect import add_parser as _inspect_parser
from .train import add_parser as _train_parser


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="stateshift", description="Move, snapshot and restore a training model's state."
    )
    parser.add_argument("--version", action="version", version=f"stateshift {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _bench_parser(sub)
    _inspect_parser(sub)
    _clean_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
