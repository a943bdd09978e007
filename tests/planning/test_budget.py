"""LLEPConfig.max_tokens_per_rank: no plan gives an EP rank more token-expert rows than the budget,
whatever the routing, lambda, m, alpha or cost model; an infeasible step is refused in one error.

Plans are checked against rows recomputed from their full chunk list (and from each rank's view),
never against the planner's own ``rank_loads_after``. Exactness under a budget is in
tests/runtime/test_exactness.py (``BUDGET_CASES``)."""

import dataclasses
import math

import numpy as np
import pytest

from megatron_llep.config import LLEPConfig, LLEPConfigError
from megatron_llep.planning.cost_model import CostModel, ExpertShape
from megatron_llep.runtime.statistics import LLEPStatsTracker, LLEPStepStats, budget_phrase, merge_layer_statistic
from megatron_llep.planning import InfeasibleBudgetError, plan_llep, rank_loads

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release

SHAPE = ExpertShape(hidden_size=64, ffn_hidden_size=64, bias=True)
COST_MODELS = [CostModel(), CostModel.cpu(), CostModel(intra_node_gbps=1e-6, inter_node_gbps=1e-6)]
ROUTINGS = ("uniform", "skewed", "one_expert", "below_lambda", "sparse")


def routing(kind: str, ep: int, local: int, rng: np.random.Generator) -> np.ndarray:
    """A ``[P, N]`` count matrix of one kind."""
    experts = ep * local
    if kind == "uniform":
        counts = rng.integers(0, 40, size=(ep, experts))
    elif kind == "skewed":  # a few hot experts of Dirichlet weights, each rank routing 50..300 rows
        weights = rng.dirichlet(np.full(experts, 0.3))
        counts = np.stack([rng.multinomial(int(rng.integers(50, 300)), weights) for _ in range(ep)])
    elif kind == "one_expert":  # 100 % of the rows into one expert
        counts = np.zeros((ep, experts), np.int64)
        counts[:, rng.integers(experts)] = rng.integers(1, 300, size=ep)
    elif kind == "below_lambda":  # balanced but for one rank ~20 % above the mean: plain EP below lambda 1.3
        counts = np.full((ep, experts), 30) + rng.integers(0, 3, size=(ep, experts))
        counts[:, rng.integers(experts)] += 6 * local + 1
    else:
        counts = rng.integers(0, 200, size=(ep, experts)) * (rng.random((ep, experts)) < 0.2)
    return counts.astype(np.int64)


def received_rows(plan) -> np.ndarray:
    """Rows each rank computes, from the plan's full chunk list (implicit native ones included)."""
    chunks = plan.token_chunks()
    return np.bincount(chunks[:, 2], weights=chunks[:, 3], minlength=plan.ep_size).astype(np.int64)


def check_plan(plan, counts: np.ndarray, budget: int) -> None:
    """The guarantee, from the plan's chunks alone: every (source, expert) row is sent exactly once
    (natives + spills = loads), and no rank computes more than ``budget`` rows."""
    chunks = plan.token_chunks()
    assert (chunks[:, 3] > 0).all()
    sent = np.zeros_like(counts)
    np.add.at(sent, (chunks[:, 1], chunks[:, 0]), chunks[:, 3])
    np.testing.assert_array_equal(sent, counts)
    native = chunks[:, 2] == chunks[:, 0] // plan.num_local_experts
    loads = counts.sum(axis=0)
    kept = np.bincount(chunks[native, 0], chunks[native, 3], plan.num_experts)
    spilled = np.bincount(chunks[~native, 0], chunks[~native, 3], plan.num_experts)
    np.testing.assert_array_equal(kept + spilled, loads)
    rows = received_rows(plan)
    views = np.array([plan.rank_view(r).recv_counts.sum() for r in range(plan.ep_size)])
    np.testing.assert_array_equal(views, rows)
    assert rows.sum() == counts.sum()
    assert rows.max() <= budget, f"rows per rank {rows.tolist()} exceed the budget {budget}"


def sweep(ep: int, kind: str, seeds: int = 50):
    """(counts, config, budget) triples: budgets from the tightest feasible one (the mean rank load,
    rounded up) to plain EP's largest rank load; every m, lambda, alpha, cost model."""
    rng = np.random.default_rng([ep, ROUTINGS.index(kind)])
    for seed in range(seeds):
        local = int(rng.integers(1, 4))
        counts = routing(kind, ep, local, rng)
        total = int(counts.sum())
        tight = max(-(-total // ep), 1)
        plain_max = int(rank_loads(counts, local).max())
        budget = tight if seed % 3 == 0 else int(rng.integers(tight, max(plain_max, tight) + 1))
        config = LLEPConfig(
            alpha=float(rng.choice([0.8, 1.0, 1.5])),
            min_chunk_tokens=int(rng.choice([0, 1, 4, 16, 64, 1024])),
            imbalance_threshold=1.3 if kind == "below_lambda" else float(rng.choice([1.0, 1.3, 2.0, 10.0])),
            ranks_per_node=None if seed % 2 else max(ep // 2, 1),
            cost_aware=seed % 4 < 2,
            cost_model=COST_MODELS[seed % len(COST_MODELS)],
            max_tokens_per_rank=budget,
        )
        yield counts, config, budget


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("ep", [2, 4, 8, 16])
def test_every_plan_honours_the_budget_and_conserves_rows(ep, kind):
    plain_ep_over_budget = 0
    for counts, config, budget in sweep(ep, kind):
        plan = plan_llep(counts, config, SHAPE)
        check_plan(plan, counts, budget)
        assert plan.budget == budget
        plain_ep = rank_loads(counts, plan.num_local_experts)
        if kind == "below_lambda":  # plain EP's max/mean load is below lambda: it would fall back
            assert plain_ep.max() * ep < config.imbalance_threshold * counts.sum()
        if plain_ep.max() > budget:
            plain_ep_over_budget += 1
            assert not plan.is_plain_ep and not plan.fallback  # spilled, below lambda or not
    if kind != "uniform":
        assert plain_ep_over_budget > 0  # the sweep does exercise binding budgets


@pytest.mark.parametrize("kind", ["skewed", "one_expert", "below_lambda"])
def test_the_check_catches_a_planner_that_ignores_the_budget(kind):
    """Negative control: the same routings and configs planned without the budget break it (the
    check above fails on them), so the property test would catch a planner that ignored it."""
    caught = 0
    for ep in (2, 4, 8, 16):
        for counts, config, budget in sweep(ep, kind):
            unbounded = plan_llep(counts, dataclasses.replace(config, max_tokens_per_rank=None), SHAPE)
            try:
                check_plan(unbounded, counts, budget)
            except AssertionError as err:
                assert "exceed the budget" in str(err)
                caught += 1
    assert caught >= 10, caught


def test_below_lambda_a_budget_forces_a_spill():
    counts = np.array([[40, 36], [40, 36]], np.int64)  # rank loads 80 / 72: max/mean 1.05 < lambda 1.3
    free = plan_llep(counts, LLEPConfig(min_chunk_tokens=0, cost_aware=False))
    assert free.fallback and free.is_plain_ep
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=0, cost_aware=False, max_tokens_per_rank=76))
    assert not plan.fallback and received_rows(plan).tolist() == [76, 76]
    # cost-aware: plain EP is cheaper here, but not a candidate while it breaks the budget
    aware = plan_llep(counts, LLEPConfig(min_chunk_tokens=0, max_tokens_per_rank=76), SHAPE)
    assert not aware.is_plain_ep and received_rows(aware).max() <= 76
    # a budget plain EP already meets changes nothing
    assert plan_llep(counts, LLEPConfig(min_chunk_tokens=0, cost_aware=False, max_tokens_per_rank=80)).fallback


def test_the_budget_wins_over_the_min_chunk_rule():
    counts = np.zeros((4, 4), np.int64)
    counts[:, 0] = 25  # 100 rows into expert 0 of rank 0; m = 1024 keeps them native without a budget
    config = dict(min_chunk_tokens=1024, cost_aware=False, imbalance_threshold=1.0)
    assert plan_llep(counts, LLEPConfig(**config)).is_plain_ep
    plan = plan_llep(counts, LLEPConfig(**config, max_tokens_per_rank=30))
    rows = received_rows(plan)
    assert rows.max() <= 30 and rows.sum() == 100
    helpers = plan.token_chunks()
    assert (helpers[helpers[:, 2] != 0, 3] < 1024).all() and plan.num_weight_transfers >= 3


def test_a_budget_at_exactly_the_mean_fills_every_rank():
    counts = np.zeros((8, 16), np.int64)
    counts[:, 5] = 64  # 512 rows, all into one expert
    for cost_aware in (False, True):
        plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=1024, cost_aware=cost_aware, max_tokens_per_rank=64), SHAPE)
        assert received_rows(plan).tolist() == [64] * 8


def test_alpha_above_one_is_clipped_to_the_budget():
    counts = np.zeros((4, 4), np.int64)
    counts[:, 1] = 30
    plan = plan_llep(counts, LLEPConfig(alpha=2.0, min_chunk_tokens=0, cost_aware=False, max_tokens_per_rank=40))
    assert plan.capacity == 40 and received_rows(plan).max() <= 40


@pytest.mark.parametrize("layer, where", [(7, "MoE layer 7"), (None, "an MoE layer")])
def test_an_infeasible_budget_is_one_error_naming_the_numbers(layer, where):
    counts = np.full((4, 8), 10, np.int64)  # 320 rows over 4 ranks: at least 80 per rank
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_llep(counts, LLEPConfig(cost_aware=False, max_tokens_per_rank=79), layer_number=layer)
    message = str(err.value)
    for part in (where, "320 token-expert rows", "4 EP ranks", "max_tokens_per_rank 79", "= 316", "at least 80",
                 "--llep-max-tokens-per-rank"):
        assert part in message, (part, message)
    assert (err.value.total_rows, err.value.ep_size, err.value.budget, err.value.layer_number) == (320, 4, 79, layer)
    # raised from the global counts alone, before any plan: the same on every rank, cost-aware or not,
    # below lambda or not
    with pytest.raises(InfeasibleBudgetError):
        plan_llep(counts, LLEPConfig(max_tokens_per_rank=79, imbalance_threshold=10.0), SHAPE)
    assert received_rows(plan_llep(counts, LLEPConfig(cost_aware=False, max_tokens_per_rank=80))).max() == 80


def test_one_rank_and_empty_steps():
    assert plan_llep(np.zeros((4, 4), np.int64), LLEPConfig(max_tokens_per_rank=1), SHAPE).fallback
    assert plan_llep(np.full((1, 4), 5, np.int64), LLEPConfig(max_tokens_per_rank=20), SHAPE).fallback
    with pytest.raises(InfeasibleBudgetError, match="20 token-expert rows over 1 EP ranks"):
        plan_llep(np.full((1, 4), 5, np.int64), LLEPConfig(max_tokens_per_rank=19), SHAPE)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "64", math.inf])
def test_config_refuses_a_budget_outside_its_domain(value):
    with pytest.raises(LLEPConfigError) as err:
        LLEPConfig(max_tokens_per_rank=value)
    assert err.value.knob == "max_tokens_per_rank"
    assert str(err.value).startswith("LLEPConfig.max_tokens_per_rank (the token-expert rows an EP rank may receive")
    assert "must be a positive integer, or None for no budget" in err.value.for_flag("--llep-max-tokens-per-rank")
    assert LLEPConfig(max_tokens_per_rank=1).max_tokens_per_rank == 1 and LLEPConfig().max_tokens_per_rank is None


def test_statistics_show_the_most_rows_against_the_budget():
    counts = np.zeros((2, 4), np.int64)
    counts[:, 0] = 50
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=0, cost_aware=False, max_tokens_per_rank=60))
    stats = LLEPStepStats.from_plan(plan, 2, 10, 0.0)
    assert stats.max_rank_rows == 50 and stats.budget_rows == 60
    assert stats.scalars()["max_rank_rows"] == 50.0 and stats.scalars()["budget_rows"] == 60.0
    free = LLEPStepStats.from_plan(plan_llep(counts, LLEPConfig(min_chunk_tokens=1000, cost_aware=False)), 2, 10, 0.0)
    assert free.max_rank_rows == 100 and free.budget_rows is None and "budget_rows" not in free.scalars()
    tracker = LLEPStatsTracker()
    tracker.record(stats)
    tracker.record(LLEPStepStats.from_plan(
        plan_llep(np.full((2, 4), 5, np.int64), LLEPConfig(cost_aware=False, max_tokens_per_rank=60)), 2, 10, 0.0))
    layer = tracker.drain_by_layer()[2]
    assert layer["max_rank_rows"] == 50.0 and layer["budget_rows"] == 60.0  # the maximum over micro-batches
    assert "max_kept_bytes" not in layer  # no ledger asked
    # the bytes kept: the most any rank keeps, over the micro-batches
    for kept in ([0, 300], [700, 100], [0, 0]):
        tracker.record(LLEPStepStats.from_plan(plan, 2, 10, 0.0, kept_bytes=np.array(kept)))
    assert tracker.drain_by_layer()[2]["max_kept_bytes"] == 700.0
    assert merge_layer_statistic("max_kept_bytes", [700.0, 100.0]) == 700.0
    # ranks merge by maximum, the other statistics by mean
    assert merge_layer_statistic("max_rank_rows", [50.0, 58.0]) == 58.0
    assert merge_layer_statistic("max_mean_after", [1.0, 2.0]) == 1.5
    metrics = {"moe/layer_1/max_rank_rows": 58.0, "moe/layer_1/budget_rows": 60.0,
               "moe/layer_2/max_rank_rows": 41.0, "moe/layer_2/budget_rows": 60.0}
    assert budget_phrase(metrics) == "rows/rank max 58 of budget 60"
    assert budget_phrase({"moe/layer_1/max_rank_rows": 58.0}) == ""


def test_log_lines_show_the_rows_against_the_budget():
    from megatron_llep.integrations.megatron_lm import summary_line
    from recipes.runtime.dashboard import llep_summary

    metrics = {"moe/layer_1/llep_active": 1.0, "moe/layer_1/max_mean_before": 2.0, "moe/layer_1/max_mean_after": 1.0,
               "moe/layer_1/spilled_tokens": 50.0, "moe/layer_1/weight_bytes": 1024.0, "moe/layer_1/plan_time_ms": 0.1,
               "moe/layer_1/max_rank_rows": 50.0}
    assert "budget" not in llep_summary(metrics) and "budget" not in summary_line(metrics)
    metrics["moe/layer_1/budget_rows"] = 60.0
    assert llep_summary(metrics).endswith(", rows/rank max 50 of budget 60")
    assert summary_line(metrics).endswith(" rows/rank max 50 of budget 60 |")
