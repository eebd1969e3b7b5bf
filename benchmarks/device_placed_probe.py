"""Where an isolated device-placed snapshot / restore loses time (run on a CUDA machine).

    LAYERS=14 python3 benchmarks/device_placed_probe.py

Prints, per case, the median over 9 calls of: when the verb's first copy was enqueued (host time
after the call), the verb's host time, its wall time to a synchronize, and the time between events
recorded around it; beside a plain ``copy_`` of the same bytes. Then the same restore with one lane
(no device-to-device side stream) and without timing events, and whether the verbs synchronise
anywhere (``torch.cuda.set_sync_debug_mode``). A diagnostic, not a result file.
"""

import os
import statistics
import sys
import time
import warnings

import torch

if not torch.cuda.is_available():
    sys.exit("device_placed_probe.py needs a CUDA device")
from stateshift import ModelState
from stateshift.core import transfer as tr
from stateshift.models import TinyConfig, build_default
from stateshift.core.engine import core_of

L = int(os.environ.get("LAYERS", "14"))
cfg = TinyConfig(vocab=32000, hidden=4096, layers=L, heads=32, seq=32, dtype=torch.bfloat16)
model = build_default(cfg, device="cuda")
state = ModelState(model)
n = state.nbytes("params")
sync = torch.cuda.synchronize
snap = state.snapshot("params", tag="p", placement="device")
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
marks = {}
orig = tr.CopyEngine._local_run
def local_run(run, devs, arena, out):
    marks.setdefault("first", time.perf_counter())
    return orig(run, devs, arena, out)
tr.CopyEngine._local_run = staticmethod(local_run)
def one(fn):
    sync(); marks.clear()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter(); e0.record(); fn(); h = time.perf_counter(); e1.record(); sync(); w = time.perf_counter()
    return (marks.get("first", t) - t) * 1e6, (h - t) * 1e6, (w - t) * 1e6, e0.elapsed_time(e1) * 1e3
def report(name, fn, k=9):
    for _ in range(3): one(fn)
    rs = [one(fn) for _ in range(k)]
    med = [statistics.median(x) for x in zip(*rs)]
    print(f"{name:28s} first-copy {med[0]:7.0f} us  host {med[1]:7.0f} us  wall {med[2]:7.0f} us  events {med[3]:7.0f} us")
print("params", n, "slots", len(core_of(state).slots("params")), "runs", len(core_of(state).groups["params"].plan(core_of(state).engine, list(range(len(core_of(state).slots("params"))))).runs))
report("plain copy", lambda: b.copy_(a))
report("restore (2 lanes)", lambda: state.restore(snap))
report("snapshot (2 lanes)", lambda: state.snapshot("params", tag="p2", placement="device"))
d2d = core_of(state).engine._d2d; core_of(state).engine._d2d = None
report("restore (1 lane)", lambda: state.restore(snap))
core_of(state).engine._d2d = d2d
core_of(state).engine.timing = False
report("restore (no timing events)", lambda: state.restore(snap))
core_of(state).engine.timing = True
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    state.restore(snap); state.snapshot("params", tag="p2", placement="device")
    sync()
print("sync warnings:", len(w), [str(x.message)[:120] for x in w][:5])
torch.cuda.set_sync_debug_mode(0)
