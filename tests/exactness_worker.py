"""Rank-side code of the exactness tests: LLEP vs Megatron's stock alltoall dispatcher vs a float64
dense MoE, on the same weights, inputs and routing. Imported by spawned gloo processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_llep.config import LLEPConfig
from megatron_llep.scenarios import force_routing, imbalanced_topk
from megatron_llep.testing.moe import build_moe_layer, init_expert_parallel, moe_config
from megatron_llep.testing.reference import dense_moe_reference


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


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _expert_param_names(layer) -> list[str]:
    return [n for n, _ in layer.experts.local_experts[0].named_parameters()]


def _gather_experts(layer, world: int) -> list[dict]:
    """Every expert's weights, float64, gathered from their native ranks."""
    names = _expert_param_names(layer)
    local = [dict(e.named_parameters()) for e in layer.experts.local_experts]
    gathered: dict[str, list[torch.Tensor]] = {}
    for name in names:
        mine = torch.stack([p[name].detach() for p in local])
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine)
        gathered[name] = [t for block in out for t in block]
    key = {"linear_fc1.weight": "fc1_weight", "linear_fc1.bias": "fc1_bias", "linear_fc2.weight": "fc2_weight", "linear_fc2.bias": "fc2_bias"}
    num = len(gathered[names[0]])
    experts = []
    for e in range(num):
        weights = {v: None for v in key.values()}
        for name in names:
            weights[key[name]] = gathered[name][e].double().clone().requires_grad_()
        experts.append(weights)
    return experts


def _run_layer(layer, x, dy, ids):
    force_routing(layer.router, ids)
    xi = x.clone().requires_grad_()
    out, _ = layer(xi)
    (out * dy).sum().backward()
    return {
        "out": out.detach(),
        "dx": xi.grad.detach(),
        "router": layer.router.weight.grad.detach().clone(),
        "experts": {n: p.grad.detach().clone() for n, p in layer.experts.named_parameters()},
    }


def compare_case(rank: int, world: int, case: Case) -> dict:
    tokens = case.tokens[rank] if case.tokens else 24
    cfg = moe_config(case.num_experts, case.hidden, case.ffn, case.topk, world, gpt_oss_experts=case.gpt_oss,
                     bias_activation_fusion=case.fused_bias_act)
    llep_cfg = LLEPConfig(min_chunk_tokens=case.min_chunk_tokens, imbalance_threshold=case.imbalance_threshold,
                          alpha=case.alpha, cost_aware=False)
    stock = build_moe_layer(cfg, None, seed=7)
    llep = build_moe_layer(cfg, llep_cfg, seed=7)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, 1, case.hidden, generator=gen)
    dy = torch.randn(tokens, 1, case.hidden, generator=gen)
    ids = _expert_ids(case, rank, tokens)

    ref_stock = _run_layer(stock, x, dy, ids)
    got = _run_layer(llep, x, dy, ids)
    stats = llep.token_dispatcher.last_stats

    # float64 dense reference with autograd; expert gradients summed over all ranks' tokens
    experts = _gather_experts(stock, world)
    x64 = x.view(tokens, -1).double().requires_grad_()
    w64 = stock.router.weight.detach().double().requires_grad_()
    b64 = None if stock.router.bias is None else stock.router.bias.detach().double()
    y64 = dense_moe_reference(x64, w64, b64, torch.as_tensor(ids), experts, cfg)
    (y64 * dy.view(tokens, -1).double()).sum().backward()
    key = {"linear_fc1.weight": "fc1_weight", "linear_fc1.bias": "fc1_bias", "linear_fc2.weight": "fc2_weight", "linear_fc2.bias": "fc2_bias"}
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
    for name, grad in got["experts"].items():
        expert_stock = max(expert_stock, _rel_err(grad, ref_stock["experts"][name]))
        _, local, *rest = name.split(".")  # local_experts.{i}.linear_fc1.weight
        g = llep.local_expert_indices[int(local)]
        expert_ref = max(expert_ref, _rel_err(grad, ref_grads[g, key[".".join(rest)]]))
    errs["experts_vs_stock"] = expert_stock
    errs["experts_vs_ref"] = expert_ref
    errs["mode"] = stats.mode if stats is not None else "none"
    errs["weight_transfers"] = stats.weight_transfers if stats is not None else 0
    errs["spilled_tokens"] = stats.spilled_tokens if stats is not None else 0
    errs["max_mean_after"] = stats.max_mean_after if stats is not None else 0.0
    errs["max_mean_before"] = stats.max_mean_before if stats is not None else 0.0
    return errs


def run_cases(rank: int, world: int, cases: list) -> dict:
    init_expert_parallel(world)
    return {case.name: compare_case(rank, world, case) for case in cases}
