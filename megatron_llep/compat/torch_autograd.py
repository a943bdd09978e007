"""The one torch autograd internal LLEP reads: whether a backward pass is running on this thread.

A forward with grad enabled inside a backward is an activation recompute (Megatron's checkpoint
runs it in its node's backward; so does torch's reentrant checkpoint): it must take its forward's
plan instead of planning, and not count one more backward to come.
"""

from __future__ import annotations

import torch

_current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass (torch 2.x)


def running_backward() -> bool:
    """Whether this thread is executing a backward pass (an autograd graph task) now."""
    return _current_graph_task_id() != -1
