"""The one "true on every rank?" question that collective plug-ins and the pi_old cycle ask."""

from __future__ import annotations

import torch


def on_every_rank(flag: bool) -> bool:
    """``flag`` if this process is alone; else whether ``flag`` is true on every rank of the default group.

    A collective (one all-reduce over the default group): call it on every rank, at the same
    point, with the same ``torch.distributed`` set-up, or the ranks wait for each other forever.
    Its tensor lives where the backend can reduce it: the current CUDA device under NCCL, else the CPU.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = (
        torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    )
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
