"""Checkpoint benchmark: stateshift save / load / async_save against torch.save and safetensors.

    python benchmarks/checkpoint_bench.py --hidden 2048 --layers 8 --out benchmarks/results

Builds the built-in transformer (one Adam step so optimizer state exists)
and, on the same tensors in the same run, times:

- ``save``: ``stateshift.checkpoint.save`` of params + buffers + optim
  (durable: files fsynced) against ``torch.save`` and
  ``safetensors.torch.save_file`` of the same tensors as the user holds them
  (on the device), each followed by an ``fsync`` so all three are durable;
- ``load``: ``stateshift.checkpoint.load`` (layout check, checksum
  verification, restore into the live tensors) against ``torch.load`` /
  ``safetensors.torch.load_file`` onto the model's device followed by a copy
  into the live tensors (the same end state); and against the simplest
  *verified* load a user would write (``safetensors.load_file`` to host
  memory, ``zlib_ng.crc32`` of every tensor, then the copy), in the row's
  ``loop_gbps`` / ``vs_loop``: ``load_file`` alone checks nothing, and on a
  machine whose copies are CPU-bound (few cores) a verified load cannot reach
  it, since hashing costs CPU time that it does not spend;
- ``async_save_blocking``: the time ``async_save`` blocks its caller (staging
  into pinned memory), against the faster baseline's whole save.

Ours runs with the groups resident (``device``) and offloaded (``host``).
``ratio`` = our GB/s over ``safetensors``' GB/s for the op in the same run
(named in ``bound``: ``safetensors.save_file`` / ``safetensors.load_file``);
every baseline's GB/s is in the run's ``ceilings``. Every save, ours and the
baselines', writes a file or directory that does not exist yet (the previous
one is removed untimed): stateshift never overwrites a checkpoint. The result
file (``_harness.BenchResult``: JSON with ``machine``, ``torch``, ``stateshift``,
``ceilings`` and ``rows``, plus a PNG) is the one every benchmark writes. Loads read from the page cache unless ``--cold`` (then
every file's cached pages are dropped with ``posix_fadvise(DONTNEED)`` before
each load, for ours and the baselines). ``--loads-only`` writes each file once,
untimed, and times only the loads (short rounds, for a machine quiet only for
moments); a row's note gives the load average when it exceeds the core count.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as bench
import torch

from stateshift import ModelState
from stateshift.checkpoint import async_save, load, save
from stateshift.core.engine import core_of
from stateshift.train.tasks.gpt import GPTConfig, build_gpt, next_token_loss, random_ids

VERIFIED = "safetensors.load_file+crc32"
"""The simplest verified load a user would write (the ``vs_loop`` baseline of the load rows)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument(
        "--groups",
        choices=["params", "all"],
        default="all",
        help="'params': params + buffers; 'all': params + buffers + Adam state",
    )
    p.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda[:N]'")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median), after one warm-up")
    p.add_argument(
        "--dir", type=Path, default=None, help="where checkpoints are written (default: a temporary directory)"
    )
    p.add_argument("--out", type=Path, default=None, help="directory for <date>-<machine>-checkpoint.json and .png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--cold", action="store_true", help="drop the files' cached pages before every load")
    p.add_argument("--name", default=None, help="machine name in the result file's name (default: from the machine)")
    p.add_argument(
        "--many",
        type=int,
        default=0,
        metavar="N",
        help="instead of the transformer: N parameters of --many-kib KiB each (result file: ...-checkpoint-many)",
    )
    p.add_argument("--many-kib", type=int, default=16)
    p.add_argument(
        "--loads-only",
        action="store_true",
        help="time only the loads (ours, safetensors.load_file and the verified loop): short rounds, "
        "for a machine that is quiet only for moments",
    )
    return p


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_cache(root: Path) -> None:
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _live_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer, with_optim: bool) -> dict[str, torch.Tensor]:
    """The same tensors a user would hand to torch.save / safetensors (tied weights once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    names = {}
    for n, p in model.named_parameters():  # deduplicates tied parameters
        out[n] = p.detach()
        seen.add(id(p))
        names[id(p)] = n
    for n, b in model.named_buffers():
        if n in model.state_dict():
            out[n] = b
    if with_optim:
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"{names[id(p)]}.{k}"] = v
    return out


def _rounds(fns: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]], repeat: int) -> dict[str, float]:
    """Median seconds of each ``fn``, timed round-robin (one run of each per round, after a warm-up round),
    so that a busy machine weighs on ours and the baselines alike. ``setup`` runs untimed before each run."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(1 + repeat):
        for name, (fn, setup) in fns.items():
            if setup is not None:
                setup()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if i:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


class _Many(torch.nn.Module):
    """``--many N``: N parameters of ``--many-kib`` KiB each, nothing else (norms, biases, LoRA adapters, experts)."""

    def __init__(self, n: int, kib: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        numel = kib * 1024 // dtype.itemsize
        self.params = torch.nn.ParameterList(torch.randn(numel, dtype=dtype, device=device) for _ in range(n))


def _build(
    args: argparse.Namespace, device: torch.device
) -> tuple[ModelState, dict[str, torch.Tensor], tuple[str, ...]]:
    cfg = GPTConfig(vocab=args.vocab, width=args.hidden, layers=args.layers, heads=args.heads, max_len=args.seq)
    if args.many:
        model: torch.nn.Module = _Many(args.many, args.many_kib, DTYPES[args.dtype], device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        sum(p.sum() for p in model.parameters()).backward()
    else:
        model = build_gpt(cfg).to(device=device, dtype=DTYPES[args.dtype])
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        next_token_loss(model, random_ids(cfg, 0, size=1, device=device)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    groups = ("params", "buffers", "optim") if args.groups == "all" else ("params", "buffers")
    tensors = _live_tensors(model, opt, args.groups == "all")
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params ({args.dtype}) on {device}; "
        f"checkpoint of {', '.join(groups)}: {sum(t.nbytes for t in tensors.values()) / 1e9:.3f} GB in "
        f"{len(tensors)} tensors",
        file=sys.stderr,
    )
    return ModelState(model, opt), tensors, groups


def _baselines(tensors: dict[str, torch.Tensor], work: Path, device: torch.device, cold: Callable, fresh: Callable):
    """torch.save / safetensors.save_file of the tensors (fsynced), and their loads into the live tensors."""
    from safetensors.torch import load_file, save_file

    pt, st = work / "baseline.pt", work / "baseline.safetensors"

    def torch_save() -> None:
        with open(pt, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())

    def st_save() -> None:
        save_file(tensors, st)
        _fsync(st)

    def copy_in(loaded: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, v in loaded.items():
                tensors[k].copy_(v)

    def verified(loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The crc32 of every tensor's bytes, as a user checking a file would (zlib-ng's, the fast one)."""
        from zlib_ng.zlib_ng import crc32

        from stateshift.checkpoint.format import byte_view

        crcs = {k: crc32(byte_view(v, v.numel() * v.element_size())) for k, v in loaded.items()}
        assert len(crcs) == len(loaded)
        return loaded

    return {
        "torch.save": (torch_save, fresh(pt)),
        "safetensors.save_file": (st_save, fresh(st)),
        "torch.load": (lambda: copy_in(torch.load(pt, map_location=device, weights_only=True)), cold(pt)),
        "safetensors.load_file": (lambda: copy_in(load_file(st, device=str(device))), cold(st)),
        # the plain verified load: read to host memory, hash every tensor, then copy into the model
        VERIFIED: (lambda: copy_in(verified(load_file(st, device="cpu"))), cold(st)),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    state, tensors, groups = _build(args, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    cold = (lambda p: lambda: _drop_cache(p)) if args.cold else (lambda p: None)
    fresh = lambda p: lambda: shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)  # noqa: E731
    fns = {
        k: (fn, lambda setup=setup: (state.onload(groups), setup and setup()))  # the baselines need it resident
        for k, (fn, setup) in _baselines(tensors, work, device, cold, fresh).items()
    }
    if args.loads_only:  # each file is written once, untimed; the rounds time only the loads
        for k in ("torch.save", "safetensors.save_file"):
            fns.pop(k)[0]()
        del fns["torch.load"]
    base_names = list(fns)
    blocked: dict[str, list[float]] = {"device": [], "host": []}

    def ours(residency: str) -> None:
        path, path_async = work / f"ours-{residency}", work / f"ours-async-{residency}"

        def start_async() -> None:
            t0 = time.perf_counter()
            handle = async_save(state, path_async, groups)
            blocked[residency].append(time.perf_counter() - t0)
            handle.wait()

        def place() -> None:
            state.offload(groups) if residency == "host" else state.onload(groups)

        if args.loads_only:
            save(state, path, groups)
        else:
            fns[f"save/{residency}"] = (lambda: save(state, path, groups), lambda: (place(), fresh(path)()))
            fns[f"async/{residency}"] = (start_async, lambda: (place(), fresh(path_async)()))
        fns[f"load/{residency}"] = (
            lambda: load(state, path, groups),
            lambda: (place(), (cold(path) or (lambda: None))()),
        )

    ours("device")
    ours("host")
    load_before = os.getloadavg()
    med = _rounds(fns, args.repeat)
    state.onload(groups)
    base_gbps = {k: nbytes / med[k] / 1e9 for k in base_names}
    ceilings = {f"{k}_gbps": round(v, 3) for k, v in base_gbps.items()}
    ceilings.update({k: round(v, 2) for k, v in bench.measure_ceilings(nbytes, device, repeat=args.repeat).items()})
    result = bench.BenchResult(
        machine=bench.machine_name(device), torch=torch.__version__, stateshift=bench.git_sha(), ceilings=ceilings
    )
    warm = "" if args.cold else "; page cache warm"
    busy = max(load_before[0], os.getloadavg()[0])
    if busy > (os.cpu_count() or 1):  # ratios on a shared machine are not those of a quiet one: say so in every row
        warm += f"; shared machine, load average {busy:.1f} on {os.cpu_count()} cores"
    for residency in ("device", "host"):
        for op, key, bound, note in (
            ("save", f"save/{residency}", "safetensors.save_file", "fsynced"),
            ("load", f"load/{residency}", "safetensors.load_file", f"checksums verified{warm}"),
            (
                "async_save_blocking",
                None,
                "safetensors.save_file",
                "caller blocked until staged; write continues in a thread",
            ),
        ):
            if (key or f"async/{residency}") not in fns:
                continue
            seconds = med[key] if key else statistics.median(blocked[residency][1:])
            gbps = nbytes / seconds / 1e9
            plain = base_gbps[VERIFIED] if op == "load" else None
            result.rows.append(
                bench.Row(
                    "torch",
                    op,
                    residency,
                    device.type,
                    nbytes,
                    seconds,
                    gbps,
                    gbps / base_gbps[bound],
                    bound,
                    note,
                    loop_gbps=plain,
                    vs_loop=None if plain is None else gbps / plain,
                    case=f"many-{args.many}x{args.many_kib}KiB" if args.many else "",
                )
            )
    result.extra.update(
        model={
            "params": sum(p.numel() for p in state.backends[0].checkpoint_facts().module.parameters()),
            "dtype": args.dtype,
            "groups": list(groups),
            "tensors": len(tensors),
        },
        baselines={k: {"seconds": med[k], "gbps": base_gbps[k]} for k in base_names},
        timing="round-robin: each round times every baseline and every op of ours once; medians over rounds",
        load_average={"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
        cold=args.cold,
        loads_only=args.loads_only,
        pool=core_of(state).pool.stats.as_dict(),
    )
    print(result.table())
    print("baselines (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in base_gbps.items()))
    if args.out is not None:
        slug = args.name or re.sub(r"[^a-z0-9]+", "-", result.machine.lower()).strip("-")
        stem = f"{datetime.date.today().isoformat()}-{slug}-checkpoint" + ("-many" if args.many else "")
        bench.save(result, args.out / f"{stem}.json", None if args.no_plot else args.out / f"{stem}.png")
        print(f"wrote {args.out / (stem + '.json')}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
