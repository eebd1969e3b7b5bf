"""The public surface of ``stateshift.checkpoint`` stays exactly this; everything else is internal."""

from __future__ import annotations

import inspect
import os
import zlib

import stateshift.checkpoint as checkpoint
from stateshift.checkpoint.format import crc32_combine


def test_public_names_are_pinned():
    assert checkpoint.__all__ == [
        "SaveHandle",
        "async_save",
        "export_hf",
        "init_optimizer_state",
        "load",
        "load_dcp",
        "save",
        "save_dcp",
        "verify",
    ]
    public = {n for n in vars(checkpoint) if not n.startswith("_") and not inspect.ismodule(getattr(checkpoint, n))}
    assert public == set(checkpoint.__all__)


def test_signatures_the_rl_trainer_calls():
    def params(fn):
        return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]

    empty = inspect.Parameter.empty
    assert params(checkpoint.save)[:8] == [
        ("state", "POSITIONAL_OR_KEYWORD", empty),
        ("path", "POSITIONAL_OR_KEYWORD", empty),
        ("groups", "POSITIONAL_OR_KEYWORD", None),
        ("tag", "KEYWORD_ONLY", None),
        ("version", "KEYWORD_ONLY", None),
        ("extra", "KEYWORD_ONLY", None),
        ("update_latest", "KEYWORD_ONLY", False),
        ("distributed", "KEYWORD_ONLY", None),
    ]
    assert params(checkpoint.async_save)[:7] == params(checkpoint.save)[:7]
    assert params(checkpoint.load)[:4] == [
        ("state", "POSITIONAL_OR_KEYWORD", empty),
        ("path", "POSITIONAL_OR_KEYWORD", empty),
        ("groups", "POSITIONAL_OR_KEYWORD", None),
        ("cast", "KEYWORD_ONLY", False),
    ]
    assert list(inspect.signature(checkpoint.init_optimizer_state).parameters) == ["optimizer"]


def test_crc32_combine_matches_zlib():
    a, b = os.urandom(1000), os.urandom(123_457)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)
    assert crc32_combine(0, zlib.crc32(b), len(b)) == zlib.crc32(b)  # crc32 of nothing is 0
