"""How a receiver copies a version into its target: planned once per layout and target, reused for every version.

What ``load_into`` does per tensor in Python -- a view of the arena (``as_strided``), a lookup, a group
for the multi-tensor copy, a ``copy_`` launch -- costs microseconds each: for a model of ~300 tensors it
is milliseconds in the reader's pause, more than the copy itself takes at the device-copy ceiling (an
H100 copies a 2.7 GB model in 1.8 ms). A ``Plan`` holds what stays the same from one version to the
next: which tensors go which way, and for the fused kernel its tables, on the device.

**A plan holds no tensor.** Its key (``plan_key``) has the manifest's tensor entries (parsed once per
layout: ``manifest.py``), the arenas' addresses (``data_ptr``) and the targets' names, addresses, shapes,
dtypes and contiguity, so a plan is used only while all of them are what it was built for. The cover
check (``check_cover``: every published tensor has a target of its shape and dtype, and every target a
tensor) runs when a plan is built: it reads nothing but the entries and the targets' names, shapes and
dtypes, all in the key, so a plan found by its key has passed it for exactly these. Holding a view of an
arena would keep a mapping of device memory the publisher frees and gives to a later version; holding a
target would keep a model the user dropped alive.

**The fused copy** (CUDA to the same CUDA device, when Triton is importable): every tensor whose source
and destination are contiguous, 8-byte aligned and a whole number of 8-byte words is copied by one
kernel launch over a table of chunks (tensor, first word): one program copies ``CHUNK`` words of one
tensor. On an H100 it copies the 291 tensors of a Qwen2-1.5B-sized model (2.69 GB) at 1,466-1,481 GB/s
where one ``memcpy`` of the same bytes gives 1,506, one ``copy_`` per tensor 903 and ``_foreach_copy_``
1,120 (docs/notes/measurements.md, "Many tensors, one launch"). The first launch in a process compiles
the kernel (Triton caches it on disk for the next process).

**The others** (host targets or sources, and tensors the kernel does not take): tensors of at least
``OWN_COPY_BYTES`` one by one (``copy_``: a plain memcpy), smaller ones by one multi-tensor copy per
(device, dtype, source device) of their bits (``bits``: as integers of the same size); their views are
made per load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch

from ...core.layout import dtype_of
from ...errors import LayoutError
from .manifest import Manifest, TensorEntry

#: tensors of at least this many bytes that the fused kernel does not take are copied one by one (``copy_``)
OWN_COPY_BYTES = 1 << 20
#: words (8 bytes) one program of the fused kernel copies (16 KiB: the fastest of 1-8K words in the probe)
CHUNK = 2048
#: the fused kernel is used where it can be (tests turn it off to compare)
FUSED = True
#: plans a receiver keeps (versions alternate between a few arenas)
MAX_PLANS = 4

_kernel: Any = None  # the compiled Triton kernel, ``False`` when Triton is missing


def fused_kernel() -> Callable[..., Any] | None:
    """The Triton kernel of the fused copy, or ``None`` where Triton cannot be imported."""
    global _kernel
    if _kernel is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _kernel = False
            return None

        @triton.jit
        def copy_chunks(src_ptrs, dst_ptrs, words, chunk_tensor, chunk_start, CHUNK: tl.constexpr):
            pid = tl.program_id(0)
            t = tl.load(chunk_tensor + pid)
            start = tl.load(chunk_start + pid)
            n = tl.load(words + t)
            src = tl.load(src_ptrs + t).to(tl.pointer_type(tl.int64))
            dst = tl.load(dst_ptrs + t).to(tl.pointer_type(tl.int64))
            offs = start + tl.arange(0, CHUNK)
            keep = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)

        _kernel = copy_chunks
    return _kernel or None


def chunk_table(words: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tensor index, first word)`` of every chunk of ``chunk`` words covering ``words[i]`` words of each
    tensor ``i`` (int32, int64; tensors of 0 words get no chunk). Every word of every tensor falls in exactly
    one chunk, and a chunk never crosses into the next tensor (the kernel masks the last one's tail)."""
    per = (words + chunk - 1) // chunk
    index = torch.repeat_interleave(torch.arange(len(words), dtype=torch.int32), per)
    first = torch.cumsum(per, 0) - per
    start = (torch.arange(int(per.sum()), dtype=torch.int64) - torch.repeat_interleave(first, per)) * chunk
    return index, start


@dataclass(frozen=True)
class Fused:
    """The fused copy of one plan: device tables for the kernel (addresses as int64)."""

    device: torch.device
    src_ptrs: torch.Tensor
    dst_ptrs: torch.Tensor
    words: torch.Tensor
    chunk_tensor: torch.Tensor
    chunk_start: torch.Tensor

    def launch(self) -> None:
        kernel = fused_kernel()
        assert kernel is not None
        with torch.cuda.device(self.device):
            kernel[(self.chunk_tensor.numel(),)](
                self.src_ptrs, self.dst_ptrs, self.words, self.chunk_tensor, self.chunk_start, CHUNK=CHUNK
            )


#: ``(part index, tensor index in the part, target name)``
Where = tuple[int, int, str]


@dataclass(frozen=True)
class Plan:
    """The copies of one load (see the module's docstring); ``run`` does them, once per version.

    ``layout``: the manifest's tensor entries it was built for, kept so that their ``id`` in the plan's key
    cannot be reused by other entries while the plan lives."""

    layout: tuple[tuple[TensorEntry, ...], ...]
    fused: tuple[Fused, ...]
    own: tuple[Where, ...]
    batches: tuple[tuple[Where, ...], ...]
    nbytes: int
    devices: frozenset[torch.device]

    def run(self, manifest: Manifest, arenas: list[torch.Tensor], targets: dict[str, torch.Tensor]) -> int:
        """Copy, wait for the copies; returns the bytes copied. ``arenas`` and ``targets`` must be those of
        the plan's key (``plan_key``)."""

        def pair(w: Where) -> tuple[torch.Tensor, torch.Tensor]:
            return targets[w[2]], manifest.parts[w[0]].tensors[w[1]].view(arenas[w[0]])

        with torch.no_grad():
            for f in self.fused:
                f.launch()
            for w in self.own:  # a plain memcpy each; the previous copy hides the next launch
                dst, src = pair(w)
                dst.copy_(src, non_blocking=True)
            for batch in self.batches:  # one multi-tensor copy per (device, dtype, source): few launches
                dsts, srcs = zip(*(pair(w) for w in batch), strict=True)
                torch._foreach_copy_([bits(t) for t in dsts], [bits(t) for t in srcs], non_blocking=True)
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        return self.nbytes


#: an integer dtype of each item size. On CUDA, ``_foreach_copy_`` of bfloat16 or float16 goes through float
#: and back, which turns a NaN's payload into the canonical NaN; of integers of the same size it copies the bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its item size (the same strides and bytes), so that a copy of it
    is one of its bits; ``t`` itself for a dtype of another size (complex128)."""
    as_int = _BITS.get(t.element_size())
    return t if as_int is None or t.dtype == as_int else t.view(as_int)


def plan_key(manifest: Manifest, arenas: list[torch.Tensor], targets: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """What a plan and its cover check depend on: the parsed entries (the same objects while the layout
    stays: ``manifest.py`` reuses them), the arenas' addresses, the targets' names, addresses, shapes,
    dtypes and contiguity (one pass each: this runs inside the reader's pause)."""
    ts = targets.values()  # (``map`` over the unbound methods: no attribute lookup per tensor)
    return (
        tuple([id(p.tensors) for p in manifest.parts]),
        tuple([a.data_ptr() for a in arenas]),
        tuple(targets),
        tuple(map(torch.Tensor.data_ptr, ts)),
        tuple(map(_SHAPE, ts)),
        tuple(map(_DTYPE, ts)),
        tuple(map(torch.Tensor.is_contiguous, ts)),
    )


_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")


def _contiguous(t: TensorEntry) -> bool:
    expect = 1
    for n, s in zip(reversed(t.shape), reversed(t.stride), strict=True):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _fusable(t: TensorEntry, src_at: int, dst: torch.Tensor, src_device: torch.device) -> bool:
    """Whether the fused kernel can copy ``t`` (its first byte at address ``src_at`` on ``src_device``)
    into ``dst``: both on one CUDA device, both contiguous, 8-byte aligned, whole words."""
    return src_device.type == "cuda" and dst.device == src_device and whole_words(t, src_at, dst)


def whole_words(t: TensorEntry, src_at: int, dst: torch.Tensor) -> bool:
    """Whether ``t`` (its first byte at address ``src_at``) and ``dst`` are contiguous, 8-byte aligned and a
    whole number of 8-byte words: what the kernel's int64 loads and stores need."""
    return t.nbytes % 8 == 0 and src_at % 8 == 0 and dst.data_ptr() % 8 == 0 and dst.is_contiguous() and _contiguous(t)


def build(
    manifest: Manifest,
    arenas: list[torch.Tensor],
    targets: dict[str, torch.Tensor],
    picked: Callable[[int], range | tuple[int, ...]] | None = None,
) -> Plan:
    """The plan of copying every tensor of ``manifest`` (``picked(part)``: only those indices of each part)
    into ``targets``; aggregates are left out (their bytes arrive through their members)."""
    fusable = FUSED and fused_kernel() is not None
    fused: dict[torch.device, list[tuple[int, int, int]]] = {}  # device -> (src address, dst address, bytes)
    own: list[Where] = []
    batches: dict[tuple[torch.device, torch.dtype, torch.device], list[Where]] = {}
    nbytes = 0
    for i, (part, arena) in enumerate(zip(manifest.parts, arenas, strict=True)):
        for j in picked(i) if picked is not None else range(len(part.tensors)):
            t = part.tensors[j]
            if t.aggregate or t.nbytes == 0:
                continue
            dst = targets[t.name]
            nbytes += t.nbytes
            src_at = arena.data_ptr() + t.offset
            if fusable and _fusable(t, src_at, dst, arena.device):
                fused.setdefault(dst.device, []).append((src_at, dst.data_ptr(), t.nbytes))
            elif t.nbytes >= OWN_COPY_BYTES:
                own.append((i, j, t.name))
            else:
                batches.setdefault((dst.device, dst.dtype, arena.device), []).append((i, j, t.name))
    devices = {d for d, _, _ in batches} | set(fused) | {targets[w[2]].device for w in own}
    return Plan(
        layout=tuple(p.tensors for p in manifest.parts),
        fused=tuple(_tables(d, rows) for d, rows in fused.items()),
        own=tuple(own),
        batches=tuple(tuple(b) for b in batches.values()),
        nbytes=nbytes,
        devices=frozenset(devices),
    )


def _tables(device: torch.device, rows: list[tuple[int, int, int]]) -> Fused:
    src, dst, size = (torch.tensor(col, dtype=torch.int64) for col in zip(*rows, strict=True))
    words = size // 8
    index, start = chunk_table(words, CHUNK)
    on = lambda t: t.to(device)  # noqa: E731
    return Fused(device, on(src), on(dst), on(words), on(index), on(start))


def check_cover(manifest: Manifest, targets: dict[str, torch.Tensor]) -> None:
    """``LayoutError("mismatch")`` naming the first published tensor that does not fit ``targets`` (or the first
    target nothing was published for)."""
    seen = set()
    for _, t in manifest.entries():
        have = targets.get(t.name)
        seen.add(t.name)
        if have is None:
            raise LayoutError(
                "mismatch", "published, but the target has no tensor of that name", tensor=t.name, field="extra"
            )
        if tuple(have.shape) != t.shape:
            raise LayoutError(
                "mismatch",
                f"published {list(t.shape)}, the target's is {list(have.shape)}",
                tensor=t.name,
                field="shape",
            )
        if have.dtype != dtype_of(t.dtype):
            raise LayoutError(
                "mismatch", f"published {t.dtype}, the target's is {have.dtype}", tensor=t.name, field="dtype"
            )
    for name in targets:
        if name not in seen:
            raise LayoutError(
                "mismatch",
                f"in the target, but version {manifest.version} has no tensor of that name",
                tensor=name,
                field="missing",
            )


class Plans:
    """A receiver's plans, by key, the most recently used kept (``MAX_PLANS``)."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], Plan] = {}
        #: plans built (a test reads it: a second load of the same target builds none)
        self.built = 0

    def copy(
        self,
        manifest: Manifest,
        arenas: list[torch.Tensor],
        targets: dict[str, torch.Tensor],
        only_changed: bool,
    ) -> int:
        """Copy every tensor (or, ``only_changed``, those the manifest lists as changed since its base) into
        ``targets``; returns the bytes copied, once the copies are done. A delta's plan is not kept (the
        changed tensors differ from version to version).

        Raises ``LayoutError("mismatch")`` (``check_cover``) before any byte is copied; the check runs for
        every plan built and is skipped for a plan found by its key (the module's docstring says why that is
        the same)."""
        if only_changed:
            check_cover(manifest, targets)
            self.built += 1
            parts = manifest.parts

            def changed(i: int) -> range | tuple[int, ...]:
                c = parts[i].changed
                return c if c is not None else range(len(parts[i].tensors))

            return build(manifest, arenas, targets, changed).run(manifest, arenas, targets)
        key = plan_key(manifest, arenas, targets)
        plan = self._plans.pop(key, None)
        if plan is None:
            check_cover(manifest, targets)
            plan = build(manifest, arenas, targets)
            self.built += 1
            while len(self._plans) >= MAX_PLANS:
                del self._plans[next(iter(self._plans))]
        self._plans[key] = plan  # (re)inserted last: the most recently used
        return plan.run(manifest, arenas, targets)
