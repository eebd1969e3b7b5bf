"""Checkpoints of a ModelState: every residency, corruption, mismatches, crashes, full disks, async saves.

CPU by default (``cuda`` too where available, marked ``gpu``). The crash and
full-disk tests use a real SIGKILL of a subprocess and a real 4 MiB tmpfs.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from helpers import (
    DEVICES,
    MIXES,
    SMALL,
    assert_same,
    batch,
    build_model,
    capture,
    expected_after,
    lm_loss,
    make,
    perturb,
    train_step,
    warm,
)
from raises import raises_kind
from torch import nn

from stateshift import LayoutError, ModelState, StateError
from stateshift.checkpoint import (
    async_save,
    export_hf,
    format as format_mod,
    init_optimizer_state,
    load,
    save,
    verify,
)
from stateshift.checkpoint.commit import read_latest
from stateshift.checkpoint.directory import Checkpoint
from stateshift.cli.inspect import add_parser
from stateshift.core.engine import core_of
from stateshift.errors import CheckpointError

SRC = str(Path(__file__).resolve().parents[2] / "src")
ALL = ("params", "buffers", "grads", "optim")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def _warmed(device: str, seed: int = 0, **changes):
    model, opt = make(device, seed=seed, **changes)
    warm(model, opt)
    if seed:
        perturb(model, opt, 0.1 * seed)
    return model, opt, ModelState(model, opt)


def read_manifest(path):
    return Checkpoint.open(path, files=()).manifest


def list_tensors(path):
    return [t for e in read_manifest(path).files.values() for t in e.tensors]


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("mix", list(MIXES))
def test_round_trip_in_every_mix(device, tmp_path, mix):
    """Saved from a mix, loaded into another model in the same mix: same values, same residency."""
    _model, _opt, state = _warmed(device)
    dropped = MIXES[mix](state)
    values = capture(state)
    residency = state.residency()
    save(state, tmp_path / "ck", ALL, tag="t", version=3)
    assert state.residency() == residency  # saving moved nothing back to the device
    assert_same(capture(state), values)

    model2, opt2, state2 = _warmed(device, seed=1)
    MIXES[mix](state2)
    residency2 = state2.residency()
    assert not torch.equal(capture(state2)["blocks.0.fc1.weight"], values["blocks.0.fc1.weight"])
    manifest = load(state2, tmp_path / "ck")
    assert manifest.tag == "t" and manifest.version == 3
    assert_same(capture(state2), expected_after(values, dropped))
    after = state2.residency()
    for g, counts in residency2.items():  # loading moved nothing: dropped slots now hold values offloaded
        assert after[g]["device"] == counts["device"]
        assert after[g]["host"] == counts["host"] + counts["dropped"] and after[g]["dropped"] == 0
    state2.onload()
    train_step(model2, opt2, 1)  # and the model trains


MEGATRON_MIXES = {
    "resident": lambda st, ddp: None,
    "offloaded": lambda st, ddp: st.offload(),
    "partial": lambda st, ddp: st.offload(["params", "optim"], only=lambda n: "expert" in n),
    # Megatron's own offload_to_cpu: the values sit in param_data_cpu (a NativeHome)
    "native": lambda st, ddp: [b.offload_to_cpu() for b in ddp.buffers + ddp.expert_parallel_buffers],
}


@pytest.mark.parametrize("mix", list(MEGATRON_MIXES))
@pytest.mark.parametrize("config", ["distrib_ep", "float16"])
def test_megatron_round_trip_in_every_mix(tmp_path, config, mix):
    """Megatron-core DDP flat buffers (CPU fake of 0.16.1): raw buffer slots, fp32 master shards, expert bias."""
    from fakes.mcore import (
        FakeMoEModel,
        build_fake_ddp,
        build_fake_optimizer,
        fake_train_step,
    )

    def build(seed: int):
        model = FakeMoEModel(16, seed=seed)
        udo = config == "distrib_ep"
        ddp = build_fake_ddp(
            model, use_distributed_optimizer=udo, expert_parallel_param_filter=lambda n, p: ".experts." in n
        )
        opt = build_fake_optimizer(ddp, "chained")
        fake_train_step(ddp, opt, torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)))
        state = ModelState(ddp, opt)
        assert state.backends[0].name.startswith("megatron")
        MEGATRON_MIXES[mix](state, ddp)
        return state

    state = build(0)
    groups = tuple(g for g in state.groups if g != "grads")
    values = capture(state, groups)
    m = save(state, tmp_path / "ck")
    assert m.backend.startswith("megatron") and set(m.layout["groups"]) == set(groups)
    raw = [s for s in m.layout["ranks"][0]["groups"]["params"]["slots"] if not s["typed"]]
    if config == "distrib_ep":  # flat param_data buffers: raw bytes with many members
        assert raw and max(len(s["members"]) for s in raw) > 1
    other = build(1)
    residency = other.residency()
    load(other, tmp_path / "ck")
    assert_same(capture(other, groups), values)
    after = other.residency()
    assert all(after[g]["device"] == residency[g]["device"] for g in groups)


def test_save_from_offloaded_state_copies_nothing_and_load_is_a_pointer_copy(tmp_path):
    _model, _opt, state = _warmed("cpu")
    groups = ("params", "buffers", "optim")
    state.offload(groups)
    values = capture(state, groups)
    before = core_of(state).pool.stats
    save(state, tmp_path / "ck")
    after = core_of(state).pool.stats
    assert after.requested_bytes == before.requested_bytes  # zero-copy: written straight from the homes
    assert after.in_use_bytes == before.in_use_bytes  # the snapshot shares the homes and is released

    _model2, _opt2, state2 = _warmed("cpu", seed=1)
    state2.offload(groups)
    before = core_of(state2).pool.stats
    load(state2, tmp_path / "ck")
    after = core_of(state2).pool.stats
    # read once into one pooled block per group, which became the homes (a pointer copy, no second copy);
    # the old homes went back to the pool
    assert after.requested_bytes - before.requested_bytes == sum(state2.layout(g).total for g in groups)
    assert after.in_use_bytes == before.in_use_bytes
    assert state2.residency()["params"]["device"] == 0
    assert_same(capture(state2, groups), values)


def test_save_of_resident_state_stages_one_copy_through_the_pool(tmp_path):
    _model, _opt, state = _warmed("cpu")
    before = core_of(state).pool.stats
    save(state, tmp_path / "ck")
    total = sum(state.layout(g).total for g in ("params", "buffers", "optim"))
    after = core_of(state).pool.stats
    assert after.requested_bytes - before.requested_bytes == total  # exactly one staged copy, no more
    assert after.in_use_bytes == before.in_use_bytes
    save(state, tmp_path / "ck2")  # the second save reuses the pooled blocks
    assert core_of(state).pool.stats.allocations == after.allocations


def test_manifest_and_format(tmp_path):
    from safetensors.torch import load_file

    model, opt, state = _warmed("cpu")
    m = save(state, tmp_path / "ck", tag="step", version=7, extra={"run": "abc"})
    assert set(m.files) == {"params.safetensors", "buffers.safetensors", "optim.safetensors"}
    assert m.backend == "torch+torch-optim" and m.extra == {"run": "abc"}
    assert m.library_version and m.torch_version == torch.__version__
    assert all(e.checksum.startswith("crc32:") for e in m.files.values())
    assert m.layout["format"] == "stateshift-state/1" and m.layout["world_size"] == 1
    slots = {s["slot"]: s for s in m.layout["ranks"][0]["groups"]["params"]["slots"]}
    tied = slots["tok.weight"]
    assert not tied["typed"] and [x["name"] for x in tied["members"]] == ["tok.weight", "head.weight"]
    assert slots["blocks.0.fc1.weight"]["typed"]
    verify(tmp_path / "ck")
    # plain safetensors: typed tensors under their usual names, the tied storage as raw bytes
    params = load_file(tmp_path / "ck" / "params.safetensors")
    assert torch.equal(params["blocks.0.fc1.weight"], model.blocks[0].fc1.weight.detach())
    assert params["tok.weight"].dtype == torch.uint8
    assert torch.equal(
        params["tok.weight"].view(torch.float32).view(SMALL.vocab, SMALL.width), model.tok.weight.detach()
    )
    optim = load_file(tmp_path / "ck" / "optim.safetensors")
    assert torch.equal(optim["blocks.1.qkv.weight.exp_avg"], opt.state[model.blocks[1].qkv.weight]["exp_avg"])


class _Flat(nn.Module):
    """Parameters that are views of one flat buffer (a Megatron DDP ``param_data``), one of them transposed."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)
        flat = torch.randn(sum(p.numel() for p in self.parameters()) + 5, generator=torch.Generator().manual_seed(seed))
        off = 0
        for p in self.parameters():
            n = p.numel()
            p.data = flat[off : off + n].view_as(p)
            off += n
        self.b.weight.data = flat[off - 3 * 8 - 3 : off - 3].view(8, 3).t()  # a strided view inside the buffer

    def forward(self, x):
        return self.b(self.a(x))


def test_flat_buffer_with_many_views_is_raw_bytes_and_stays_shared(tmp_path):
    src = _Flat(0)
    state = ModelState(src)
    m = save(state, tmp_path / "ck")
    (slot,) = m.layout["ranks"][0]["groups"]["params"]["slots"]
    assert not slot["typed"] and len(slot["members"]) == 4
    dst = _Flat(1)
    state2 = ModelState(dst)
    state2.offload()
    load(state2, tmp_path / "ck")
    state2.onload()
    for (n, p), q in zip(dst.named_parameters(), src.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert len({p.untyped_storage().data_ptr() for p in dst.parameters()}) == 1  # still one flat buffer
    assert not dst.b.weight.is_contiguous()
    with torch.no_grad():  # the views still share it
        torch.empty(0).set_(dst.a.weight.untyped_storage()).add_(1.0)
    assert torch.equal(dst.a.bias, src.a.bias + 1.0) and torch.equal(dst.b.weight, src.b.weight + 1.0)


# --------------------------------------------------------------------------- corruption


def _loaded_unchanged(state: ModelState, path: Path, err: tuple[type[Exception], str], match: str | None = None, **kw):
    """The error ``load`` raises, of ``err`` (class, kind); the model unchanged."""
    before = capture(state, ("params", "buffers", "optim"))
    residency = state.residency()
    with raises_kind(*err, match=match) as ei:
        load(state, path, **kw)
    assert_same(capture(state, ("params", "buffers", "optim")), before)
    assert state.residency() == residency
    return ei.value


@pytest.mark.parametrize("residency", ["resident", "offloaded"])
def test_flipped_byte_is_an_error_naming_the_file_and_the_model_is_unchanged(tmp_path, residency):
    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck")
    f = tmp_path / "ck" / "optim.safetensors"
    _flip_byte(f, f.stat().st_size - 100)
    _, _, state2 = _warmed("cpu", seed=1)
    if residency == "offloaded":
        state2.offload()
    err = _loaded_unchanged(state2, tmp_path / "ck", (CheckpointError, "corrupt"), "checksum mismatch")
    assert err.path == str(f) and "optim.safetensors" in str(err)


@pytest.mark.parametrize("residency", ["resident", "offloaded"])
def test_io_error_while_reading_is_a_typed_error_naming_the_file_and_tensor_and_the_model_is_unchanged(
    tmp_path, residency, monkeypatch
):
    """EIO from the device in the middle of a load (a failing disk, a network file system going away):
    ``CheckpointError`` of kind ``"read"`` (an ``OSError``) with the file, the tensor
    whose bytes failed and the errno; nothing of the model changed."""

    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck")
    _, _, state2 = _warmed("cpu", seed=1)
    if residency == "offloaded":
        state2.offload()
    real = os.preadv
    fails_at: list[int] = []

    def preadv(fd, bufs, offset):
        """(the kernel's answer when a block of the file cannot be read)"""
        if os.readlink(f"/proc/self/fd/{fd}").endswith("optim.safetensors") and not fails_at:
            fails_at.append(offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    monkeypatch.setattr(format_mod.os, "preadv", preadv)
    err = _loaded_unchanged(state2, tmp_path / "ck", (CheckpointError, "read"), "EIO")
    assert fails_at, "the fault was never injected"
    assert isinstance(err, OSError) and err.errno == errno.EIO
    assert err.path == str(tmp_path / "ck" / "optim.safetensors") and err.tensor is not None
    assert f"'{err.tensor}'" in str(err) and "unchanged" in str(err)


def test_io_error_reading_the_manifest_or_verifying_is_a_typed_error(tmp_path, monkeypatch):
    from stateshift.checkpoint import manifest as mf
    from stateshift.errors import CheckpointError

    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck")

    def eio(*_a, **_k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as m:
        m.setattr(mf, "read", eio)
        with raises_kind(CheckpointError, "read", match="manifest.json") as ei:
            verify(tmp_path / "ck")
        assert ei.value.errno == errno.EIO and ei.value.tensor is None
    monkeypatch.setattr(format_mod.os, "preadv", eio)
    with raises_kind(CheckpointError, "read", match="EIO") as ei:
        verify(tmp_path / "ck")
    assert ei.value.tensor is not None and ei.value.path.endswith(".safetensors")


def test_an_io_error_names_a_long_tensor_name_in_a_short_message(tmp_path, monkeypatch):
    """(the whole name was in the message: a tensor named by a hostile manifest made it as long as it liked)"""
    from stateshift.checkpoint.directory import write_checkpoint
    from stateshift.checkpoint.format import Record
    from stateshift.errors import CheckpointError

    name = "w" * 100_000
    write_checkpoint(
        tmp_path / "ck", {"a.safetensors": [Record.from_tensor(name, torch.ones(4))]}, backend="t", layout={}
    )

    def eio(*_a, **_k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(format_mod.os, "preadv", eio)
    with raises_kind(CheckpointError, "read", match="EIO") as ei:
        verify(tmp_path / "ck")
    assert ei.value.tensor == name and len(str(ei.value)) < 2000


@pytest.mark.parametrize("verb", ["load", "verify"])
def test_io_error_reading_the_latest_pointer_is_a_typed_error(tmp_path, monkeypatch, verb):
    """(found by the adversarial session: ``latest`` was read outside the conversion)"""
    from stateshift.checkpoint import commit as commit_mod
    from stateshift.errors import CheckpointError

    _, _, state = _warmed("cpu")
    save(state, tmp_path / "step-1", update_latest=True)
    real = os.pread

    def pread(fd, n, off):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/latest"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, n, off)

    monkeypatch.setattr(commit_mod.os, "pread", pread)
    with raises_kind(CheckpointError, "read", match="EIO"):
        load(state, tmp_path) if verb == "load" else verify(tmp_path)


def test_an_os_error_of_the_progress_callback_is_the_callers_not_a_read_error(tmp_path):
    """(found by the adversarial session: every OS error inside ``Checkpoint.file()`` was called a read error)"""

    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck")

    def progress(_n):
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))  # progress printed to a closed pipe

    with pytest.raises(BrokenPipeError) as ei:
        load(state, tmp_path / "ck", progress=progress)
    assert not isinstance(ei.value, CheckpointError)


@pytest.mark.parametrize("fault", ["EIO", "ValueError"])
def test_load_dcp_failing_part_way_puts_every_value_back(tmp_path, monkeypatch, fault):
    """DCP reads into the live tensors; the disk failing part-way through its data file (found by the
    adversarial session) left some parameters loaded and the rest old, behind torch's CheckpointException."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from stateshift.checkpoint import load_dcp, save_dcp
    from stateshift.errors import CheckpointError

    model, opt, _ = _warmed("cpu")
    save_dcp(tmp_path / "dcp", model, opt)
    model2, opt2, state2 = _warmed("cpu", seed=1)
    before = capture(state2, ("params", "buffers", "optim"))
    real, calls = FileSystemReader._slice_file, []

    def slice_file(self, file, sinfo):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO)) if fault == "EIO" else ValueError("a bad slice")
        return real(self, file, sinfo)

    monkeypatch.setattr(FileSystemReader, "_slice_file", slice_file)
    with raises_kind(CheckpointError, "read" if fault == "EIO" else "failed", match="unchanged") as ei:
        load_dcp(tmp_path / "dcp", model2, opt2, trusted=True)
    assert len(calls) > 3, "the fault was never injected"
    assert (ei.value.errno == errno.EIO) if fault == "EIO" else "a bad slice" in str(ei.value)
    assert_same(capture(state2, ("params", "buffers", "optim")), before)
    monkeypatch.undo()
    load_dcp(tmp_path / "dcp", model2, opt2, trusted=True)  # and it loads once the disk reads again
    assert_same(capture(state2, ("params", "buffers")), capture(ModelState(model, opt), ("params", "buffers")))


def test_save_dcp_full_disk_is_a_write_error_and_creates_nothing(tmp_path, monkeypatch):
    """DCP wraps a writer's OSError in its CheckpointException, a BaseException: it escaped untyped."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from stateshift.checkpoint import save_dcp

    model, opt, _ = _warmed("cpu")

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    with raises_kind(CheckpointError, "write", match="no space left on device") as ei:
        save_dcp(tmp_path / "dcp", model, opt)
    assert ei.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []


def test_the_manifest_a_save_returns_is_the_one_read_back(tmp_path):
    """A save hands back the manifest it built (not decoded again from what it wrote): it must be the
    very manifest a reader decodes from the file, ``ranks`` included."""
    from stateshift.checkpoint import save_dcp

    model, opt, state = _warmed("cpu")
    for path, written in (
        (tmp_path / "ck", lambda p: save(state, p, tag="t", version=3, extra={"a": "b"})),
        (tmp_path / "dcp", lambda p: save_dcp(p, model, opt, tag="t", version=3)),
    ):
        returned = written(path)
        read_back = read_manifest(path)
        assert returned == read_back and returned.ranks == read_back.ranks
        assert returned.kind != "stateshift-state/1" or len(returned.ranks) == 1


def _named(name: str) -> ModelState:
    model = nn.Module()
    model.register_parameter(name, nn.Parameter(torch.ones(2)))
    return ModelState(model)


def _with_meta(value) -> ModelState:
    from stateshift.backends.torch import TorchModuleBackend

    model, _ = make("cpu")
    return ModelState(model, backends=[TorchModuleBackend(model, meta_of=lambda t: (("v", value),))])


UNREADABLE = {  # what the reader refuses, so a save must refuse it before writing (adversarial session)
    "tag with a lone surrogate": (lambda: _warmed("cpu")[2], {"tag": "\udcff"}, ValueError),
    "extra with a lone surrogate": (lambda: _warmed("cpu")[2], {"extra": {"k": "\ud800"}}, ValueError),
    "version past 2**62": (lambda: _warmed("cpu")[2], {"version": 1 << 63}, ValueError),
    "tensor name with a lone surrogate": (lambda: _named("\ud800"), {}, (LayoutError, "checkpoint_mismatch")),
    "meta holding NaN": (lambda: _with_meta(float("nan")), {}, (LayoutError, "checkpoint_mismatch")),
    "meta holding a lone surrogate": (lambda: _with_meta("\ud800"), {}, (LayoutError, "checkpoint_mismatch")),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_save_refuses_what_no_load_would_accept_before_writing(tmp_path, case):
    make_state, kwargs, err = UNREADABLE[case]
    with raises_kind(*err) if isinstance(err, tuple) else pytest.raises(err):
        save(make_state(), tmp_path / "ck", update_latest=True, **kwargs)
    assert os.listdir(tmp_path) == []


def test_meta_holding_a_str_subclass_round_trips(tmp_path):
    """(a ``str`` subclass, an enum's value say, is text: JSON writes it as such and a load compares it equal)"""

    class Placement(str):
        pass

    save(_with_meta(Placement("shard")), tmp_path / "ck", "params")
    load(_with_meta(Placement("shard")), tmp_path / "ck", "params")
    load(_with_meta("shard"), tmp_path / "ck", "params")


def test_load_into_a_model_whose_meta_cannot_be_stored_is_a_typed_mismatch(tmp_path):
    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck", ("params",))
    with raises_kind(LayoutError, "checkpoint_mismatch", match="meta holds nan"):
        load(_with_meta(float("nan")), tmp_path / "ck", "params")


def test_truncated_file_is_an_error_naming_the_file_and_the_model_is_unchanged(tmp_path):
    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck")
    f = tmp_path / "ck" / "params.safetensors"
    os.truncate(f, f.stat().st_size - 1000)
    _, _, state2 = _warmed("cpu", seed=1)
    err = _loaded_unchanged(state2, tmp_path / "ck", (CheckpointError, "corrupt"), "truncated")
    assert err.path == str(f)


# --------------------------------------------------------------------------- mismatches


@pytest.mark.parametrize(
    "changes, tensor, what",
    [
        ({"layers": 1}, "blocks.1.ln1.weight", "in the checkpoint \\(group 'params'\\) but not in the model"),
        ({"layers": 3}, "blocks.2.ln1.weight", "in the model \\(group 'params'\\) but not in the checkpoint"),
        ({"width": 48}, "tok.weight", "shape is \\[64, 48\\] in the model but \\[64, 32\\]"),
        ({"dtype": torch.bfloat16}, "tok.weight", "dtype is bfloat16 in the model but float32.*cast=True"),
        ({"tied": False}, "tok.weight", "storage sharing differs"),
    ],
)
def test_mismatched_model_is_an_error_naming_the_tensor(tmp_path, changes, tensor, what):
    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck")
    _, _, other = _warmed("cpu", seed=1, **changes)
    err = _loaded_unchanged(other, tmp_path / "ck", (LayoutError, "checkpoint_mismatch"), what)
    assert err.tensor == tensor
    assert isinstance(err, ValueError)


def test_fp32_checkpoint_into_bf16_model_with_cast(tmp_path):
    model, _opt, state = _warmed("cpu", tied=False)
    save(state, tmp_path / "ck", "params")
    model2, _opt2, state2 = _warmed("cpu", seed=1, tied=False, dtype=torch.bfloat16)
    state2.offload("params")
    with raises_kind(LayoutError, "checkpoint_mismatch", match="cast=True"):
        load(state2, tmp_path / "ck")
    load(state2, tmp_path / "ck", cast=True)
    state2.onload()
    for (n, p), q in zip(model2.named_parameters(), model.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q.to(torch.bfloat16)), n
    # a tied storage is raw bytes: it cannot be converted, and the error says so
    _, _, tied_state = _warmed("cpu")
    save(tied_state, tmp_path / "tied", "params")
    _, _, bf16 = _warmed("cpu", seed=1, dtype=torch.bfloat16)
    err = _loaded_unchanged(bf16, tmp_path / "tied", (LayoutError, "checkpoint_mismatch"), "raw bytes", cast=True)
    assert err.tensor == "tok.weight"


def test_groups_are_checked(tmp_path):
    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck", "params")
    with raises_kind(LayoutError, "checkpoint_mismatch", match="group 'optim' is not in the checkpoint"):
        load(state, tmp_path / "ck", "optim")
    with raises_kind(LayoutError, "unknown_group"):
        save(state, tmp_path / "ck2", "weights")
    assert not (tmp_path / "ck2").exists()


def test_resume_from_fresh_optimizer_is_bit_identical(tmp_path):
    model, opt, state = _warmed("cpu")
    save(state, tmp_path / "ck")
    losses = [train_step(model, opt, s) for s in range(2)]
    model2, opt2 = make("cpu", seed=5)
    state2 = ModelState(model2, opt2)
    with raises_kind(LayoutError, "checkpoint_mismatch", match="init_optimizer_state"):
        load(state2, tmp_path / "ck")
    init_optimizer_state(opt2)
    assert all(p.grad is None for p in model2.parameters())
    load(state2, tmp_path / "ck")
    assert [train_step(model2, opt2, s) for s in range(2)] == losses
    assert_same(capture(state2, ("params", "buffers", "optim")), capture(state, ("params", "buffers", "optim")))


# --------------------------------------------------------------------------- crashes and full disks


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    path, path2 = tmp_path / "ck", tmp_path / "ck2"
    big = "dataclasses.replace(SMALL, vocab=512, width=128)"  # ~5 MB with Adam state

    def build(seed: int):
        model = build_model(dataclasses.replace(SMALL, vocab=512, width=128), seed=seed)
        opt = torch.optim.Adam(model.parameters())
        lm_loss(model, batch(model.cfg, 0)).backward()
        opt.step()
        return model, opt, ModelState(model, opt)

    _model1, _opt1, state1 = build(1)
    want = capture(state1, ("params", "buffers", "optim"))
    save(state1, path, version=1, update_latest=True)
    code = f"""
        import dataclasses, sys, time, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from helpers import SMALL, batch, build_model, lm_loss
        from stateshift import ModelState
        from stateshift.checkpoint import save
        from stateshift.checkpoint import format as fmt
        fmt.CHUNK_BYTES = 256 << 10
        model = build_model({big}, seed=2)
        opt = torch.optim.Adam(model.parameters())
        lm_loss(model, batch(model.cfg, 0)).backward(); opt.step()
        state = ModelState(model, opt)
        done = 0
        def progress(n):
            global done
            done += n
            if done > (1 << 20):
                if done - n <= (1 << 20):
                    print("ready", flush=True)
                time.sleep(0.05)
        save(state, {str(path2)!r}, version=2, progress=progress, update_latest=True)
        print("finished", flush=True)
        """
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == b"ready\n", (line, child.stderr.read() if child.stderr else b"")
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".ck2.tmp-")]  # really mid-write
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL

    _, _, state = build(3)
    assert read_manifest(path).version == 1 and read_latest(tmp_path) == path
    load(state, tmp_path)  # through latest
    assert_same(capture(state, ("params", "buffers", "optim")), want)
    save(state, path2, version=3)  # the next save to that path cleans up after the dead writer
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck2", "latest"]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if sys.platform != "linux":
        pytest.skip("tmpfs mount needs Linux")
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, timeout=30, check=False
        )
    except (FileNotFoundError, PermissionError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not permitted): {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30, check=False)


def test_real_full_disk_is_a_clear_error_and_the_previous_checkpoint_loads(tiny_tmpfs, monkeypatch):
    path = tiny_tmpfs / "ck"
    model, opt, state = _warmed("cpu")  # ~0.1 MB of params + Adam state
    values = capture(state, ("params", "buffers", "optim"))
    save(state, path, version=1)
    train_step(model, opt, 1)
    monkeypatch.setattr(format_mod, "CHUNK_BYTES", 16 << 10)
    filler = tiny_tmpfs / "filler"

    def fill_disk(_n: int) -> None:  # another process takes the space while we write
        if filler.exists():
            return
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * (64 << 10))
            except OSError as e:
                assert e.errno == errno.ENOSPC

    with raises_kind(CheckpointError, "write", match="no space left on device") as ei:
        save(state, tiny_tmpfs / "ck2", version=2, progress=fill_disk)
    assert ei.value.errno == errno.ENOSPC
    assert "previous checkpoint" in str(ei.value) and "intact" in str(ei.value)
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["ck", "filler"]  # the temporary directory was removed
    assert core_of(state).pool.stats.in_use_bytes == 0  # the staged snapshot went back to the pool
    _, _, fresh = _warmed("cpu", seed=2)
    assert read_manifest(path).version == 1
    load(fresh, path)
    assert_same(capture(fresh, ("params", "buffers", "optim")), values)


# --------------------------------------------------------------------------- async


class _Gate:
    """A progress callback that holds the writer thread until the test opens it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.open = threading.Event()

    def __call__(self, n: int) -> None:
        self.started.set()
        assert self.open.wait(30), "gate never opened"


@pytest.mark.parametrize("residency", ["resident", "offloaded"])
def test_async_save_holds_the_values_of_the_call_while_training_continues(device, tmp_path, residency):
    model, opt, state = _warmed(device)
    groups = ("params", "buffers", "optim")
    if residency == "offloaded":
        state.offload(groups)
    values = capture(state, groups)
    gate = _Gate()
    handle = async_save(state, tmp_path / "ck", version=1, progress=gate, update_latest=True)
    assert gate.started.wait(30)
    assert not handle.done()
    # training continues while the writer is held mid-file
    state.onload()
    for s in range(2):
        train_step(model, opt, s)
    if residency == "offloaded":
        state.offload(groups)  # rewrites the homes the staged snapshot shares (copy-on-write)
    assert not torch.equal(capture(state, groups)["blocks.0.fc1.weight"], values["blocks.0.fc1.weight"])
    assert read_latest(tmp_path) is None  # the pointer moves only once the checkpoint is durable
    gate.open.set()
    manifest = handle.wait(timeout=60)
    assert manifest.version == 1 and handle.done() and handle.exception() is None
    assert read_latest(tmp_path) == tmp_path / "ck"
    _, _, fresh = _warmed(device, seed=1)
    load(fresh, tmp_path / "ck")
    assert_same(capture(fresh, groups), values)


def test_async_save_error_reaches_wait_and_memory_goes_back(tmp_path):
    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck", version=1)

    def boom(n: int) -> None:
        raise RuntimeError("disk on fire")

    handle = async_save(state, tmp_path / "ck2", version=2, progress=boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        handle.wait(timeout=60)
    assert isinstance(handle.exception(), RuntimeError)
    assert core_of(state).pool.stats.in_use_bytes == 0 and len(core_of(state).snapshots) == 0
    assert read_manifest(tmp_path / "ck").version == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary directory left


def test_async_saves_are_written_in_call_order_and_latest_follows(tmp_path):
    model, opt, state = _warmed("cpu")
    gate = _Gate()
    first = async_save(state, tmp_path / "step-1", version=1, progress=gate, update_latest=True)
    assert gate.started.wait(30)
    train_step(model, opt, 1)
    second_values = capture(state, ("params", "buffers", "optim"))
    second = async_save(state, tmp_path / "step-2", version=2, update_latest=True)
    assert not second.done()  # waits for the first writer
    gate.open.set()
    assert first.wait(60).version == 1 and second.wait(60).version == 2
    assert read_latest(tmp_path) == tmp_path / "step-2"  # latest moved in call order
    _, _, fresh = _warmed("cpu", seed=1)
    assert load(fresh, tmp_path).version == 2
    assert_same(capture(fresh, ("params", "buffers", "optim")), second_values)
    with pytest.raises(FileExistsError):  # a checkpoint is never overwritten, in the background either
        async_save(state, tmp_path / "step-2", version=3).wait(60)
    assert read_manifest(tmp_path / "step-2").version == 2


def test_release_under_an_async_save_aborts_it(tmp_path):
    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck", version=1)
    gate = _Gate()
    handle = async_save(state, tmp_path / "ck2", version=2, progress=gate)
    assert gate.started.wait(30)
    core_of(state).snapshots.clear()  # someone frees the staged copy mid-write
    gate.open.set()
    with raises_kind(StateError, "released"):
        handle.wait(60)
    assert read_manifest(tmp_path / "ck").version == 1 and not (tmp_path / "ck2").exists()
    verify(tmp_path / "ck")


@pytest.mark.parametrize("offloaded", [False, True])
def test_close_and_trim_under_an_async_save_abort_it_and_free_nothing_it_still_reads(tmp_path, offloaded):
    """``Trainer.close()`` closes the state and trims its pool: the staged blocks an async save still read were
    unmapped under it (a SIGSEGV, or a write error from the bad address). The writer holds them until it is done."""
    from stateshift import HostPool

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 2048))  # 64 MiB: four pieces of the params file
    pool = HostPool()
    state = ModelState(model, pool=pool)
    if offloaded:
        state.offload()
    gate = _Gate()
    handle = async_save(state, tmp_path / "ck", progress=gate)
    assert gate.started.wait(30)
    state.close()
    pool.trim()
    gate.open.set()
    with raises_kind(StateError, "released"):
        handle.wait(60)
    assert not (tmp_path / "ck").exists() and pool.stats.in_use_bytes == 0  # and then it gave them back


def test_a_script_that_ends_right_after_async_save_still_writes_its_checkpoint(tmp_path):
    code = f"""
        import torch
        from stateshift import ModelState
        from stateshift.checkpoint import async_save
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
        async_save(ModelState(model), {str(tmp_path / "ck")!r}, update_latest=True)
        """  # (no wait(): the interpreter's exit waits for the writer)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    verify(tmp_path / "ck")
    assert read_latest(tmp_path) == tmp_path / "ck"


# --------------------------------------------------------------------------- export, inspect


def test_export_hf_usual_names_from_an_offloaded_model(tmp_path):
    from safetensors.torch import load_file

    model, _opt, state = _warmed("cpu")
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.offload()
    path = export_hf(state, tmp_path / "hf")
    assert state.residency()["params"]["device"] == 0  # nothing came back to the device
    got = load_file(path)
    assert sorted(got) == sorted(k for k in want if k != "head.weight")  # tied duplicate written once
    for k, v in got.items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k
    fresh, _ = make("cpu", seed=3)
    missing, unexpected = fresh.load_state_dict(got, strict=False)
    assert missing == ["head.weight"] and unexpected == []
    assert fresh.head.weight is fresh.tok.weight and torch.equal(fresh.head.weight, want["head.weight"])
    # a plain module works too, and the export replaces the file in place
    path2 = export_hf(model.__class__(model.cfg), tmp_path / "hf")
    assert path2 == path and sorted(load_file(path)) == sorted(got)
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["model.safetensors"]


def test_export_hf_writes_every_empty_tensor(tmp_path):
    """Empty tensors share one pointer; none is a tied duplicate of another."""
    from safetensors.torch import load_file

    class Empties(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            self.a = nn.Parameter(torch.zeros(0, 3))
            self.b = nn.Parameter(torch.zeros(0, 3))
            self.register_buffer("c", torch.zeros(0, 3))

    model = Empties()
    for i, source in enumerate((model, ModelState(model))):
        got = load_file(export_hf(source, tmp_path / f"hf{i}"))
        assert sorted(got) == ["a", "b", "c", "w"] and got["c"].shape == (0, 3)


@pytest.mark.parametrize("name", ["step-1 ", " step-1", "step\n1", os.fsdecode(b"step-\xff")])
def test_a_name_latest_cannot_hold_is_refused_before_anything_is_written(tmp_path, name):
    """``latest`` is read back stripped, as UTF-8: a name that does not survive that named another checkpoint
    (or raised an untyped error once the checkpoint existed)."""
    model, _opt, state = _warmed("cpu")
    save(state, tmp_path / "step-0", update_latest=True)
    path = tmp_path / name
    for saver in (save, async_save):
        with pytest.raises(ValueError, match="latest"):
            h = saver(state, path, update_latest=True)
            if saver is async_save:
                h.wait()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-0"]
    assert read_latest(tmp_path) == tmp_path / "step-0"
    save(state, path)  # (without update_latest the name is the user's to choose)


def test_export_hf_full_disk_names_the_tensor_and_keeps_the_previous_file(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    model, _opt, state = _warmed("cpu")
    path = export_hf(state, tmp_path / "hf")
    before = load_file(path)
    perturb(model, None, 0.5)

    real = os.pwritev

    def pwritev(fd, bufs, offset):
        if offset > 0 and sum(len(b) for b in bufs) > 64:  # a tensor's bytes, past the header
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, offset)

    monkeypatch.setattr(format_mod.os, "pwritev", pwritev)
    with raises_kind(CheckpointError, "write", match="no space left on device") as ei:
        export_hf(state, tmp_path / "hf")
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and "tensor '" in msg and "intact" in msg, msg
    assert any(f"tensor '{k}'" in msg for k in before), msg
    monkeypatch.undo()
    after = load_file(path)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["model.safetensors"]


def test_export_hf_loads_with_transformers_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    state = ModelState(model)
    state.offload("params")
    export_hf(state, tmp_path / "hf")
    cfg.save_pretrained(tmp_path / "hf")
    state.onload("params")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    ids = torch.arange(8)[None]
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def _inspect(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="stateshift")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_inspect_prints_and_verifies(tmp_path, capsys):
    _, _, state = _warmed("cpu")
    save(state, tmp_path / "ck", tag="step", version=4)
    assert _inspect(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "step" in out and "version" in out and "torch+torch-optim" in out
    assert "blocks.0.fc1.weight" in out and "float32" in out and "params.safetensors" in out
    assert "checksums OK" in out
    assert _inspect(["inspect", "--json", str(tmp_path / "ck")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verified"] is True and len(data["tensors"]) == len(list_tensors(tmp_path / "ck"))
    f = tmp_path / "ck" / "params.safetensors"
    _flip_byte(f, f.stat().st_size - 7)
    assert _inspect(["inspect", str(tmp_path / "ck")]) == 1
    err = capsys.readouterr().err
    assert "params.safetensors" in err and "checksum mismatch" in err
    assert _inspect(["inspect", str(tmp_path / "nothing")]) == 1


def test_checkpoint_bench_writes_rows(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import checkpoint_bench
    finally:
        sys.path.pop(0)
    rc = checkpoint_bench.main(
        [
            "--hidden",
            "64",
            "--layers",
            "1",
            "--vocab",
            "128",
            "--repeat",
            "1",
            "--device",
            "cpu",
            "--dir",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "out"),
            "--no-plot",
        ]
    )
    assert rc == 0
    (result,) = list((tmp_path / "out").glob("*.json"))
    data = json.loads(result.read_text())
    ops = {r["op"] for r in data["rows"]}
    assert ops == {"save", "load", "async_save_blocking"}
    for r in data["rows"]:
        assert r["bytes"] > 0 and r["seconds"] > 0 and r["ratio"] > 0
        assert r["bound"] in ("torch.save", "safetensors.save_file", "torch.load", "safetensors.load_file")
    assert {"torch.save_gbps", "safetensors.save_file_gbps"} <= data["ceilings"].keys()
