"""Run Megatron-Core's MoE stack on CPU with the gloo backend — for tests and CPU demos only.

Megatron-Core 0.16 assumes CUDA in a handful of places (side streams in the alltoall dispatcher,
``torch.cuda.current_device()`` used as a device, CUDA RNG state, hard-coded ``device="cuda"`` in
the optimizer, grad scaler, clip_grads and grad buffers; CUDA tensors asserted by text generation's
pipeline-stage communication). :func:`enable` patches exactly those places so that the real MoELayer,
GPTModel, DDP, the distributed optimizer, activation recompute and Megatron's static text generation
run on CPU.

The patches are process-wide and refuse to install when CUDA is available, so this module is inert
on GPU machines. Never import it from library code paths that run in production.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: "_CudaToCpuMode | None" = None

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
}


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered, so every call is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullEvent":
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0


class _NullEvent:
    """Stands in for ``torch.cuda.Event``; records the wall clock, so that ``elapsed_time`` works
    (Megatron's static text generation times every decode step with events)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._recorded_at = time.perf_counter()

    def record(self, stream: Any = None) -> None:
        self._recorded_at = time.perf_counter()

    def elapsed_time(self, end_event: "_NullEvent") -> float:
        """Milliseconds from this event's record to ``end_event``'s, as CUDA events report them."""
        return (end_event._recorded_at - self._recorded_at) * 1e3

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_NULL_STREAM = _NullStream()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU: ``device="cuda"``, ``.cuda()``, ``pin_memory=True`` and the
    CUDA type names Megatron's optimizers assert on."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        # every torch call of the process passes here: the common case (no special function, no
        # device or pin_memory keyword) returns after two checks
        if func in _SPECIAL_FUNCTIONS:
            if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return _CUDA_TYPE_NAMES.get(name, name)
            if func is torch.Tensor.to and args:
                args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        if not kwargs:
            return func(*args)
        if "device" in kwargs or "pin_memory" in kwargs:
            kwargs = dict(kwargs)
            if "device" in kwargs and (_is_cuda_device(kwargs["device"]) or isinstance(kwargs["device"], int)):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return func(*args, **kwargs)


_SPECIAL_FUNCTIONS = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.type, torch.Tensor.to})


def _cpu_as_numpy_maybe_move_tensor_to_cpu(original: Callable) -> Callable:
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        tensor = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(tensor):
            tensor = tensor.numpy()
        return tensor

    return maybe_move_tensor_to_cpu


def _is_present(tensor: Any) -> None:
    """Megatron's inference ``_is_cuda`` check without its CUDA part."""
    assert tensor is not None


def enable() -> bool:
    """Install the CPU patches once per process. Returns False (and patches nothing) under CUDA."""
    global _ENABLED, _MODE
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    torch._dynamo.config.disable = True  # megatron.core.jit would otherwise build C++ on CPU

    torch.cuda.Stream = _NullStream  # type: ignore[misc]
    torch.cuda.Event = _NullEvent  # type: ignore[misc]
    torch.cuda.current_stream = lambda device=None: _NULL_STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _NULL_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    patched = _cpu_as_numpy_maybe_move_tensor_to_cpu(moe_utils.maybe_move_tensor_to_cpu)
    moe_utils.maybe_move_tensor_to_cpu = patched
    token_dispatcher.maybe_move_tensor_to_cpu = patched

    from megatron.core.inference import communication_utils

    # text generation's pipeline-stage send/receive/broadcast assert CUDA tensors; gloo moves CPU ones
    communication_utils._is_cuda = _is_present

    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    # A backward pass runs outside the mode (Tensor.backward reaches autograd's engine from the mode's
    # own handler), so activation recompute, which runs the forward again there, enters it again
    recompute = mcore_random.CheckpointFunction.backward

    def recompute_on_cpu(ctx, *args):
        with _MODE:
            return recompute(ctx, *args)

    mcore_random.CheckpointFunction.backward = staticmethod(recompute_on_cpu)
    _ENABLED = True
    return True


def is_enabled() -> bool:
    """Whether :func:`enable` installed the CPU patches in this process."""
    return _ENABLED
