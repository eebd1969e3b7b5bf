"""Disk layer of checkpoints: format, checksums, atomic commit, crashes, full disks.

CPU only.  The crash and full-disk tests use real subprocesses: a real SIGKILL
in the middle of a write, a real RLIMIT_FSIZE (EFBIG) and, when mounting is
permitted, a real 4 MiB tmpfs (ENOSPC).  Checkpoints are never overwritten: a
write goes to a fresh directory, and every failure leaves the previous
checkpoint (and ``latest``) as it was.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from raises import raises_kind

from stateshift.checkpoint import format as format_mod, manifest as manifest_mod, verify
from stateshift.checkpoint.commit import read_latest, set_latest
from stateshift.checkpoint.directory import Checkpoint, write_checkpoint
from stateshift.checkpoint.format import Record as TensorRecord
from stateshift.checkpoint.manifest import MANIFEST_NAME
from stateshift.errors import CheckpointError, LayoutError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(3, 3, generator=g).to(torch.float16),
        "w.f32": torch.randn(11, generator=g),
        "w.f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i8": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
        "i32": torch.randint(-(2**30), 2**30, (5,), generator=g, dtype=torch.int32),
        "step": torch.tensor(seed + 12345, dtype=torch.int64),  # 0-d
        "scalar.bf16": torch.tensor(1.5 + seed, dtype=torch.bfloat16),  # 0-d bf16
        "mask": torch.rand(6, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "empty.bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
    }


TensorInfo = namedtuple("TensorInfo", "name dtype shape nbytes file offset")  # offset: of the first byte in the file


class _Reader:
    """A checkpoint opened for the tests: tensors listed and read by name across its files."""

    def __init__(self, path: Path) -> None:
        self.ckpt = Checkpoint.open(path)

    def records(self) -> list[TensorInfo]:
        return [
            TensorInfo(t.name, t.dtype, t.shape, t.nbytes, f, e.header[0] + t.start)
            for f, e in self.ckpt.manifest.files.items()
            for t in e.tensors
        ]

    def read_into(self, dsts: dict[str, torch.Tensor]) -> None:
        where = {i.name: i.file for i in self.records()}
        unknown = [n for n in dsts if n not in where]
        if unknown:
            raise LayoutError("checkpoint_mismatch", "not stored in this checkpoint", tensor=unknown[0])
        for f in sorted({where[n] for n in dsts}):
            self.ckpt.read_into(f, {n: d for n, d in dsts.items() if where[n] == f})

    def read_tensors(self, names=None) -> dict[str, torch.Tensor]:
        infos = {i.name: i for i in self.records()}
        out = {n: torch.empty(infos[n].shape, dtype=infos[n].dtype) for n in (infos if names is None else names)}
        self.read_into(out)
        return out


def open_checkpoint(path: Path) -> _Reader:
    return _Reader(path)


def read_manifest(path: Path):
    return Checkpoint.open(path, files=()).manifest


def list_tensors(path: Path) -> list[TensorInfo]:
    return _Reader(path).records()


def read_header(path: Path):
    """Parse a bare safetensors file's header (no manifest to compare it with)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0] if len(raw) >= 8 else 0
    return manifest_mod.parse_header(raw[: 8 + n], len(raw), str(path))


def _records(ts: dict[str, torch.Tensor]) -> list[TensorRecord]:
    return [TensorRecord.from_tensor(k, v) for k, v in ts.items()]


def _write(path: Path, ts: dict[str, torch.Tensor], **kw):
    names = list(ts)
    half = len(names) // 2
    files = {
        "a.safetensors": _records({k: ts[k] for k in names[:half]}),
        "b.safetensors": _records({k: ts[k] for k in names[half:]}),
    }
    kw.setdefault("backend", "torch")
    kw.setdefault("layout", {"names": names})
    return write_checkpoint(path, files, **kw)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


def _complete_siblings(path: Path) -> list[Path]:
    return [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.") and (p / MANIFEST_NAME).exists()]


def _siblings(path: Path) -> list[Path]:
    return [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


# --------------------------------------------------------------------------- format


def test_round_trip_all_dtypes(tmp_path: Path) -> None:
    ts = _tensors()
    ts["f8"] = torch.randn(8).to(torch.float8_e4m3fn)
    ts["u16"] = torch.tensor([1, 2, 65535], dtype=torch.uint16)
    m = _write(tmp_path / "ck", ts, tag="step", version=7, extra={"note": "x"})
    assert m.tag == "step" and m.version == 7 and m.layout == {"names": list(ts)}
    assert m.total_bytes == sum(t.nbytes for t in ts.values())
    assert m.checksum_algorithm == "crc32"
    m2 = read_manifest(tmp_path / "ck")
    assert m2 == m
    reader = open_checkpoint(tmp_path / "ck")
    _assert_same(reader.read_tensors(), ts)
    # Straight into uint8 destinations (what the engine passes: byte views of pinned homes).
    dsts = {k: torch.empty(v.nbytes, dtype=torch.uint8) for k, v in ts.items()}
    reader.read_into(dsts)
    for k, v in ts.items():
        assert torch.equal(dsts[k], v.reshape(-1).view(torch.uint8) if v.numel() else dsts[k]), k
    # A subset still verifies the whole file it comes from.
    _assert_same(reader.read_tensors(["w.bf16", "step"]), {"w.bf16": ts["w.bf16"], "step": ts["step"]})
    infos = {i.name: i for i in list_tensors(tmp_path / "ck")}
    assert infos["w.bf16"].dtype == torch.bfloat16 and infos["w.bf16"].shape == (7, 5)
    assert infos["step"].shape == () and infos["empty"].nbytes == 0
    assert {i.file for i in infos.values()} == {"a.safetensors", "b.safetensors"}
    for i in infos.values():  # every tensor is aligned to its element size
        assert i.offset % i.dtype.itemsize == 0
    assert verify(tmp_path / "ck") == m


def test_checksums_are_zlib_crc32_of_each_tensor_header_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zlib

    monkeypatch.setattr(format_mod, "CHUNK_BYTES", 4 << 10)  # tensors cut into pieces, crcs combined
    ts = _tensors(1)
    ts["big"] = torch.randn(10_000)
    m = _write(tmp_path / "ck", ts)
    for fname, entry in m.files.items():
        raw = (tmp_path / "ck" / fname).read_bytes()
        assert entry.checksum == f"crc32:{zlib.crc32(raw):08x}" and entry.bytes == len(raw)
        assert entry.header == (entry.header[0], zlib.crc32(raw[: entry.header[0]]))
        for t in entry.tensors:
            begin = entry.header[0] + t.start
            assert t.crc32 == zlib.crc32(raw[begin : begin + t.nbytes]), t.name


def test_loadable_by_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    ts = _tensors(2)
    _write(tmp_path / "ck", ts, tag="pi_old", version=3)
    loaded: dict[str, torch.Tensor] = {}
    for f in ("a.safetensors", "b.safetensors"):
        loaded.update(load_file(tmp_path / "ck" / f))
        with safe_open(tmp_path / "ck" / f, framework="pt") as h:
            meta = h.metadata()
        assert meta["format"] == "pt" and meta["tag"] == "pi_old" and meta["version"] == "3"
    _assert_same(loaded, ts)


def test_raw_bytes_record_written_as_declared_dtype(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = torch.randn(4, 6).to(torch.bfloat16)
    home = src.reshape(-1).view(torch.uint8).clone()  # a byte home, as the engine keeps them
    rec = TensorRecord("p", torch.bfloat16, (4, 6), home)
    write_checkpoint(tmp_path / "ck", {"p.safetensors": [rec]}, backend="megatron", layout={})
    out = load_file(tmp_path / "ck" / "p.safetensors")["p"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, src)


def test_chunked_streaming_and_partial_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_mod, "CHUNK_BYTES", 64 << 10)  # many chunks, threaded hashing, scratch path
    big = {f"t{i}": torch.randn(100_000 + i) for i in range(4)}
    seen: list[int] = []
    m = write_checkpoint(
        tmp_path / "ck", {"x.safetensors": _records(big)}, backend="t", layout={}, progress=seen.append
    )
    assert sum(seen) == m.total_bytes and len(seen) > 20
    r = open_checkpoint(tmp_path / "ck")
    _assert_same(r.read_tensors(["t2"]), {"t2": big["t2"]})
    _assert_same(r.read_tensors(), big)
    verify(tmp_path / "ck")
    # A crc32 per tensor: a flip inside t0 names t0, wherever it is found; t3 still reads, verified by its own crc.
    off = {i.name: i for i in r.records()}["t0"].offset + 1000
    _flip_byte(tmp_path / "ck" / "x.safetensors", off)
    with raises_kind(CheckpointError, "corrupt", match="'t0'") as ei:
        r.read_tensors(["t0"])
    assert ei.value.tensor == "t0"
    with raises_kind(CheckpointError, "corrupt", match="'t0'"):
        verify(tmp_path / "ck")
    _assert_same(r.read_tensors(["t3"]), {"t3": big["t3"]})


def test_bad_input_is_rejected_before_anything_happens(tmp_path: Path) -> None:
    t = torch.randn(4, 4)
    with raises_kind(LayoutError, "checkpoint_mismatch", match="'nc'"):
        write_checkpoint(
            tmp_path / "ck", {"x.safetensors": [TensorRecord("nc", t.dtype, (4, 4), t.t())]}, backend="t", layout={}
        )
    with raises_kind(LayoutError, "checkpoint_mismatch", match="'short'"):
        write_checkpoint(
            tmp_path / "ck",
            {"x.safetensors": [TensorRecord("short", torch.float32, (5, 4), t)]},
            backend="t",
            layout={},
        )
    with raises_kind(LayoutError, "checkpoint_mismatch", match="'dup'"):
        write_checkpoint(
            tmp_path / "ck",
            {
                "x.safetensors": [TensorRecord.from_tensor("dup", t)],
                "y.safetensors": [TensorRecord.from_tensor("dup", t)],
            },
            backend="t",
            layout={},
        )
    with pytest.raises(ValueError):
        write_checkpoint(tmp_path / "ck", {"manifest.json": []}, backend="t", layout={})
    assert list(tmp_path.iterdir()) == []
    write_checkpoint(tmp_path / "ck", {"x.safetensors": [TensorRecord.from_tensor("w", t)]}, backend="t", layout={})
    r = open_checkpoint(tmp_path / "ck")
    for dst, what in [
        (torch.empty(15, dtype=torch.uint8), "'w'"),
        (torch.empty(4, 4, dtype=torch.float64), "'w'"),
        (torch.empty(2, 8), "'w'"),
    ]:
        with raises_kind(LayoutError, "checkpoint_mismatch", match=what):
            r.read_into({"w": dst})
    with raises_kind(LayoutError, "checkpoint_mismatch", match="'nope'"):
        r.read_into({"nope": torch.empty(64, dtype=torch.uint8)})


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "home"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        _write(d, _tensors())
    assert (d / "precious.txt").read_text() == "keep me"
    assert _siblings(d) == []


# --------------------------------------------------------------------------- corruption


def test_flipped_data_byte_names_the_file(tmp_path: Path) -> None:
    ts = _tensors()
    _write(tmp_path / "ck", ts)
    f = tmp_path / "ck" / "b.safetensors"
    _flip_byte(f, f.stat().st_size - 3)
    r = open_checkpoint(tmp_path / "ck")  # headers fine, sizes fine
    dsts = {i.name: torch.empty(i.nbytes, dtype=torch.uint8) for i in r.records()}
    with raises_kind(CheckpointError, "corrupt", match="checksum mismatch") as ei:
        r.read_into(dsts)
    assert ei.value.path == str(f)
    with raises_kind(CheckpointError, "corrupt") as ei:
        verify(tmp_path / "ck")
    assert ei.value.path == str(f)
    # The other file is intact and readable on its own.
    a_names = [i.name for i in r.records() if i.file == "a.safetensors"]
    _assert_same(r.read_tensors(a_names), {k: ts[k] for k in a_names})


def test_flipped_header_byte_names_the_file(tmp_path: Path) -> None:
    _write(tmp_path / "ck", _tensors())
    f = tmp_path / "ck" / "a.safetensors"
    raw = f.read_bytes()
    i = raw.index(b'"dtype"') + 2  # corrupt a key inside the JSON header
    _flip_byte(f, i)
    with raises_kind(CheckpointError, "corrupt") as ei:
        open_checkpoint(tmp_path / "ck")
    assert ei.value.path == str(f)


def test_truncated_file(tmp_path: Path) -> None:
    ts = _tensors()
    _write(tmp_path / "ck", ts)
    f = tmp_path / "ck" / "a.safetensors"
    size = f.stat().st_size
    os.truncate(f, size - 5)
    with raises_kind(CheckpointError, "corrupt", match="truncated") as ei:
        open_checkpoint(tmp_path / "ck")
    assert ei.value.path == str(f)
    with raises_kind(CheckpointError, "corrupt", match="truncated"):
        read_header(f)  # a bare file without manifest: the header catches it
    os.truncate(f, 5)
    with raises_kind(CheckpointError, "corrupt", match="truncated"):
        read_header(f)
    with raises_kind(CheckpointError, "corrupt"):
        verify(tmp_path / "ck")


@pytest.mark.parametrize("when", ["before the read", "during the read"])
def test_file_truncated_under_a_read_is_a_typed_error_not_sigbus(tmp_path: Path, when) -> None:
    """A file cut short once it was checked, before the read or between two of its pieces (another process
    truncating it under a running load): the read ends early, ``CheckpointError("corrupt")``. Bytes read out of a
    memory map of it were a SIGBUS that killed the process."""
    f = tmp_path / "big.bin"
    size = 40 << 20  # (tasks of CHUNK_BYTES: the progress after the first one runs before the last is read)
    f.write_bytes(os.urandom(size))
    if when == "before the read":
        os.truncate(f, 1 << 20)

    def progress(n: int) -> None:
        os.truncate(f, 1 << 20)

    dst = torch.empty(size, dtype=torch.uint8)
    fd = os.open(f, os.O_RDONLY)
    try:
        with raises_kind(CheckpointError, "corrupt", match="truncated") as ei:
            format_mod.read_spans(
                fd,
                [(0, size, format_mod.byte_view(dst, size))],
                str(f),
                progress if when != "before the read" else None,
                ["t"],
            )
    finally:
        os.close(fd)
    assert ei.value.tensor == "t"


def test_what_is_not_a_checkpoint_is_said(tmp_path: Path) -> None:
    with raises_kind(CheckpointError, "not_found", match="nothing there"):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with raises_kind(CheckpointError, "not_found", match="empty directory"):
        open_checkpoint(tmp_path / "empty")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"x")
    with raises_kind(CheckpointError, "not_found", match="torch.distributed.checkpoint"):
        open_checkpoint(tmp_path / "dcp")
    (tmp_path / ".ck.tmp-0123abcd").mkdir()
    with raises_kind(CheckpointError, "incomplete", match="never finished"):
        open_checkpoint(tmp_path / ".ck.tmp-0123abcd")


def test_missing_manifest_is_incomplete(tmp_path: Path) -> None:
    _write(tmp_path / "ck", _tensors())
    (tmp_path / "ck" / MANIFEST_NAME).unlink()
    for fn in (open_checkpoint, read_manifest, verify, list_tensors):
        with raises_kind(CheckpointError, "incomplete"):
            fn(tmp_path / "ck")
    with raises_kind(CheckpointError, "incomplete"):
        set_latest(tmp_path / "ck")


def test_corrupt_manifest(tmp_path: Path) -> None:
    _write(tmp_path / "ck", _tensors())
    mp = tmp_path / "ck" / MANIFEST_NAME
    d = json.loads(mp.read_text())
    del d["files"]
    mp.write_text(json.dumps(d))
    with raises_kind(CheckpointError, "corrupt") as ei:
        read_manifest(tmp_path / "ck")
    assert ei.value.path == str(mp)


# --------------------------------------------------------------------------- atomic install


def test_checkpoints_are_never_overwritten(tmp_path: Path) -> None:
    """Fresh directories, ``latest`` moved last; a save to an existing checkpoint is refused and changes nothing."""
    for seed in range(3):
        ts = _tensors(seed)
        _write(tmp_path / f"step-{seed}", ts, version=seed, update_latest=True)
        _assert_same(open_checkpoint(tmp_path / f"step-{seed}").read_tensors(), ts)
        assert read_latest(tmp_path) == tmp_path / f"step-{seed}"
    with pytest.raises(FileExistsError, match="never overwritten"):
        _write(tmp_path / "step-1", _tensors(9), version=9, update_latest=True)
    assert read_manifest(tmp_path / "step-1").version == 1 and read_latest(tmp_path) == tmp_path / "step-2"
    _assert_same(open_checkpoint(tmp_path).read_tensors(), _tensors(2))  # the directory of latest opens what it names
    assert sorted(x.name for x in tmp_path.iterdir()) == ["latest", "step-0", "step-1", "step-2"]


def test_an_empty_directory_may_receive_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    _write(tmp_path / "ck", _tensors(3))
    _assert_same(open_checkpoint(tmp_path / "ck").read_tensors(), _tensors(3))


def test_latest_pointer(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    _write(tmp_path / "step-1", _tensors(1), update_latest=True)
    assert read_latest(tmp_path) == tmp_path / "step-1"
    _write(tmp_path / "step-2", _tensors(2))  # not durable-pointed yet
    assert read_latest(tmp_path) == tmp_path / "step-1"
    set_latest(tmp_path / "step-2")
    assert read_latest(tmp_path) == tmp_path / "step-2"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_leftovers_are_never_checkpoints_and_the_next_write_to_the_path_removes_them(tmp_path: Path) -> None:
    """A crashed write leaves ``.<name>.tmp-*`` (even one with a complete manifest): never loaded, cleaned on retry."""
    _write(tmp_path / "staged", _tensors(2))
    os.rename(tmp_path / "staged", tmp_path / ".ck.tmp-0b0b0b0b0b0b")  # crashed just before its rename
    (tmp_path / ".ck.tmp-0c0c0c0c0c0c").mkdir()  # crashed earlier
    (tmp_path / ".other.tmp-0d0d0d0d0d0d").mkdir()  # another path's: not ours to remove
    with raises_kind(CheckpointError, "not_found"):
        open_checkpoint(tmp_path / "ck")
    _write(tmp_path / "ck", _tensors(3), version=3)
    assert sorted(x.name for x in tmp_path.iterdir()) == [".other.tmp-0d0d0d0d0d0d", "ck"]
    _assert_same(open_checkpoint(tmp_path / "ck").read_tensors(), _tensors(3))


# --------------------------------------------------------------------------- real crashes and full disks


def _run_child(code: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw
    )


def test_sigkill_mid_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    prev_path, p = tmp_path / "ck", tmp_path / "ck2"
    prev = _tensors(5)
    _write(prev_path, prev, version=1, update_latest=True)
    child = _run_child(
        f"""
        import sys, time, torch
        from stateshift.checkpoint.directory import write_checkpoint
        from stateshift.checkpoint.format import Record as TensorRecord
        from stateshift.checkpoint import format as fmt
        fmt.CHUNK_BYTES = 1 << 20
        first = torch.ones(4 << 20, dtype=torch.uint8)               # 4 MiB
        second = torch.full((64 << 20,), 1.5, dtype=torch.bfloat16)  # 128 MiB
        done = 0
        def progress(n):
            global done
            done += n
            if done > first.nbytes:           # first file written and fsynced; second under way
                if done - n <= first.nbytes:
                    sys.stdout.write("ready\\n"); sys.stdout.flush()
                time.sleep(0.01)
        write_checkpoint({str(p)!r}, {{"first.safetensors": [TensorRecord.from_tensor("first", first)],
                                       "second.safetensors": [TensorRecord.from_tensor("second", second)]}},
                         backend="t", layout={{}}, version=2, progress=progress, update_latest=True)
        sys.stdout.write("finished\\n"); sys.stdout.flush()
        """
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == b"ready\n", (line, child.stderr.read() if child.stderr else b"")
    tmp_dirs = [x for x in _siblings(p) if ".tmp-" in x.name]
    assert len(tmp_dirs) == 1 and (tmp_dirs[0] / "first.safetensors").exists()  # really mid-write
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    # The previous checkpoint is untouched and verifies, latest still names it; nothing else looks complete.
    assert read_manifest(prev_path).version == 1 and read_latest(tmp_path) == prev_path
    verify(prev_path)
    _assert_same(open_checkpoint(tmp_path).read_tensors(), prev)
    assert _complete_siblings(p) == []
    with raises_kind(CheckpointError, "not_found"):
        open_checkpoint(p)
    # The next write to that path cleans the dead writer's leftovers.
    _write(p, _tensors(6), version=3)
    assert _siblings(p) == [] and read_manifest(p).version == 3


def test_file_size_limit_efbig(tmp_path: Path) -> None:
    prev_path, p = tmp_path / "ck", tmp_path / "ck2"
    prev = _tensors(7)
    _write(prev_path, prev, version=1)
    child = _run_child(
        f"""
        import json, resource, signal, sys, torch
        from stateshift.errors import CheckpointError
        from stateshift.checkpoint.directory import write_checkpoint
        from stateshift.checkpoint.format import Record as TensorRecord
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # so write() returns EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        big = torch.zeros(8 << 20, dtype=torch.uint8)
        try:
            write_checkpoint({str(p)!r}, {{"big.safetensors": [TensorRecord.from_tensor("big", big)]}},
                             backend="t", layout={{}}, version=2)
        except CheckpointError as e:
            if e.kind != "write":
                raise
            print(json.dumps({{"errno": e.errno, "msg": str(e)}}))
        """
    )
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err.decode()
    res = json.loads(out)
    assert res["errno"] == errno.EFBIG
    assert "EFBIG" in res["msg"] and "previous checkpoint" in res["msg"] and "intact" in res["msg"]
    assert "big.safetensors" in res["msg"]
    assert _siblings(p) == [] and not p.exists()
    assert read_manifest(prev_path).version == 1
    verify(prev_path)
    _assert_same(open_checkpoint(prev_path).read_tensors(), prev)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if sys.platform != "linux":
        pytest.skip("tmpfs mount needs Linux")
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, timeout=30
        )
    except (FileNotFoundError, PermissionError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not permitted): {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_real_full_disk_enospc(tiny_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prev_path, p = tiny_tmpfs / "ck", tiny_tmpfs / "ck2"
    prev = {"w": torch.randn(256 << 10)}  # 1 MiB
    write_checkpoint(
        prev_path, {"w.safetensors": _records(prev)}, backend="t", layout={}, version=1, update_latest=True
    )

    # 1) Clearly too big: refused before a byte is written.
    huge = {"w": torch.zeros(8 << 20, dtype=torch.uint8)}
    with raises_kind(CheckpointError, "write", match="ENOSPC") as ei:
        write_checkpoint(p, {"w.safetensors": _records(huge)}, backend="t", layout={}, version=2)
    assert ei.value.errno == errno.ENOSPC and "intact" in str(ei.value)
    assert _siblings(p) == []

    # 2) The disk fills up while we write (another process takes the space): real ENOSPC from write().
    # At most 2 * WORKERS tasks run ahead of the first progress call: with 2 workers, 4 of the 16
    # chunks; with a machine's 16 every chunk was out before the filler ran, and the ENOSPC came
    # from manifest.json instead (test_disk_filling_after_data_names_manifest).
    monkeypatch.setattr(format_mod, "CHUNK_BYTES", 128 << 10)
    monkeypatch.setattr(format_mod, "WORKERS", 2)
    filler = tiny_tmpfs / "filler"

    def fill_disk(_n: int) -> None:
        if filler.exists():
            return
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * (64 << 10))
            except OSError as e:
                assert e.errno == errno.ENOSPC

    new = {"w": torch.randn(512 << 10)}  # 2 MiB, fits before the filler
    with raises_kind(CheckpointError, "write", match="no space left on device") as ei:
        write_checkpoint(p, {"w.safetensors": _records(new)}, backend="t", layout={}, version=2, progress=fill_disk)
    assert ei.value.errno == errno.ENOSPC
    assert "previous checkpoint" in str(ei.value) and "intact" in str(ei.value)
    assert "'w.safetensors' (tensor 'w')" in str(ei.value)
    assert _siblings(p) == [] and not p.exists()
    assert read_manifest(prev_path).version == 1 and read_latest(tiny_tmpfs) == prev_path
    verify(prev_path)
    _assert_same(open_checkpoint(prev_path).read_tensors(), prev)

    # Space comes back: the same write now succeeds (the temporary directory really was removed).
    filler.unlink()
    write_checkpoint(p, {"w.safetensors": _records(new)}, backend="t", layout={}, version=2)
    _assert_same(open_checkpoint(p).read_tensors(), new)


def test_pointer_write_failure_keeps_old_pointer(tiny_tmpfs: Path) -> None:
    write_checkpoint(
        tiny_tmpfs / "s1", {"w.safetensors": _records({"w": torch.ones(4)})}, backend="t", layout={}, update_latest=True
    )
    write_checkpoint(tiny_tmpfs / "s2", {"w.safetensors": _records({"w": torch.ones(4)})}, backend="t", layout={})
    filler = tiny_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    with raises_kind(CheckpointError, "write", match="previous checkpoint"):
        set_latest(tiny_tmpfs / "s2")
    assert read_latest(tiny_tmpfs) == tiny_tmpfs / "s1"
    assert [x for x in tiny_tmpfs.iterdir() if x.name.startswith(".")] == []


class _FillingDisk:
    """``os.pwritev`` on a disk with ``room`` bytes left, shared by every writer thread: a write that
    does not fit is short, the next one fails with ENOSPC -- what a real filling disk does, no root needed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, room: int) -> None:
        import threading

        self.room, self.lock, self.real = room, threading.Lock(), os.pwritev
        monkeypatch.setattr(os, "pwritev", self.pwritev)

    def pwritev(self, fd: int, bufs, offset: int) -> int:
        with self.lock:
            if self.room <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            cut, left = [], self.room
            for b in bufs:
                cut.append(memoryview(b)[:left])
                left -= len(cut[-1])
                if not left:
                    break
            n = self.real(fd, cut, offset)
            self.room -= n
            return n


def test_disk_filling_during_data_write_names_file_and_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: a full disk's ENOSPC must name the file being written (and its tensor), as the
    # GPU machine's tmpfs test asks; everything else as before.
    prev_path, p = tmp_path / "ck", tmp_path / "ck2"
    prev = {"w": torch.randn(1000)}
    write_checkpoint(
        prev_path, {"w.safetensors": _records(prev)}, backend="t", layout={}, version=1, update_latest=True
    )
    monkeypatch.setattr(format_mod, "CHUNK_BYTES", 64 << 10)
    _FillingDisk(monkeypatch, room=300 << 10)  # part-way through the 1 MiB tensor
    with raises_kind(CheckpointError, "write", match="no space left on device") as ei:
        write_checkpoint(
            p, {"w.safetensors": _records({"w": torch.randn(256 << 10)})}, backend="t", layout={}, version=2
        )
    assert ei.value.errno == errno.ENOSPC
    msg = str(ei.value)
    assert "'w.safetensors'" in msg and "tensor 'w'" in msg, msg
    assert "previous checkpoint" in msg and "intact" in msg
    assert _siblings(p) == [] and not p.exists()
    monkeypatch.undo()
    assert read_manifest(prev_path).version == 1 and read_latest(tmp_path) == prev_path
    _assert_same(open_checkpoint(prev_path).read_tensors(), prev)


def test_disk_filling_after_data_names_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (what the GPU machine's 16 cores hit in test_real_full_disk_enospc): every data byte
    # was written before the disk filled, and the ENOSPC came from manifest.json, whose error named
    # no file ("while installing the checkpoint").
    prev_path, p = tmp_path / "ck", tmp_path / "ck2"
    write_checkpoint(
        prev_path, {"w.safetensors": _records({"w": torch.ones(4)})}, backend="t", layout={}, update_latest=True
    )
    new = {"w": torch.randn(1000)}
    disk = _FillingDisk(monkeypatch, room=1 << 30)

    def fill(_n: int) -> None:
        disk.room = 0  # another process takes the rest of the space once our data is out

    with raises_kind(CheckpointError, "write", match="no space left on device") as ei:
        write_checkpoint(p, {"w.safetensors": _records(new)}, backend="t", layout={}, version=2, progress=fill)
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and f"'{MANIFEST_NAME}'" in msg, msg
    assert "previous checkpoint" in msg and "intact" in msg
    assert _siblings(p) == [] and not p.exists() and read_latest(tmp_path) == prev_path


def test_io_error_syncing_names_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # EIO from fsync (a failing device) names the file too, and leaves nothing behind.
    p = tmp_path / "ck"

    def fsync(_fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    with raises_kind(CheckpointError, "write", match="EIO") as ei:
        write_checkpoint(p, {"w.safetensors": _records({"w": torch.ones(4)})}, backend="t", layout={})
    assert ei.value.errno == errno.EIO and "'w.safetensors'" in str(ei.value)
    assert _siblings(p) == [] and not p.exists()


def test_without_gc_pauses_the_collector_and_gives_back_its_state() -> None:
    """Metadata of many tensors is decoded with the cyclic collector paused (it took half of a load of
    20,000 tensors); the caller's setting comes back, after an error too, and a caller's own pause stays."""
    import gc

    from stateshift.checkpoint.format import without_gc

    seen = []

    @without_gc
    def work(fail: bool) -> None:
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("bad header")

    assert gc.isenabled()
    work(False)
    with pytest.raises(ValueError):
        work(True)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        work(False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_without_gc_from_two_threads_leaves_the_collector_on() -> None:
    """Found by the adversarial session: checking and switching the collector without a lock let two threads
    (a save and an async_save's writer, two loads) leave it off for good."""
    import gc
    import sys
    import threading

    from stateshift.checkpoint.format import without_gc

    work = without_gc(lambda: None)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=lambda: [work() for _ in range(300_000)]) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
        on = gc.isenabled()
        gc.enable()
    assert on, "the collector was left off"
