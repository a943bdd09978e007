"""Megatron-LM PR #7488's token-imbalance workloads W0-W7 as forced routing
(:func:`token_imbalance_topk`): the routing contract, determinism, and the property each isolates."""

import numpy as np
import pytest

from megatron_llep.planning.scenarios import (TOKEN_IMBALANCE_WORKLOADS, _distinct_draws, token_imbalance_counts,
                                              token_imbalance_sources, token_imbalance_topk)

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release

N, K, T = 64, 4, 4096
WIDTH = max(K, N // 4)


def hot_rows(num_tokens=T):
    return np.arange(num_tokens) % 4 != 0


@pytest.mark.parametrize("workload", TOKEN_IMBALANCE_WORKLOADS)
@pytest.mark.parametrize("experts, topk", [(8, 1), (8, 2), (8, 4), (64, 4), (384, 8), (16, 16)])
def test_every_row_holds_topk_distinct_experts_in_range(workload, experts, topk):
    for step in (0, 3):
        ids = token_imbalance_topk(workload, 1000, experts, topk, seed=5, step=step)
        assert ids.shape == (1000, topk) and ids.dtype.kind == "i"
        assert ids.min() >= 0 and ids.max() < experts
        ordered = np.sort(ids, axis=1)
        assert (ordered[:, 1:] != ordered[:, :-1]).all()


@pytest.mark.parametrize("workload", TOKEN_IMBALANCE_WORKLOADS)
def test_routing_is_a_function_of_workload_seed_and_step(workload):
    a = token_imbalance_topk(workload, T, N, K, seed=7, step=2)
    np.testing.assert_array_equal(a, token_imbalance_topk(workload, T, N, K, seed=7, step=2))
    if workload != "W0_balanced":  # round-robin has no randomness
        assert not np.array_equal(a, token_imbalance_topk(workload, T, N, K, seed=8, step=2))
    # the EP layout only groups the tokens: every layout counts the same global histogram
    histogram = np.bincount(token_imbalance_topk(workload, 64 * 32, N, K, seed=7, step=2).ravel(), minlength=N)
    for ep in (1, 2, 8, 64):
        counts = token_imbalance_counts(workload, ep, 64 * 32 // ep, N, K, seed=7, step=2)
        assert counts.shape == (ep, N)
        np.testing.assert_array_equal(counts.sum(axis=0), histogram)


def test_unknown_workload_is_rejected():
    with pytest.raises(ValueError, match="unknown workload"):
        token_imbalance_topk("W9", 8, N, K)


def test_w0_is_exactly_balanced():
    loads = np.bincount(token_imbalance_topk("W0_balanced", T, N, K).ravel(), minlength=N)
    assert loads.max() == loads.min() == T * K // N


def test_w1_hot_set_is_fixed_across_steps_and_not_a_block():
    sets = [np.unique(token_imbalance_topk("W1_hot_expert_set", T, N, K, seed=3, step=s)[hot_rows()]) for s in range(4)]
    for s in sets[1:]:
        np.testing.assert_array_equal(s, sets[0])
    assert sets[0].size == WIDTH and not np.array_equal(sets[0], np.arange(WIDTH))


def test_w1_and_w2_have_the_same_heat_and_differ_in_placement():
    ep = 8
    w1 = token_imbalance_counts("W1_hot_expert_set", ep, T // ep, N, K, seed=1)
    w2 = token_imbalance_counts("W2_hot_rank", ep, T // ep, N, K, seed=1)
    heat = [np.sort(c.sum(axis=0))[::-1][:WIDTH].sum() / c.sum() for c in (w1, w2)]
    assert abs(heat[0] - heat[1]) < 0.02
    rank_peak = [c.sum(axis=0).reshape(ep, -1).sum(axis=1).max() for c in (w1, w2)]
    assert rank_peak[1] > 1.3 * rank_peak[0]  # the block lands on the fewest ranks


def test_w2_hot_rows_stay_in_the_block_and_w3_spreads_it():
    w2 = token_imbalance_topk("W2_hot_rank", T, N, K)
    assert w2[hot_rows()].max() < WIDTH
    w3 = token_imbalance_topk("W3_spread_hot_experts", T, N, K)
    assert (w3[hot_rows()] % 2 == 0).all()
    ep = 8  # every rank owns hot experts: rank loads near even
    loads = token_imbalance_counts("W3_spread_hot_experts", ep, T // ep, N, K).sum(axis=0).reshape(ep, -1).sum(axis=1)
    assert loads.max() / loads.mean() < 1.1


def test_w4_ragged_sources_balanced_destinations():
    ep = 8
    sources = token_imbalance_sources("W4_source_ragged", T, ep)
    per_rank = np.bincount(sources, minlength=ep)
    assert per_rank.sum() == T and (np.diff(per_rank) > 0).all()
    assert abs(per_rank[-1] / per_rank[0] - ep) < 0.1
    even = np.bincount(token_imbalance_sources("W1_hot_expert_set", T, ep), minlength=ep)
    assert even.max() - even.min() <= 1
    counts = token_imbalance_counts("W4_source_ragged", ep, T // ep, N, K)
    np.testing.assert_array_equal(counts.sum(axis=1), per_rank * K)
    loads = counts.sum(axis=0).reshape(ep, -1).sum(axis=1)
    assert loads.max() / loads.mean() < 1.1


def test_w5_first_half_of_the_experts_is_never_selected():
    ids = token_imbalance_topk("W5_zero_expert_rank", T, N, K)
    assert ids.min() >= N // 2
    loads = np.bincount(ids.ravel(), minlength=N)
    assert loads.max() / loads.mean() >= 1.9


def test_w6_hotspot_moves_every_three_steps():
    blocks = [np.unique(token_imbalance_topk("W6_rotating_hotspot", T, N, K, step=s)[hot_rows()]) for s in range(6)]
    for s in range(6):
        np.testing.assert_array_equal(blocks[s], (s // 3) * WIDTH + np.arange(WIDTH))


def test_w7_bursts_on_every_fourth_step():
    for step in range(8):
        ids = token_imbalance_topk("W7_burst", T, N, K, step=step)
        loads = np.bincount(ids.ravel(), minlength=N)
        if step % 4 == 3:
            assert ids[::2].max() < WIDTH and loads.max() / loads.mean() > 2
        else:
            assert loads.max() / loads.mean() < 1.3


def test_distinct_draws_are_uniform():
    rng = np.random.default_rng(0)
    pool = np.arange(10, 30)
    picks = _distinct_draws(rng, 20000, pool, 5)
    frequency = np.bincount(picks.ravel() - 10, minlength=20) / picks.size
    assert np.abs(frequency - 1 / 20).max() < 0.004
    first = np.bincount(picks[:, 0] - 10, minlength=20) / 20000  # every position uniform too
    assert np.abs(first - 1 / 20).max() < 0.01
