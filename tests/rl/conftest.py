"""Fixtures of the weight-sync tests: a trainer's state on a shared pool, and a publisher of it."""

from __future__ import annotations

import pytest
from rl.sync_kit import model

from stateshift import HostPool, ModelState
from stateshift.core.engine import core_of
from stateshift.rl.sync import WeightPublisher


@pytest.fixture
def trainer():
    """A model and its ``ModelState`` on a shared pool (the blocks receivers map)."""
    m = model(0)
    state = ModelState(m, pool=HostPool(shared=True))
    yield m, state
    state.close()
    core_of(state).pool.trim()


@pytest.fixture
def pub(trainer):
    """A publisher of ``trainer`` that looks at its receivers every 10 ms and reclaims them after 0.5 s."""
    p = WeightPublisher(trainer[1], name="t", ack_timeout_s=0.5, poll_s=0.01)
    yield p
    p.close()
