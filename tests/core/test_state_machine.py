"""Stateful property tests: random sequences of every verb, on every backend, against models that never move.

One rule set (``machines.py``) drives three backends:

* the plain torch backend (the built-in GPT with a tied embedding and a buffer, ``helpers.CountingGPT``, Adam) and
* the Megatron CPU fake (all four ``fakes.mcore.setups`` configurations; with
  Megatron's own ``offload_to_cpu`` / ``reload_from_cpu`` and the master rebuild
  plug-in), each as a seeded random walk (weighted rules, every config) and as a
  hypothesis ``RuleBasedStateMachine`` (shrinks what it finds; one config per example);
* FSDP2 on two gloo ranks (plain and under a CPU ``CPUOffloadPolicy`` stand-in):
  every rank runs the same seeded random sequence and checks its own shards.

Rules (``machines.py`` has the table): offload / onload / drop of every group
with ``only=`` subsets (predicates and name lists); snapshots (host and device
placement, tags, versions, replacement, taken while offloaded) and
``snapshot_from`` (with a failing fill); restore; ``swapped`` entered and left
in separate steps (nested, any verb inside, every stash placement, the master
rebuild when ``available()``); release and ``snapshots.clear()``; training
steps and forwards (refused by the guards while state is offloaded); the pi_old
cycle; ``stateshift.checkpoint`` ``save`` / ``async_save`` (+ wait) / ``load``;
pool and snapshot budgets; ``close()`` and a new ``ModelState``; Megatron's own
``offload_to_cpu`` / ``reload_from_cpu``. After every step: every tensor equals
the reference bit for bit, live snapshots never change, the store holds what it
should, residency is what was asked, and a verb that raised changed nothing.
Short fixed sequences of the same rules are in ``test_verb_interactions.py``;
nothing is stepped around.

Environment (the defaults are CI's):

* ``STATESHIFT_MACHINE_WALK_STEPS`` -- rules per seeded walk (torch and each Megatron config); default 800.
* ``STATESHIFT_MACHINE_FSDP2_STEPS`` -- rules per FSDP2 walk (run on both ranks); default 400.
* ``STATESHIFT_MACHINE_SEED`` -- seed of the walks; default 0. (Hypothesis: ``--hypothesis-seed``.)
* ``STATESHIFT_MACHINE_EXAMPLES`` -- hypothesis examples per machine (torch, Megatron); default 12.
* ``STATESHIFT_MACHINE_STEPS`` -- rules per hypothesis example (at most); default 30.
* ``STATESHIFT_MACHINE_LOG`` -- a file each finished machine appends its step count to.
* ``STATESHIFT_TEST_DEVICE=cuda`` -- the torch target on the GPU (the Megatron fake and FSDP2 stay on the CPU).

A failing walk names its seed and its last 25 rules; replay it with the same seed.
A long run::

    STATESHIFT_MACHINE_WALK_STEPS=3000 STATESHIFT_MACHINE_FSDP2_STEPS=2000 STATESHIFT_MACHINE_EXAMPLES=100 \
    STATESHIFT_MACHINE_STEPS=50 STATESHIFT_MACHINE_SEED=1 STATESHIFT_MACHINE_LOG=/tmp/machine.log \
        python -m pytest -q -s -p no:cacheprovider tests/core/test_state_machine.py --hypothesis-seed=1
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # machines.py, also inside spawned ranks
from fakes.mcore.setups import CONFIGS
from helpers import one_torch_thread
from machines import (
    STATS,
    STEPS,
    FSDP2Target,
    Machine,
    MegatronTarget,
    TorchTarget,
    drive,
    hypothesis_machine,
)

EXAMPLES = int(os.environ.get("STATESHIFT_MACHINE_EXAMPLES", "12"))
STEPS_PER_EXAMPLE = int(os.environ.get("STATESHIFT_MACHINE_STEPS", "30"))
WALK_STEPS = int(os.environ.get("STATESHIFT_MACHINE_WALK_STEPS", "800"))
FSDP2_STEPS = int(os.environ.get("STATESHIFT_MACHINE_FSDP2_STEPS", "400"))
SEED = int(os.environ.get("STATESHIFT_MACHINE_SEED", "0"))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield
    if STEPS:
        print(f"\nstate machine steps: {dict(STEPS)}; outcomes: {dict(sorted(STATS.items()))}")


_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS_PER_EXAMPLE,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

TorchVerbs = hypothesis_machine("TorchVerbs", [TorchTarget], TorchTarget)
TorchVerbs.TestCase.settings = _SETTINGS
TestTorchVerbs = TorchVerbs.TestCase

MegatronVerbs = hypothesis_machine("MegatronVerbs", [lambda c=c: MegatronTarget(c) for c in CONFIGS], MegatronTarget)
MegatronVerbs.TestCase.settings = _SETTINGS
TestMegatronVerbs = MegatronVerbs.TestCase


# ----------------------------------------------------------------------------- seeded walks


def walk(target, seed: int, steps: int, tmpdir: str | None = None, who: str = "") -> Machine:
    """``steps`` rules drawn with ``random.Random(seed)`` (weighted, see ``machines.WEIGHTS``); the failing
    rule's trail (the last 25 rules) and seed are in the error."""
    import random

    machine = Machine(target, tmpdir=tmpdir)
    trail: list[str] = []
    try:
        drive(machine, random.Random(seed), steps, log=trail.append)
    except BaseException as e:
        raise AssertionError(
            f"{target.name}{who}, seed {seed}, rules so far (last 25):\n" + "\n".join(trail[-25:])
        ) from e
    machine.teardown()
    return machine


@pytest.mark.parametrize(
    "make",
    [TorchTarget, *[lambda c=c: MegatronTarget(c) for c in CONFIGS]],
    ids=["torch", *[f"megatron-{c}" for c in CONFIGS]],
)
def test_seeded_walk(make, tmp_path):
    machine = walk(make(), SEED, WALK_STEPS, str(tmp_path))
    assert machine.steps == WALK_STEPS + 1


def fsdp2_walk(rank, world, seed, steps, tmpdir, offload_policy):
    """The same seeded walk on every rank; each rank checks its own shards after every step."""
    torch.set_num_threads(1)
    machine = walk(FSDP2Target(offload_policy), seed, steps, tmpdir, who=f" rank {rank}")
    return machine.steps, sorted(machine.stats.items())


@pytest.mark.slow
@pytest.mark.parametrize("offload_policy", [False, True], ids=["plain", "cpu_offload_policy"])
def test_fsdp2_walk_2_ranks(tmp_path, offload_policy):
    from dist_harness import run_distributed

    results = run_distributed(
        fsdp2_walk, 2, args=(SEED, FSDP2_STEPS, str(tmp_path), offload_policy), timeout=120 + FSDP2_STEPS
    )
    assert [r[0] for r in results] == [FSDP2_STEPS + 1] * 2
    STEPS[FSDP2Target(offload_policy).name] += results[0][0]  # one sequence, run on both ranks
