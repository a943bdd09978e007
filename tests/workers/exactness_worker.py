"""Rank-side code of the exactness tests: LLEP vs Megatron's stock alltoall dispatcher vs a float64
dense MoE, on the same weights, inputs and routing. Imported by spawned gloo processes."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_llep.config import LLEPConfig
from megatron_llep.runtime.forced_routing import force_routing
from megatron_llep.planning.scenarios import imbalanced_topk
from megatron_llep.testing import grouped_gemm_cpu
from megatron_llep.testing.moe import (build_moe_layer, expert_weights, gathered_expert_weights, init_expert_parallel,
                                       moe_config, send_a_neighbouring_expert)
from megatron_llep.testing.reference import dense_moe_reference, expert_forward_reference
from megatron_llep.runtime.kept_weights import KeptLedger
from megatron_llep.runtime.weight_exchange import ExpertWeightExchange


@dataclass(frozen=True)
class Case:
    name: str
    routing: str  # "uniform", "hot", "subset"
    num_experts: int = 8
    topk: int = 2
    tokens: tuple = ()  # tokens per rank; empty: 24 everywhere
    hot_fraction: float = 0.95
    num_hot: int = 1
    subset: tuple = ()  # experts that get all tokens for "subset"
    gpt_oss: bool = False
    fused_bias_act: bool = False
    hidden: int = 16
    ffn: int = 12
    min_chunk_tokens: int = 2
    imbalance_threshold: float = 1.3
    alpha: float = 1.0
    expect_mode: str = "llep"
    grouped_gemm: bool = False  # Megatron's legacy GroupedMLP (bf16; Megatron-Core < 0.17) instead of SequentialMLP
    bf16: bool = False  # bf16 parameters and activations (always with grouped_gemm)
    broken: str = ""  # negative control: a key of BROKEN_MAPPINGS, applied to the LLEP layer's run
    shared_expert: int = 0  # shared expert FFN width (0: none)
    shared_overlap: bool = False  # moe_shared_expert_overlap: dispatcher drives the shared expert
    capacity_factor: Optional[float] = None  # Megatron's token dropping (no padding); the dense reference does not drop
    budget_over_mean: Optional[int] = None  # max_tokens_per_rank = ceil(routed rows / EP) + this (None: no budget)
    ranks_per_node: Optional[int] = None  # LLEPConfig.ranks_per_node (None: one node)


def _expert_ids(case: Case, rank: int, tokens: int) -> np.ndarray:
    if case.routing == "uniform":
        return imbalanced_topk(tokens, case.num_experts, case.topk, 0.0, 0, seed=rank)
    if case.routing == "hot":
        return imbalanced_topk(tokens, case.num_experts, case.topk, case.hot_fraction, case.num_hot, seed=rank)
    if case.routing == "subset":
        pool = np.asarray(case.subset)
        rng = np.random.default_rng(rank)
        return pool[np.argsort(rng.random((tokens, pool.size)), axis=1)[:, : case.topk]]
    raise ValueError(case.routing)


def _row_budget(case: Case, world: int) -> Optional[int]:
    """``case``'s max_tokens_per_rank, from every rank's routing (each rank derives all of them)."""
    if case.budget_over_mean is None:
        return None
    rows = sum(_expert_ids(case, r, case.tokens[r] if case.tokens else 24).size for r in range(world))
    return -(-rows // world) + case.budget_over_mean


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _gather_experts(layer) -> list[dict]:
    """Every expert's weights (float64 leaves), gathered from their native ranks."""
    experts = [{key: tensor.double().requires_grad_() for key, tensor in weights.items()}
               for weights in gathered_expert_weights(layer)]
    for weights in experts:
        for key in ("fc1_bias", "fc2_bias"):
            weights.setdefault(key, None)
    return experts


@contextlib.contextmanager
def _drop_returned_gradients():
    """Helpers compute borrowed-weight gradients, but the native rank never receives them (neither
    those of copies used once nor the step's return of the kept ones)."""
    original, flush = ExpertWeightExchange.return_gradients, KeptLedger.flush_layer

    def dropped(self):
        original(self)
        return [None] * (len(self.sent_experts) * len(self.specs))

    def flushed_into_nothing(self, *args, **kwargs):
        flush(self, *args, **kwargs)
        return {}

    ExpertWeightExchange.return_gradients, KeptLedger.flush_layer = dropped, flushed_into_nothing
    try:
        yield
    finally:
        ExpertWeightExchange.return_gradients, KeptLedger.flush_layer = original, flush


@contextlib.contextmanager
def _reverse_each_wave():
    """Each wave's received weights go to its borrowed slots in reverse order."""
    original = ExpertWeightExchange.finish_wave

    def reversed_wave(self, wave, native_output):
        anchor, borrowed = original(self, wave, native_output)
        return anchor, borrowed[::-1]

    ExpertWeightExchange.finish_wave = reversed_wave
    try:
        yield
    finally:
        ExpertWeightExchange.finish_wave = original


# Negative controls: each breaks one mapping of LLEP; the comparisons must then fail.
BROKEN_MAPPINGS = {"wrong_expert_sent": send_a_neighbouring_expert, "gradients_not_returned": _drop_returned_gradients,
                   "wave_slots_reversed": _reverse_each_wave}


def _run_layer(layer, x, dy, ids):
    force_routing(layer.router, ids)
    xi = x.clone().requires_grad_()
    out, _ = layer(xi)
    (out * dy).sum().backward()
    return {
        "out": out.detach(),
        "dx": xi.grad.detach(),
        "router": layer.router.weight.grad.detach().clone(),
        "experts": [{k: g.detach().clone() for k, g in w.items()} for w in expert_weights(layer, grads=True)],
        "shared": [p.grad.detach().clone() for p in layer.shared_experts.parameters()] if layer.shared_experts else [],
    }


def compare_case(rank: int, world: int, case: Case) -> dict:
    tokens = case.tokens[rank] if case.tokens else 24
    dtype = torch.bfloat16 if case.grouped_gemm or case.bf16 else torch.float32
    if case.grouped_gemm:
        grouped_gemm_cpu.install()
    shared = dict(moe_shared_expert_intermediate_size=case.shared_expert,
                  moe_shared_expert_overlap=case.shared_overlap) if case.shared_expert else {}
    dropping = dict(moe_expert_capacity_factor=case.capacity_factor) if case.capacity_factor else {}
    cfg = moe_config(case.num_experts, case.hidden, case.ffn, case.topk, world, gpt_oss_experts=case.gpt_oss,
                     bias_activation_fusion=case.fused_bias_act, params_dtype=dtype, **shared, **dropping)
    llep_cfg = LLEPConfig(min_chunk_tokens=case.min_chunk_tokens, imbalance_threshold=case.imbalance_threshold,
                          alpha=case.alpha, cost_aware=False, max_tokens_per_rank=_row_budget(case, world),
                          ranks_per_node=case.ranks_per_node)
    stock = build_moe_layer(cfg, None, seed=7, grouped_gemm=case.grouped_gemm)
    llep = build_moe_layer(cfg, llep_cfg, seed=7, grouped_gemm=case.grouped_gemm)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, 1, case.hidden, generator=gen).to(dtype)
    dy = torch.randn(tokens, 1, case.hidden, generator=gen).to(dtype)
    ids = _expert_ids(case, rank, tokens)

    ref_stock = _run_layer(stock, x, dy, ids)
    with BROKEN_MAPPINGS[case.broken]() if case.broken else contextlib.nullcontext():
        got = _run_layer(llep, x, dy, ids)
    stats = llep.token_dispatcher.last_stats

    # float64 dense reference with autograd; expert gradients summed over all ranks' tokens
    experts = _gather_experts(stock)
    x64 = x.view(tokens, -1).double().requires_grad_()
    w64 = stock.router.weight.detach().double().requires_grad_()
    b64 = None if stock.router.bias is None else stock.router.bias.detach().double()
    y64 = dense_moe_reference(x64, w64, b64, torch.as_tensor(ids), experts, cfg)
    if case.shared_expert:
        fc1 = stock.shared_experts.linear_fc1.weight.detach().double()
        fc2 = stock.shared_experts.linear_fc2.weight.detach().double()
        y64 = y64 + expert_forward_reference(x64, fc1, None, fc2, None, torch.ones(tokens, dtype=torch.float64), cfg)
    (y64 * dy.view(tokens, -1).double()).sum().backward()
    errs = {
        "out_vs_stock": _rel_err(got["out"], ref_stock["out"]),
        "dx_vs_stock": _rel_err(got["dx"], ref_stock["dx"]),
        "router_vs_stock": _rel_err(got["router"], ref_stock["router"]),
        "out_vs_ref": _rel_err(got["out"].view(tokens, -1), y64.detach()),
        "dx_vs_ref": _rel_err(got["dx"].view(tokens, -1), x64.grad),
        "router_vs_ref": _rel_err(got["router"], w64.grad),
    }
    # every rank's reference holds the gradient of its own tokens: sum them, expert by expert
    ref_grads = {}
    for e, weights in enumerate(experts):
        for k, w in weights.items():
            if w is not None:
                grad = w.grad.clone()
                dist.all_reduce(grad)
                ref_grads[e, k] = grad
    expert_stock, expert_ref = 0.0, 0.0
    for local, grads in enumerate(got["experts"]):
        g = llep.local_expert_indices[local]
        for k, grad in grads.items():
            expert_stock = max(expert_stock, _rel_err(grad, ref_stock["experts"][local][k]))
            expert_ref = max(expert_ref, _rel_err(grad, ref_grads[g, k]))
    errs["experts_vs_stock"] = expert_stock
    errs["shared_vs_stock"] = max([_rel_err(a, b) for a, b in zip(got["shared"], ref_stock["shared"])], default=0.0)
    errs["experts_vs_ref"] = expert_ref
    errs["mode"] = stats.mode if stats is not None else "none"
    errs["dropped"] = tokens * case.topk - int(stock.token_dispatcher.routing_map.sum())
    errs["weight_transfers"] = stats.weight_transfers if stats is not None else 0
    errs["spilled_tokens"] = stats.spilled_tokens if stats is not None else 0
    errs["max_mean_after"] = stats.max_mean_after if stats is not None else 0.0
    errs["max_mean_before"] = stats.max_mean_before if stats is not None else 0.0
    errs["weight_bytes"] = stats.weight_bytes if stats is not None else 0
    rank_plan = llep.token_dispatcher.rank_plan if errs["mode"] == "llep" else None
    errs["borrowed_here"] = len(rank_plan.weights_to_receive) if rank_plan is not None else 0
    exchange = llep.token_dispatcher.weight_exchange if rank_plan is not None else None
    errs["waves_here"] = [len(exchange.wave_receives[w]) for w in exchange.waves] if exchange is not None else []
    errs["num_local_experts"] = llep.num_local_experts
    # the rows this rank's experts computed: what its token all-to-all received (the dispatcher's splits)
    dispatcher = llep.token_dispatcher
    errs["rows_here"] = int(sum(dispatcher._output_split_list) if dispatcher.llep_active else dispatcher.output_splits.sum())
    errs["budget"] = llep_cfg.max_tokens_per_rank
    errs["cross_node_chunks"], errs["node_aware_differs"] = _node_traffic(llep.token_dispatcher.plan, llep_cfg)
    weight_group = llep.token_dispatcher.weight_group
    errs["separate_weight_group"] = weight_group is not llep.token_dispatcher.ep_group and (
        dist.get_process_group_ranks(weight_group) == dist.get_process_group_ranks(llep.token_dispatcher.ep_group))
    return errs


def _node_traffic(plan, config: LLEPConfig) -> tuple[int, bool]:
    """Token rows the plan's spilled chunks move across nodes, and whether matching tokens in rank
    order (``node_aware_tokens=False``) would have made other chunks."""
    if plan is None or plan.is_plain_ep or config.ranks_per_node is None:
        return 0, False
    from megatron_llep.planning import plan_llep

    node = np.arange(plan.ep_size) // config.ranks_per_node
    crossing = int(plan.chunk_count[node[plan.chunk_src] != node[plan.chunk_dst]].sum())
    unaware = plan_llep(plan.counts, dataclasses.replace(config, node_aware_tokens=False))
    differs = unaware.chunk_count.size != plan.chunk_count.size or not all(
        np.array_equal(getattr(unaware, k), getattr(plan, k)) for k in ("chunk_src", "chunk_dst", "chunk_count"))
    return crossing, differs


def infeasible_budget(rank: int, world: int) -> dict:
    """An LLEP layer whose step routes more rows than EP x max_tokens_per_rank: what each rank
    raises, then one all-reduce of all ranks (it completes only if no rank was left inside a
    collective of the layer)."""
    from megatron_llep.planning import InfeasibleBudgetError

    init_expert_parallel(world)
    case = Case("infeasible_budget", "hot")
    tokens = 24
    budget = _row_budget(dataclasses.replace(case, budget_over_mean=-1), world)  # one row short of the mean
    cfg = moe_config(case.num_experts, case.hidden, case.ffn, case.topk, world)
    layer = build_moe_layer(cfg, LLEPConfig(min_chunk_tokens=2, cost_aware=False, max_tokens_per_rank=budget), seed=7)
    force_routing(layer.router, _expert_ids(case, rank, tokens))
    result = {"budget": budget}
    try:
        layer(torch.randn(tokens, 1, case.hidden))
        result["error"] = None
    except InfeasibleBudgetError as err:
        result.update(error=str(err), layer_number=err.layer_number, total_rows=err.total_rows)
    done = torch.ones(1)
    dist.all_reduce(done)
    result["all_reduce"] = float(done.item())
    return result


def run_cases(rank: int, world: int, cases: list) -> dict:
    init_expert_parallel(world)
    return {case.name: compare_case(rank, world, case) for case in cases}


def _main_grads_under_ddp(layer, x, dy, ids) -> list[dict[str, torch.Tensor]]:
    """Expert gradients as Megatron DDP accumulates them (fp32 ``main_grad`` of bf16 parameters)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(layer.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
    ddp.zero_grad_buffer()
    force_routing(layer.router, ids)
    out, _ = ddp(x.clone().requires_grad_())
    (out.float() * dy.float()).sum().backward()
    ddp.finish_grad_sync()
    params = expert_weights(layer)
    return [{k: p.main_grad.detach().clone() for k, p in weights.items()} for weights in params]


def bf16_main_grad_errors(rank: int, world: int) -> dict:
    """bf16 layers under DDP, hot routing: each expert's fp32 main_grad against a float64 reference,
    for stock EP and for LLEP (the mean relative error over all expert weights)."""
    init_expert_parallel(world)
    case = Case("bf16_ddp", "hot", topk=2, num_hot=1, hot_fraction=0.95, bf16=True)
    tokens = 96
    cfg = moe_config(case.num_experts, 32, 24, case.topk, world, params_dtype=torch.bfloat16)
    stock = build_moe_layer(cfg, None, seed=3)
    llep = build_moe_layer(cfg, LLEPConfig(min_chunk_tokens=2, cost_aware=False), seed=3)
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(tokens, 1, 32, generator=gen).to(torch.bfloat16)
    dy = torch.randn(tokens, 1, 32, generator=gen).to(torch.bfloat16)
    ids = _expert_ids(case, rank, tokens)
    experts = _gather_experts(stock)
    x64 = x.view(tokens, -1).double()
    w64 = stock.router.weight.detach().double()
    y64 = dense_moe_reference(x64, w64, None, torch.as_tensor(ids), experts, cfg)
    (y64 * dy.view(tokens, -1).double()).sum().backward()
    # every rank's reference holds its own tokens' share: sum them (all experts, in one order everywhere);
    # DDP averages over the 2 data-parallel ranks of the dense parameters (Megatron's gradient scaling)
    for weights in experts:
        for w in weights.values():
            if w is not None:
                dist.all_reduce(w.grad)
                w.grad /= world
    grads = {"stock": _main_grads_under_ddp(stock, x, dy, ids), "llep": _main_grads_under_ddp(llep, x, dy, ids)}
    result = {"mode": llep.token_dispatcher.last_stats.mode}
    for name, per_expert in grads.items():
        err = norm = 0.0
        for local, weights in enumerate(per_expert):
            for key, grad in weights.items():
                ref = experts[stock.local_expert_indices[local]][key].grad
                err += float((grad.double() - ref).abs().sum())
                norm += float(ref.abs().sum())
        result[name] = err / norm
    return result
