"""verl 0.9.1's own offload / copy / restore functions against stateshift's drop-ins, same models, same run.

    python3 benchmarks/verl_bench.py --out benchmarks/results          # on the GPU machine (see docs/guide/verl.md)

For each model -- a dense and an MoE (router ``expert_bias`` on) Megatron-core GPT (DDP + distributed
optimizer, bf16) and an FSDP2 model (``fully_shard`` per block, world size 1) -- it runs verl's
fully-async non-bypass pi_old sequence (``verl_sequence.py``) with: plain clones that never move
(the reference), stateshift's drop-ins (pi_old in pinned host or device memory), what ``install()``
gives by default (stateshift's ``SAFE`` functions beside verl's others) and verl's functions, in each
residency mix (params on the
device; offloaded by the offload function; for Megatron also Megatron's own ``offload_to_cpu``, and
the two alternately). Each run records its old log-probs (compared bit for bit with the reference's),
whether its final weights equal the reference's, the first exception as it happened, and the time of
every call. Writes ``<out>/<date>-<card>-verl.json`` (``h200`` on the H200) and a PNG beside it.

verl is loaded from its wheel (``--verl-whl``, default ``.whl-verl/verl-0.9.1-py3-none-any.whl``):
only ``verl.utils.megatron_utils`` and ``verl.utils.fsdp_utils`` are imported, with verl's package
``__init__`` files bypassed (they import ray, tensordict, ...); verl modules those two import at module
level but whose functions the benchmark never calls are stubbed when they cannot be imported
(recorded in the result's ``verl_stubs``). Each model runs in a child process, so a CUDA fault in one
cannot spoil the others' numbers.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "src", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from verl_sequence import (  # noqa: E402
    compare,
    fsdp2_fns,
    megatron_fns,
    megatron_native_offload,
    reference_fns,
    run_sequence,
    weights,
)

#: verl modules the two files import at module level whose functions are never called here
STUB_FIRST = ("verl.workers.config", "verl.utils.model")


def _stub(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__stateshift_stub__ = True  # type: ignore[attr-defined]

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


def load_verl(whl: str) -> tuple[Any, Any, dict[str, Any]]:
    """``(megatron_utils, fsdp_utils, info)`` of the verl wheel, imported as the module docstring says."""
    root = Path(tempfile.mkdtemp(prefix="verl-wheel-"))
    zipfile.ZipFile(whl).extractall(root)
    version = (root / "verl/version/version").read_text().strip()
    for pkg in ("verl", "verl.utils", "verl.workers"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(root / pkg.replace(".", "/"))]  # type: ignore[attr-defined]
        sys.modules[pkg] = mod
    sys.modules["verl"].__version__ = version  # type: ignore[attr-defined]
    stubs: list[str] = []
    for name in STUB_FIRST:
        sys.modules[name], _ = _stub(name), stubs.append(name)
    out = []
    for target in ("verl.utils.megatron_utils", "verl.utils.fsdp_utils"):
        for _ in range(20):
            try:
                out.append(__import__(target, fromlist=["_"]))
                break
            except ModuleNotFoundError as exc:
                if not exc.name or exc.name in sys.modules:
                    raise
                sys.modules[exc.name], _ = _stub(exc.name), stubs.append(exc.name)
            except ImportError as exc:  # "cannot import name X from Y": Y exists here, without X (another version)
                missing = re.match(r"cannot import name '(\w+)' from '([\w.]+)'", str(exc))
                if missing is None or missing.group(2) not in sys.modules:
                    raise
                setattr(sys.modules[missing.group(2)], missing.group(1), type(missing.group(1), (), {}))
                stubs.append(f"{missing.group(2)}.{missing.group(1)}")
    return out[0], out[1], {"verl_version": version, "verl_stubs": stubs, "verl_root": str(root)}


def _placement(impl: str) -> None:
    """``stateshift-device``: the drop-ins with ``install(placement="device")``'s setting; otherwise pinned host."""
    from stateshift.integrations.verl import SETTINGS

    SETTINGS.placement = "device" if impl == "stateshift-device" else "host"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _release_megatron(ddp: Any, opt: Any) -> None:
    """Free one run's Megatron model and optimizer by hand: megatron-core's DDP is never collected (its
    grad-accumulation hooks hold its params through C++), so each run would keep its model, optimizer
    state and stateshift's states -- the MoE case ran out of memory on an 80 GB card. Closes the run's
    stateshift states (their snapshots and homes), then releases every storage left."""
    from stateshift.integrations.verl import registry

    registry.drain()
    entry = registry._MODELS.get(ddp)
    states = [
        entry.state() if entry is not None else None,
        *(r() for o in _leaves(opt) if (r := registry._OPTIMIZERS.get(o))),
    ]
    for st in states:
        if st is not None and not st.closed:
            try:
                st.close()
            except Exception as exc:  # noqa: BLE001 - a run that crashed (verl's functions) may leave what no close can mend
                print(f"  (closing a state of a failed run: {type(exc).__name__})", flush=True)
    tensors = [*torch.nn.Module.parameters(ddp), *torch.nn.Module.buffers(ddp)]
    for b in list(ddp.buffers) + list(ddp.expert_parallel_buffers):
        tensors += [t for t in (getattr(b, "param_data", None), getattr(b, "grad_data", None)) if t is not None]
    for leaf in _leaves(opt):
        inner = getattr(leaf, "optimizer", None)
        if inner is not None:
            tensors += [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
            tensors += [q for g in inner.param_groups for q in g["params"]]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.resizable():
            storage.resize_(0)


def _leaves(opt: Any) -> list[Any]:
    """The leaf optimizers of a (chained) Megatron optimizer, and the optimizer itself."""
    return [opt, *getattr(opt, "chained_optimizers", [])]


def _progress(t0: float, what: str) -> None:
    peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if torch.cuda.is_available() else ""
    print(f"[verl_bench {time.perf_counter() - t0:6.1f} s] {what}{peak}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _megatron_case(name: str, args: argparse.Namespace, impls: dict[str, Any]) -> list[dict[str, Any]]:
    import megatron_bench as mb

    mb.init_megatron(args.device)
    spec = mb.GPTSpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        experts=args.experts if name == "moe" else 0,
    )

    def run(fns: Any, mix: str) -> tuple[Any, Any, int]:
        ddp, opt = mb.build_gpt(spec, args.device)
        mb.train_step(ddp, opt, mb.batch(spec, 0, args.device))
        nbytes = sum(
            b.param_data.numel() * b.param_data.element_size() for b in ddp.buffers + ddp.expert_parallel_buffers
        )
        fwd = lambda s: mb.logits(ddp, mb.batch(spec, 100 + s, args.device))  # noqa: E731, F821 - runs before the del below
        step = lambda s: mb.train_step(ddp, opt, mb.batch(spec, s + 1, args.device))  # noqa: E731, F821 - runs before the del below
        res = run_sequence(
            fns,
            [ddp],
            opt,
            forward=fwd,
            train=step,
            n=args.n,
            cycles=args.cycles,
            mix=mix,
            native_offload=megatron_native_offload,
            sync=_sync,
        )
        final = weights([ddp]) if res.error is None else None
        _release_megatron(ddp, opt)
        del ddp, opt
        _free()
        return res, final, nbytes

    t0 = time.perf_counter()
    ref, ref_final, nbytes = run(reference_fns(), "device")
    _progress(t0, f"megatron-{name} reference ({nbytes / 2**20:.0f} MiB of params)")
    rows = []
    for impl, mod in impls.items():
        for mix in args.mixes:
            _placement(impl)
            res, final, _ = run(megatron_fns(mod), mix)
            rows.append(_row(f"megatron-{name}", impl, mix, res, ref, final, ref_final, nbytes))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "seconds"}), flush=True)
            _progress(t0, f"megatron-{name} {impl} {mix}: {'error' if res.error else 'ok'}")
    return rows


class _Blocks(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(hidden),
                torch.nn.Linear(hidden, 4 * hidden),
                torch.nn.GELU(),
                torch.nn.Linear(4 * hidden, hidden),
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b(x)
        return torch.log_softmax(self.head(x).float(), dim=-1)


def init_dist(device: str) -> None:
    """One process group of one rank (idempotent): NCCL on CUDA, gloo on the CPU."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
        if device == "cuda":
            torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def _fsdp2_case(args: argparse.Namespace, impls: dict[str, Any]) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    init_dist(args.device)
    mesh = init_device_mesh(args.device, (1,))

    def ids(step: int) -> torch.Tensor:
        return torch.randint(0, args.vocab, (2, args.seq), generator=torch.Generator().manual_seed(step)).to(
            args.device
        )

    def run(fns: Any, mix: str) -> tuple[Any, Any, int]:
        torch.manual_seed(0)
        model = _Blocks(args.layers, args.hidden, args.vocab).to(args.device, torch.bfloat16)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def train(step: int) -> None:
            opt.zero_grad()  # noqa: F821 - runs before the del below
            out = model(ids(step))  # noqa: F821 - runs before the del below
            torch.nn.functional.nll_loss(out.flatten(0, 1), ids(step).roll(-1, 1).flatten()).backward()
            opt.step()  # noqa: F821 - runs before the del below

        def forward(step: int) -> torch.Tensor:
            with torch.no_grad():
                return model(ids(1000 + step)).clone()  # noqa: F821 - runs before the del below

        train(0)
        nbytes = sum(p._local_tensor.numel() * p._local_tensor.element_size() for p in model.parameters())
        res = run_sequence(
            fns,
            model,
            opt,
            forward=forward,
            train=lambda s: train(s + 1),
            n=args.n,
            cycles=args.cycles,
            mix=mix,
            sync=_sync,
        )
        final = weights(model) if res.error is None else None
        del model, opt
        _free()
        return res, final, nbytes

    t0 = time.perf_counter()
    ref, ref_final, nbytes = run(reference_fns(), "device")
    _progress(t0, f"fsdp2 reference ({nbytes / 2**20:.0f} MiB of params)")
    rows = []
    for impl, mod in impls.items():
        for mix in [m for m in args.mixes if m in ("device", "offloaded")]:
            _placement(impl)
            res, final, _ = run(fsdp2_fns(mod, args.device), mix)
            rows.append(_row("fsdp2", impl, mix, res, ref, final, ref_final, nbytes))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "seconds"}), flush=True)
            _progress(t0, f"fsdp2 {impl} {mix}: {'error' if res.error else 'ok'}")
    return rows


def _row(
    model: str, impl: str, mix: str, res: Any, ref: Any, final: Any, ref_final: Any, nbytes: int
) -> dict[str, Any]:
    report = compare(res, ref, final, ref_final)
    med = {k: sorted(v)[len(v) // 2] for k, v in res.seconds.items()}
    # per cycle: its copies and restores (the time verl's worker spends on pi_old), over whole runs only
    pi_old = (
        (sum(res.seconds.get("copy", [])) + sum(res.seconds.get("restore", []))) / _CYCLES[0]
        if res.error is None
        else None
    )
    return {
        "model": model,
        "impl": impl,
        "mix": mix,
        "bytes": nbytes,
        **report,
        "pi_old_cycle_seconds": pi_old,
        "median_seconds": med,
        "gbps": {
            k: nbytes / s / 1e9
            for k, s in med.items()
            if s > 0 and k in ("copy", "restore", "offload_model", "load_model")
        },
        "seconds": res.seconds,
    }


#: cycles per run (set by ``child``; ``_row`` divides by it)
_CYCLES = [1]


def child(args: argparse.Namespace) -> int:
    from stateshift.integrations import verl as ours

    _CYCLES[0] = args.cycles
    impls: dict[str, Any] = {}
    info: dict[str, Any] = {}
    verl_mod = None
    if "verl" in args.impls or "default-install" in args.impls:
        mu, fu, info = load_verl(args.verl_whl)
        verl_mod = mu if args.case != "fsdp2" else fu
    for impl in args.impls:
        if impl == "verl":
            impls["verl"] = verl_mod
        elif impl == "default-install":  # what install() gives by default: SAFE from stateshift, the rest verl's
            impls[impl] = types.SimpleNamespace(
                **{
                    n: getattr(ours if n in ours.SAFE else verl_mod, n)
                    for n in ours.SAFE + ours.ON_REQUEST
                    if hasattr(verl_mod, n)
                }
            )
        elif impl in ("stateshift", "stateshift-device"):
            impls[impl] = ours
        else:
            raise SystemExit(f"unknown impl {impl!r}: stateshift, stateshift-device, default-install or verl")
    rows = _fsdp2_case(args, impls) if args.case == "fsdp2" else _megatron_case(args.case, args, impls)
    nbytes = max((r["bytes"] for r in rows), default=0)
    if nbytes:
        from _harness import measure_ceilings

        info["ceilings"] = measure_ceilings(nbytes, torch.device(args.device))
    Path(args.part).write_text(
        json.dumps({"rows": rows, **{f"{args.case}_{k}" if k == "ceilings" else k: v for k, v in info.items()}})
    )
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("median_seconds")]
    ops = ["copy", "restore", "offload_model", "load_model", "pi_old_cycle"]
    for r in rows:
        if r.get("pi_old_cycle_seconds"):
            r["median_seconds"] = {**r["median_seconds"], "pi_old_cycle": r["pi_old_cycle_seconds"]}
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 4))
    for ax, op in zip(axes, ops, strict=True):
        labels = [f"{r['model']}\n{r['mix']}\n{r['impl']}" for r in rows if op in r["median_seconds"]]
        vals = [r["median_seconds"][op] * 1e3 for r in rows if op in r["median_seconds"]]
        ax.barh(labels, vals, color=["tab:red" if lab.endswith("verl") else "tab:blue" for lab in labels])
        ax.set_xscale("log")
        ax.set_title(f"{op} (ms, median)")
        ax.tick_params(labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="fsdp2,dense,moe")
    ap.add_argument(
        "--impls",
        default="stateshift,stateshift-device,default-install,verl",
        help="stateshift (every function; pi_old on pinned host), stateshift-device, default-install "
        "(install()'s default: stateshift's SAFE functions, verl's others), verl",
    )
    ap.add_argument("--mixes", default="device,offloaded,native,mixed")
    ap.add_argument("--verl-whl", default=str(ROOT / ".whl-verl/verl-0.9.1-py3-none-any.whl"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="mini-batches per pi_old cycle")
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--name", default="verl", help="the result is <out>/<date>-<card>-<name>.json (and .png)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.impls, args.mixes = args.impls.split(","), args.mixes.split(",")
    if args.case:
        return child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from _harness import git_sha, host_facts

    result: dict[str, Any] = {
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "stateshift": git_sha(),
        "host": {"name": socket.gethostname(), **host_facts()},
        "args": vars(args),
        "rows": [],
        "failed_cases": {},
    }
    t0 = time.perf_counter()
    card = result["machine"].split()[-1].lower() if args.device == "cuda" else "cpu"  # "NVIDIA H200" -> h200
    stem = f"{datetime.date.today()}-{card}-{args.name}"
    for case in args.cases.split(","):
        print(f"[verl_bench {time.perf_counter() - t0:6.1f} s] case {case}: a child process", flush=True)
        part = out / f".verl-part-{case}.json"
        cmd = [
            sys.executable,
            __file__,
            *(argv if argv is not None else sys.argv[1:]),
            "--case",
            case,
            "--part",
            str(part),
        ]
        proc = subprocess.run(cmd, capture_output=False)
        if proc.returncode != 0 or not part.exists():
            result["failed_cases"][case] = f"child exited {proc.returncode}"
        else:
            data = json.loads(part.read_text())
            part.unlink()
            result["rows"] += data.pop("rows")
            result.update(data)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))  # after every case: a timeout keeps the rest
    try:
        _plot(result, out / f"{stem}.png")
    except Exception as exc:  # noqa: BLE001 - a plot failure must not lose the numbers
        print(f"plot failed: {exc}")
    print(f"wrote {out / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
