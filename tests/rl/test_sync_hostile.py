"""Weight sync against hostile files and failures half-way: each a typed error within its timeout, no listed
version ever freed, a publisher that goes on after a publish that failed before its listing, no file left."""

from __future__ import annotations

import errno
import glob
import json
import os
import threading
from pathlib import Path

import pytest
from raises import raises_kind
from rl.sync_kit import model, same, step, values, wait_for

from stateshift.rl.sync import SyncError, SyncHandle, WeightPublisher, WeightReceiver, mailbox as mailbox_mod
from stateshift.rl.sync.manifest import Manifest


def _edit_mailbox(pub, edit) -> None:
    with pub.mailbox.locked():
        state = pub.mailbox.read()
        edit(state)
        pub.mailbox.write(state)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "entry",
    [{}, {"holding": 1}, {"holding": None, "since": None, "reclaimed": None, "x": 1}, {"holding": 1.5, "since": 0}],
)
def test_a_receiver_entry_not_as_receivers_write_it_is_refused_typed_and_no_listed_version_is_freed(trainer, entry):
    m, state = trainer
    pub = WeightPublisher(state, name="t", ack_timeout_s=5, poll_s=30)  # it looks at receivers after each publish
    try:
        pub.publish(1).wait(5)
        rx = WeightReceiver(pub.handle(), name="r")
        _edit_mailbox(pub, lambda s: s["receivers"].__setitem__("r", dict(entry)))
        with raises_kind(SyncError, "mailbox") as err:
            rx.latest_version()
        assert err.value.field == "receiver 'r'"
        step(m, 2)
        with raises_kind(SyncError, "mailbox"):
            pub.publish(2).wait(5)  # not listed: the publisher does not write over a mailbox it cannot read
        wait_for(lambda: pub._failure is not None)  # its look at the receivers met the entry too: it stopped
        with raises_kind(SyncError, "failed"):
            pub.publish(3)
        listed = json.loads(Path(pub.mailbox.path).read_text())["versions"]
        assert listed == [1] and 1 in pub._live and 2 not in pub._live  # the listed version kept, the other freed
        rx.close()
    finally:
        pub.close()


@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_a_mailbox_that_is_not_a_regular_file_is_refused_typed_and_hangs_nobody(pub, what):
    pub.publish(1).wait(5)
    rx = WeightReceiver(pub.handle(), name="r")
    os.unlink(pub.mailbox.path)
    os.mkfifo(pub.mailbox.path) if what == "fifo" else os.mkdir(pub.mailbox.path)
    done = threading.Event()

    def load() -> None:
        with raises_kind(SyncError, "mailbox") as err:
            rx.load_into(model(1), timeout=1)
        assert err.value.field == "file"
        done.set()

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "load_into hung on the mailbox"
    closer = threading.Thread(target=pub.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "the publisher's close hung on the mailbox"
    rx.close()
    assert glob.glob(f"/dev/shm/{pub.handle().prefix}*") == []


def test_a_manifest_that_is_not_a_regular_file_is_refused_typed(pub):
    pub.publish(1).wait(5)
    rx = WeightReceiver(pub.handle(), name="r")
    os.unlink(pub.mailbox.manifest_path(1))
    os.mkdir(pub.mailbox.manifest_path(1))
    with raises_kind(SyncError, "mailbox"):
        rx.load_into(model(1), timeout=1)
    os.rmdir(pub.mailbox.manifest_path(1))
    rx.close()


def test_deeply_nested_json_is_refused_typed_and_close_still_removes_every_file(pub):
    pub.publish(1).wait(5)
    rx = WeightReceiver(pub.handle(), name="r")
    with raises_kind(SyncError, "mailbox"):
        SyncHandle.from_json(_nested(100_000))
    with open(pub.mailbox.path, "w") as f:
        f.write(_nested(100_000))
    with raises_kind(SyncError, "mailbox") as err:
        rx.latest_version()
    assert err.value.field == "json"
    with raises_kind(SyncError, "mailbox"):
        rx.load_into(model(1), timeout=1)
    pub.close()
    rx.close()
    assert glob.glob(f"/dev/shm/{pub.handle().prefix}*") == []


def _manifest(parts: list[dict]) -> bytes:
    return json.dumps({"version": 1, "transport": "shared_host", "parts": parts}).encode()


def _part(tensors: list, size: int = 64, offset: int = 0) -> dict:
    return {
        "group": "params",
        "size": size,
        "file": None,
        "ipc": None,
        "offset": offset,
        "tensors": json.dumps(tensors),
    }


@pytest.mark.parametrize(
    "part,field",
    [
        (_part([["w", "float32", [4], [1], 0, 0]], offset=2), "part 0 offset"),  # the part's float32s unaligned
        (_part([["w", "float32", [1 << 47, 1 << 47], [0, 0], 0, 0]]), "tensor 'w' shape"),  # numel past int64
    ],
)
def test_a_manifest_whose_tensors_torch_cannot_view_is_refused_typed(part, field):
    with raises_kind(SyncError, "mailbox") as err:
        Manifest.parse(_manifest([part]), "m.json")
    assert err.value.field == field


def test_a_version_past_what_a_file_name_holds_is_refused_and_the_publisher_goes_on(trainer, pub):
    for bad in (10**250, -1, 1 << 63):
        with pytest.raises(ValueError):
            pub.publish(bad)
    pub.publish(1).wait(5)
    rx = WeightReceiver(pub.handle(), name="r")
    target = model(1)
    assert rx.load_into(target) == 1 and same(values(target), values(trainer[0]))
    rx.close()


def test_a_publish_that_fails_before_its_listing_fails_alone(trainer, pub, monkeypatch):
    m, state = trainer
    pub.publish(1).wait(5)
    real = pub.mailbox.write_manifest

    def full(manifest: Manifest) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pub.mailbox, "write_manifest", full)
    step(m, 2)
    with pytest.raises(OSError):
        pub.publish(2).wait(5)
    monkeypatch.setattr(pub.mailbox, "write_manifest", real)
    step(m, 3)
    pub.publish(3).wait(5)  # the space is back: the publisher goes on
    rx = WeightReceiver(pub.handle(), name="r")
    target = model(1)
    assert rx.load_into(target, min_version=3) == 3 and same(values(target), values(m))
    assert 2 not in pub._live  # the failed version's memory went back
    assert not os.path.exists(pub.mailbox.manifest_path(2))
    rx.close()


def test_a_receiver_made_after_its_publisher_closed_leaves_no_file(trainer):
    pub = WeightPublisher(trainer[1], name="gone")
    handle = pub.handle()
    pub.close()
    with raises_kind(SyncError, "closed"):
        WeightReceiver(handle, name="late")
    assert glob.glob(f"/dev/shm/{handle.prefix}*") == []


def test_a_pool_block_grown_under_its_name_is_mapped_again(pub):
    pub.publish(1).wait(5)
    rx = WeightReceiver(pub.handle(), name="r")
    with rx.receive() as (_, pairs):
        dict(pairs)  # the block is mapped now, at its size
    raw = json.loads(Path(pub.mailbox.manifest_path(1)).read_text())
    part = raw["parts"][0]
    path = os.path.join(pub.handle().directory, part["file"])
    old = os.path.getsize(path)
    os.truncate(path, old + (1 << 20))  # grown (zeros), and the manifest says so: its first tensor lies there now
    tensors = json.loads(part["tensors"])
    tensors[0][4] = old + 4096
    part["tensors"], part["size"] = json.dumps(tensors), old + (1 << 20) - part["offset"]
    Path(pub.mailbox.manifest_path(1)).write_text(json.dumps(raw))
    with rx.receive() as (_, pairs):
        got = dict(pairs)[tensors[0][0]].clone()
    assert got.numel() > 0 and not got.any()
    os.truncate(path, old)
    rx.close()


def test_mailbox_reads_refuse_what_is_not_a_regular_file_without_opening_it_for_long(tmp_path):
    box = mailbox_mod.Mailbox(str(tmp_path), "stateshift-sync-1-ab")
    os.mkfifo(box.path)
    with raises_kind(SyncError, "mailbox") as err:
        box.read()
    assert err.value.field == "file"
