"""Forced routing scenarios ("f into h experts"), a test and benchmark tool: never evidence.

Scenario "f into h": a fraction ``f`` of tokens takes ``min(h, K)`` of the ``h`` hot experts
(uniformly, distinct) into its top-K and fills the other slots uniformly from the remaining
experts; the other tokens pick K distinct experts uniformly among the non-hot ones. ``f = 0`` (or
``h = 0``) is the balanced, uniform case. Hot experts are ``0..h-1`` by default: contiguous ids
share a native rank, the worst case for plain EP.

Megatron-LM PR #7488's token-imbalance workloads W0-W7 (:func:`token_imbalance_topk`,
:func:`token_imbalance_counts`): each isolates one kind of skew (expert heat, rank placement,
source raggedness, zero-load experts, a moving hotspot, a burst), routing fixed by
``(workload, seed, step)``.
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


# Megatron-LM PR #7488 (benchmarks/moe/token_imbalance): its token-imbalance workloads W0-W7.
TOKEN_IMBALANCE_WORKLOADS = (
    "W0_balanced",
    "W1_hot_expert_set",
    "W2_hot_rank",
    "W3_spread_hot_experts",
    "W4_source_ragged",
    "W5_zero_expert_rank",
    "W6_rotating_hotspot",
    "W7_burst",
)


def _workload_rng(workload: str, seed: int, step: int) -> np.random.Generator:
    """A generator seeded by ``(workload, seed, step)`` alone (stable across runs and platforms;
    ``step = -1``: what is fixed across steps)."""
    import zlib

    return np.random.default_rng([zlib.crc32(workload.encode()), seed, step + 1])


def _distinct_draws(rng: np.random.Generator, rows: int, pool: np.ndarray, k: int) -> np.ndarray:
    """``rows`` uniform draws of ``k`` distinct elements of ``pool``, without a ``rows x pool`` array:
    the ``j``-th pick is uniform over the ``n - j`` elements left, mapped past the earlier picks."""
    picks = np.empty((rows, k), np.int64)
    for j in range(k):
        x = rng.integers(0, pool.size - j, size=rows)
        for earlier in np.sort(picks[:, :j], axis=1).T:  # ascending: each skip can enable the next
            x += x >= earlier
        picks[:, j] = x
    return pool[picks]


def token_imbalance_topk(workload: str, num_tokens: int, num_experts: int, topk: int, seed: int = 0,
                         step: int = 0) -> np.ndarray:
    """Expert ids ``[num_tokens, topk]`` of one of Megatron-LM PR #7488's token-imbalance workloads.

    Follows the PR's definitions (its README and ``routing_for_step``), in this implementation:
    routing is a function of ``(workload, seed, step)`` alone, never of the EP layout, and every
    row holds exactly ``topk`` distinct experts. With ``w = max(topk, N // 4)`` hot experts, a token
    ``t`` with ``t % 4 != 0`` (three in four) draws its experts from the hot set, the others from all:

    * ``W0_balanced``: round-robin, token ``t`` takes experts ``(t * topk + j) % N``: every expert
      equal when ``num_tokens * topk`` is a multiple of ``N``;
    * ``W1_hot_expert_set``: a fixed set of ``w`` experts, drawn once from the seed (per-expert
      skew). The PR's generator draws W1 from the same contiguous block as W2; a seeded set keeps
      W1's heat and lets W1 and W2 differ by placement alone, as the PR's README describes them;
    * ``W2_hot_rank``: the contiguous block ``0 .. w-1`` (hot experts sharing native ranks: per-rank
      skew at the heat of W1);
    * ``W3_spread_hot_experts``: the hot pool is every other expert (``0, 2, 4, ...``, ``N // 2``
      of them): the hotspot spread across ranks;
    * ``W4_source_ragged``: experts uniform over all; the skew is in how many tokens each source
      rank routes (:func:`token_imbalance_sources`);
    * ``W5_zero_expert_rank``: experts uniform over ``N // 2 .. N-1``: the first half never selected,
      their native ranks receive nothing;
    * ``W6_rotating_hotspot``: W2's block moved by ``w`` every 3 steps (``(step // 3) * w``);
    * ``W7_burst``: uniform, except at every fourth step (``step % 4 == 3``), where even tokens draw
      from W2's block.
    """
    if workload not in TOKEN_IMBALANCE_WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(TOKEN_IMBALANCE_WORKLOADS)}")
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk must be in 1..num_experts={num_experts}, got {topk}")
    tokens = np.arange(num_tokens)
    if workload == "W0_balanced":
        return (tokens[:, None] * topk + np.arange(topk)[None, :]) % num_experts
    rng = _workload_rng(workload, seed, step)
    everyone = np.arange(num_experts)
    width = max(topk, num_experts // 4)
    hot_tokens = tokens % 4 != 0
    if workload == "W1_hot_expert_set":  # fixed across steps: drawn from the workload and seed alone
        hot = np.sort(_workload_rng(workload, seed, -1).permutation(num_experts)[:width])
    elif workload in ("W2_hot_rank", "W7_burst"):
        hot = np.arange(width) % num_experts
    elif workload == "W3_spread_hot_experts":
        hot = np.unique((2 * np.arange(max(topk, num_experts // 2))) % num_experts)
        hot = hot if hot.size >= topk else everyone
    elif workload == "W6_rotating_hotspot":
        hot = ((step // 3) * width + np.arange(width)) % num_experts
    else:  # W4, W5: one pool for every token
        pool = everyone if workload == "W4_source_ragged" else (everyone[num_experts // 2:] if num_experts > 1 else everyone)
        if pool.size < topk:
            pool = everyone
        return _distinct_draws(rng, num_tokens, pool, topk)
    if workload == "W7_burst":
        hot_tokens = (tokens % 2 == 0) if step % 4 == 3 else np.zeros(num_tokens, bool)
    hot = np.unique(hot)
    ids = np.empty((num_tokens, topk), np.int64)
    ids[hot_tokens] = _distinct_draws(rng, int(hot_tokens.sum()), hot, topk)
    ids[~hot_tokens] = _distinct_draws(rng, int((~hot_tokens).sum()), everyone, topk)
    return ids


def token_imbalance_sources(workload: str, num_tokens: int, ep_size: int) -> np.ndarray:
    """The source rank of each of ``num_tokens`` tokens: contiguous, rank-major, as even as the count
    allows; for ``W4_source_ragged`` rank ``r`` routes a share in proportion to ``r + 1`` (the last
    rank ``ep_size`` times the first's)."""
    weights = np.arange(1, ep_size + 1) if workload == "W4_source_ragged" else np.ones(ep_size, np.int64)
    bounds = (np.cumsum(weights) * num_tokens) // weights.sum()
    return np.searchsorted(bounds, np.arange(num_tokens), side="right")


def token_imbalance_counts(workload: str, ep_size: int, tokens_per_rank: int, num_experts: int, topk: int,
                           seed: int = 0, step: int = 0) -> np.ndarray:
    """``[P, N]`` routed-token counts of a PR #7488 workload: ``ep_size * tokens_per_rank`` tokens
    (:func:`token_imbalance_topk`), each counted at its source rank (:func:`token_imbalance_sources`)."""
    num_tokens = ep_size * tokens_per_rank
    ids = token_imbalance_topk(workload, num_tokens, num_experts, topk, seed, step)
    source = token_imbalance_sources(workload, num_tokens, ep_size)
    cells = (source[:, None] * num_experts + ids).ravel()
    return np.bincount(cells, minlength=ep_size * num_experts).reshape(ep_size, num_experts)
