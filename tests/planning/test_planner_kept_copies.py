"""The planner's kept-copy features, with no process group: helpers that already keep a borrowed expert
for the step (``held``), a bound on how many more copies each rank keeps (``keep_room``) and
copies relayed inside nodes (``LLEPConfig.relay_within_node``)."""

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_llep.config import LLEPConfig
from megatron_llep.planning.cost_model import CostModel, ExpertShape
from megatron_llep.planning import LLEPPlan, LayerTimeModel, plan_llep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import plan_model  # noqa: E402  (its rank-by-rank layer-time prediction is the oracle)
from common import FULL_SHAPES, SCENARIOS, sample_counts  # noqa: E402
from test_planner import assignment as computed_here  # noqa: E402  (tokens[e, rank] computed where)

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release

# The planner before kept copies existed (held, keep_room and relays did not exist): with them off, plans must
# be what it made.
BEFORE_KEPT_COPIES = "3816b4dcaed34aee28c5e5191d77a90af111057e"
SHAPE = ExpertShape(hidden_size=64, ffn_hidden_size=64, bias=True)
NO_COST = dict(cost_aware=False)


@st.composite
def planning_inputs(draw):
    """Counts with hot experts on 2 to 4 nodes, a held matrix, a keep room and a config."""
    per_node = draw(st.sampled_from([1, 2, 4]))
    ep = per_node * draw(st.integers(2, 4))
    local = draw(st.integers(1, 3))
    experts = ep * local
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    counts = rng.integers(0, 20, size=(ep, experts))
    for e in rng.choice(experts, size=min(experts, draw(st.integers(1, 3))), replace=False):
        counts[:, e] += rng.integers(0, 300, size=ep)
    held = rng.random((experts, ep)) < draw(st.sampled_from([0.0, 0.1, 0.4]))
    held[np.arange(experts), np.arange(experts) // local] = False
    room = None if draw(st.booleans()) else rng.integers(0, 3, size=ep)
    config = LLEPConfig(min_chunk_tokens=draw(st.sampled_from([0, 4, 32])), ranks_per_node=per_node,
                        cost_aware=draw(st.booleans()), relay_within_node=draw(st.booleans()),
                        cost_model=draw(st.sampled_from([CostModel(), CostModel.cpu(), CostModel(inter_node_gbps=1e-3)])))
    return counts.astype(np.int64), held, room, config


@settings(max_examples=300, deadline=None)
@given(planning_inputs())
def test_copies_follow_held_keep_room_and_relay_rules(inputs):
    counts, held, room, config = inputs
    plan = plan_llep(counts, config, SHAPE, held=held, keep_room=room)
    ep, local, per_node = plan.ep_size, plan.num_local_experts, config.ranks_per_node
    node = np.arange(ep) // per_node
    native = plan.native_rank
    where = computed_here(plan)
    np.testing.assert_array_equal(where.sum(axis=1), counts.sum(axis=0))  # every token computed once
    # a new copy goes exactly where a helper computes an expert it neither owns nor holds
    needs_copy = {(e, p) for e, p in zip(*np.nonzero(where)) if p != native[e] and not held[e, p]}
    assert set(zip(plan.transfer_expert.tolist(), plan.transfer_helper.tolist())) == needs_copy
    assert len(needs_copy) == plan.num_weight_transfers
    np.testing.assert_array_equal(plan.transfer_native, native[plan.transfer_expert])
    # kept copies: as many per helper as it has room for
    for p in range(ep):
        mine = plan.transfer_helper == p
        expected = mine.sum() if room is None else min(mine.sum(), room[p])
        assert plan.transfer_kept[mine].sum() == expected
    got_kept = {(e, h) for e, h, k in zip(plan.transfer_expert, plan.transfer_helper, plan.transfer_kept) if k}
    wave_of = dict(zip(zip(plan.transfer_expert.tolist(), plan.transfer_helper.tolist()), plan.transfer_wave.tolist()))
    for e, s, h, w in zip(plan.transfer_expert, plan.transfer_source, plan.transfer_helper, plan.transfer_wave):
        if s == native[e]:
            continue
        # relayed: only with relays on, inside the helper's node, from a holder or a kept receiver
        assert config.relay_within_node and node[s] == node[h] != node[native[e]]
        assert held[e, s] or ((e, s) in got_kept and w > wave_of[(e, s)])
    if config.relay_within_node:
        for e in range(plan.num_experts):
            for b in set(node.tolist()) - {node[native[e]]}:
                into = (plan.transfer_expert == e) & (node[plan.transfer_helper] == b)
                crossing = into & (node[plan.transfer_source] != b)
                holders = np.flatnonzero(held[e] & (node == b))
                if holders.size:  # the lowest holder there sends every new copy
                    assert set(plan.transfer_source[into].tolist()) <= {int(holders[0])}
                elif plan.transfer_kept[into].any():  # one copy crosses, to the lowest kept helper
                    assert plan.transfer_helper[crossing].tolist() == [plan.transfer_helper[into & plan.transfer_kept].min()]
                else:  # transient copies are never sources
                    assert crossing.sum() == into.sum()


@settings(max_examples=150, deadline=None)
@given(planning_inputs())
def test_rank_views_match_sends_receives_and_slots(inputs):
    counts, held, room, config = inputs
    plan = plan_llep(counts, config, SHAPE, held=held, keep_room=room)
    views = [plan.rank_view(r) for r in range(plan.ep_size)]
    local = plan.num_local_experts
    sends = sorted((e, v.rank, h, w) for v in views for (e, h), w in zip(v.weights_to_send, v.send_waves))
    receives = sorted((e, s, v.rank, w) for v in views for (e, s), w in zip(v.weights_to_receive, v.receive_waves))
    assert sends == receives and len(sends) == plan.num_weight_transfers
    where = computed_here(plan)
    for view in views:
        r = view.rank
        assert view.send_waves == sorted(view.send_waves) and view.receive_waves == sorted(view.receive_waves)
        assert view.num_native_slots == local
        received = [e for e, _ in view.weights_to_receive]
        assert list(view.slot_experts) == list(range(r * local, (r + 1) * local)) + view.held_experts + received
        assert view.held_experts == sorted(view.held_experts) and all(held[e, r] for e in view.held_experts)
        # slots hold exactly what the plan computes here, and every token routed from here is sent
        np.testing.assert_array_equal(view.tokens_per_slot, where[view.slot_experts, r])
        assert where[:, r].sum() == view.tokens_per_slot.sum()
        np.testing.assert_array_equal(view.send_counts.sum(axis=1), counts[r])
        assert len(view.receive_kept) == len(received)
    for src in range(plan.ep_size):
        for dst in range(plan.ep_size):
            np.testing.assert_array_equal(views[src].send_counts[:, dst], views[dst].recv_counts[src])


def _planner_before_kept_copies():
    """The planner module as of BEFORE_KEPT_COPIES (None where git or that commit is not at hand)."""
    try:
        source = subprocess.run(["git", "show", f"{BEFORE_KEPT_COPIES}:megatron_llep/planner.py"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    source = source.replace("from megatron_llep.cost_model import", "from megatron_llep.planning.cost_model import")
    spec = importlib.util.spec_from_loader("planner_before_kept_copies", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, "planner_before_kept_copies.py", "exec"), module.__dict__)
    return module


OLD_PLANNER = _planner_before_kept_copies()
PLAN_ARRAYS = ("spilled_experts", "chunk_expert", "chunk_src", "chunk_dst", "chunk_count", "transfer_expert",
               "transfer_native", "transfer_helper", "transfer_wave", "rank_loads_after")


@pytest.mark.skipif(OLD_PLANNER is None, reason=f"needs git and commit {BEFORE_KEPT_COPIES[:7]}")
@settings(max_examples=300, deadline=None)
@given(planning_inputs())
def test_without_held_room_or_relays_plans_are_those_of_before(inputs):
    counts, _, _, config = inputs
    from dataclasses import replace

    config = replace(config, relay_within_node=False, node_aware_tokens=False, repack_copies=False)  # none existed before
    new, old = plan_llep(counts, config, SHAPE), OLD_PLANNER.plan_llep(counts, config, SHAPE)
    assert (new.capacity, new.fallback) == (old.capacity, old.fallback)
    for name in PLAN_ARRAYS:
        np.testing.assert_array_equal(getattr(new, name), getattr(old, name), err_msg=name)
    np.testing.assert_array_equal(new.transfer_source, old.transfer_native)
    # keep_room only marks copies kept; it changes nothing else
    bounded = plan_llep(counts, config, SHAPE, keep_room=np.ones(counts.shape[0], np.int64))
    for name in PLAN_ARRAYS:
        np.testing.assert_array_equal(getattr(bounded, name), getattr(old, name), err_msg=name)
    for r in range(counts.shape[0]):
        a, b = new.rank_view(r), old.rank_view(r)
        assert (a.weights_to_send, a.weights_to_receive, a.send_waves, a.receive_waves) == (
            b.weights_to_send, b.weights_to_receive, b.send_waves, b.receive_waves)
        np.testing.assert_array_equal(a.slot_experts, b.slot_experts)


@pytest.mark.skipif(OLD_PLANNER is None, reason=f"needs git and commit {BEFORE_KEPT_COPIES[:7]}")
def test_regression_check_catches_relays():
    """Negative control: with relays on, a multi-node plan differs from the old planner's."""
    layer, ep = FULL_SHAPES[1], 64
    counts = sample_counts(layer, ep, SCENARIOS[-1], seed=0)
    config = LLEPConfig(ranks_per_node=8, **NO_COST)
    new, old = plan_llep(counts, config), OLD_PLANNER.plan_llep(counts, config)
    assert not np.array_equal(new.transfer_source, old.transfer_native)


def test_held_helpers_are_preferred_and_get_no_copy():
    """Two nodes of two ranks, one expert per rank; rank 0's expert is hot (180 of 300 tokens,
    capacity 1.5 x 75). Without held copies the native node's rank 1 takes the 68 tokens over the
    capacity; with rank 3 holding the expert, rank 3 takes them, and gets no copy."""
    counts = np.array([[180, 10, 10, 10], [0, 10, 10, 10], [0, 10, 10, 10], [0, 10, 10, 10]], np.int64)
    config = LLEPConfig(alpha=1.5, min_chunk_tokens=0, ranks_per_node=2, **NO_COST)
    plain = plan_llep(counts, config)
    assert computed_here(plain)[0].tolist() == [112, 68, 0, 0] and plain.transfer_helper.tolist() == [1]
    held = np.zeros((4, 4), bool)
    held[0, 3] = True
    plan = plan_llep(counts, config, held=held)
    assert computed_here(plan)[0].tolist() == [112, 0, 0, 68]
    assert plan.num_weight_transfers == 0
    assert plan.rank_view(3).held_experts == [0] and list(plan.rank_view(3).slot_experts) == [3, 0]
    with pytest.raises(ValueError, match="own native rank"):
        plan_llep(counts, config, held=np.eye(4, dtype=bool))


def test_relayed_copy_follows_its_relay_in_the_plan():
    """Ranks 2 and 3 (node 1) compute rank 0's expert: one copy crosses to rank 2 (kept), which
    forwards it to rank 3 a wave later; without room to keep, both cross from rank 0."""
    counts = np.array([[0, 0, 0, 0], [0, 0, 0, 0], [300, 0, 0, 0], [300, 0, 0, 0]], np.int64)
    config = LLEPConfig(min_chunk_tokens=0, ranks_per_node=2, **NO_COST)
    plan = plan_llep(counts, config)
    copies = sorted(zip(plan.transfer_helper.tolist(), plan.transfer_source.tolist(), plan.transfer_wave.tolist()))
    assert copies[-2:] == [(2, 0, 0), (3, 2, 1)]
    assert plan.rank_view(2).weights_to_send == [(0, 3)] and plan.rank_view(2).send_waves == [1]
    assert plan.rank_view(3).weights_to_receive == [(0, 2)] and plan.rank_view(3).receive_kept == [True]
    transient = plan_llep(counts, config, keep_room=np.zeros(4, np.int64))
    assert set(transient.transfer_source.tolist()) == {0} and not transient.transfer_kept.any()


# Layer time by hand: a token is 1 byte, the weights 20 bytes, a GEMM 1 us per token; links across
# nodes move 1 byte per us, inside a node 10; no latency. Two nodes of two ranks, one expert each;
# ranks 2 and 3 each route 30 tokens to rank 0's expert and compute them themselves.
TINY = ExpertShape(hidden_size=1, ffn_hidden_size=10, gated=False, dtype_bytes=1)
TINY_MODEL = CostModel(gemm_tflops=4e-5, gemm_half_efficiency_tokens=0.0, gemm_launch_s=0.0,
                       intra_node_gbps=1e-2, inter_node_gbps=1e-3, link_latency_s=0.0)
TINY_COUNTS = np.array([[0] * 4, [0] * 4, [30, 0, 0, 0], [30, 0, 0, 0]], np.int64)


def _tiny_plan(sources, waves, helpers=(2, 3)):
    helpers = np.array(helpers, np.int64)
    spilled = np.array([0], np.int64)
    n = helpers.size
    return LLEPPlan(TINY_COUNTS, 1, 15.0, np.array([60, 0, 0, 0]), np.array([0, 0, 30, 30]), False,
                    spilled_experts=spilled, chunk_expert=np.zeros(2, np.int64), chunk_src=np.array([2, 3]),
                    chunk_dst=np.array([2, 3]), chunk_count=np.array([30, 30]),
                    transfer_expert=np.zeros(n, np.int64), transfer_native=np.zeros(n, np.int64),
                    transfer_helper=helpers, transfer_wave=np.array(waves, np.int64),
                    transfer_source=np.array(sources, np.int64), transfer_kept=np.ones(n, bool))


@pytest.mark.parametrize("name, sources, waves, helpers, layer_us", [
    # both copies cross on rank 0's one inter-node link: 40 us, then 30 us of GEMM
    ("direct", [0, 0], [0, 0], (2, 3), 70),
    # one crosses (20 us); rank 2 forwards it inside the node (2 us): rank 3 ends at 22 + 30
    ("relayed", [0, 2], [0, 1], (2, 3), 52),
    # rank 2 holds a copy already: it starts at once (30 us) and forwards to rank 3 (2 + 30)
    ("held and relayed", [2], [0], (3,), 32),
    # rank 2 holds a copy, rank 3's crosses from rank 0: 20 + 30
    ("held, direct", [0], [0], (3,), 50),
])
def test_layer_time_of_held_and_relayed_copies_by_hand(name, sources, waves, helpers, layer_us):
    plan = _tiny_plan(sources, waves, helpers)
    timer = LayerTimeModel(TINY_COUNTS, 1, TINY, TINY_MODEL, ranks_per_node=2)
    assert round(timer.time(plan) * 1e6, 6) == layer_us
    assert plan_model_time(plan, TINY_MODEL) == pytest.approx(timer.time(plan), rel=1e-9)


def plan_model_time(plan, model):
    """benchmarks/plan_model.py's rank-by-rank prediction, at the tiny shape (4 ranks, 2 per node)."""
    layer = plan_model.LayerShape("tiny", 4, 1, 10, 1, 1)
    saved = plan_model.RANKS_PER_NODE, plan_model.expert_shape
    plan_model.RANKS_PER_NODE, plan_model.expert_shape = 2, lambda _: TINY
    try:
        return plan_model.predict(plan, layer, model)["layer_s"]
    finally:
        plan_model.RANKS_PER_NODE, plan_model.expert_shape = saved


@pytest.mark.parametrize("ep", [16, 64])
def test_held_and_relayed_plans_priced_like_the_rank_by_rank_model(ep):
    """At the published layer shapes across nodes, a micro-batch after one that kept copies: LayerTimeModel
    agrees with plan_model.predict, and the plan needs fewer new copies than one made with nothing
    held."""
    layer = FULL_SHAPES[1]
    shape, model = plan_model.expert_shape(layer), CostModel(training=True)
    config = LLEPConfig(ranks_per_node=8, cost_model=model)
    timer_of = lambda counts: LayerTimeModel(counts, layer.num_experts // ep, shape, model, 8)  # noqa: E731
    fewer = 0
    for scenario in SCENARIOS[1:]:
        first = plan_llep(sample_counts(layer, ep, scenario, seed=0), config, shape)
        held = np.zeros((layer.num_experts, ep), bool)
        held[first.transfer_expert[first.transfer_kept], first.transfer_helper[first.transfer_kept]] = True
        counts = sample_counts(layer, ep, scenario, seed=1)
        second = plan_llep(counts, config, shape, held=held)
        fresh = plan_llep(counts, config, shape)
        timer = timer_of(counts)
        for plan in (second, fresh):
            assert timer.time(plan) == pytest.approx(plan_model.predict(plan, layer, model)["layer_s"], rel=1e-9)
        if first.num_weight_transfers:  # repacked fresh plans can need as few new copies
            assert second.num_weight_transfers <= fresh.num_weight_transfers
            fewer += second.num_weight_transfers < fresh.num_weight_transfers
    assert fewer >= len(SCENARIOS) // 2


def test_relaying_is_cheaper_across_slow_node_links():
    """Four helpers on another node need rank 0's hot expert: relayed, one copy crosses the slow
    link instead of four, and the predicted layer is faster."""
    layer = FULL_SHAPES[1]
    ep, shape, model = 16, plan_model.expert_shape(layer), CostModel(inter_node_gbps=10.0)
    counts = sample_counts(layer, ep, SCENARIOS[4], seed=0)  # 95 % into one expert
    timer = LayerTimeModel(counts, layer.num_experts // ep, shape, model, 8)
    plans = {relay: plan_llep(counts, LLEPConfig(ranks_per_node=8, cost_model=model, relay_within_node=relay, **NO_COST))
             for relay in (False, True)}
    node = np.arange(ep) // 8
    crossing = {relay: int((node[p.transfer_source] != node[p.transfer_helper]).sum()) for relay, p in plans.items()}
    assert crossing[False] >= 2 and crossing[True] == 1
    assert timer.time(plans[True]) < timer.time(plans[False])
    assert math.isclose(timer.time(plans[True]), plan_model.predict(plans[True], layer, model)["layer_s"], rel_tol=1e-9)


def test_step_gradient_return_crosses_once_per_expert_and_node():
    """DeepSeek-V3 at P = 16: rank 0's expert 0 kept on ranks 1 (its node), 8 and 9 (the other
    node). Relayed, each node sums eight stripes at its eight ranks (rank 1 sends 7/8 of its
    gradient inside node 0, ranks 8 and 9 7/8 each inside node 1), one gradient crosses as eight
    stripes, one per link, and ranks 1-7 send their stripe sums to rank 0 (7/8 of a gradient);
    directly, two whole gradients cross into rank 0. Gradients are the 176 MB fp32 accumulators,
    at 45 GB/s across nodes and 400 GB/s inside."""
    layer, ep = FULL_SHAPES[1], 16
    numel = plan_model.expert_shape(layer).num_params
    weight_bytes = 4 * numel  # the fp32 accumulator the runtime sends
    held = np.zeros((layer.num_experts, ep), bool)
    held[0, [1, 8, 9]] = True
    model = CostModel()
    relayed, relayed_bytes = plan_model.step_gradient_return(held, layer, model, relay=True)
    direct, direct_bytes = plan_model.step_gradient_return(held, layer, model, relay=False)
    assert (relayed_bytes, direct_bytes) == (weight_bytes, 2 * weight_bytes)
    seven_stripes = 4 * (numel - numel // 8)  # all stripes but the first (stripe 0 stays on rank 0 / rank 8)
    inside = model.link_time(seven_stripes, False)
    across = model.link_time(4 * (numel * 2 // 8 - numel // 8), True)  # the largest stripe crossing
    # phases: stripe sums inside nodes, the crossing (one helper node: no reduce-scatter), into rank 0
    assert relayed == pytest.approx([inside, across, inside], rel=1e-6)
    assert direct == pytest.approx([model.link_time(2 * weight_bytes, True)], rel=1e-12)


def test_a_return_behind_the_backward_shows_only_beyond_the_layers_below():
    """Phase k hides in the backward GEMMs of the k-th layer below and shows beyond them; the
    bottom layers' phases without layers below wait at the end: sum_k (k + 1) t_k over the model."""
    assert plan_model.behind_backward([1.0, 2.0, 3.0], window_s=2.5, moe_layers=10) == pytest.approx(
        0.5 + (1 * 1.0 + 2 * 2.0 + 3 * 3.0) / 10)
    assert plan_model.behind_backward([1.0], window_s=2.0, moe_layers=1) == pytest.approx(1.0)  # one layer: all of it


def test_step_model_keeps_copies_only_after():
    """The step-level model: copying per micro-batch (before) keeps nothing and returns no
    gradient at the step's end; keeping (after) copies fewer weights over 8 micro-batches."""
    layer, ep = FULL_SHAPES[1], 16
    config = plan_model.ep_config(LLEPConfig(), CostModel(training=True), ep)
    rows = plan_model.step_rows(layer, ep, SCENARIOS[8], config, seed=0, repeats=1)
    by = {(r["weights"], r["micro_batches"]): r for r in rows}
    assert sorted(by) == sorted((w, k) for w in ("before", "after") for k in plan_model.MICRO_BATCHES)
    assert all(by["before", k]["kept_copies"] == 0 and by["before", k]["grad_return_ms"] == 0 for k in plan_model.MICRO_BATCHES)
    assert by["after", 8]["kept_copies"] > 0
    assert by["after", 8]["weight_gb"] < by["before", 8]["weight_gb"]
