"""Node-aware token transport (``LLEPConfig.node_aware_tokens``): a spilled expert's tokens are matched
to their computing ranks inside each node first, and what must cross is spread over the node's
ranks. Plans are checked with no process group; exactness against Megatron's plain EP runs at EP = 4
as 2 nodes x 2 ranks and 4 nodes x 1, and at EP = 8 as 2 nodes x 4, with negative controls."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from exactness_worker import Case, run_cases
from megatron_llep.config import LLEPConfig
from megatron_llep.planning import plan_llep
from megatron_llep.testing.distributed import run_distributed

import plan_model  # noqa: E402
from common import FULL_SHAPES, SCENARIOS, sample_counts  # noqa: E402


@st.composite
def multi_node_inputs(draw):
    per_node = draw(st.sampled_from([1, 2, 4]))
    ep = per_node * draw(st.integers(2, 4))
    local = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    counts = rng.integers(0, 20, size=(ep, ep * local))
    for e in rng.choice(ep * local, size=min(ep * local, draw(st.integers(1, 3))), replace=False):
        counts[:, e] += rng.integers(0, 300, size=ep) * (rng.random(ep) < draw(st.sampled_from([0.5, 1.0])))
    config = LLEPConfig(min_chunk_tokens=draw(st.sampled_from([0, 4, 32])), ranks_per_node=per_node,
                        alpha=draw(st.sampled_from([1.0, 1.2])), imbalance_threshold=1.0, cost_aware=False)
    return counts.astype(np.int64), config


def _cross_rows(plan, per_node):
    node = np.arange(plan.ep_size) // per_node
    return int(plan.chunk_count[node[plan.chunk_src] != node[plan.chunk_dst]].sum())


@settings(max_examples=300, deadline=None)
@given(multi_node_inputs())
def test_each_spilled_expert_crosses_nodes_no_more_than_its_split_needs(inputs):
    """Per spilled expert: chunks deliver every routed token once and every destination its
    share; the rows that cross nodes are the least the split allows, sum over nodes of
    max(0, demand - supply), which the rank-order matching does not always reach."""
    counts, config = inputs
    plan = plan_llep(counts, config)
    unaware = plan_llep(counts, dataclasses.replace(config, node_aware_tokens=False))
    per_node = config.ranks_per_node
    nodes = plan.ep_size // per_node
    node = np.arange(plan.ep_size) // per_node
    for e in plan.spilled_experts.tolist():
        mine = plan.chunk_expert == e
        src, dst, count = plan.chunk_src[mine], plan.chunk_dst[mine], plan.chunk_count[mine]
        np.testing.assert_array_equal(np.bincount(src, count, plan.ep_size), counts[:, e])
        supply = np.bincount(node[src], count, nodes)
        demand = np.bincount(node[dst], count, nodes)
        assert count[node[src] != node[dst]].sum() == np.maximum(demand - supply, 0).sum()
    # the same splits (node awareness changes only the matching), and never more rows across nodes
    np.testing.assert_array_equal(plan.rank_loads_after, unaware.rank_loads_after)
    assert _cross_rows(plan, per_node) <= _cross_rows(unaware, per_node)


def test_the_cross_node_remainder_is_spread_over_the_node():
    """Real routing (the shipped trace of the pretrained model on legal text, last layer) at P = 16,
    two nodes of 8: rank-order matching piles the tokens that must cross onto a node's last
    helpers; node-aware matching spreads them, so the busiest cross-node link carries fewer rows
    (and none more than plain EP's)."""
    from recipes.runtime import routing_traces
    import real_routing

    trace = routing_traces.load("pretrained", "legal")
    layer = trace.layer(max(trace.layers))
    ep = 16
    counts = real_routing.replay_counts(layer.expert_ids, trace.num_experts,
                                        real_routing.sequence_draws(layer.num_sampled, ep, 32768, 0))
    config = LLEPConfig(ranks_per_node=8, cost_aware=False)
    node = np.arange(ep) // 8

    def busiest(plan):
        chunks = plan.token_chunks()
        crossing = chunks[node[chunks[:, 1]] != node[chunks[:, 2]]]
        return max(np.bincount(crossing[:, 1], crossing[:, 3], ep).max(), np.bincount(crossing[:, 2], crossing[:, 3], ep).max())

    aware = busiest(plan_llep(counts, config))
    unaware = busiest(plan_llep(counts, dataclasses.replace(config, node_aware_tokens=False)))
    plain = busiest(plan_llep(counts, LLEPConfig(imbalance_threshold=1e9, cost_aware=False)))
    assert aware < 0.8 * unaware and aware < plain, (aware, unaware, plain)


@pytest.mark.parametrize("ep", [16, 64])
@pytest.mark.parametrize("layer", FULL_SHAPES[:2], ids=lambda layer: layer.name)
def test_llep_moves_fewer_cross_node_rows_than_plain_ep_on_the_forced_grid(layer, ep):
    """On the plan model's forced grid across nodes (8 ranks a node), the busiest cross-node link of
    LLEP's plan carries no more token rows than plain EP's."""
    config = plan_model.ep_config(LLEPConfig(), plan_model.CostModel(), ep)
    for scenario in SCENARIOS:
        counts = sample_counts(layer, ep, scenario, seed=0)
        llep = plan_llep(counts, config, plan_model.expert_shape(layer))
        plain = plan_llep(counts, LLEPConfig(imbalance_threshold=1e9, cost_aware=False))
        assert (plan_model.predict(llep, layer, config.cost_model)["cross_node_rows"]
                <= plan_model.predict(plain, layer, config.cost_model)["cross_node_rows"]), scenario.label


# Exactness at EP = 4 laid out as 2 nodes x 2 ranks and 4 nodes x 1 rank.
def node_cases(per_node: int) -> list:
    tag = f"{4 // per_node}x{per_node}"
    return [
        Case(f"hot_95_into_1_{tag}", "hot", ranks_per_node=per_node),
        Case(f"top4_{tag}", "hot", topk=4, num_hot=4, ranks_per_node=per_node),
        Case(f"uneven_tokens_{tag}", "hot", tokens=(12, 12, 48, 48), num_hot=2, ranks_per_node=per_node),
        Case(f"borrowed_in_waves_{tag}", "hot", num_experts=32, num_hot=16, tokens=(96,) * 4, ranks_per_node=per_node),
        Case(f"gpt_oss_{tag}", "hot", topk=4, num_hot=2, gpt_oss=True, ranks_per_node=per_node),
    ]


NODE_NEGATIVE_CONTROLS = [
    Case("broken_wrong_expert_sent_2x2", "hot", topk=4, num_hot=4, ranks_per_node=2, broken="wrong_expert_sent"),
    Case("broken_gradients_not_returned_2x2", "hot", topk=4, num_hot=4, ranks_per_node=2,
         broken="gradients_not_returned"),
]
CASES = node_cases(2) + node_cases(1)
TOLERANCE = {"stock": 1e-5, "ref": 2e-5}  # as tests/runtime/test_exactness.py (fp32)


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_cases, 4, CASES + NODE_NEGATIVE_CONTROLS, timeout_s=900)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_node_aware_llep_equals_plain_ep(results, case):
    per_rank = [r[case.name] for r in results]
    assert all(r["mode"] == "llep" for r in per_rank)
    for key in ("out", "dx", "router", "experts"):
        for ref in ("stock", "ref"):
            worst = max(r[f"{key}_vs_{ref}"] for r in per_rank)
            assert worst <= TOLERANCE[ref], (key, ref, worst)


def test_two_node_cases_run_plans_that_node_awareness_changed(results):
    """The 2 x 2 cases are not the plans of rank-order matching: at least one moves tokens across
    nodes and is laid out differently because of node awareness."""
    changed = [c.name for c in node_cases(2) if results[0][c.name]["node_aware_differs"]]
    assert changed, "no 2 x 2 case exercises a node-aware plan"
    assert any(results[0][c.name]["cross_node_chunks"] > 0 for c in node_cases(2))


@pytest.mark.parametrize("case", NODE_NEGATIVE_CONTROLS, ids=lambda c: c.name)
def test_negative_controls_fail_across_nodes(results, case):
    per_rank = [r[case.name] for r in results]
    assert all(r["mode"] == "llep" for r in per_rank)
    damaged = "experts" if case.broken == "gradients_not_returned" else "out"
    for ref in ("stock", "ref"):
        assert max(r[f"{damaged}_vs_{ref}"] for r in per_rank) > 1e-2


# EP = 8 as 2 nodes x 4 ranks: 8 gloo processes, a few cases (the machine has 2 cores).
EP8_CASES = [
    Case("hot_95_into_1_2x4", "hot", num_experts=16, ranks_per_node=4),
    Case("top4_2x4", "hot", num_experts=16, topk=4, num_hot=4, ranks_per_node=4),
]
EP8_NEGATIVE_CONTROL = Case("broken_wrong_expert_sent_2x4", "hot", num_experts=16, topk=4, num_hot=4, ranks_per_node=4,
                            broken="wrong_expert_sent")


@pytest.fixture(scope="module")
def results_ep8():
    return run_distributed(run_cases, 8, EP8_CASES + [EP8_NEGATIVE_CONTROL], timeout_s=900)


@pytest.mark.parametrize("case", EP8_CASES, ids=lambda c: c.name)
def test_node_aware_llep_equals_plain_ep_at_ep8(results_ep8, case):
    per_rank = [r[case.name] for r in results_ep8]
    assert all(r["mode"] == "llep" for r in per_rank)
    for key in ("out", "dx", "router", "experts"):
        for ref in ("stock", "ref"):
            assert max(r[f"{key}_vs_{ref}"] for r in per_rank) <= TOLERANCE[ref], (key, ref)
    assert any(results_ep8[0][c.name]["node_aware_differs"] for c in EP8_CASES)


def test_negative_control_fails_at_ep8(results_ep8):
    per_rank = [r[EP8_NEGATIVE_CONTROL.name] for r in results_ep8]
    assert all(r["mode"] == "llep" for r in per_rank)
    assert max(r["out_vs_stock"] for r in per_rank) > 1e-2 and max(r["out_vs_ref"] for r in per_rank) > 1e-2
