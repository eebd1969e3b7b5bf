"""Stateful property test: random sequences of every verb against a model that never moves.

The reference is an identical model + optimizer that is never offloaded; each
rule applies the verb to the state under test and its meaning to the
reference (a restore copies the snapshot's values in, a drop zeroes the grads,
a training step runs on both). After every rule, every tensor of the state
under test -- read through a snapshot, in whatever residency it is -- must
equal the reference bit for bit.

Set STATESHIFT_TEST_DEVICE=cuda to run it on a GPU; STATESHIFT_MACHINE_EXAMPLES
sets the number of examples (default 25 in CI).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from helpers import SMALL, make, train_step, warm
from stateshift import ModelState, ReleasedSnapshotError
from stateshift.backends.torch import TorchModuleBackend, TorchOptimizerBackend, param_names
from stateshift.models import batch

DEVICE = os.environ.get("STATESHIFT_TEST_DEVICE", "cpu")
EXAMPLES = int(os.environ.get("STATESHIFT_MACHINE_EXAMPLES", "25"))
GROUPS = ("params", "buffers", "grads", "optim")
# Whole groups and whole-model calls are drawn more often than arbitrary subsets, so that
# fully offloaded groups (where homes and snapshots share blocks copy-on-write) come up often.
group_sets = st.one_of(
    st.just(list(GROUPS)),
    st.sampled_from([["params"], ["params", "buffers"], ["optim", "grads"]]),
    st.lists(st.sampled_from(GROUPS), min_size=1, max_size=4, unique=True),
)
only = st.one_of(st.none(), st.sampled_from([None, "blocks.0.", "blocks.1.", "embed."]))


def reference_values(model, opt) -> dict[str, torch.Tensor]:
    backends = [TorchModuleBackend(model), TorchOptimizerBackend(opt, param_names(model))]
    return {e.name: e.tensor for b in backends for g in b.groups for e in b.entries(g)}


class Verbs(RuleBasedStateMachine):
    snapshots = Bundle("snapshots")

    def __init__(self) -> None:
        super().__init__()
        self.model, self.opt = make(DEVICE)
        self.ref_model, self.ref_opt = make(DEVICE)
        warm(self.model, self.opt)
        warm(self.ref_model, self.ref_opt)
        self.state = ModelState(self.model, self.opt)
        self.expected: dict[int, dict[str, torch.Tensor]] = {}
        self.step = 0

    def _only(self, prefix):
        return None if prefix is None else (lambda name: name.startswith(prefix))

    @rule(groups=group_sets, prefix=only)
    def offload(self, groups, prefix):
        self.state.offload(groups, only=self._only(prefix))

    @rule(groups=group_sets, prefix=only)
    def onload(self, groups, prefix):
        self.state.onload(groups, only=self._only(prefix))

    @rule(prefix=only)
    def drop_grads(self, prefix):
        self.state.drop("grads", only=self._only(prefix))
        for p_name, p in self.ref_model.named_parameters(remove_duplicate=False):
            if prefix is None or p_name.startswith(prefix):
                p.grad.zero_()

    @rule(target=snapshots, groups=st.one_of(st.none(), group_sets), tag=st.sampled_from(["a", "b", "c"]),
          placement=st.sampled_from(["host", "device"]))
    def snapshot(self, groups, tag, placement):
        snap = self.state.snapshot(groups, tag=tag, placement=placement)
        ref = reference_values(self.ref_model, self.ref_opt)
        names = {m.name for p in snap.parts for s in p.layout.slots for m in s.members}
        self.expected[id(snap)] = {n: ref[n].detach().clone() for n in names}
        return snap

    @rule(target=snapshots, groups=group_sets, tag=st.sampled_from(["a", "b", "c"]))
    def snapshot_while_offloaded(self, groups, tag):
        """The pi_old pattern: the snapshot shares the homes copy-on-write."""
        self.state.offload(groups)
        return self.snapshot(groups, tag, "host")

    @rule(snap=snapshots)
    def restore(self, snap):
        if snap.released:
            return
        self.state.restore(snap)
        ref = reference_values(self.ref_model, self.ref_opt)
        with torch.no_grad():
            for name, value in self.expected[id(snap)].items():
                ref[name].copy_(value)

    @rule(snap=snapshots)
    def swapped_forward(self, snap):
        if snap.released:
            return
        want = self.expected[id(snap)]
        with self.state.swapped(snap):
            got = snap.tensors()  # the snapshot itself is unchanged
            inside = self._read(snap.groups)
        for name in want:
            assert torch.equal(got[name].cpu(), want[name].cpu()), name
            assert torch.equal(inside[name].cpu(), want[name].cpu()), name

    @rule(snap=consumes(snapshots))
    def release(self, snap):
        self.state.release(snap)
        try:
            self.state.restore(snap)
        except ReleasedSnapshotError:
            pass
        else:
            raise AssertionError("restore of a released snapshot did not raise")

    @rule()
    def train(self):
        self.state.onload()
        self.step += 1
        loss = train_step(self.model, self.opt, self.step)
        ref_loss = train_step(self.ref_model, self.ref_opt, self.step)
        assert loss == ref_loss

    @invariant()
    def snapshots_never_change(self):
        """Rule 2: a live snapshot's values are the ones it was taken with, whatever happened since."""
        for snap in list(self.state.snapshots):
            if snap.tag.startswith("_"):
                continue
            want = self.expected[id(snap)]
            got = snap.tensors()
            for name, value in want.items():
                assert torch.equal(got[name].cpu(), value.cpu()), f"snapshot {snap.tag!r} changed at {name}"

    @invariant()
    def matches_reference(self):
        got = self._read(GROUPS)
        ref = reference_values(self.ref_model, self.ref_opt)
        assert got.keys() == ref.keys()
        for name, value in ref.items():
            assert torch.equal(got[name].cpu(), value.detach().cpu()), f"divergence at {name}"

    def _read(self, groups) -> dict[str, torch.Tensor]:
        snap = self.state.snapshot(groups, tag="_read")
        try:
            return snap.tensors()
        finally:
            self.state.release(snap)

    def teardown(self) -> None:
        self.state.close()


Verbs.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestVerbs = Verbs.TestCase

_ = (SMALL, batch)
