"""How fast can host memory be allocated pinned? (The first offload / snapshot of a state pins its homes.)

    python3 benchmarks/pinned_alloc_probe.py        # on a machine with CUDA (Linux)

Strategies, each on a fresh region, for 1 GiB and 8 GiB: torch's pinned allocator (cudaHostAlloc), anonymous mmap
+ cudaHostRegister (what HostPool does), the same after MADV_HUGEPAGE, after a parallel touch (torch zero_ on all
cores), after MADV_POPULATE_WRITE, and combinations. Then a D2H copy into each (pages must not slow the DMA), and the
unregister + munmap time."""
import ctypes, mmap, os, statistics, sys, time, threading
import torch

MADV_POPULATE_WRITE = 23
if not torch.cuda.is_available():
    raise SystemExit("pinned_alloc_probe needs a CUDA device (pinning is what it measures)")
print("THP enabled:", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
      "defrag:", open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip())
print("kernel", os.uname().release, "cpus", os.cpu_count(), "torch threads", torch.get_num_threads())
cudart = torch.cuda.cudart()
dev = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()


def register(t):
    rc = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
    assert int(getattr(rc, "value", rc)) == 0, rc


def populate_threads(mm, n, threads=16):
    """MADV_POPULATE_WRITE over n bytes, cut into `threads` ranges in parallel (madvise needs page-aligned starts)."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    step = -(-n // threads)
    step = -(-step // (2 << 20)) * (2 << 20)
    errs = []
    def one(a, b):
        if libc.madvise(base + a, b - a, MADV_POPULATE_WRITE) != 0:
            errs.append(ctypes.get_errno())
    ts = [threading.Thread(target=one, args=(a, min(n, a + step))) for a in range(0, n, step)]
    [t.start() for t in ts]; [t.join() for t in ts]
    assert not errs, errs


def strategy(name, n):
    t0 = time.perf_counter()
    mm = None
    if name == "torch pin_memory":
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    else:
        mm = mmap.mmap(-1, n)
        if "hugepage" in name:
            mm.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(mm, dtype=torch.uint8)
        if "zero_" in name:
            t.zero_()
        if "populate x16" in name:
            populate_threads(mm, n)
        elif "populate" in name:
            mm.madvise(MADV_POPULATE_WRITE)
        t1 = time.perf_counter()
        register(t)
    t2 = time.perf_counter()
    # D2H into it, 3 times
    ts = []
    for _ in range(3):
        torch.cuda.synchronize(); a = time.perf_counter(); t.copy_(dev[:n], non_blocking=True); torch.cuda.synchronize(); ts.append(time.perf_counter() - a)
    t3 = time.perf_counter()
    if mm is not None:
        cudart.cudaHostUnregister(t.data_ptr())
        del t
        mm.close()
    else:
        del t
        torch._C._host_emptyCache()
    t4 = time.perf_counter()
    pre = (t1 - t0) if mm is not None else 0.0
    print(f"{n >> 30:>2} GiB  {name:<34} alloc+pin {n / (t2 - t0) / 1e9:6.2f} GB/s ({(t2 - t0) * 1e3:7.1f} ms; prep {pre * 1e3:6.1f}, "
          f"register {(t2 - t0 - pre) * 1e3:7.1f})  d2h {n / min(ts) / 1e9:5.1f} GB/s  free {(t4 - t3) * 1e3:6.1f} ms", flush=True)


names = ["torch pin_memory", "mmap+register", "mmap+hugepage+register", "mmap+zero_+register", "mmap+hugepage+zero_+register",
         "mmap+populate+register", "mmap+hugepage+populate+register", "mmap+populate x16+register", "mmap+hugepage+populate x16+register"]
for n in (1 << 30, 8 << 30):
    for name in names:
        try:
            strategy(name, n)
        except Exception as e:
            print(n >> 30, name, "FAILED", repr(e)[:200], flush=True)
    # second pass, to see the order does not matter
    for name in names[1:3]:
        strategy(name, n)


# the touch on N intra-op threads against none, 2 GiB fresh blocks, alternating (the pool touches on 2 or more)
def touched(threads: int, n: int = 2 << 30) -> float:
    mm = mmap.mmap(-1, n)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
        t.zero_()
    register(t)
    dt = time.perf_counter() - t0
    cudart.cudaHostUnregister(t.data_ptr())
    del t
    mm.close()
    return dt


sweep: dict[int, list[float]] = {k: [] for k in (0, 1, 2, 4, 8, 16)}
for _ in range(3):
    for k in sweep:
        sweep[k].append(touched(k))
for k, v in sweep.items():
    med = statistics.median(v)
    print(f"{'register alone' if k == 0 else f'zero_ on {k:>2} threads + register'}: {med * 1e3:7.1f} ms for 2 GiB ({(2 << 30) / med / 1e9:.2f} GB/s)")


# the pool's own path (stateshift.core.pool: the touch on threads of its own), with torch on 1 and on 16 threads
from stateshift.core.pool import HostPool  # noqa: E402

for torch_threads in (1, 16):
    torch.set_num_threads(torch_threads)
    ts = []
    for _ in range(3):
        pool = HostPool(pin=True)
        t0 = time.perf_counter()
        block = pool.acquire(2 << 30)
        ts.append(time.perf_counter() - t0)
        pool.release(block)
        pool.trim()  # unregistered and unmapped: the next one is fresh
    med = statistics.median(ts)
    print(f"HostPool.acquire of a fresh 2 GiB block, torch on {torch_threads:>2} threads: {med * 1e3:7.1f} ms ({(2 << 30) / med / 1e9:.2f} GB/s)")
