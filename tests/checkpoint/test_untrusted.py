"""Untrusted checkpoints (issue 13, items 9-12): no code runs, nothing outside the directory is read,
no unbounded input, typed errors only, and ``inspect`` fails wherever ``load`` would refuse.

Each test crafts a directory as an attacker (or a damaged disk) would. Manifests edited here are
resealed (``manifest.seal``), so they reach the schema check as a crafted one would.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import threading
import zlib
from pathlib import Path

import pytest
from helpers import make, warm
from raises import raises_kind

from stateshift import ModelState
from stateshift.checkpoint import load, load_dcp, save, save_dcp, verify
from stateshift.cli import main as cli
from stateshift.errors import CheckpointError


def _reseal(d: dict) -> dict:
    try:
        from stateshift.checkpoint.manifest import seal
    except ImportError:  # the layout before the rewrite had no seal
        return d
    return seal(d)


def _rewrite(root: Path, mutate) -> None:
    mp = root / "manifest.json"
    d = json.loads(mp.read_text())
    d.pop("seal", None)
    mutate(d)
    mp.write_text(json.dumps(_reseal(d)))


def _state(seed: int = 0) -> ModelState:
    model, opt = make("cpu", seed=seed)
    warm(model, opt)
    return ModelState(model, opt)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    save(_state(), tmp_path / "ck")
    return tmp_path / "ck"


def _inspect(capsys, *argv: str) -> tuple[int, str]:
    rc = cli(["inspect", *argv])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def _crc(path: Path) -> str:
    return f"crc32:{zlib.crc32(path.read_bytes()):08x}"


# --------------------------------------------------------------------------- item 9: no unpickling


class _Evil:
    """Unpickling this creates ``marker`` (what a crafted ``.metadata`` could do with a shell command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def evil_dcp(tmp_path: Path) -> tuple[Path, Path]:
    model, opt = make("cpu")
    warm(model, opt)
    root = tmp_path / "dcp"
    save_dcp(root, model, opt)
    marker = tmp_path / "pwned"
    meta = root / ".metadata"
    meta.write_bytes(pickle.dumps(_Evil(marker)))

    def fix(d: dict) -> None:  # the attacker satisfies the recorded checksum and size
        d["files"][".metadata"]["checksum"] = _crc(meta)
        d["files"][".metadata"]["bytes"] = meta.stat().st_size

    _rewrite(root, fix)
    return root, marker


def test_inspect_never_unpickles_dcp_metadata(evil_dcp, capsys):
    root, marker = evil_dcp
    _inspect(capsys, str(root))
    _inspect(capsys, "--no-verify", "--json", str(root))
    assert not marker.exists()


def test_load_dcp_refuses_pickle_metadata_unless_trusted(evil_dcp):
    from stateshift.errors import CheckpointError

    root, marker = evil_dcp
    model, opt = make("cpu", seed=1)
    warm(model, opt)
    with raises_kind(CheckpointError, "untrusted", match="pickle.*trusted=True"):
        load_dcp(root, model, opt)
    assert not marker.exists()
    assert "pickle" in load_dcp.__doc__ and "trusted" in load_dcp.__doc__


def test_load_dcp_verifies_metadata_checksum_before_opening_it(evil_dcp):
    root, marker = evil_dcp
    meta = root / ".metadata"
    meta.write_bytes(meta.read_bytes() + b".")  # no longer what the manifest records
    _rewrite(root, lambda d: d["files"][".metadata"].update(bytes=meta.stat().st_size))
    model, opt = make("cpu", seed=1)
    warm(model, opt)
    with raises_kind(CheckpointError, "corrupt") as ei:
        load_dcp(root, model, opt, trusted=True)
    assert ei.value.path == str(meta)
    assert not marker.exists()


def test_inspect_help_says_dcp_metadata_is_pickle(capsys):
    with pytest.raises(SystemExit):
        cli(["inspect", "--help"])
    out = capsys.readouterr().out
    assert "pickle" in out and "trusted=True" in out and "stateshift save" not in out


# --------------------------------------------------------------------------- item 10: only regular files inside the root


def _in_thread(fn, fifo: Path | None = None, timeout: float = 20.0):
    """Run ``fn``; if it hangs (a FIFO opened for reading), unblock it by opening the FIFO for writing."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail(f"{fn} hung on a FIFO")
    return out


@pytest.mark.parametrize("name", ["params.safetensors", "manifest.json"])
def test_fifo_in_the_checkpoint_is_refused_without_hanging(ckpt, name, capsys):
    victim = ckpt / name
    victim.unlink()
    os.mkfifo(victim)
    out = _in_thread(lambda: load(_state(1), ckpt), victim)
    assert isinstance(out.get("error"), CheckpointError) and out["error"].kind == "corrupt", out
    assert "not a regular file" in str(out["error"])
    out = _in_thread(lambda: _inspect(capsys, str(ckpt)), victim)
    rc, text = out["value"]
    assert rc == 1 and "not a regular file" in text


def test_symlinked_data_file_is_refused_even_when_its_bytes_are_right(ckpt, tmp_path):
    outside = tmp_path / "outside.safetensors"
    (ckpt / "params.safetensors").rename(outside)
    (ckpt / "params.safetensors").symlink_to(outside)
    with raises_kind(CheckpointError, "corrupt", match="symbolic link|not a regular file"):
        load(_state(1), ckpt)
    with raises_kind(CheckpointError, "corrupt", match="symbolic link|not a regular file"):
        verify(ckpt)


def test_no_bytes_of_a_file_outside_the_directory_reach_an_error(ckpt, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET!!" + b"x" * 100)
    (ckpt / "params.safetensors").unlink()
    (ckpt / "params.safetensors").symlink_to(secret)
    with raises_kind(CheckpointError, "corrupt") as ei:
        load(_state(1), ckpt)
    leaked = str(struct.unpack("<Q", b"SECRET!!")[0])
    assert leaked not in str(ei.value) and "SECRET" not in str(ei.value)


def test_latest_naming_a_symlink_outside_the_root_is_refused(tmp_path, capsys):
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    root.mkdir()
    save(_state(), elsewhere / "step-1")
    (root / "step-1").symlink_to(elsewhere / "step-1")
    (root / "latest").write_text("step-1\n")
    with raises_kind(CheckpointError, "corrupt", match="symbolic link"):
        load(_state(1), root)
    rc, text = _inspect(capsys, str(root))
    assert rc == 1 and "symbolic link" in text
    (root / "latest").write_text("../elsewhere/step-1\n")
    with raises_kind(CheckpointError, "corrupt", match="latest"):
        load(_state(1), root)


# --------------------------------------------------------------------------- item 11: size and depth limits


def test_oversized_manifest_is_refused_before_it_is_read(ckpt, capsys):
    from stateshift.checkpoint import manifest as manifest_mod

    limit = getattr(manifest_mod, "MAX_MANIFEST_BYTES", 64 << 20)
    with open(ckpt / "manifest.json", "r+b") as f:
        f.truncate(limit + 1)  # sparse: costs no disk
    with raises_kind(CheckpointError, "corrupt", match="larger than"):
        load(_state(1), ckpt)
    rc, text = _inspect(capsys, str(ckpt))
    assert rc == 1 and "larger than" in text


def test_deeply_nested_manifest_is_corrupt_not_a_recursion_error(ckpt, capsys):
    (ckpt / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with raises_kind(CheckpointError, "corrupt", match="nested"):
        load(_state(1), ckpt)
    rc, _ = _inspect(capsys, str(ckpt))
    assert rc == 1


def test_deeply_nested_meta_is_corrupt(ckpt):
    deep: list = []
    for _ in range(100):
        deep = [deep]

    def mutate(d):
        d["layout"]["ranks"][0]["groups"]["params"]["slots"][0]["members"][0]["meta"] = deep

    _rewrite(ckpt, mutate)
    with raises_kind(CheckpointError, "corrupt", match="nested"):
        load(_state(1), ckpt)


def test_deeply_nested_safetensors_header_is_corrupt(ckpt):
    f = ckpt / "buffers.safetensors"
    blob = b"[" * 200_000 + b"]" * 200_000
    f.write_bytes(struct.pack("<Q", len(blob)) + blob)
    _rewrite(ckpt, lambda d: d["files"]["buffers.safetensors"].update(bytes=f.stat().st_size))
    with raises_kind(CheckpointError, "corrupt"):
        load(_state(1), ckpt)


# --------------------------------------------------------------------------- item 12: one schema, typed errors


def _slot(d):
    return d["layout"]["ranks"][0]["groups"]["params"]["slots"][0]


def _member(d):
    return _slot(d)["members"][0]


MALFORMED = {
    "ranks=[]": lambda d: d["layout"].update(ranks=[]),
    "world_size='x'": lambda d: d["layout"].update(world_size="x"),
    "world_size=0": lambda d: d["layout"].update(world_size=0),
    "rank without groups": lambda d: d["layout"]["ranks"][0].pop("groups"),
    "members=5": lambda d: _slot(d).update(members=5),
    "stride renamed": lambda d: _member(d).update(stridf=_member(d).pop("stride")),
    "lone surrogate in a name": lambda d: _member(d).update(name="blocks\udc80weight"),
    "shape of bools": lambda d: _member(d).update(shape=[True, 2]),
    "negative nbytes": lambda d: _slot(d).update(nbytes=-8),
    "unknown dtype": lambda d: _member(d).update(dtype="float128"),
    "file missing from files": lambda d: d["files"].pop("params.safetensors"),
    "files=[]": lambda d: d.update(files=[]),
    "bytes='x'": lambda d: d["files"]["params.safetensors"].update(bytes="x"),
    "version='x'": lambda d: d.update(version="x"),
    "extra of ints": lambda d: d.update(extra={"a": 1}),
    "file name with a slash": lambda d: d["files"].update({"../x.safetensors": d["files"]["params.safetensors"]}),
    "group file outside files": lambda d: d["layout"]["ranks"][0]["groups"]["params"].update(file="nope.safetensors"),
    # (adversarial session: float() of it raised OverflowError)
    "created_unix of 400 digits": lambda d: d.update(created_unix=10**400),
}


@pytest.mark.parametrize("mutation", list(MALFORMED))
def test_malformed_manifest_field_is_a_typed_error_and_inspect_fails(ckpt, mutation, capsys):
    _rewrite(ckpt, MALFORMED[mutation])
    state = _state(1)
    with raises_kind(CheckpointError, "corrupt"):
        load(state, ckpt)
    rc, _ = _inspect(capsys, str(ckpt))
    assert rc == 1
    rc, _ = _inspect(capsys, "--no-verify", str(ckpt))
    assert rc == 1


def test_manifest_that_is_not_an_object_is_corrupt(ckpt):
    (ckpt / "manifest.json").write_text("[1, 2]")
    with raises_kind(CheckpointError, "corrupt"):
        load(_state(1), ckpt)


def test_flipped_byte_in_the_manifest_is_caught(ckpt):
    mp = ckpt / "manifest.json"
    raw = bytearray(mp.read_bytes())
    i = raw.index(b'"stride"') + 3
    raw[i] ^= 0x01  # "stride" becomes another key
    mp.write_bytes(bytes(raw))
    with raises_kind(CheckpointError, "corrupt"):
        load(_state(1), ckpt)


def test_inspect_does_not_call_an_empty_directory_or_an_hf_export_incomplete(tmp_path, capsys):
    from stateshift.checkpoint import export_hf

    (tmp_path / "empty").mkdir()
    rc, text = _inspect(capsys, str(tmp_path / "empty"))
    assert rc == 1 and "empty" in text and "never finished" not in text and "incomplete" not in text
    model, _ = make("cpu")
    export_hf(model, tmp_path / "hf")
    rc, text = _inspect(capsys, str(tmp_path / "hf"))
    assert rc == 1 and "Hugging Face" in text and "never finished" not in text
    with raises_kind(CheckpointError, "not_found", match="Hugging Face"):
        load(_state(1), tmp_path / "hf")


# --------------------------------------------------------------------------- hostile shapes: bounded work, typed errors
#
# Anyone can reseal a manifest (the seal is a crc32), so its shapes are as hostile as its author wants:
# every check below must cost time linear in the manifest's size, raise a typed error and print one line.

_HUGE = 1 << 61


def _typed_slot(d):
    return next(s for s in d["layout"]["ranks"][0]["groups"]["params"]["slots"] if s["typed"])


def _dims(where: str, n: int, value: int = _HUGE):
    """Give the tensor (or member) at ``where`` ``n`` dimensions of ``value`` (its strides to match in rank)."""

    def mutate(d):
        if where == "tensor":
            d["files"]["params.safetensors"]["tensors"][0]["shape"] = [value] * n
        else:
            m = _slot(d)["members"][1] if where == "raw member" else _typed_slot(d)["members"][0]
            m.update(shape=[value] * n, stride=[1] * n)

    return mutate


def _refused_everywhere(root: Path, capsys, error=(CheckpointError, "corrupt")) -> str:
    """``load`` and ``verify`` raise ``error`` (class, kind); ``inspect`` (verifying or not) exits 1 with one line
    on stderr."""
    with raises_kind(*error) as ei:
        load(_state(1), root)
    with raises_kind(*error):
        verify(root)
    for argv in ((str(root),), ("--no-verify", str(root))):
        assert cli(["inspect", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and len(err) < 2000, err[:3000]
    return str(ei.value)


@pytest.mark.parametrize("where", ["tensor", "raw member", "typed member"])
def test_shape_of_300_dims_of_2_61_is_a_typed_error(ckpt, where, capsys):
    _rewrite(ckpt, _dims(where, 300))
    text = _refused_everywhere(ckpt, capsys)
    assert len(text) < 2000


@pytest.mark.parametrize("where", ["tensor", "raw member", "typed member"])
def test_manifest_with_a_million_dims_is_refused_in_under_a_second(ckpt, where, capsys):
    import time

    _rewrite(ckpt, _dims(where, 1_000_000))  # (a 21 MB manifest)
    state = _state(1)
    for fn in (verify, lambda root: load(state, root)):
        t0 = time.perf_counter()
        with raises_kind(CheckpointError, "corrupt", match="dimensions"):
            fn(ckpt)
        assert time.perf_counter() - t0 < 1.0


def test_dimension_of_2_48_is_refused(ckpt, capsys):
    _rewrite(ckpt, _dims("raw member", 1, 1 << 48))
    assert "dimension" in _refused_everywhere(ckpt, capsys)


def test_dcp_tensor_of_300_dims_of_2_61_is_a_typed_error(tmp_path, capsys):
    model, opt = make("cpu")
    warm(model, opt)
    root = tmp_path / "dcp"
    save_dcp(root, model, opt)
    _rewrite(root, lambda d: next(iter(d["dcp_tensors"].values())).update(shape=[_HUGE] * 300))
    with raises_kind(CheckpointError, "corrupt"):
        verify(root)
    for argv in ((str(root),), ("--no-verify", "--json", str(root))):
        assert cli(["inspect", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err[:3000]


def test_safetensors_header_with_a_million_dims_is_refused_in_under_a_second(ckpt):
    """A header whose crc32 the (resealed) manifest records is parsed: its shapes are capped as well."""
    import time

    f = ckpt / "buffers.safetensors"
    raw = f.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = header[name]["shape"] + [1] * 1_000_000 + [_HUGE] * 1000
    blob = json.dumps(header).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    head = struct.pack("<Q", len(blob)) + blob
    f.write_bytes(head + raw[8 + hlen :])

    def fix(d):
        e = d["files"]["buffers.safetensors"]
        e.update(bytes=f.stat().st_size, checksum=_crc(f))
        e["header"].update(bytes=len(head), checksum=f"crc32:{zlib.crc32(head):08x}")

    _rewrite(ckpt, fix)
    t0 = time.perf_counter()
    with raises_kind(CheckpointError, "corrupt", match="dimensions"):
        verify(ckpt)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("offset", [(1 << 62) - 1, 8192 - 4, 2], ids=["2**62-1", "past the end", "misaligned"])
def test_raw_slot_member_outside_its_slot_is_refused_by_verify_inspect_and_load(ckpt, offset, capsys):
    _rewrite(ckpt, lambda d: _slot(d)["members"][1].update(offset=offset))
    assert "outside" in _refused_everywhere(ckpt, capsys) or offset == 2


LONG = "x" * 100_000
LONG_NAMES = {  # (every one of these printed the whole name: a 100 kB message)
    "file name with a slash": lambda d: d["files"].update({"a/" + LONG: d["files"]["params.safetensors"]}),
    "group's file not in files": lambda d: d["layout"]["ranks"][0]["groups"]["params"].update(file=LONG),
    "group not in the ranks": lambda d: d["layout"].update(groups=[*d["layout"]["groups"], LONG]),
    "extra's value not text": lambda d: d.update(extra={LONG: 1}),
}


@pytest.mark.parametrize("mutation", list(LONG_NAMES))
def test_a_long_name_in_a_hostile_manifest_gives_a_short_message(ckpt, mutation, capsys):
    _rewrite(ckpt, LONG_NAMES[mutation])
    assert len(_refused_everywhere(ckpt, capsys)) < 2000


def test_two_slots_naming_one_record_are_corrupt(ckpt):
    """Each slot reads its own record: a manifest where two name one left the other's bytes unread, and load
    put what its staging memory held before into the model."""

    def mutate(d):
        slots = d["layout"]["ranks"][0]["groups"]["params"]["slots"]
        by_shape = {}
        for s in slots:
            if s["typed"]:
                key = (tuple(s["members"][0]["shape"]), s["members"][0]["dtype"])
                if key in by_shape:
                    s["record"] = by_shape[key]["record"]
                    return
                by_shape[key] = s
        raise AssertionError("no two typed slots of one shape and dtype")

    _rewrite(ckpt, mutate)
    state = _state(1)
    before = {k: v.clone() for k, v in state.model.state_dict().items()} if hasattr(state, "model") else None
    with raises_kind(CheckpointError, "corrupt"):
        verify(ckpt)
    with raises_kind(CheckpointError, "corrupt"):
        load(state, ckpt)
    if before is not None:
        assert all(v.equal(before[k]) for k, v in state.model.state_dict().items())
