"""The torch APIs LLEP reads that are internal or renamed between torch releases, in one place."""

from __future__ import annotations

import torch
import torch.distributed as dist

_current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass (torch 2.x)

# torch 2.13 renamed all_gather_into_tensor (same signature); older torch has only the old name
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def running_backward() -> bool:
    """Whether this thread is executing a backward pass (an autograd graph task) now. A forward
    with grad enabled inside a backward is an activation recompute (Megatron's checkpoint runs it
    in its node's backward; so does torch's reentrant checkpoint)."""
    return _current_graph_task_id() != -1
