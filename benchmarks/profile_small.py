"""Where the time goes for a model of many small tensors (run on the GPU machine).

python3 benchmarks/profile_small.py [--count 4000] [--numel 65536]
"""

import argparse
import cProfile
import pstats
import time

import torch
from _harness import ManySmall

from stateshift import ModelState
from stateshift.core.engine import core_of

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--count", type=int, default=4000)
parser.add_argument("--numel", type=int, default=65536)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = ManySmall(args.count, 2 * args.numel, device)
state = ModelState(model)


def ops() -> None:
    state.snapshot("params", tag="a")
    state.offload("params")
    state.onload("params")
    state.restore(core_of(state).snapshots.get("a"))
    if device == "cuda":
        torch.cuda.synchronize()


for _ in range(3):
    ops()
for name, fn in [("refresh", lambda: core_of(state).refresh(["params"])), ("ops", ops)]:
    t = time.perf_counter()
    fn()
    print(f"{name}: {1e3 * (time.perf_counter() - t):.1f} ms")
cProfile.run("ops()", "/tmp/prof_small.out")
pstats.Stats("/tmp/prof_small.out").sort_stats("tottime").print_stats(15)
