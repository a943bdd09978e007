"""The LLEP planner against its contract (SPEC section 1, step 3), with no process group."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_llep.config import LLEPConfig
from megatron_llep.cost_model import CostModel, ExpertShape
from megatron_llep.planner import chunk_gather_index, plan_llep, rank_loads
from megatron_llep.scenarios import imbalanced_topk

NO_COST = dict(cost_aware=False)


def counts_from_ids(ids_per_rank, num_experts):
    return np.stack([np.bincount(ids.ravel(), minlength=num_experts) for ids in ids_per_rank])


@st.composite
def count_matrices(draw):
    ep = draw(st.sampled_from([1, 2, 3, 4, 8]))
    local = draw(st.integers(1, 4))
    experts = ep * local
    skew = draw(st.sampled_from(["uniform", "hot", "sparse", "single"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    if skew == "uniform":
        counts = rng.integers(0, 40, size=(ep, experts))
    elif skew == "hot":
        counts = rng.integers(0, 5, size=(ep, experts))
        counts[:, draw(st.integers(0, experts - 1))] += rng.integers(0, 400, size=ep)
    elif skew == "sparse":
        counts = rng.integers(0, 200, size=(ep, experts)) * (rng.random((ep, experts)) < 0.2)
    else:
        counts = np.zeros((ep, experts), np.int64)
        counts[:, draw(st.integers(0, experts - 1))] = rng.integers(0, 300, size=ep)
    return counts.astype(np.int64)


configs = st.builds(
    LLEPConfig,
    alpha=st.sampled_from([1.0, 1.1, 1.5]),
    min_chunk_tokens=st.sampled_from([0, 1, 4, 16, 64]),
    imbalance_threshold=st.sampled_from([1.0, 1.3, 2.0]),
    cost_aware=st.just(False),
)


def assignment(plan):
    """tokens[e, dst] computed where, rebuilt from the full chunk list."""
    out = np.zeros((plan.num_experts, plan.ep_size), np.int64)
    for e, _, dst, count in plan.token_chunks():
        out[e, dst] += count
    return out


@settings(max_examples=300, deadline=None)
@given(count_matrices(), configs)
def test_every_routed_token_is_assigned_exactly_once(counts, config):
    plan = plan_llep(counts, config)
    sent = np.zeros_like(counts)
    for e, src, _, count in plan.token_chunks():
        sent[src, e] += count
    np.testing.assert_array_equal(sent, counts)
    np.testing.assert_array_equal(assignment(plan).sum(axis=1), counts.sum(axis=0))
    np.testing.assert_array_equal(assignment(plan).sum(axis=0), plan.rank_loads_after)


@settings(max_examples=300, deadline=None)
@given(count_matrices(), configs)
def test_max_rank_load_within_capacity_plus_m(counts, config):
    plan = plan_llep(counts, config)
    if plan.fallback:
        ratio = plan.rank_loads_before.max() * plan.ep_size / max(counts.sum(), 1)
        assert ratio < config.imbalance_threshold or counts.sum() == 0 or plan.ep_size == 1
        return
    # integer tokens: some rank carries at least ceil(cap) when alpha == 1
    assert plan.rank_loads_after.max() <= np.ceil(plan.capacity) + config.min_chunk_tokens
    assert plan.rank_loads_after.max() <= plan.rank_loads_before.max()


@settings(max_examples=200, deadline=None)
@given(count_matrices(), configs)
def test_rank_views_agree_pairwise(counts, config):
    plan = plan_llep(counts, config)
    views = [plan.rank_view(r) for r in range(plan.ep_size)]
    for src in range(plan.ep_size):
        for dst in range(plan.ep_size):
            np.testing.assert_array_equal(views[src].send_counts[:, dst], views[dst].recv_counts[src])
    for view in views:
        np.testing.assert_array_equal(view.send_counts.sum(axis=1), counts[view.rank])
        borrowed = {e for e, _ in view.weights_to_receive}
        computed = set(np.flatnonzero(view.recv_counts.sum(axis=0)).tolist())
        native = set(range(view.rank * plan.num_local_experts, (view.rank + 1) * plan.num_local_experts))
        assert computed - native == borrowed
        assert all(view.tokens_per_slot[view.num_native_slots :] > 0)
    # every weight sent is received by exactly the helper that computes it
    sends = sorted((e, v.rank, h) for v in views for e, h in v.weights_to_send)
    receives = sorted((e, n, v.rank) for v in views for e, n in v.weights_to_receive)
    assert sends == receives


@settings(max_examples=200, deadline=None)
@given(count_matrices(), configs)
def test_dispatch_layout_delivers_every_token_to_its_slot(counts, config):
    """Simulate the a2a with labelled tokens: every token reaches a slot of its own expert, and the
    inverse permutations bring every token back to its place."""
    plan = plan_llep(counts, config)
    views = [plan.rank_view(r) for r in range(plan.ep_size)]
    ep, experts = counts.shape
    # expert-major buffers like Megatron's permute: label = (src, expert, index)
    local = [np.array([(r, e, i) for e in range(experts) for i in range(counts[r, e])], np.int64).reshape(-1, 3) for r in range(ep)]
    sent = [local[r][views[r].send_order()] for r in range(ep)]
    blocks = [np.split(sent[r], np.cumsum(views[r].input_splits)[:-1]) for r in range(ep)]
    received = [np.concatenate([blocks[src][dst] for src in range(ep)]) for dst in range(ep)]
    for dst, view in enumerate(views):
        slotted = received[dst][view.recv_order()]
        bounds = np.cumsum(view.tokens_per_slot)[:-1]
        for expert, rows in zip(view.slot_experts, np.split(slotted, bounds)):
            assert (rows[:, 1] == expert).all()
        back = np.empty_like(slotted)
        back[view.recv_order()] = slotted
        np.testing.assert_array_equal(back, received[dst])
    for r in range(ep):
        back = np.empty_like(sent[r])
        back[views[r].send_order()] = sent[r]
        np.testing.assert_array_equal(back, local[r])


def test_balanced_routing_gives_plain_ep():
    ids = [imbalanced_topk(4096, 32, 4, 0.0, 0, seed=s) for s in range(8)]
    plan = plan_llep(counts_from_ids(ids, 32), LLEPConfig(**NO_COST))
    assert plan.fallback and plan.is_plain_ep
    assert plan.num_weight_transfers == 0 and plan.spilled_tokens == 0


def test_exactly_even_load_is_plain_even_at_lambda_one():
    counts = np.full((4, 8), 10, np.int64)
    plan = plan_llep(counts, LLEPConfig(imbalance_threshold=1.0, min_chunk_tokens=0, **NO_COST))
    assert plan.is_plain_ep
    np.testing.assert_array_equal(plan.rank_loads_after, [80, 80, 80, 80])


def test_hot_expert_is_spilled_to_least_loaded_ranks():
    ids = [imbalanced_topk(2048, 32, 4, 0.95, 1, seed=s) for s in range(8)]
    counts = counts_from_ids(ids, 32)
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=64, **NO_COST))
    assert not plan.is_plain_ep
    before = rank_loads(counts, 4)
    assert before.max() / before.mean() > 2.0
    assert plan.rank_loads_after.max() <= np.ceil(plan.capacity) + 64
    assert set(plan.transfer_expert.tolist()) == {0}
    assert (plan.transfer_native == 0).all()


def test_helper_takes_its_own_routed_tokens_first():
    counts = np.array([[100, 0, 0, 0], [60, 0, 0, 0]], np.int64)  # expert 0 lives on rank 0
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=0, **NO_COST))
    chunks = {(int(e), int(s), int(d)): int(c) for e, s, d, c in plan.token_chunks()}
    # rank 1 computes 80 tokens of expert 0: its own 60 plus 20 from rank 0
    assert chunks == {(0, 0, 0): 80, (0, 1, 1): 60, (0, 0, 1): 20}
    assert plan.moved_tokens() == 20  # plain EP would move rank 1's 60


def test_small_remainder_stays_native():
    counts = np.array([[110, 0, 0, 0], [0, 0, 90, 0]], np.int64)  # rank loads 110 / 90, cap 100
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=16, imbalance_threshold=1.0, **NO_COST))
    assert plan.is_plain_ep and not plan.fallback  # a 10-token spill is below m
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=4, imbalance_threshold=1.0, **NO_COST))
    np.testing.assert_array_equal(plan.rank_loads_after, [100, 100])


def test_helpers_inside_the_native_node_are_preferred():
    counts = np.zeros((4, 8), np.int64)
    counts[0, 0] = 120  # expert 0 on rank 0
    counts[1, 2] = 20  # rank 1 is busier than ranks 2 and 3
    config = dict(alpha=1.5, min_chunk_tokens=8, imbalance_threshold=1.0, **NO_COST)
    one_node = plan_llep(counts, LLEPConfig(**config))
    assert set(one_node.transfer_helper.tolist()) == {2, 3}  # least loaded first
    two_nodes = plan_llep(counts, LLEPConfig(ranks_per_node=2, **config))  # ranks 0-1 share a node
    assert set(two_nodes.transfer_helper.tolist()) == {1, 2}
    assert two_nodes.rank_loads_after.max() <= np.ceil(two_nodes.capacity) + 8


def test_all_ranks_full_still_assigns_every_token():
    counts = np.array([[50, 0], [50, 0]], np.int64)  # alpha < 1 makes the capacity impossible
    plan = plan_llep(counts, LLEPConfig(alpha=0.5, min_chunk_tokens=0, imbalance_threshold=1.0, **NO_COST))
    assert plan.rank_loads_after.sum() == 100
    assert plan.rank_loads_after.max() < 100


def test_cost_model_vetoes_unprofitable_spills():
    counts = np.zeros((8, 32), np.int64)
    counts[:, 0] = 512
    shape = ExpertShape(hidden_size=2880, ffn_hidden_size=2880, bias=True)
    slow_links = CostModel(intra_node_gbps=0.01, inter_node_gbps=0.01)
    vetoed = plan_llep(counts, LLEPConfig(min_chunk_tokens=1, cost_model=slow_links), shape)
    assert vetoed.is_plain_ep
    fast_links = CostModel(intra_node_gbps=1e6, inter_node_gbps=1e6, link_latency_s=0.0)
    spilled = plan_llep(counts, LLEPConfig(min_chunk_tokens=1, cost_model=fast_links), shape)
    assert spilled.num_weight_transfers > 0
    with pytest.raises(ValueError, match="expert shape"):
        plan_llep(counts, LLEPConfig())


def test_plan_is_deterministic():
    ids = [imbalanced_topk(1024, 64, 8, 0.8, 4, seed=s) for s in range(8)]
    counts = counts_from_ids(ids, 64)
    a = plan_llep(counts, LLEPConfig(min_chunk_tokens=8, **NO_COST))
    b = plan_llep(counts.copy(), LLEPConfig(min_chunk_tokens=8, **NO_COST))
    np.testing.assert_array_equal(a.token_chunks(), b.token_chunks())
    np.testing.assert_array_equal(a.transfer_helper, b.transfer_helper)


@pytest.mark.parametrize(
    "counts, message",
    [
        (np.zeros((2, 3), np.int64), "not divisible"),
        (np.zeros(4, np.int64), "matrix"),
        (np.zeros((2, 4)), "integers"),
        (-np.ones((2, 4), np.int64), "non-negative"),
    ],
)
def test_bad_counts_are_rejected(counts, message):
    with pytest.raises((ValueError, TypeError), match=message):
        plan_llep(counts, LLEPConfig(**NO_COST))


def test_chunk_gather_index_matches_naive_concatenation():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 5, size=12)
    order = rng.permutation(12)
    starts = np.cumsum(sizes) - sizes
    naive = np.concatenate([np.arange(starts[c], starts[c] + sizes[c]) for c in order])
    np.testing.assert_array_equal(chunk_gather_index(sizes, order), naive)
    with pytest.raises(ValueError):
        chunk_gather_index(np.array([1, 2]), np.array([1]))


@settings(max_examples=100, deadline=None)
@given(count_matrices(), configs)
def test_moved_tokens_counts_cross_rank_chunks(counts, config):
    plan = plan_llep(counts, config)
    chunks = plan.token_chunks()
    assert plan.moved_tokens() == int(chunks[chunks[:, 1] != chunks[:, 2], 3].sum())
