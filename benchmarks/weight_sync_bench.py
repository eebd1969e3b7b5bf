"""Weight sync between processes on one machine: publish from a trainer, receive in another process.

For each model family (a plain torch model, a Megatron-core GPT of 2.9B parameters, an FSDP2
Qwen2 of 1.35B; with ``--families fsdp2-3b`` a Qwen2 of 3.0B, with ``megatron-7b`` a GPT of 6.7B),
params resident and offloaded, and each transport that runs on one GPU
(``cuda_ipc``, ``shared_host``; ``shared_host`` only on the CPU), the trainer
publishes versions and a receiver in a ``spawn``ed process copies each into
preallocated tensors on its device (``WeightReceiver.load_into``). Per row:

- ``publish_s``: what ``publish()`` cost the trainer (enqueueing one snapshot);
  ``visible_s``: until receivers could see the version;
- ``pause_s``: the receipt's pause -- from the version held (its manifest read, its memory
  mapped) to its let-go check: copies, and the cover check when a plan is built;
  ``load_s``: the whole ``load_into`` call as the receiving process timed it (the hold, the
  manifest and the mapping too: what a reader that calls it at a token boundary waits), and
  ``load_ratio`` its GB/s over the same ceiling;
  ``receive_gbps`` = ``received_bytes / pause_s`` (the bytes copied into its tensors; ``bytes`` is
  what was published, alignment padding and a Megatron flat buffer's padding included);
- ``ratio``: ``receive_gbps`` over the ceiling measured in this run (``copy_ratio``: the same for
  the copies alone, ``copy_s``, without the hold, the manifest and the let-go): a
  device-to-device copy of the same bytes (bytes copied per second) for
  ``cuda_ipc``, a pinned host-to-device copy for ``shared_host``, a host
  memcpy on the CPU;
- ``vs_naive``: what a user would write, timed in the same run --
  ``state_dict()`` -> ``torch.save`` to ``/dev/shm`` in the trainer, then
  ``torch.load`` -> copy into preallocated tensors (``load_state_dict``) in the
  receiving process -- over ``visible_s + pause_s`` (publish to loaded);
  measured once per family with params resident; ``vs_naive_ray`` the same against
  ``ray.put(model.state_dict())`` and an actor (half a GPU) copying it in (when Ray is installed);
- ``loop_pause_s``: the simplest receiving code on our receiver, timed in the same receiver on the
  same version -- ``with rx.receive() as pairs:`` one ``copy_`` per tensor into the same
  preallocated tensors, then a synchronize -- and ``vs_loop`` = ``loop_pause_s / pause_s``;
- ``d2h_bytes``: device-to-host bytes of the publish (0 for offloaded params
  in a shared pool);
- ``plans_built``: timed loads that built their copy plan (new arenas: the cover check and the
  plan's tables inside ``pause_s``) instead of reusing one.

On the GPU machine (Megatron carried as docs/notes/gpu-machine.md says)::

    python3 benchmarks/weight_sync_bench.py --out benchmarks/results

writes ``<date>-<gpu>-weight-sync.json`` and its PNG. A CPU check (seconds)::

    PYTHONPATH=src python3 benchmarks/weight_sync_bench.py --device cpu --small --out /tmp/ws
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _harness as bench  # noqa: E402

from stateshift import ModelState  # noqa: E402
from stateshift.core.engine import core_of  # noqa: E402
from stateshift.core.pool import HostPool  # noqa: E402
from stateshift.rl.sync import WeightPublisher, WeightReceiver  # noqa: E402

REPLY_S = 600.0
#: above this many bytes the ``ray.put`` baseline is timed once after its warm-up (each takes tens of seconds)
RAY_NAIVE_ONE_ABOVE = 1 << 30


# ------------------------------------------------------------------ the receiving process
def receiver_main(handle: str, device: str, conn: Any) -> None:
    """Commands: ("load", v) -> load version >= v into preallocated tensors, reply timings; ("check", v) ->
    zero them, load version >= v, reply whether every tensor equals the published one; ("loop", v) ->
    the same version copied by a plain ``copy_`` loop over ``receive()``'s pairs, reply its pause; ("naive", path) -> torch.load + copy into preallocated tensors, reply seconds; ("stop",)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    if device == "cpu":
        torch.set_num_threads(1)  # small copies on a busy CPU: intra-op threads only add wake-up latency
    rx = WeightReceiver(handle, name="bench-rx", device=device, timeout_s=REPLY_S)
    targets: dict[str, torch.Tensor] | None = None
    naive: dict[str, torch.Tensor] | None = None
    conn.send(("ready",))
    while True:
        cmd = conn.recv()
        if cmd[0] == "load":
            if targets is None:  # allocate once, from the first version's names, shapes and dtypes
                with rx.receive(min_version=cmd[1]) as (_, pairs):
                    targets = {n: torch.empty(t.shape, dtype=t.dtype, device=device) for n, t in pairs}
            t0 = time.perf_counter()
            version = rx.load_into(targets, min_version=cmd[1])
            r = rx.last_receipt
            conn.send((version, time.perf_counter() - t0, r.pause_s, r.copy_s, r.copied_bytes, r.planned))
        elif cmd[0] == "loop":
            assert targets is not None
            with rx.receive(min_version=cmd[1]) as (_, pairs), torch.no_grad():
                for n, t in pairs:
                    targets[n].copy_(t)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
            conn.send(rx.last_receipt.pause_s)
        elif cmd[0] == "check":  # targets zeroed, version >= v loaded, then compared to the published buffers
            assert targets is not None
            for t in targets.values():
                t.zero_()
            rx.load_into(targets, min_version=cmd[1])
            with rx.receive(min_version=cmd[1]) as (_, pairs):
                conn.send(all(torch.equal(targets[n], t.to(targets[n].device)) for n, t in pairs))
        elif cmd[0] == "naive":
            t0 = time.perf_counter()
            sd = torch.load(cmd[1], map_location=device, weights_only=False)
            if naive is None:
                naive = {k: torch.empty_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
            with torch.no_grad():
                for k, t in naive.items():
                    t.copy_(sd[k])
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send(time.perf_counter() - t0)
            del sd
        else:
            rx.close()
            conn.send("bye")
            return


class Receiver:
    """A receiver process for one publisher."""

    def __init__(self, handle: str, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(handle, device, child), daemon=True)
        self.proc.start()
        assert self.ask(None) == ("ready",)

    def ask(self, cmd: Any) -> Any:
        if cmd is not None:
            self.conn.send(cmd)
        if not self.conn.poll(REPLY_S):
            raise TimeoutError(f"receiver gave no reply to {cmd}")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.ask(("stop",))
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


# ------------------------------------------------------------------ model families
def build_torch(device: torch.device, small: bool) -> Any:
    """A plain model: ``layers`` bf16 (fp32 on the CPU) square Linears with LayerNorms, 2.1 GB at full size."""
    hidden, layers = (256, 4) if small else (8192, 16)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        mods = [m for _ in range(layers) for m in (torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden))]
        return torch.nn.Sequential(*mods).to(dtype)


#: Megatron GPT configs: 2.92B params (5.83 GB) and 6.71B (13.4 GB: there the receiver's fixed host time of about
#: 0.5 ms per load weighs less than half what it does at 5.83 GB; docs/notes/measurements.md)
MEGATRON_SIZES = {
    "megatron": dict(layers=24, hidden=3072, heads=24, vocab=32000),
    "megatron-7b": dict(layers=32, hidden=4096, heads=32, vocab=32000),
}


def build_megatron(device: torch.device, small: bool, family: str = "megatron") -> Any:
    """A Megatron-core GPT in mcore DDP (``megatron_bench.build_gpt``) without its optimizer (the sync moves
    params; its Adam states would not leave an 80 GB GPU room for three versions); ``family`` picks its size
    (``MEGATRON_SIZES``). At 6.71B the GPU holds about 67 GB: params, the fp32 grad buffer, the publisher's
    arena and the receiver's copy."""
    from megatron_bench import GPTSpec, build_gpt, init_megatron

    init_megatron(device.type)
    spec = GPTSpec(layers=2, hidden=256, heads=4) if small else GPTSpec(**MEGATRON_SIZES[family])
    ddp, _ = build_gpt(spec, device.type, optimizer=False)
    return ddp


#: Qwen2 configs of the FSDP2 families: 1.35B (291 tensors) and, at the Megatron GPT's size, 3.0B (435 tensors)
QWEN2_SIZES = {
    "fsdp2": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16),
    "fsdp2-3b": dict(hidden_size=2560, intermediate_size=6912, num_hidden_layers=36, num_attention_heads=20),
}


def build_fsdp2(device: torch.device, small: bool, family: str = "fsdp2") -> Any:
    """Hugging Face Qwen2 (from a config, no download) under FSDP2 (``fully_shard`` per layer and root), world size 1;
    ``family`` picks its size (``QWEN2_SIZES``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if not dist.is_initialized():
        from fsdp2_bench import init_distributed

        init_distributed(device)
    size = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=256,
        )
        if small
        else dict(QWEN2_SIZES[family], vocab_size=32000)
    )
    size["num_key_value_heads"] = size["num_attention_heads"]
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**size)).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        model(torch.randint(0, size["vocab_size"], (1, 8), device=device))
    return model


FAMILIES = {
    "torch": build_torch,
    "megatron": build_megatron,
    "megatron-7b": lambda device, small: build_megatron(device, small, "megatron-7b"),
    "fsdp2": build_fsdp2,
    "fsdp2-3b": lambda device, small: build_fsdp2(device, small, "fsdp2-3b"),
}


# ------------------------------------------------------------------ measuring
def naive_seconds(model: Any, rx: Receiver, shm_dir: str) -> tuple[float, float]:
    """(save_s, load_s): state_dict -> torch.save to shm in this process; torch.load -> copy in the receiver.
    One warm-up, then the median of two."""
    path = os.path.join(shm_dir, f"weight-sync-naive-{os.getpid()}.pt")
    saves, loads = [], []
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            sd = _user_state_dict(model)
            torch.save(sd, path)
            saves.append(time.perf_counter() - t0)
            del sd
            loads.append(rx.ask(("naive", path)))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return statistics.median(saves[1:]), statistics.median(loads[1:])


def _user_state_dict(model: Any) -> dict[str, Any]:
    """``model.state_dict()`` as a user would send it (an FSDP2 DTensor gathered whole)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}


def naive_ray_seconds(model: Any, device: torch.device) -> float | None:
    """What a Ray user would write: ``ray.put(model.state_dict())`` in the trainer, an actor (half a GPU)
    whose method receives it and copies it into preallocated tensors. Seconds from the put to the copy
    done: one warm-up, then the median of two (of one above ``RAY_NAIVE_ONE_ABOVE`` bytes: about 20 s each
    at 6 GB on an H100); ``None`` when Ray is not installed. Ray is shut down before it returns (it runs
    after the family's cases, so that no case is timed beside a running Ray)."""
    try:
        import ray
    except ImportError:
        return None
    cuda = device.type == "cuda"
    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            num_gpus=1 if cuda else 0,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
        )

    @ray.remote
    class NaiveReceiver:
        def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], dev: str) -> None:
            self.dev = dev
            self.targets = {k: torch.empty(shape, dtype=dt, device=dev) for k, (shape, dt) in specs.items()}

        def load(self, sd: dict[str, Any]) -> int:
            with torch.no_grad():
                for k, t in self.targets.items():
                    t.copy_(sd[k])
            if self.dev.startswith("cuda"):
                torch.cuda.synchronize()
            return len(self.targets)

    sd = _user_state_dict(model)
    specs = {k: (tuple(v.shape), v.dtype) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    nbytes = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
    reps = 2 if nbytes > RAY_NAIVE_ONE_ABOVE else 3
    del sd
    rx = NaiveReceiver.options(num_gpus=0.5 if cuda else 0).remote(specs, "cuda" if cuda else "cpu")
    times = []
    try:
        for i in range(reps):
            t0 = time.perf_counter()
            ref = ray.put(_user_state_dict(model))
            ray.get(rx.load.remote(ref), timeout=REPLY_S)
            times.append(time.perf_counter() - t0)
            print(f"  ray.put naive {i + 1}/{reps}: {times[-1]:.2f}s", file=sys.stderr)
            del ref
    finally:
        ray.kill(rx)
        ray.shutdown()
    return statistics.median(times[1:])


def run_case(
    state: ModelState,
    transport: str,
    device: torch.device,
    args: argparse.Namespace,
    version: list[int],
    naive_of: Any = None,
) -> dict[str, Any]:
    """Publish ``warmup + repeat`` versions; the receiver loads each; medians of the timed ones. With
    ``naive_of`` (the model), the naive path is timed too, through the same receiver process."""
    pub = WeightPublisher(
        state, transport=transport, name=f"bench-{transport}", directory=args.shm_dir, ack_timeout_s=REPLY_S
    )
    rx = Receiver(pub.handle().to_json(), str(device))
    rows, naive = [], None
    try:
        if naive_of is not None:
            naive = sum(naive_seconds(naive_of, rx, args.shm_dir))
        for i in range(args.warmup + args.repeat):
            version[0] += 1
            p = pub.publish(version[0]).wait(REPLY_S)
            got, load_s, pause_s, copy_s, received, planned = rx.ask(("load", version[0]))
            assert got == version[0], (got, version[0])
            loop_s = rx.ask(("loop", version[0]))
            if i >= args.warmup:
                rows.append(
                    (
                        p.publish_s,
                        p.visible_s,
                        pause_s,
                        p.d2h_bytes,
                        p.copied_bytes,
                        p.nbytes,
                        copy_s,
                        received,
                        loop_s,
                        load_s,
                        planned,
                    )
                )
        version[0] += 1
        pub.publish(version[0]).wait(REPLY_S)
        exact = rx.ask(("check", version[0]))
    finally:
        rx.close()
        pub.close()
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {
        "publish_s": med(0),
        "visible_s": med(1),
        "pause_s": med(2),
        "copy_s": med(6),
        "loop_pause_s": med(8),
        "load_s": med(9),
        "plans_built": sum(bool(r[10]) for r in rows),
        "d2h_bytes": rows[-1][3],
        "copied_bytes": rows[-1][4],
        "bytes": rows[-1][5],
        "received_bytes": rows[-1][7],
        "naive_s": naive,
        "exact": exact,
    }


def bench_family(
    family: str, device: torch.device, args: argparse.Namespace, ceilings: dict[str, float]
) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    model = FAMILIES[family](device, args.small)
    state = ModelState(model, pool=HostPool(shared=True, shm_dir=args.shm_dir))
    groups = tuple(state.forward_groups)  # what the publisher publishes by default
    print(
        f"{family}: {state.nbytes(groups) / 1e9:.3f} GB published ({', '.join(groups)}), built in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
    )
    transports = ("cuda_ipc", "shared_host") if device.type == "cuda" else ("shared_host",)
    out, version, naive = [], [0], 0.0
    for residency in ("resident", "offloaded"):
        if residency == "offloaded":
            state.offload(groups)
        for transport in transports:
            r = run_case(state, transport, device, args, version, naive_of=model if not out else None)
            naive = r["naive_s"] if not out else naive
            out.append(_row(family, residency, transport, r, naive, ceilings, device))
            print(json.dumps(out[-1]), file=sys.stderr)
    if args.ray_naive:  # last: a running Ray must not share the GPU with the timed cases
        state.onload(groups)
        naive_ray = naive_ray_seconds(model, device)
        for row in out:
            row.update(_vs_ray(naive_ray, row["visible_s"] + row["pause_s"]))
    state.close()
    core_of(state).pool.trim()
    del state, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _row(
    family: str,
    residency: str,
    transport: str,
    r: dict[str, Any],
    naive_s: float,
    ceilings: dict[str, float],
    device: torch.device,
) -> dict[str, Any]:
    if device.type != "cuda":
        ceiling, bound = ceilings["host_memcpy_gbps"], "host_memcpy"
    elif transport == "cuda_ipc":
        ceiling, bound = ceilings["d2d_gbps"] / 2, "d2d_copy"  # bytes copied per second (bench counts read + write)
    else:
        ceiling, bound = ceilings["h2d_gbps"], "pinned_h2d"
    gbps = r["received_bytes"] / r["pause_s"] / 1e9  # bytes copied into the target over the whole pause
    copy_gbps = r["received_bytes"] / r["copy_s"] / 1e9  # the copies alone
    ours = r["visible_s"] + r["pause_s"]
    return {
        "transport": transport,
        "family": family,
        "residency": residency,
        "bytes": r["bytes"],
        "received_bytes": r["received_bytes"],
        "publish_s": round(r["publish_s"], 6),
        "visible_s": round(r["visible_s"], 6),
        "publish_gbps": round(r["bytes"] / r["visible_s"] / 1e9, 2),
        "pause_s": round(r["pause_s"], 6),
        "receive_gbps": round(gbps, 2),
        "ceiling_gbps": round(ceiling, 2),
        "bound": bound,
        "ratio": round(gbps / ceiling, 3),
        "copy_s": round(r["copy_s"], 6),
        "copy_gbps": round(copy_gbps, 2),
        "copy_ratio": round(copy_gbps / ceiling, 3),
        "load_s": round(r["load_s"], 6),
        "load_ratio": round(r["received_bytes"] / r["load_s"] / 1e9 / ceiling, 3),
        "loop_pause_s": round(r["loop_pause_s"], 6),
        "vs_loop": round(r["loop_pause_s"] / r["pause_s"], 2),
        "naive_s": round(naive_s, 4),
        "vs_naive": round(naive_s / ours, 2),
        **_vs_ray(None, ours),
        "d2h_bytes": r["d2h_bytes"],
        "copied_bytes": r["copied_bytes"],
        "plans_built": r["plans_built"],
        "exact": r["exact"],
    }


def _vs_ray(naive_ray_s: float | None, ours_s: float) -> dict[str, float | None]:
    """A row's ``naive_ray_s`` and ``vs_naive_ray`` (``None`` without Ray or before it is timed)."""
    if naive_ray_s is None:
        return {"naive_ray_s": None, "vs_naive_ray": None}
    return {"naive_ray_s": round(naive_ray_s, 4), "vs_naive_ray": round(naive_ray_s / ours_s, 2)}


# ------------------------------------------------------------------ main
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny models: a check that everything runs (CPU is fine)")
    p.add_argument(
        "--families",
        default=None,
        help="comma-separated (default: torch,megatron,fsdp2 on CUDA; torch,fsdp2 on the CPU)",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--warmup", type=int, default=2, help="versions before timing (the receiver maps and registers the blocks)"
    )
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument(
        "--no-ray-naive",
        dest="ray_naive",
        action="store_false",
        help="skip the ray.put / ray.get baseline (run when Ray is installed)",
    )
    args = p.parse_args(argv)
    default = "torch,megatron,fsdp2" if args.device == "cuda" else "torch,fsdp2"
    args.partial = args.families is not None and args.families != default
    args.families = [f for f in (args.families or default).split(",") if f]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    if args.small:
        args.repeat = min(args.repeat, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    vfs = os.statvfs(args.shm_dir)
    print(f"{args.shm_dir}: {vfs.f_bavail * vfs.f_frsize / 1e9:.1f} GB free", file=sys.stderr)
    ceilings = bench.measure_ceilings(16 << 20 if args.small else 1 << 31, device)
    rows, errors = [], {}
    for fam in args.families:  # one family failing (a missing package, memory) still leaves the others' rows
        try:
            rows += bench_family(fam, device, args, ceilings)
        except Exception as exc:  # noqa: BLE001 - recorded in the result file and printed
            import traceback

            traceback.print_exc()
            errors[fam] = repr(exc)
            del exc
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    slug = (
        "cpu"
        if device.type == "cpu"
        else re.sub(
            r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).replace("NVIDIA", "").strip().split()[0].lower()
        )
    )
    stem = f"{datetime.date.today().isoformat()}-{slug}-weight-sync{'-small' if args.small else ''}"
    if args.partial:  # runs of some families each get a file of their own
        stem += "-" + "-".join(args.families)
    result = {
        "machine": bench.machine_name(device),
        "host": bench.host_facts(),
        "torch": torch.__version__,
        "stateshift": bench.git_sha(),
        "ceilings": ceilings,
        "small": args.small,
        "shm_free_bytes": vfs.f_bavail * vfs.f_frsize,
        "repeat": args.repeat,
        "warmup": args.warmup,
        "errors": errors,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    labels = [f"{r['family']}\n{r['transport']}\n{r['residency']}" for r in rows]
    bench.plot_ratios(
        labels,
        [r["ratio"] for r in rows],
        f"weight sync, receiver / ceiling ({result['machine']})",
        args.out / f"{stem}.png",
    )
    print(
        f"{'family':<9} {'transport':<12} {'residency':<10} {'GB':>6} {'publish_s':>9} {'visible_s':>9} {'pause_s':>8} "
        f"{'GB/s':>7} {'ratio':>6} {'copy':>5} {'vs_loop':>7} {'vs_naive':>8} {'vs_ray':>7} {'d2h_GB':>7} exact"
    )
    for r in rows:
        print(
            f"{r['family']:<9} {r['transport']:<12} {r['residency']:<10} {r['bytes'] / 1e9:>6.2f} {r['publish_s']:>9.4f} "
            f"{r['visible_s']:>9.4f} {r['pause_s']:>8.4f} {r['receive_gbps']:>7.1f} {r['ratio']:>6.2f} {r['copy_ratio']:>5.2f} {r['vs_loop']:>7.2f} {r['vs_naive']:>8.1f} {r['vs_naive_ray'] or float('nan'):>7.1f} "
            f"{r['d2h_bytes'] / 1e9:>7.2f} {'yes' if r['exact'] else 'NO'}"
        )
    inexact = [f"{r['family']}/{r['transport']}/{r['residency']}" for r in rows if not r["exact"]]
    print(
        f"wrote {args.out / stem}.json"
        + (f"; failed: {errors}" if errors else "")
        + (f"; NOT EXACT (a loaded tensor differs from the published one): {inexact}" if inexact else "")
    )
    return 1 if errors or inexact else 0


if __name__ == "__main__":
    sys.exit(main())
