"""Benchmark stateshift on a real megatron-core GPT (DDP + DistributedOptimizer, bf16).

    python3 benchmarks/megatron_bench.py --out $OUT            # 24 x 3072 GPT, 2.92B params, on the GPU
    python3 benchmarks/megatron_bench.py --device cpu --layers 2 --hidden 64 --heads 4 --vocab 256 --out /tmp/o
                                                               # smoke run on a CPU-only machine (patched megatron)

Rows (format: docs/design/result-format.md, backend ``megatron``), every ratio against
ceilings measured in the same process on the params' byte count:

- every verb of ``_harness.bench_state`` on the params group:
  snapshot / restore of device-resident params (host and device placement),
  offload / onload, snapshot / restore of offloaded params (zero-copy),
  swap, and the engine-level pi_old cycle (stash + write back);
- snapshot of params offloaded by Megatron's own ``offload_to_cpu`` (values
  in ``param_data_cpu``) against a host memcpy;
- offload / onload of the whole training state (params, grads, fp32
  masters, Adam moments, buffers) and the GPU memory left allocated;
- the ``PiOldCycle`` helper, N mini-batches: host placement, device
  placement (and what ``placement="auto"`` chose), with and without the
  master-rebuild plug-in (``"auto"``: used where it is the cheaper way back,
  so on the device, with room, the cycle stashes; one more row forces it
  there), ``run`` (first swap skipped) and one swap per mini-batch; the
  note says what the swaps did; ``bytes`` = bytes moved (device copies
  counted read + write), ``ratio`` = (time those bytes need at the ceilings) / (measured time);
- host memory: peak RSS during a snapshot above the steady state, first
  (allocating) and second (reusing the pooled block).

Also importable: ``init_megatron``, ``build_gpt``, ``train_step``, ``logits``
and ``patch_megatron_for_cpu`` are what ``tests/gpu/test_megatron_gpu.py``
builds its models with (and what the CPU tests run under patches).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stateshift.core.engine import core_of

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

# --------------------------------------------------------------------------- megatron setup


_CPU_PATCHED = False


def patch_megatron_for_cpu() -> None:
    """Let megatron-core 0.16.1 build and train a GPT on a CPU-only machine (tests and smoke runs only).

    Megatron allocates on ``torch.cuda.current_device()``, hard-codes
    ``device='cuda'`` in a few factories, checks ``param.type()`` against
    ``torch.cuda.*Tensor`` names, pins host copies and forks the CUDA RNG
    tracker; each is redirected to the CPU here. Nothing of this runs on a
    GPU machine.
    """
    global _CPU_PATCHED
    if _CPU_PATCHED:
        return
    _CPU_PATCHED = True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
    torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()  # type: ignore[assignment]

    def on_cpu(fn: Any) -> Any:
        def f(*a: Any, **k: Any) -> Any:
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)

        return f

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    plain_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        r = plain_type(self, *a, **k)
        if not a and not k and isinstance(r, str) and r.startswith("torch.") and not r.startswith("torch.cuda."):
            return "torch.cuda." + r[len("torch.") :]
        return r

    torch.Tensor.type = cuda_type  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def fork(self: Any, name: Any = None) -> Any:
        yield

    mrandom.CudaRNGStatesTracker.fork = fork


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def init_megatron(device: str) -> None:
    """One process group of one rank and model-parallel size 1 (idempotent)."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    if device == "cpu":
        patch_megatron_for_cpu()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", _free_port())
        if device == "cuda":
            torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    # megatron-core 0.16.1 without Transformer-Engine: moe_utils uses the name te_general_gemm
    # only if TE imported (router_gating_linear, moe_utils.py:1192), which raises NameError otherwise.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@dataclass
class GPTSpec:
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    vocab: int = 512
    seq: int = 64
    experts: int = 0  # MoE experts per layer (0: dense)
    lr: float = 1e-3
    seed: int = 0


def build_gpt(spec: GPTSpec, device: str, optimizer: bool = True) -> tuple[Any, Any]:
    """A bf16 GPTModel (local spec) in Float16Module + mcore DDP, and its DistributedOptimizer (Chained;
    ``None`` without ``optimizer``: its fp32 main params and Adam states take 14 bytes per param)."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(spec.seed)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    moe: dict[str, Any] = {}
    if spec.experts:
        moe = {
            "num_moe_experts": spec.experts,
            "moe_router_topk": 2,
            "moe_router_enable_expert_bias": True,
            "moe_router_score_function": "sigmoid",
            "moe_router_load_balancing_type": "none",
            "moe_token_dispatcher_type": "allgather",
            "moe_router_bias_update_rate": 1e-2,
            "add_bias_linear": False,  # 0.16.1 SequentialMLP adds expert biases in place on a view (autograd error)
        }
    config = TransformerConfig(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device == "cpu",
        **moe,
    )
    model = GPTModel(
        config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=spec.experts or None),
        vocab_size=spec.vocab,
        max_sequence_length=spec.seq,
    )
    if device == "cuda":
        model = model.cuda()
    model = Float16Module(config, model)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), module=model
    )
    if not optimizer:
        return ddp, None
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=spec.lr, bf16=True, use_distributed_optimizer=True, clip_grad=1.0), [ddp]
    )
    return ddp, opt


def batch(spec: GPTSpec, step: int, device: str, size: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, spec.vocab, (size, spec.seq), generator=g).to(device)


def _inputs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = ids.shape[1]
    pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    mask = torch.triu(torch.ones(s, s, device=ids.device), diagonal=1).bool()[None, None]
    return pos, mask


def train_step(ddp: Any, opt: Any, ids: torch.Tensor) -> float:
    """One Megatron step: zero grads, forward, backward, finalize (grad sync + expert-bias update), step."""
    from megatron.core.distributed import finalize_model_grads

    pos, mask = _inputs(ids)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(ids, pos, mask, labels=ids).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    opt.step()
    return float(loss.item())


@torch.no_grad()
def logits(ddp: Any, ids: torch.Tensor) -> torch.Tensor:
    pos, mask = _inputs(ids)
    return ddp(ids, pos, mask).float()


# --------------------------------------------------------------------------- host memory


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Peak resident set size during a block, above the RSS at its start.

    Resets the kernel's high-water mark (``/proc/self/clear_refs`` 5) when
    allowed and also samples every millisecond, taking the larger.
    """

    def __enter__(self) -> PeakRSS:
        self.start = _rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_ok = True
        except OSError:
            self.hwm_ok = False
        self.sampled = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sampled = max(self.sampled, _rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sampled = max(self.sampled, _rss_bytes())
        peak = max(self.sampled, _hwm_bytes() if self.hwm_ok else 0)
        self.delta = peak - self.start


# --------------------------------------------------------------------------- the benchmark


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument("--minibatches", type=int, default=4, help="N of the pi_old cycle")
    p.add_argument("--skip-full-state", action="store_true", help="no whole-state offload/onload rows")
    p.add_argument("--out", type=Path, required=True, help="output directory (or a .json path; the PNG goes beside it)")
    args = p.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    import _harness as sb

    from stateshift import ModelState
    from stateshift.rl import PiOldCycle, find_rebuild

    t_start = time.perf_counter()
    init_megatron(device)
    spec = GPTSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq, lr=1e-5)
    ddp, opt = build_gpt(spec, device)
    n_params = sum(p.numel() for p in ddp.parameters())
    train_step(ddp, opt, batch(spec, 0, device, size=1))  # grads and Adam moments exist from here
    _sync()
    t_built = time.perf_counter() - t_start
    print(f"built and stepped a {n_params / 1e9:.2f}B-param GPT in {t_built:.0f}s", file=sys.stderr)

    state = ModelState(ddp, opt)
    dev = torch.device(device)
    params_bytes = state.nbytes("params")
    ceilings = sb.measure_ceilings(params_bytes, dev, repeat=args.repeat)
    if device == "cuda" and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # the ceiling's pinned buffer (torch's caching host allocator)
    cuda = device == "cuda"
    host = ceilings["host_memcpy_gbps"]
    d2h, h2d, d2d = (ceilings["d2h_gbps"], ceilings["h2d_gbps"], ceilings["d2d_gbps"]) if cuda else (host, host, host)
    pcie = min(d2h, h2d)
    bidir = ceilings.get("bidir_gbps", pcie) if cuda else host

    rows, extra = sb.bench_state(
        state,
        backend="megatron",
        ceilings=ceilings,
        groups=("params",),
        repeat=args.repeat,
        cycle_minibatches=args.minibatches,
        loop_tensors=list(ddp.parameters()),
    )
    for r in rows:
        if r.op == "pi_old_cycle":
            r.note += " (engine-level: snapshot + swapped, no rebuild)"

    def add(op: str, residency: str, seconds: float, moved: int, ceiling: float, bound: str, note: str = "") -> None:
        gbps = moved / seconds / 1e9 if seconds > 0 else float("inf")
        rows.append(sb.Row("megatron", op, residency, device, moved, seconds, gbps, gbps / ceiling, bound, note))

    # -- params offloaded by Megatron itself: values in param_data_cpu
    for b in ddp.buffers + ddp.expert_parallel_buffers:
        b.offload_to_cpu(move_params=True, move_grads=False)
    _sync()
    assert state.residency()["params"]["host"] == len(core_of(state).slots("params")), state.residency()
    t = sb.timed(lambda: state.snapshot("params", tag="bench-native").wait(), repeat=args.repeat)
    add(
        "snapshot",
        "host",
        t,
        params_bytes,
        host,
        "host_memcpy",
        "offloaded by megatron offload_to_cpu (param_data_cpu): host copy",
    )
    state.release(core_of(state).snapshots.get("bench-native"))
    state.onload("params")  # refills param_data from param_data_cpu, then Megatron forgets that copy
    _sync()
    if cuda and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # Megatron's pinned param_data_cpu (torch's caching host allocator)

    # -- pi_old cycle helper
    n = args.minibatches

    def noop(mb: Any) -> None:
        return None

    def cycle_row(placement: str, rebuild: Any, how: str) -> None:
        forced = rebuild not in ("auto", None)
        cycle = PiOldCycle(state, placement=placement, rebuild=rebuild)  # type: ignore[arg-type]
        if how == "run":

            def fn() -> None:
                cycle.run(range(n), noop, noop)
        else:

            def fn() -> None:
                cycle.begin()
                for _ in range(n):
                    with cycle.old_policy():
                        pass
                cycle.end()

        fn()  # warm-up (pool blocks, allocator)
        _sync()
        before = dict(cycle.stats.as_dict())
        t = sb.timed(fn, repeat=args.repeat, warmup=0)
        after = cycle.stats.as_dict()
        runs = args.repeat
        keys = ("pcie_bytes", "device_bytes", "host_bytes", "rebuild_bytes", "both_ways_bytes")
        per = {k: (after[k] - before[k]) // runs for k in keys}
        pcie_b, dev_b, host_b, rb_b, both_b = (per[k] for k in keys)
        # a device copy reads and writes its bytes (the d2d ceiling counts both); a rebuild reads
        # the fp32 masters and writes the bf16 params; a host stash's bytes going out while as many of
        # pi_old come in move at the bidirectional ceiling (never faster than one direction alone), the
        # rest of PCIe one way at a time
        both_s = max(2 * both_b / (bidir * 1e9), both_b / (pcie * 1e9))
        bound_s = (
            (pcie_b - 2 * both_b) / (pcie * 1e9) + both_s + (2 * dev_b + rb_b) / (d2d * 1e9) + host_b / (host * 1e9)
        )
        moved = pcie_b + dev_b + host_b
        rows.append(
            sb.Row(
                "megatron",
                "pi_old_cycle",
                "device",
                device,
                moved,
                t,
                moved / t / 1e9 if t > 0 else float("inf"),
                bound_s / t if t > 0 else float("inf"),
                "pcie+d2d" if cuda else "host_memcpy",
                f"N={n}, pi_old placement={cycle.stats.placement}, "
                f"{'rebuild from masters' if cycle.rebuilding else 'stash'}{' (forced)' if forced else ''}, "
                f"{'run (first swap skipped)' if how == 'run' else 'swap every mini-batch'}; "
                f"pcie {pcie_b / 1e9:.2f} GB, device {dev_b / 1e9:.2f} GB, rebuild {rb_b / 1e9:.2f} GB, bound {bound_s:.3f}s"
                + (f"; fallbacks: {sorted(set(cycle.stats.fallbacks))}" if cycle.stats.fallbacks else ""),
            )
        )

    auto = PiOldCycle(state).choose_placement()
    extra["pi_old_auto_placement"] = auto
    for placement in ("host", "device"):
        for rebuild in ("auto", None):
            cycle_row(placement, rebuild, "run")
        cycle_row(placement, "auto", "every")
    plugin = find_rebuild(state)  # on the device "auto" stashes where a stash fits: the rebuild's own figure
    if plugin is not None:
        cycle_row("device", plugin, "run")

    # -- host memory peak during a snapshot
    for snap in list(core_of(state).snapshots):
        state.release(snap)
    core_of(state).pool.trim()
    _sync()
    peaks = {}
    for label in ("first", "second"):
        with PeakRSS() as pk:
            s = state.snapshot("params", tag="rss")
            s.wait()
            _sync()
        peaks[label] = {
            "delta_bytes": pk.delta,
            "snapshot_bytes": s.nbytes,
            "ratio": pk.delta / s.nbytes,
            "hwm_reset": pk.hwm_ok,
        }
    state.release(core_of(state).snapshots.get("rss"))
    extra["host_peak_during_snapshot"] = peaks

    # -- the whole training state
    if not args.skip_full_state:
        core_of(state).pool.trim()
        everything = state.groups
        total = state.nbytes(everything)
        _sync()
        memory = sb.memory_handed_back(state, everything)
        allocated = torch.cuda.memory_allocated() if cuda else 0
        t_off = sb.timed(lambda: state.offload(everything), setup=lambda: state.onload(everything), repeat=args.repeat)
        _sync()
        after_off = torch.cuda.memory_allocated() if cuda else 0
        add(
            "offload",
            "device",
            t_off,
            total,
            d2h,
            "d2h" if cuda else "host_memcpy",
            "params+frozen+buffers+grads+optim",
        )
        t_on = sb.timed(lambda: state.onload(everything), setup=lambda: state.offload(everything), repeat=args.repeat)
        add("onload", "host", t_on, total, h2d, "h2d" if cuda else "host_memcpy", "params+frozen+buffers+grads+optim")
        extra["full_state"] = {
            "bytes": total,
            "gpu_allocated_before": allocated,
            "gpu_allocated_after_offload": after_off,
            "groups": {g: state.nbytes(g) for g in everything},
            **memory,
        }
        # training still works after it all
        loss = train_step(ddp, opt, batch(spec, 1, device, size=1))
        extra["full_state"]["loss_after"] = loss

    result = sb.BenchResult(
        machine=sb.machine_name(dev),
        torch=torch.__version__,
        stateshift=sb.git_sha(),
        ceilings=ceilings,
        rows=rows,
        extra={
            "model": {
                "params": n_params,
                "layers": spec.layers,
                "hidden": spec.hidden,
                "vocab": spec.vocab,
                "dtype": "bf16",
                "params_bytes": params_bytes,
            },
            "megatron_core": _mcore_version(),
            "seconds_total": time.perf_counter() - t_start,
            **extra,
            "pool": core_of(state).pool.stats.as_dict(),
        },
    )
    out = args.out
    if out.suffix == ".json":
        json_path = out
    else:
        day = datetime.date.today().isoformat()
        machine = "h200" if cuda and "H200" in torch.cuda.get_device_name() else ("gpu" if cuda else "cpu")
        json_path = out / f"{day}-{machine}-megatron.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    sb.save(result, json_path, json_path.with_suffix(".png"))
    print(result.table())
    print(json.dumps({k: v for k, v in result.to_json().items() if k not in ("rows",)}, indent=1, default=str))
    print(f"wrote {json_path}", file=sys.stderr)
    return 0


def _mcore_version() -> str:
    try:
        import megatron.core

        return str(getattr(megatron.core, "__version__", "?"))
    except ImportError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
