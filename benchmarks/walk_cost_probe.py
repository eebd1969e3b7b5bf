"""Device-placed restore / snapshot, isolated: as shipped, and with the module-tree walk skipped (TreeWatch.changed
patched to say 'unchanged' -- what an opt-in 'the tree is fixed' mode would do, which stateshift does not offer:
docs/design.md), alternating, same process. Against one device copy of the same bytes.

    python3 benchmarks/walk_cost_probe.py       # on a CUDA machine
"""
import statistics
import torch
from stateshift import ModelState
from stateshift import bench
from stateshift.bench import host_facts
from stateshift.models import TinyConfig, build_default
import importlib
tb = importlib.import_module("stateshift.backends.torch")

if not torch.cuda.is_available():
    raise SystemExit("walk_cost_probe needs a CUDA device")
print(host_facts())
orig = tb.TreeWatch.changed
def timed(fn):
    """Median microseconds over 25 synchronised runs after 3 (``stateshift.bench.timed``, as every bench row)."""
    return bench.timed(fn, repeat=25, warmup=3) * 1e6
for L in (6, 14):
    model = build_default(TinyConfig(vocab=32000, hidden=4096, layers=L, heads=32, seq=32, dtype=torch.bfloat16), device="cuda")
    state = ModelState(model)
    snap = state.snapshot("params", tag="p", placement="device")
    nbytes = state.nbytes("params")
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
    ceil = timed(lambda: b.copy_(a)); del a, b
    res = {}
    for rnd in range(2):
        for walk in (True, False):
            tb.TreeWatch.changed = orig if walk else (lambda self: False)
            for name, fn in (("restore", lambda: state.restore(snap)), ("snapshot", lambda: state.snapshot("params", tag="q", placement="device"))):
                res.setdefault((name, walk), []).append(timed(fn))
    tb.TreeWatch.changed = orig
    print(f"layers {L}, {nbytes / 1e9:.2f} GB, one copy {ceil:.0f} us")
    for (name, walk), v in res.items():
        t = statistics.median(v)
        print(f"  {name:<8} {'walk' if walk else 'no walk':<8} {t:7.0f} us -> {ceil / t:.3f} of one copy")
    del state, snap, model
    torch.cuda.empty_cache()
