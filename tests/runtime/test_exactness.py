"""LLEP equals plain EP: the same Megatron MoE layer with Megatron's stock alltoall dispatcher and
with LLEP, on the same weights, inputs and routing, at EP=2 and EP=4 over gloo; both also checked
against an independent float64 dense MoE. Forward output, input grad, router grad and every expert
weight grad are compared."""

import pytest

from exactness_worker import Case, infeasible_budget, run_cases
from megatron_llep.compat import mcore
from megatron_llep.testing.distributed import run_distributed


LEGACY_GROUPED_MLP = "grouped_gemm_bf16"


def cases(ep: int) -> list:
    """The cases the installed Megatron-Core can run (legacy GroupedMLP only before 0.17)."""
    return [c for c in all_cases(ep) if c.name != LEGACY_GROUPED_MLP or mcore.GroupedMLP is not None]


def all_cases(ep: int) -> list:
    experts_of_last_rank = 8 // ep
    return [
        Case("balanced", "uniform", expect_mode="fallback"),
        Case("hot_95_into_1", "hot"),
        Case("all_tokens_to_one_expert", "hot", topk=1, hot_fraction=1.0),
        Case("rank_without_routed_tokens", "subset", subset=tuple(range(8 - experts_of_last_rank))),
        Case("uneven_tokens_per_rank", "hot", tokens=tuple(24 if r else 3 for r in range(ep))),
        Case("experts_with_zero_tokens", "subset", subset=(0, 1, 2)),
        Case("top1", "hot", topk=1),
        Case("top4", "hot", topk=4, num_hot=4),
        Case("gpt_oss_biases_unfused", "hot", topk=4, num_hot=2, gpt_oss=True),
        Case("gpt_oss_biases_fused", "hot", topk=4, num_hot=2, gpt_oss=True, fused_bias_act=True),
        Case("borrow_more_than_native", "subset", subset=(0, 1, 2, 3, 4, 5), topk=1, min_chunk_tokens=0),
        Case("borrowed_in_waves", "hot", num_experts=32, num_hot=16, tokens=(96,) * ep),
        Case("below_lambda_falls_back", "hot", hot_fraction=0.3, imbalance_threshold=10.0, expect_mode="fallback"),
        Case("alpha_1_5", "hot", alpha=1.5, expect_mode="llep" if ep == 4 else "plain"),
        Case(LEGACY_GROUPED_MLP, "hot", topk=2, num_hot=2, grouped_gemm=True),
        Case("sequential_mlp_bf16", "hot", topk=2, num_hot=2, bf16=True),
        Case("shared_expert", "hot", shared_expert=8),
        Case("shared_expert_overlapped", "hot", shared_expert=8, shared_overlap=True),
        Case("token_dropping", "hot", capacity_factor=2.0, imbalance_threshold=1.05),
        *NEGATIVE_CONTROLS,
    ]


# The same comparisons with one LLEP mapping broken on purpose: they must fail.
NEGATIVE_CONTROLS = [
    Case("broken_wrong_expert_sent", "hot", broken="wrong_expert_sent"),
    Case("broken_gradients_not_returned", "hot", broken="gradients_not_returned"),
    Case("broken_wave_slots_reversed", "hot", num_experts=32, num_hot=16, tokens=(96,) * 4,
         broken="wave_slots_reversed"),
]


# LLEPConfig.max_tokens_per_rank at the mean rank load (the tightest feasible budget): the plan must
# spill where plain EP would not (below lambda; chunks smaller than m), and still equal plain EP.
BUDGET_CASES = [
    Case("budget_below_lambda", "hot", hot_fraction=0.3, imbalance_threshold=10.0, budget_over_mean=0),
    Case("budget_beats_min_chunk", "hot", topk=1, hot_fraction=1.0, min_chunk_tokens=64, budget_over_mean=0),
    Case("budget_cuts_min_chunk_slack", "hot", num_experts=16, num_hot=3, min_chunk_tokens=12, budget_over_mean=1),
]


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ep_results(request):
    """Every case of one EP size in one launch (the budget cases too: a launch costs more than a case)."""
    ep = request.param
    per_rank = run_distributed(run_cases, ep, cases(ep) + BUDGET_CASES, timeout_s=600)
    return ep, per_rank


def _expert_bytes(case: Case, dtype_bytes: int) -> int:
    d, h = case.hidden, case.ffn
    params = d * 2 * h + h * d + ((2 * h + d) if case.gpt_oss else 0)
    return params * dtype_bytes


@pytest.mark.parametrize("name", [c.name for c in all_cases(2) if not c.broken])
def test_llep_equals_plain_ep(ep_results, name):
    ep, per_rank = ep_results
    if name not in {c.name for c in cases(ep)}:
        pytest.skip(f"legacy GroupedMLP does not exist in Megatron-Core {mcore.MCORE_VERSION} (removed in 0.17)")
    case = {c.name: c for c in cases(ep)}[name]
    bf16 = case.grouped_gemm or case.bf16
    tight, loose = (2e-2, 5e-2) if bf16 else (1e-5, 2e-5)
    for rank, results in enumerate(per_rank):
        r = results[name]
        assert r["mode"] == case.expect_mode, f"rank {rank}: plan mode {r['mode']}"
        for key in ("out_vs_stock", "dx_vs_stock", "router_vs_stock", "experts_vs_stock", "shared_vs_stock"):
            assert r[key] <= tight, f"rank {rank}: {key} = {r[key]:.3g}"
        for key in ("out_vs_ref", "dx_vs_ref", "router_vs_ref", "experts_vs_ref"):
            assert case.capacity_factor or r[key] <= loose, f"rank {rank}: {key} = {r[key]:.3g}"
    if case.capacity_factor:  # the router really dropped tokens (the float64 reference does not)
        assert max(r[name]["dropped"] for r in per_rank) > 0
    first = per_rank[0][name]
    if case.expect_mode == "llep":
        assert first["weight_transfers"] > 0 and first["spilled_tokens"] > 0
        assert first["max_mean_after"] < first["max_mean_before"]
        assert first["weight_bytes"] == first["weight_transfers"] * _expert_bytes(case, 2 if bf16 else 4)
    else:
        assert first["weight_transfers"] == 0 and first["spilled_tokens"] == 0




@pytest.mark.parametrize("case", BUDGET_CASES, ids=lambda c: c.name)
def test_a_row_budget_keeps_llep_equal_to_plain_ep(ep_results, case):
    """Forced to spill by the budget alone (these routings fall back to plain EP, or keep small
    remainders native, without it): every rank's received rows stay within the budget, and outputs
    and every gradient still equal plain EP's."""
    ep, per_rank = ep_results
    results = [r[case.name] for r in per_rank]
    budget = results[0]["budget"]
    assert all(r["mode"] == "llep" for r in results), [r["mode"] for r in results]
    rows = [r["rows_here"] for r in results]
    assert max(rows) <= budget, (rows, budget)
    assert sum(rows) == ep * (case.tokens[0] if case.tokens else 24) * case.topk  # every row computed once
    for rank, r in enumerate(results):
        for key in ("out_vs_stock", "dx_vs_stock", "router_vs_stock", "experts_vs_stock"):
            assert r[key] <= 1e-5, f"rank {rank}: {key} = {r[key]:.3g}"
        for key in ("out_vs_ref", "dx_vs_ref", "router_vs_ref", "experts_vs_ref"):
            assert r[key] <= 2e-5, f"rank {rank}: {key} = {r[key]:.3g}"


def test_an_infeasible_budget_stops_every_rank_with_one_error():
    """More rows than EP x budget: every rank raises the same error naming the numbers and the layer
    before the token all-to-all, and all ranks then meet in one all-reduce (none hangs in the layer)."""
    results = run_distributed(infeasible_budget, 2, timeout_s=300)
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages, messages
    message = messages.pop()
    assert all(r["layer_number"] == 1 and r["total_rows"] == 96 for r in results)
    budget = results[0]["budget"]
    assert budget == 47 and "MoE layer 1: 96 token-expert rows over 2 EP ranks exceed 2 x max_tokens_per_rank 47" in message
    assert all(r["all_reduce"] == 2.0 for r in results)


def test_weights_travel_on_their_own_communicator_over_the_ep_ranks(ep_results):
    _, per_rank = ep_results
    assert all(r[name]["separate_weight_group"] for r in per_rank for name in r)


def test_a_helper_can_borrow_more_experts_than_it_owns(ep_results):
    ep, per_rank = ep_results
    borrowed = max(r["borrow_more_than_native"]["borrowed_here"] for r in per_rank)
    local = per_rank[0]["borrow_more_than_native"]["num_local_experts"]
    if ep == 4:
        assert borrowed > local  # exercises more than one substitution group per step
    else:
        assert borrowed >= 1


def test_borrowed_weights_arrive_in_waves(ep_results):
    """16 hot experts: a native rank sends one helper several copies, in waves of 1, 1, 2, 4 ..."""
    ep, per_rank = ep_results
    waves = [r["borrowed_in_waves"]["waves_here"] for r in per_rank]
    if ep == 2:  # one helper borrows about 8 experts of rank 0: a helper computes 3+ waves, one of 2+ experts
        assert max(len(w) for w in waves) >= 3 and max(max(w, default=0) for w in waves) >= 2, waves
    else:
        assert max(len(w) for w in waves) >= 2, waves


@pytest.mark.parametrize("case", NEGATIVE_CONTROLS, ids=lambda c: c.name)
def test_negative_controls_fail_the_comparison(ep_results, case):
    ep, per_rank = ep_results
    r = {rank: results[case.name] for rank, results in enumerate(per_rank)}
    assert all(result["mode"] == "llep" for result in r.values())
    damaged = "experts" if case.broken == "gradients_not_returned" else "out"
    keys = (f"{damaged}_vs_stock", f"{damaged}_vs_ref")
    for key in keys:  # some rank must see the damage, far above the parity tolerance
        assert max(result[key] for result in r.values()) > 1e-2, key
