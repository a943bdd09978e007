"""A loop-of-matmuls stand-in for the ``grouped_gemm`` CUDA package, so Megatron's legacy
GroupedMLP (Megatron-Core < 0.17) can run (slowly, on CPU) in tests. Semantics follow
``grouped_gemm.ops.gmm``."""

from __future__ import annotations

import types

import torch

from megatron_llep.compat import mcore


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """``a`` rows split by ``batch_sizes``; chunk ``i`` times ``b[i]`` (``b[i].T`` with ``trans_b``)."""
    chunks = torch.split(a, [int(n) for n in batch_sizes.tolist()])
    outs = [chunk @ (b[i].t() if trans_b else b[i]) for i, chunk in enumerate(chunks)]
    return torch.cat(outs, dim=0)


def install() -> None:
    """Make Megatron believe grouped_gemm is installed, with :func:`gmm` as its kernel."""
    grouped_gemm_util = mcore.grouped_gemm_util()
    if grouped_gemm_util is None:
        raise RuntimeError(f"Megatron-Core {mcore.MCORE_VERSION} has no legacy GroupedMLP to run grouped_gemm for")
    module = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=gmm))
    grouped_gemm_util.grouped_gemm = module
    grouped_gemm_util.ops = module.ops
