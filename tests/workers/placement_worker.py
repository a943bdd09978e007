"""Rank-side code of the placement tests (EP=2 over gloo): a placed Megatron MoE layer against the
unplaced one on the same weights and inputs, round trips, checkpoints and the trace recorder.
Imported by spawned gloo processes; every check returns numbers the test asserts on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer.moe.router import TopKRouter

from megatron_llep.compat import mcore
from megatron_llep.config import LLEPConfig
from megatron_llep.integrations import placement as placement_apply
from megatron_llep.integrations.placement import apply_placement, restore_original_order
from megatron_llep.placement.placement import ExpertPlacement, read_checkpoint_placement, write_checkpoint_placement
from megatron_llep.integrations.routing_traces import RoutingTraceRecorder
from megatron_llep.runtime.forced_routing import force_routing
from megatron_llep.planning.scenarios import imbalanced_topk
from megatron_llep.testing import grouped_gemm_cpu
from megatron_llep.testing.moe import build_moe_layer, gathered_expert_weights, init_expert_parallel, moe_config

NUM_EXPERTS, HIDDEN, FFN, TOKENS = 8, 16, 12, 24
# moves experts across the two EP ranks (rank 0 owns slots 0..3)
CROSS_RANK = np.array([5, 0, 7, 2, 1, 6, 3, 4])
# routing groups of 2 ({0,1} {2,3} {4,5} {6,7}): whole groups move, and experts inside groups
GROUP_PRESERVING = np.array([5, 4, 0, 1, 7, 6, 3, 2])


@dataclass(frozen=True)
class Case:
    name: str
    perm: tuple = tuple(CROSS_RANK)
    topk: int = 2
    forced: str = ""  # "" natural routing, "hot": 95% of tokens into expert 0
    llep: bool = False  # the placed layer is an LLEPMoELayer (the reference stays plain EP)
    grouped_gemm: bool = False
    config: tuple = ()  # TransformerConfig overrides as (key, value) pairs
    expert_bias: bool = False
    quantile_balancing: bool = False  # Megatron-Core 0.19's per-expert qb_beta routing bias
    router_rows_stay: bool = False  # negative control: experts move, the router's rows do not


# quantile-balancing routing exists from Megatron-Core 0.19 on (feature probe, not a version check)
HAS_QUANTILE_BALANCING = hasattr(TopKRouter, "quantile_balancing")

CASES = [
    Case("natural_routing"),
    Case("top1_natural", topk=1),
    Case("llep_forced_imbalance", forced="hot", llep=True),
    Case("sigmoid_expert_bias", expert_bias=True,
         config=(("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True),
                 ("moe_router_topk_scaling_factor", 2.5))),
    Case("group_limited", perm=tuple(GROUP_PRESERVING),
         config=(("moe_router_num_groups", 4), ("moe_router_group_topk", 2))),
    Case("grouped_gemm_bf16", grouped_gemm=True, forced="hot"),  # bf16 logits tie: force the routing
    Case("broken_router_rows_not_moved", router_rows_stay=True),
    Case("quantile_balancing", quantile_balancing=True,
         config=(("moe_router_load_balancing_type", "quantile_balancing"),)),
]
CASES = [
    c for c in CASES
    if (not c.grouped_gemm or mcore.GroupedMLP is not None) and (not c.quantile_balancing or HAS_QUANTILE_BALANCING)
]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _all_experts(layer, grads: bool) -> list[dict[str, torch.Tensor]]:
    """Every physical slot's expert tensors (or grads), gathered over the EP group."""
    return gathered_expert_weights(layer, grads=grads)


def _snapshot(layer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}


def _run(layer, x, dy, ids):
    if ids is not None:
        force_routing(layer.router, ids)
    xi = x.clone().requires_grad_()
    out, _ = layer(xi)
    (out.float() * dy.float()).sum().backward()
    return out.detach(), xi.grad.detach()


def compare_case(rank: int, case: Case) -> dict:
    perm = np.asarray(case.perm)
    dtype = torch.bfloat16 if case.grouped_gemm else torch.float32
    if case.grouped_gemm:
        grouped_gemm_cpu.install()
    cfg = moe_config(NUM_EXPERTS, HIDDEN, FFN, case.topk, 2, params_dtype=dtype, **dict(case.config))
    plain = build_moe_layer(cfg, None, seed=11, grouped_gemm=case.grouped_gemm)
    placed = build_moe_layer(cfg, LLEPConfig(min_chunk_tokens=2, cost_aware=False) if case.llep else None,
                             seed=11, grouped_gemm=case.grouped_gemm)
    if case.expert_bias:  # large enough to change which experts win
        bias = torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(3)) * 0.5
        for layer in (plain, placed):
            layer.router.expert_bias.copy_(bias)
    if case.quantile_balancing:  # a learnt-looking bias that changes which experts win
        beta = torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(4)) * 0.5
        for layer in (plain, placed):
            layer.router.qb_beta.copy_(beta)
    original = _snapshot(placed)
    placement = ExpertPlacement(NUM_EXPERTS, 2, {1: perm})
    if case.router_rows_stay:
        with mock.patch.object(placement_apply, "router_expert_tensors", lambda router, num_experts: []):
            apply_placement(placed, placement)
    else:
        apply_placement(placed, placement)

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, 1, HIDDEN, generator=gen).to(dtype)
    dy = torch.randn(TOKENS, 1, HIDDEN, generator=gen).to(dtype)
    ids = imbalanced_topk(TOKENS, NUM_EXPERTS, case.topk, 0.95, 1, seed=rank) if case.forced == "hot" else None
    to_slot = np.argsort(perm)
    ref_out, ref_dx = _run(plain, x, dy, ids)
    out, dx = _run(placed, x, dy, None if ids is None else to_slot[ids])

    ref_experts, got_experts = _all_experts(plain, grads=True), _all_experts(placed, grads=True)
    result = {
        "out": _rel_err(out, ref_out),
        "dx": _rel_err(dx, ref_dx),
        "router_grad": _rel_err(placed.router.weight.grad, plain.router.weight.grad[perm]),
        "expert_grads": max(_rel_err(got_experts[s][k], ref_experts[perm[s]][k]) for s in range(NUM_EXPERTS) for k in got_experts[s]),
        "llep_mode": placed.token_dispatcher.last_stats.mode if case.llep else "",
    }
    if case.expert_bias:
        result["tokens_per_expert"] = _rel_err(placed.router.local_tokens_per_expert, plain.router.local_tokens_per_expert[perm])
        result["expert_bias_moved"] = bool(torch.equal(placed.router.expert_bias, plain.router.expert_bias[perm]))
    if case.quantile_balancing:
        result["qb_beta_moved"] = bool(torch.equal(placed.router.qb_beta, plain.router.qb_beta[perm]))
        result["qb_beta_accum"] = _rel_err(placed.router.qb_beta_accum, plain.router.qb_beta_accum[perm])
    placed.zero_grad(set_to_none=True)
    if case.router_rows_stay:
        return result
    restore_original_order(placed, placement)
    restored = _snapshot(placed)
    result["round_trip_bit_identical"] = all(
        torch.equal(restored[k], v) for k, v in original.items() if k != "router.local_tokens_per_expert"
    ) and set(restored) == set(original)
    return result


def group_mixing_rejected() -> str:
    cfg = moe_config(NUM_EXPERTS, HIDDEN, FFN, 2, 2, moe_router_num_groups=4, moe_router_group_topk=2)
    layer = build_moe_layer(cfg, None, seed=1)
    try:
        apply_placement(layer, ExpertPlacement(NUM_EXPERTS, 2, {1: CROSS_RANK}))
    except ValueError as err:
        return str(err)
    return ""


def model_level_checks() -> dict:
    """A two-layer model: every layer gets its own permutation; mismatches are rejected clearly."""
    cfg = moe_config(NUM_EXPERTS, HIDDEN, FFN, 2, 2)
    model = torch.nn.ModuleList([build_moe_layer(cfg, None, seed=s) for s in (1, 2)])
    model[1].set_layer_number(2)
    before = [layer.router.weight.detach().clone() for layer in model]
    placement = ExpertPlacement(NUM_EXPERTS, 2, {1: CROSS_RANK, 2: GROUP_PRESERVING, 9: np.arange(8)})
    apply_placement(model, placement)
    moved = [torch.equal(layer.router.weight, w[torch.as_tensor(p)]) for layer, w, p in
             zip(model, before, (CROSS_RANK, GROUP_PRESERVING))]
    errors = {}
    for name, wrong in {"missing_layer": ExpertPlacement(NUM_EXPERTS, 2, {1: CROSS_RANK}),
                        "ep_size": ExpertPlacement(NUM_EXPERTS, 4, {1: CROSS_RANK, 2: CROSS_RANK}),
                        "num_experts": ExpertPlacement(4, 2, {1: np.arange(4), 2: np.arange(4)})}.items():
        try:
            apply_placement(model, wrong)
            errors[name] = ""
        except ValueError as err:
            errors[name] = str(err)
    return {"moved": moved, "errors": errors}


def checkpoint_round_trip(rank: int, directory: str) -> dict:
    """Save a placed layer with its placement file, load into a fresh layer, restore the order."""
    cfg = moe_config(NUM_EXPERTS, HIDDEN, FFN, 2, 2)
    layer = build_moe_layer(cfg, None, seed=5)
    original = _snapshot(layer)
    placement = ExpertPlacement(NUM_EXPERTS, 2, {1: CROSS_RANK})
    apply_placement(layer, placement)
    if rank == 0:
        write_checkpoint_placement(directory, placement)
    torch.save(layer.state_dict(), os.path.join(directory, f"model_rank{rank}.pt"))
    dist.barrier()
    fresh = build_moe_layer(cfg, None, seed=6)  # different weights until the checkpoint is loaded
    fresh.load_state_dict(torch.load(os.path.join(directory, f"model_rank{rank}.pt")))
    saved_in = read_checkpoint_placement(directory)
    restore_original_order(fresh, saved_in)
    restored = _snapshot(fresh)
    return {"equal": all(torch.equal(restored[k], v) for k, v in original.items()),
            "placement_recorded": saved_in is not None and np.array_equal(saved_in.slot_to_expert(1), CROSS_RANK)}


def record_traces(rank: int) -> dict:
    """Recorder vs independent references: forced ids, the router's own top-K, the memory cap."""
    cfg = moe_config(NUM_EXPERTS, HIDDEN, FFN, 2, 2)
    layer = build_moe_layer(cfg, None, seed=9)
    gen = torch.Generator().manual_seed(200 + rank)
    batches = [torch.randn(TOKENS, 1, HIDDEN, generator=gen) for _ in range(3)]

    with RoutingTraceRecorder(layer, max_tokens_per_layer=None) as recorder:
        with torch.no_grad():
            layer(batches[0])
    natural = recorder.trace().layer(1).expert_ids
    logits = batches[0].view(TOKENS, HIDDEN) @ layer.router.weight.detach().t()
    expected = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)[1].sort(dim=-1)[0].numpy()

    forced = [imbalanced_topk(TOKENS, NUM_EXPERTS, 2, 0.5, 2, seed=rank * 10 + i) for i in range(3)]
    capped = RoutingTraceRecorder(layer, max_tokens_per_layer=10, seed=rank)
    with capped:
        for x, ids in zip(batches, forced):
            force_routing(layer.router, ids)
            with torch.no_grad():
                layer(x)
    force_routing(layer.router, None)
    with torch.no_grad():
        layer(batches[0])  # after stop(): not recorded
    sample = capped.trace().layer(1)
    all_rows = {tuple(sorted(r)) for ids in forced for r in ids.tolist()}
    all_ids = np.concatenate(forced)
    return {
        "natural_equal": bool(np.array_equal(natural, expected)),
        "sampled": sample.num_sampled,
        "tokens_seen": sample.tokens_seen,
        "counts_exact": bool(np.array_equal(sample.expert_counts, np.bincount(all_ids.ravel(), minlength=NUM_EXPERTS))),
        "rows_recorded_exactly": all(tuple(r) in all_rows for r in sample.expert_ids.tolist()),
    }


def run_all(rank: int, world: int, directory: str) -> dict:
    init_expert_parallel(world)
    results = {case.name: compare_case(rank, case) for case in CASES}
    results["group_mixing_rejected"] = group_mixing_rejected()
    results["model"] = model_level_checks()
    results["checkpoint"] = checkpoint_round_trip(rank, directory)
    results["recorder"] = record_traces(rank)
    return results
