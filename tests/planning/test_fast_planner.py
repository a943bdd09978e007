"""The planner's fast path makes exactly the plans of the straightforward reference
(tests/planning/reference_planner.py, the loop version it replaced): same assignment, same token
chunks, same weight copies (sources, waves, kept flags), same capacity and loads, on the forced
grid, on random inputs (held copies, keep room, relays, budgets, cost models) and on the shipped
real routing traces. A negative control shows the comparison catches a one-element change."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_llep.config import LLEPConfig
from megatron_llep.planning import plan_llep
from megatron_llep.planning.cost_model import CostModel, ExpertShape
from megatron_llep.planning.plan import InfeasibleBudgetError

from common import FULL_SHAPES, SCENARIOS, sample_counts
from plan_model import RANKS_PER_NODE, expert_shape
from reference_planner import reference_plan_llep

ARRAYS = ("counts", "rank_loads_before", "rank_loads_after", "spilled_experts", "chunk_expert", "chunk_src",
          "chunk_dst", "chunk_count", "transfer_expert", "transfer_native", "transfer_helper", "transfer_wave",
          "transfer_source", "transfer_kept")
SCALARS = ("num_local_experts", "capacity", "fallback", "budget")
SHAPE = ExpertShape(hidden_size=64, ffn_hidden_size=64, bias=True)


def assert_same_plan(fast, slow):
    for name in SCALARS:
        assert getattr(fast, name) == getattr(slow, name), name
    for name in ARRAYS:
        a, b = np.asarray(getattr(fast, name)), np.asarray(getattr(slow, name))
        assert a.shape == b.shape and a.dtype.kind == b.dtype.kind, name
        assert np.array_equal(a, b), name


def both(counts, config, shape=None, held=None, keep_room=None):
    fast = slow = None
    try:
        fast = plan_llep(counts, config, shape, held=held, keep_room=keep_room)
    except InfeasibleBudgetError as error:
        fast = error
    try:
        slow = reference_plan_llep(counts, config, shape, held=held, keep_room=keep_room)
    except InfeasibleBudgetError as error:
        slow = error
    if isinstance(slow, Exception):
        assert isinstance(fast, Exception) and str(fast) == str(slow)
    else:
        assert_same_plan(fast, slow)
    return slow


def exact(ep):
    return LLEPConfig(alpha=1.0, min_chunk_tokens=0, imbalance_threshold=1.0, cost_aware=False,
                      ranks_per_node=min(RANKS_PER_NODE, ep))


@pytest.mark.parametrize("ep", [8, 16, 64])
@pytest.mark.parametrize("layer", FULL_SHAPES, ids=lambda layer: layer.name)
def test_same_plans_on_the_forced_grid(layer, ep):
    defaults = LLEPConfig(ranks_per_node=min(RANKS_PER_NODE, ep))
    shape = expert_shape(layer)
    rng = np.random.default_rng(ep)
    for scenario in SCENARIOS:
        counts = sample_counts(layer, ep, scenario, seed=3)
        both(counts, defaults, shape)
        both(counts, exact(ep))
        held = rng.random((layer.num_experts, ep)) < 0.02
        held[np.arange(layer.num_experts), np.arange(layer.num_experts) // (layer.num_experts // ep)] = False
        both(counts, defaults, shape, held=held, keep_room=rng.integers(0, 2, size=ep))


@st.composite
def planning_inputs(draw):
    per_node = draw(st.sampled_from([None, 1, 2, 4]))
    ep = draw(st.sampled_from([1, 2, 4, 8, 16]))
    local = draw(st.integers(1, 6))
    experts = ep * local
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    counts = rng.integers(0, draw(st.sampled_from([1, 5, 40])), size=(ep, experts))
    for e in rng.choice(experts, size=min(experts, draw(st.integers(0, 10))), replace=False):
        counts[:, e] += rng.integers(0, draw(st.sampled_from([50, 400, 5000])), size=ep)
    held = None
    if draw(st.booleans()):
        held = rng.random((experts, ep)) < draw(st.sampled_from([0.05, 0.3]))
        held[np.arange(experts), np.arange(experts) // local] = False
    room = None if draw(st.booleans()) else rng.integers(0, 3, size=ep)
    total = int(counts.sum())
    budget = draw(st.sampled_from([None, None, 1.0, 1.05, 1.3]))
    budget = None if budget is None else max(1, math.ceil(budget * total / ep))
    config = LLEPConfig(alpha=draw(st.sampled_from([1.0, 1.1, 1.5])),
                        min_chunk_tokens=draw(st.sampled_from([0, 1, 4, 32, 1024])),
                        imbalance_threshold=draw(st.sampled_from([1.0, 1.3])),
                        ranks_per_node=per_node if per_node is None or per_node < ep else None,
                        cost_aware=draw(st.booleans()), relay_within_node=draw(st.booleans()),
                        node_aware_tokens=draw(st.booleans()), repack_copies=draw(st.booleans()),
                        max_tokens_per_rank=budget,
                        cost_model=draw(st.sampled_from([CostModel(), CostModel.cpu(), CostModel(inter_node_gbps=1e-3),
                                                         CostModel(gemm_tflops=1e-4)])))
    return counts.astype(np.int64), held, room, config


@settings(max_examples=400, deadline=None)
@given(planning_inputs())
def test_same_plans_on_random_inputs(inputs):
    counts, held, room, config = inputs
    both(counts, config, SHAPE, held=held, keep_room=room)


@pytest.mark.parametrize("ep", [8, 16, 64])
def test_same_plans_on_the_real_routing_traces(ep):
    import real_routing
    from recipes.runtime import routing_traces

    defaults = LLEPConfig(ranks_per_node=min(RANKS_PER_NODE, ep))
    shape = ExpertShape(hidden_size=2880, ffn_hidden_size=2880, bias=True)
    traces = real_routing.load_all(routing_traces.TRACE_DIR)
    assert traces
    for (name, domain), trace in traces.items():
        for number, layer in sorted(trace.layers.items()):
            draws = real_routing.sequence_draws(layer.num_sampled, ep, 32768, 0)
            counts = real_routing.replay_counts(layer.expert_ids, trace.num_experts, draws)
            both(counts, defaults, shape)
            both(counts, exact(ep))


def test_the_comparison_catches_a_one_element_change():
    """Negative control: the same plan passes; the plan with any one array element changed, or
    its capacity nudged, fails."""
    layer = FULL_SHAPES[2]
    counts = sample_counts(layer, 64, SCENARIOS[-1], seed=3)
    config = LLEPConfig(ranks_per_node=RANKS_PER_NODE)
    plan = plan_llep(counts, config, expert_shape(layer))
    assert plan.num_weight_transfers > 0
    assert_same_plan(plan, reference_plan_llep(counts, config, expert_shape(layer)))
    for name in ARRAYS:
        array = np.array(getattr(plan, name))
        if not array.size:
            continue
        changed = array.copy()
        flat = changed.reshape(-1)
        flat[flat.size // 2] = (not flat[flat.size // 2]) if changed.dtype == bool else flat[flat.size // 2] + 1
        with pytest.raises(AssertionError):
            assert_same_plan(dataclasses.replace(plan, **{name: changed}), plan)
    with pytest.raises(AssertionError):
        assert_same_plan(dataclasses.replace(plan, capacity=plan.capacity * (1 + 1e-12)), plan)
