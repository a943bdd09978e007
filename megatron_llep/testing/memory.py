"""Deterministic accounting of live tensor memory: every tensor storage an operator allocates while
a :class:`LiveTensors` mode is active is recorded with its size and creation site, and it counts as
live until its storage is freed (a weak reference to the storage expires). The peak of the live
bytes and the tensors alive at that moment do not depend on the allocator, the machine's load or
glibc, unlike the process's resident set.

What is counted: storages created by operators inside the mode (forward, and the backward when it
runs inside the mode: autograd's engine carries the mode to the ops it runs). Parameters, inputs
and other tensors that existed before are not counted (outputs that alias an input are views).
The live set is re-checked after each operator, so a buffer freed between two operators is seen
freed at the next one: the peak is that of the live set at operator boundaries, which is where
allocations happen.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.multiprocessing.reductions import StorageWeakRef

_SITE_DIRS = (os.sep + "megatron_llep" + os.sep, os.sep + "megatron" + os.sep)
_SKIP_FILES = (os.path.join("megatron_llep", "testing", "memory.py"), os.path.join("compat", "cpu_gloo.py"))


def _site(depth: int = 2) -> str:
    """The innermost ``depth`` Python frames in megatron_llep or megatron (``file:line function``)."""
    frames = []
    frame = sys._getframe(2)
    while frame is not None and len(frames) < depth:
        name = frame.f_code.co_filename
        if any(d in name for d in _SITE_DIRS) and not name.endswith(_SKIP_FILES):
            short = name[name.rfind(os.sep + "megatron") + 1 :]
            frames.append(f"{short}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(frames) if frames else "(outside megatron)"


@dataclass
class Allocation:
    nbytes: int
    shape: tuple
    dtype: str
    op: str
    site: str
    phase: str
    node: str = ""  # the autograd node running it, in backward

    def key(self) -> str:
        where = self.node if self.phase == "backward" and self.node else self.site
        return f"{self.phase}: {self.op} @ {where}"

    def as_dict(self) -> dict:
        return {"bytes": self.nbytes, "shape": list(self.shape), "dtype": self.dtype, "op": self.op,
                "site": self.site, "phase": self.phase, "node": self.node}


@dataclass
class Peak:
    bytes: int = 0
    op_index: int = -1
    op: str = ""
    phase: str = ""
    live: list = field(default_factory=list)  # the Allocations alive at the peak


class LiveTensors(TorchDispatchMode):
    """Records every storage allocated by an operator while active; tracks live bytes and their peak.

    ``phase`` (a free label, e.g. ``"forward"`` / ``"backward"``) is stamped on each allocation."""

    def __init__(self, stacks: bool = True) -> None:
        super().__init__()
        self.stacks = stacks
        self.phase = "forward"
        self._live: dict[int, tuple[StorageWeakRef, Allocation]] = {}
        self.live_bytes = 0
        self.peak = Peak()
        self.ops = 0
        self.allocated_bytes = 0
        self._phase_peaks: dict[str, int] = {}

    def phase_peak(self, phase: str) -> int:
        return self._phase_peaks.get(phase, 0)

    def _sweep(self) -> None:
        dead = [ptr for ptr, (ref, _) in self._live.items() if ref.expired()]
        for ptr in dead:
            self.live_bytes -= self._live.pop(ptr)[1].nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self._sweep()
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        if not aliasing:
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.device.type != "meta"}
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0 or ptr in inputs or ptr in self._live:
                    continue
                node = ""
                if self.phase == "backward":
                    current = torch._C._current_autograd_node()
                    node = type(current).__name__ if current is not None else ""
                    if current is not None and hasattr(current, "name"):
                        node = current.name()
                alloc = Allocation(nbytes, tuple(t.shape), str(t.dtype).removeprefix("torch."), str(func.overloadpacket.__name__),
                                   _site() if self.stacks else "", self.phase, node)
                self._live[ptr] = (StorageWeakRef(storage), alloc)
                self.live_bytes += nbytes
                self.allocated_bytes += nbytes
        if self.live_bytes > self._phase_peaks.get(self.phase, 0):
            self._phase_peaks[self.phase] = self.live_bytes
        if self.live_bytes > self.peak.bytes:
            self.peak = Peak(self.live_bytes, self.ops, str(func), self.phase, [a for _, a in self._live.values()])
        return out

    def live(self) -> list[Allocation]:
        self._sweep()
        return [a for _, a in self._live.values()]


def by_site(allocations: list[Allocation]) -> dict[str, int]:
    """Bytes per :meth:`Allocation.key`, largest first."""
    totals: dict[str, int] = {}
    for a in allocations:
        totals[a.key()] = totals.get(a.key(), 0) + a.nbytes
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def step_live_bytes(fn, backward_of: Optional[callable] = None, stacks: bool = True) -> LiveTensors:
    """Run ``out = fn()`` (forward) then ``backward_of(out)`` inside one :class:`LiveTensors`; the
    output is dropped before the backward returns, as in a training step. Returns the tracker."""
    tracker = LiveTensors(stacks=stacks)
    # the cyclic garbage collector would free tensors caught in reference cycles at moments that
    # depend on the whole process's allocations: off, such tensors count as live until the step ends
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with tracker:
            out = fn()
            if backward_of is not None:
                tracker.phase = "backward"
                backward_of(out)
            del out
    finally:
        if enabled:
            gc.enable()
    return tracker
