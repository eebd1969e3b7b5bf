"""What a relayout lets go of, and what a verb refuses before it moves anything.

A tensor the model replaced or set to ``None`` is freed once a verb re-lists its group (the state keeps no
cached slot list alive); a disk window whose chunk is not word-aligned moves its staged run as bytes; a
storage made non-resizable between verbs (``t.numpy()``) is refused before the offload releases anything.
"""

from __future__ import annotations

import gc
import weakref

import torch

from stateshift import ModelState


def test_a_replaced_tensor_is_not_kept_alive_by_the_state():
    """A tensor the model let go of (a parameter replaced, e.g. ``load_state_dict(..., assign=True)``) is
    freed once a verb re-lists its group: the state must not hold its storage. A cache of the last
    offload / drop's slot list would keep slots, their tensors and storages (device memory on a GPU) alive
    until the group's next offload or drop, which may never come (snapshot / restore / swapped / onload do
    not ask it)."""
    model = torch.nn.Linear(64, 64)
    state = ModelState(model)
    state.offload()
    state.onload()
    old = weakref.ref(model.weight)
    model.weight = torch.nn.Parameter(torch.zeros(64, 64))
    state.snapshot(tag="after")  # re-lists the group: a new slot list (relayout)
    state.onload()
    gc.collect()
    assert old() is None, "the replaced weight (and its storage) is still referenced by the ModelState"


def test_grads_set_to_none_are_freed_after_an_offload_onload_cycle():
    """The same cache in a training loop: after ``offload(); onload()`` the grads of that moment stay alive
    through ``zero_grad(set_to_none=True)`` and the next backward (one extra copy of every grad, on the
    device) until the next offload or drop of ``grads``."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    state = ModelState(model, opt)
    state.offload()
    state.onload()
    old = weakref.ref(model.weight.grad)
    opt.zero_grad(set_to_none=True)
    model(torch.randn(2, 64)).sum().backward()
    state.residency()  # re-lists every group
    gc.collect()
    assert old() is None, "a grad the model set to None is still referenced by the ModelState"


def test_a_disk_offload_through_a_window_whose_chunk_is_not_word_aligned(tmp_path):
    """``disk_window_bytes=1000``: plans through the windows chunk large slots every 750 bytes, so a window
    starts at the second chunk of ``a{i}`` (arena byte 750 of it) and holds the staged run ``b{i}``, ``c{i}``
    (int64 words) 274 bytes in; where ``staged()`` cannot shift the window's start to the disk alignment it
    starts at the buffer's first byte and ``span.view(torch.int64)`` raises (storage offset 274). Any
    ``disk_window_bytes`` whose chunk is not a multiple of 8 can do this. Such a run moves as bytes."""
    model = torch.nn.Module()
    for i in range(3):  # (3 times: where the buffer's address lets a window start aligned, the next one cannot)
        model.register_parameter(f"a{i}", torch.nn.Parameter(torch.randn(250)))  # 1000 bytes: runs of 750 and 250
        model.register_parameter(f"b{i}", torch.nn.Parameter(torch.randn(16)))  # 64 bytes, 24 bytes after a{i}
        model.register_parameter(f"c{i}", torch.nn.Parameter(torch.randn(16)))  # b{i} + c{i}: one staged run
    want = {k: v.clone() for k, v in model.state_dict().items()}
    state = ModelState(model, disk_dir=tmp_path, disk_window_bytes=1000)
    state.offload(to="disk")
    state.onload()
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k])


def test_an_offload_after_numpy_refuses_before_anything_moves():
    """``t.numpy()`` (e.g. logging a parameter) marks its storage non-resizable. The slot cached
    ``releasable`` at an earlier offload; were that trusted, the next offload would release the weight, then
    raise on the bias, leaving the weight's storage released with residency ``device`` and every later verb
    raising ``StateError("foreign")``. Resizability is asked at each verb, so the offload refuses before
    anything moves."""
    model = torch.nn.Linear(4, 4)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    state = ModelState(model)
    state.offload()
    state.onload()
    model.bias.detach().numpy()
    try:
        state.offload()
    except RuntimeError:
        pass  # refusing is fine; losing the weight is not
    try:
        state.onload()
        failed = None
    except Exception as e:  # noqa: BLE001 -- (not re-raised: pytest would print the released tensors and crash)
        failed = f"{type(e).__name__}: {e}"
    assert failed is None, failed
    assert model.weight.untyped_storage().nbytes() > 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k])
