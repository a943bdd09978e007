"""Applying a placement to real Megatron MoE layers at EP=2 over gloo is exact: the placed layer
(plain EP or LLEP) gives the unplaced layer's outputs and input grads, its router and expert
grads are the unplaced ones permuted, and the inverse restores every parameter bit for bit. The
trace recorder records exactly what the router chose, within its memory bound."""

import pytest

from placement_worker import CASES, HAS_QUANTILE_BALANCING, run_all
from megatron_llep.testing.distributed import run_distributed


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return run_distributed(run_all, 2, str(tmp_path_factory.mktemp("ckpt")), timeout_s=600)


@pytest.mark.parametrize("name", [c.name for c in CASES if not c.router_rows_stay])
def test_placed_layer_equals_unplaced_layer(per_rank, name):
    bf16 = name == "grouped_gemm_bf16"
    tolerance = 2e-2 if bf16 else 1e-5
    for rank, results in enumerate(per_rank):
        r = results[name]
        for key in ("out", "dx", "router_grad", "expert_grads"):
            assert r[key] <= tolerance, f"rank {rank}: {key} differs by {r[key]:.3g}"
        assert r["round_trip_bit_identical"], f"rank {rank}: placement + inverse changed a parameter"


def test_negative_control_experts_moved_without_their_router_rows_fail(per_rank):
    worst = max(results["broken_router_rows_not_moved"]["out"] for results in per_rank)
    assert worst > 1e-2, "the comparison cannot tell a broken placement from a correct one"


def test_llep_sees_the_placed_layout_and_still_spills(per_rank):
    assert {results["llep_forced_imbalance"]["llep_mode"] for results in per_rank} == {"llep"}


def test_expert_bias_and_token_counts_move_with_their_experts(per_rank):
    for results in per_rank:
        r = results["sigmoid_expert_bias"]
        assert r["expert_bias_moved"] and r["tokens_per_expert"] == 0.0


@pytest.mark.skipif(not HAS_QUANTILE_BALANCING, reason="quantile-balancing routing needs Megatron-Core 0.19+")
def test_quantile_balancing_bias_moves_with_its_experts(per_rank):
    for results in per_rank:
        r = results["quantile_balancing"]
        assert r["qb_beta_moved"] and r["qb_beta_accum"] <= 1e-6


def test_group_limited_routing_rejects_a_placement_that_splits_groups(per_rank):
    message = per_rank[0]["group_mixing_rejected"]
    assert "mix routing groups" in message and "moe_router_num_groups=4" in message


def test_every_layer_of_a_model_gets_its_permutation_and_mismatches_are_rejected(per_rank):
    for results in per_rank:
        r = results["model"]
        assert r["moved"] == [True, True]
        assert "no entry for MoE layer(s) [2]" in r["errors"]["missing_layer"]
        assert "expert-parallel size 2, the placement is for 4" in r["errors"]["ep_size"]
        assert "has 8 experts, the placement is for 4" in r["errors"]["num_experts"]


def test_checkpoint_saved_placed_round_trips_to_original_order(per_rank):
    for results in per_rank:
        assert results["checkpoint"] == {"equal": True, "placement_recorded": True}


def test_recorder_records_exactly_the_routers_choice_within_its_memory_bound(per_rank):
    for results in per_rank:
        r = results["recorder"]
        assert r["natural_equal"]
        assert r["sampled"] == 10 and r["tokens_seen"] == 3 * 24
        assert r["counts_exact"] and r["rows_recorded_exactly"]
