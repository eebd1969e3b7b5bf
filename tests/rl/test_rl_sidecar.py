"""The RL checkpoint's sidecar: a typed, versioned, checksummed file that never runs code, and a resume that
falls back to the newest intact checkpoint when the latest one is damaged."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from raises import raises_kind
from rl.rlkit import tiny

from stateshift.errors import CheckpointError
from stateshift.train.checkpointing import SIDECAR, latest_checkpoint, load_checkpoint
from stateshift.train.launch import run

COMMON = [
    "async_training.trigger_parameter_sync_step=2",
    "async_training.staleness_threshold=0",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=2",
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A tiny run of 4 steps with checkpoints at steps 2 and 4 (copied by each test that changes it)."""
    base = tmp_path_factory.mktemp("sidecar")
    result = run(tiny(base, "trainer.steps=4", *COMMON))
    return result


@pytest.fixture
def run_dir(finished, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished.out_dir, out)
    (out / "run.lock").unlink(missing_ok=True)
    return out


def _trainer(tmp_path: Path):
    from stateshift.train.build import build_policy, build_task
    from stateshift.train.trainer import Trainer

    cfg = tiny(tmp_path, "trainer.steps=4", *COMMON)
    return Trainer(build_policy(cfg, build_task(cfg)), cfg.trainer, temperature=1.0)


def _params(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


class _Touch:
    """Unpickling this creates ``path``: what a hostile sidecar would do (with any other code)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_crafted_pickle_as_sidecar_runs_no_code(run_dir, tmp_path):
    marker = tmp_path / "pwned"
    for step in ("step-2", "step-4"):
        for name in (SIDECAR, "rl_state.pt"):
            torch.save({"step": 4, "payload": _Touch(marker)}, run_dir / "checkpoints" / step / name)
    trainer = _trainer(tmp_path)
    with raises_kind(CheckpointError, "corrupt") as info:
        load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), trainer)
    assert not marker.exists(), "loading the sidecar ran code from it"
    assert SIDECAR in str(info.value)


def test_every_single_bit_flip_of_the_sidecar_is_refused_naming_it(run_dir, tmp_path):
    step = run_dir / "checkpoints" / "step-4"
    good = (step / SIDECAR).read_bytes()
    trainer = _trainer(tmp_path)
    before = _params(trainer)
    rng = random.Random(29)
    t0 = time.perf_counter()
    for bit in rng.sample(range(len(good) * 8), 200):
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        (step / SIDECAR).write_bytes(bytes(bad))
        with raises_kind(CheckpointError, "corrupt") as info:
            load_checkpoint(step, trainer)
        assert info.value.path == str(step / SIDECAR), (bit, str(info.value))
    assert time.perf_counter() - t0 < 30
    assert all(torch.equal(a, b) for a, b in zip(before, _params(trainer), strict=True))  # nothing changed
    (step / SIDECAR).write_bytes(good)
    assert load_checkpoint(step, trainer).step == 4


@pytest.mark.parametrize("keep", [0, 1, 8, 20, 60, -1])
def test_truncated_sidecar_is_refused_naming_it(run_dir, tmp_path, keep):
    step = run_dir / "checkpoints" / "step-4"
    good = (step / SIDECAR).read_bytes()
    (step / SIDECAR).write_bytes(good[:keep] if keep >= 0 else good[: len(good) // 2])
    with raises_kind(CheckpointError, "corrupt") as info:
        load_checkpoint(step, _trainer(tmp_path))
    assert info.value.path == str(step / SIDECAR)


def _reseal(body: bytes, version: int) -> bytes:
    """A sidecar of ``version`` around ``body`` with a correct checksum (the layout of docs/guide/rl.md)."""
    head = b"SSRLSIDE" + struct.pack("<IQ", version, len(body))
    return head + hashlib.sha256(head + body).digest() + body


def test_resealed_sidecar_of_another_version_or_shape_is_refused(run_dir, tmp_path):
    step = run_dir / "checkpoints" / "step-4"
    good = (step / SIDECAR).read_bytes()
    body = good[52:]
    assert _reseal(body, 1) == good  # the layout the test relies on
    (step / SIDECAR).write_bytes(_reseal(body, 2))
    with raises_kind(CheckpointError, "corrupt", match="format version 2"):
        load_checkpoint(step, _trainer(tmp_path))
    (hlen,) = struct.unpack_from("<Q", body)
    header = json.loads(body[8 : 8 + hlen])
    header["tensors"][0][1] = [2**61] * 300  # a hostile shape: refused at once, the message bounded
    raw = json.dumps(header).encode()
    (step / SIDECAR).write_bytes(_reseal(struct.pack("<Q", len(raw)) + raw + body[8 + hlen :], 1))
    t0 = time.perf_counter()
    with raises_kind(CheckpointError, "corrupt") as info:
        load_checkpoint(step, _trainer(tmp_path))
    assert time.perf_counter() - t0 < 5 and len(str(info.value)) < 400


@pytest.mark.parametrize("pointer", ["../elsewhere", "/tmp", "step-2/../../x", "", "step-2\0", "x" * 5000])
def test_latest_is_a_plain_name_inside_the_run(run_dir, pointer):
    (run_dir / "checkpoints" / "latest").write_bytes(pointer.encode())
    with raises_kind(CheckpointError, "corrupt"):
        latest_checkpoint(run_dir / "checkpoints")


def test_latest_naming_a_symlink_out_of_the_run_is_refused(run_dir, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(run_dir / "checkpoints" / "step-4", outside)
    (run_dir / "checkpoints" / "step-9").symlink_to(outside)
    (run_dir / "checkpoints" / "latest").write_text("step-9")
    with raises_kind(CheckpointError, "corrupt", match="symbolic link"):
        load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), _trainer(tmp_path))


def _damage(step: Path, how: str) -> None:
    if how == "truncated sidecar":
        (step / SIDECAR).write_bytes((step / SIDECAR).read_bytes()[:100])
    elif how == "empty sidecar":
        (step / SIDECAR).write_bytes(b"")
    elif how == "no sidecar":
        (step / SIDECAR).unlink()
    elif how == "no state":
        shutil.rmtree(step / "state")
    elif how == "corrupt state":
        victim = next(p for p in sorted((step / "state").rglob("*.safetensors")))
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x10
        victim.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated sidecar", "empty sidecar", "no sidecar", "no state", "corrupt state"])
def test_damaged_latest_falls_back_to_the_newest_intact_one_with_one_warning(finished, run_dir, how):
    _damage(run_dir / "checkpoints" / "step-4", how)
    stream = io.StringIO()
    resumed = run(tiny(run_dir.parent, "trainer.steps=5", *COMMON), resume=run_dir, stream=stream)
    warnings = [line for line in stream.getvalue().splitlines() if "skipped" in line]
    assert len(warnings) == 1 and "step-4" in warnings[0], stream.getvalue()
    assert "resumed" in stream.getvalue() and "at step 2" in stream.getvalue()
    assert resumed.summary["status"] == "finished" and resumed.steps == 5
    assert resumed.losses[:2] == finished.losses[2:4]  # steps 3 and 4 trained again, identically
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_no_intact_checkpoint_is_one_error_naming_each(run_dir, tmp_path):
    for step in ("step-2", "step-4"):
        _damage(run_dir / "checkpoints" / step, "truncated sidecar")
    with raises_kind(CheckpointError, "not_found") as info:
        run(tiny(run_dir.parent, "trainer.steps=5", *COMMON), resume=run_dir, stream=io.StringIO())
    text = str(info.value)
    assert "step-4" in text and "step-2" in text and "\n" not in text


def _capture():
    """A capture with a wave in flight, queued groups, an orphan and both random states."""
    from stateshift.train.executors.base import RolloutCapture
    from stateshift.train.rollout import Wave
    from stateshift.train.sampler import Sampling
    from stateshift.train.tasks.addition import AdditionTask

    task = AdditionTask()
    rng = random.Random(3)
    items = [task.sample(rng) for _ in range(3)]
    sampling = Sampling(max_new_tokens=5, stop_token=task.stop_token, pad_token=task.pad_token)
    wave = Wave.start([7, 8, 9], items, [task.prompt(i) for i in items], 2, sampling)
    wave.tokens[:, :2] = 3
    wave.versions[:, :2] = 1
    wave.logprobs.normal_()
    wave.step = 2
    groups = wave.groups(task.score)
    gen = torch.Generator().manual_seed(5)
    return RolloutCapture(
        version=1,
        prompt_rng=rng.getstate(),
        sample_rng=gen.get_state(),
        next_uid=10,
        wave=wave,
        queued=groups[:2],
        running=3,
        staleness_samples=4,
        ledger={
            "admitted": 9,
            "generated": 6,
            "trained": 2,
            "discarded": {"lag": 1},
            "by_version": {"0": 4, "1": 2},
            "regenerated": 0,
        },
        orphans=((11, items[0]),),
    )


def test_capture_round_trips_exactly(tmp_path):
    """Every field of a capture (wave in flight, queued groups, orphans, both random states) comes back equal."""
    from stateshift.train.sidecar import read_sidecar, write_sidecar

    cap = _capture()
    wave, groups = cap.wave, cap.queued
    write_sidecar(tmp_path, step=6, version=3, capture=cap, extra={"heldout_accuracy_start": 0.25})
    back = read_sidecar(tmp_path)
    assert (back.step, back.version, back.extra) == (6, 3, {"heldout_accuracy_start": 0.25})
    got = back.capture
    assert got.prompt_rng == cap.prompt_rng and torch.equal(got.sample_rng, cap.sample_rng)
    assert (got.version, got.next_uid, got.running, got.staleness_samples, got.ledger, got.orphans) == (
        1,
        10,
        3,
        4,
        cap.ledger,
        cap.orphans,
    )
    for name in ("prompt_ids", "prompt_mask", "tokens", "logprobs", "versions", "done"):
        a, b = getattr(got.wave, name), getattr(wave, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.wave.uids, got.wave.items, got.wave.n, got.wave.step) == (wave.uids, wave.items, 2, 2)
    for a, b in zip(got.queued, groups, strict=True):
        assert (a.uid, a.item, a.prompt) == (b.uid, b.item, b.prompt)
        for name in ("tokens", "mask", "logprobs", "versions", "rewards", "exact", "finished"):
            assert getattr(a, name).dtype == getattr(b, name).dtype and torch.equal(getattr(a, name), getattr(b, name))
    assert os.listdir(tmp_path) == [SIDECAR]


def _edit_header(path: Path, edit) -> None:
    """Change the header of the sidecar at ``path`` with ``edit(header)`` and re-seal it (a hostile writer)."""
    body = path.read_bytes()[52:]
    (hlen,) = struct.unpack_from("<Q", body)
    header = json.loads(body[8 : 8 + hlen])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(_reseal(struct.pack("<Q", len(raw)) + raw + body[8 + hlen :], 1))


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["capture"].update(queued=h["capture"]["queued"] * 10_000),  # one tensor used 20,000 times
        lambda h: h["tensors"].__setitem__(slice(None), [max(h["tensors"], key=lambda e: e[3])] * len(h["tensors"])),
        lambda h: h["capture"]["wave"].update(step=10**30),
        lambda h: h["capture"].update(prompt_rng=[3, [2**40] * 625, None]),
        lambda h: h["capture"]["queued"][0].update(item={"type": "os.system", "fields": {"command": "touch x"}}),
        lambda h: h["capture"]["queued"][0].update(uid=True),
        lambda h: h["capture"]["wave"].update(n=3),
        lambda h: h["capture"].update(extra_field=1),
        lambda h: h.update(extra={"k": [1] * 10}),
    ],
    ids=[
        "tensor shared",
        "tensors overlap",
        "huge step",
        "bad random state",
        "unknown item type",
        "bool uid",
        "wave rows",
        "unknown field",
        "nested extra",
    ],
)
def test_hostile_resealed_header_is_refused_quickly(tmp_path, edit):
    from stateshift.train.sidecar import read_sidecar, write_sidecar

    path = write_sidecar(tmp_path, step=6, version=3, capture=_capture(), extra={})
    _edit_header(path, edit)
    t0 = time.perf_counter()
    with raises_kind(CheckpointError, "corrupt") as info:
        read_sidecar(tmp_path)
    assert time.perf_counter() - t0 < 5 and len(str(info.value)) < 500 and info.value.path == str(path)
