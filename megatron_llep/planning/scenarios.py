"""Forced routing scenarios ("f into h experts"), a test and benchmark tool: never evidence.

Scenario "f into h": a fraction ``f`` of tokens takes ``min(h, K)`` of the ``h`` hot experts
(uniformly, distinct) into its top-K and fills the other slots uniformly from the remaining
experts; the other tokens pick K distinct experts uniformly among the non-hot ones. ``f = 0`` (or
``h = 0``) is the balanced, uniform case. Hot experts are ``0..h-1`` by default: contiguous ids
share a native rank, the worst case for plain EP.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def _distinct_uniform(rng: np.random.Generator, rows: int, pool: np.ndarray, k: int) -> np.ndarray:
    """``rows`` draws of ``k`` distinct elements of ``pool`` (vectorised argsort of noise)."""
    if k == 0 or rows == 0:
        return np.zeros((rows, k), np.int64)
    if k > pool.size:
        raise ValueError(f"cannot pick {k} distinct experts from {pool.size}")
    picks = np.argsort(rng.random((rows, pool.size)), axis=1)[:, :k]
    return pool[picks]


def imbalanced_topk(
    num_tokens: int,
    num_experts: int,
    topk: int,
    hot_fraction: float,
    num_hot: int,
    seed: int = 0,
    hot_experts: Optional[Sequence[int]] = None,
) -> np.ndarray:
    """Expert ids ``[num_tokens, topk]`` (distinct per row) for the "f into h" scenario."""
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk must be in 1..num_experts={num_experts}, got {topk}")
    if not 0.0 <= hot_fraction <= 1.0:
        raise ValueError(f"hot_fraction must be within [0, 1], got {hot_fraction}")
    hot = np.arange(num_hot) if hot_experts is None else np.asarray(hot_experts, np.int64)
    if hot.size != num_hot or (hot.size and (hot.min() < 0 or hot.max() >= num_experts)):
        raise ValueError(f"hot experts must be {num_hot} ids within 0..{num_experts - 1}")
    rng = np.random.default_rng(seed)
    if num_hot == 0 or hot_fraction == 0.0:
        return _distinct_uniform(rng, num_tokens, np.arange(num_experts), topk)
    cold = np.setdiff1d(np.arange(num_experts), hot)
    hot_per_token = min(num_hot, topk)  # topk <= num_experts leaves enough cold experts
    is_hot = rng.random(num_tokens) < hot_fraction
    ids = np.empty((num_tokens, topk), np.int64)
    num_hot_tokens = int(is_hot.sum())
    ids[is_hot] = np.concatenate(
        [
            _distinct_uniform(rng, num_hot_tokens, hot, hot_per_token),
            _distinct_uniform(rng, num_hot_tokens, cold, topk - hot_per_token),
        ],
        axis=1,
    )
    cold_pool = cold if cold.size >= topk else np.arange(num_experts)
    ids[~is_hot] = _distinct_uniform(rng, num_tokens - num_hot_tokens, cold_pool, topk)
    return ids
