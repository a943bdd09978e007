"""Routing pruning as an option of LLEPMoELayer (``LLEPConfig.pruning``): CAP's device-level pruning
and the naive expert-level baseline.

At EP=2 over gloo, in eval mode, the layer's output must equal a float64 dense MoE fed with routing
pruned by the per-token loop written here (not by the library's functions), with LLEP spilling and
with LLEP disabled, for softmax and sigmoid (DeepSeek-style, scaled) routers; a reference with one
mapping broken on purpose must not match. Its statistics must equal brute-force counts, and reach
the dashboard's gather. Cost ordering across more than two devices (own device, its node, other
nodes) is checked in-process against the same loop at P=4 (at EP=2 the only other device is
ranked second whatever it costs). All distributed cases share one spawned process group.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from megatron_llep.config import LLEPConfig, LLEPConfigError, RoutingPruning
from megatron_llep.runtime.statistics import LLEPStatsTracker, PruningStepStats, pruning_metrics, pruning_totals
from megatron_llep.runtime.pruning import device_costs, prune_experts, prune_routing_map

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # recipes.runtime.dashboard, in the spawned ranks too

NUM_EXPERTS, HIDDEN, FFN, TOKENS, WORLD = 8, 16, 12, 48, 2
M = NUM_EXPERTS // WORLD


# ---------------------------------------------------------------- the per-token reimplementation
def brute_prune(
    experts: list[int],
    scores: list[float],
    method: str,
    p: float,
    own: int,
    node_size: int,
    cross_node_cost: float,
    device_of: Callable[[int], int] = lambda e: e // M,
    swap_own_and_remote_cost: bool = False,
) -> dict[int, float]:
    """One token: ``{kept expert: rescaled score}``, written from the rule's definition."""
    total = sum(scores)
    if method == "experts":
        ranked = sorted(range(len(experts)), key=lambda i: (-scores[i], experts[i]))
        kept, acc = [], 0.0
        for i in ranked:
            if kept and acc >= (1 - p) * total:
                break
            kept.append(experts[i])
            acc += scores[i]
    else:
        mass: dict[int, float] = {}
        for e, s in zip(experts, scores):
            mass[device_of(e)] = mass.get(device_of(e), 0.0) + s

        def cost(d: int) -> float:
            c = 0.0 if d == own else 1.0 if d // node_size == own // node_size else cross_node_cost
            return (1.0 if c == 0.0 else 0.0) if swap_own_and_remote_cost else c

        ranked_devices = sorted(mass, key=lambda d: (-(mass[d] / cost(d)) if cost(d) > 0 else -math.inf, -mass[d], d))
        kept_devices, acc = [], 0.0
        for d in ranked_devices:
            if kept_devices and acc >= (1 - p) * total:
                break
            kept_devices.append(d)
            acc += mass[d]
        kept = [e for e in experts if device_of(e) in kept_devices]
    score = dict(zip(experts, scores))
    kept_total = sum(score[e] for e in kept)
    return {e: score[e] * total / kept_total for e in kept}


def brute_counts(ids: np.ndarray, kept: list[dict], own: int, bytes_per_pair: int, node_size: int) -> dict[str, float]:
    """The statistics' totals for one rank and step, counted token by token."""
    out = dict.fromkeys(["device_visits", "device_visits_unpruned", "remote_device_visits",
                         "remote_device_visits_unpruned", "cross_node_device_visits",
                         "cross_node_device_visits_unpruned", "pairs", "pairs_unpruned", "alltoall_bytes",
                         "alltoall_bytes_unpruned"], 0.0)
    out["tokens"] = float(len(ids))
    for row, token_kept in zip(ids.tolist(), kept):
        for suffix, experts in (("_unpruned", row), ("", list(token_kept))):
            devices = {e // M for e in experts}
            out["device_visits" + suffix] += len(devices)
            out["remote_device_visits" + suffix] += len(devices - {own})
            out["cross_node_device_visits" + suffix] += sum(d // node_size != own // node_size for d in devices)
            out["pairs" + suffix] += len(experts)
            out["alltoall_bytes" + suffix] += bytes_per_pair * sum(e // M != own for e in experts)
    return out


# ---------------------------------------------------------------- rank side (spawned processes)
@dataclass(frozen=True)
class Case:
    name: str
    method: str
    p: float
    llep: bool = True  # LLEP enabled, with routing hot enough that it spills
    ranks_per_node: Optional[int] = None
    cross_node_cost: float = 4.0
    sigmoid: bool = False  # DeepSeek-style: sigmoid scores, expert bias, top-K scaling factor 2.5
    controls: bool = False  # also compare against references with one mapping broken


CASES = [
    *[Case(f"{method}_p{p}_{path}", method, p, llep=path == "llep")
      for method in ("devices", "experts") for p in (0.2, 0.5) for path in ("llep", "ep")],
    Case("devices_p0.5_cross_node", "devices", 0.5, ranks_per_node=1, cross_node_cost=4.0, controls=True),
    Case("devices_p0.5_sigmoid_llep", "devices", 0.5, sigmoid=True),
    Case("experts_p0.2_sigmoid_ep", "experts", 0.2, llep=False, sigmoid=True),
]
DASHBOARD_CASE = "devices_p0.5_cross_node"


def _all_experts(layer) -> list[dict]:
    """Every expert's weights in float64, gathered from their native ranks."""
    from megatron_llep.testing.moe import gathered_expert_weights

    return [dict(fc1_bias=None, fc2_bias=None, **{key: tensor.double() for key, tensor in weights.items()})
            for weights in gathered_expert_weights(layer)]


def _reference(x64: torch.Tensor, kept: list[dict], experts: list[dict], config) -> torch.Tensor:
    """``y_t = sum_e s'_{t,e} expert_e(x_t)`` over the kept (token, expert) pairs."""
    from megatron_llep.testing.reference import expert_forward_reference

    y = torch.zeros_like(x64)
    for e, weights in enumerate(experts):
        rows = [t for t, token_kept in enumerate(kept) if e in token_kept]
        if rows:
            prob = torch.tensor([kept[t][e] for t in rows], dtype=torch.float64)
            y = y.index_add(0, torch.tensor(rows), expert_forward_reference(x64[rows], prob=prob, config=config, **weights))
    return y


def _scores64(layer, x64: torch.Tensor, ids: np.ndarray, sigmoid: bool) -> np.ndarray:
    """The router's top-K scores at the forced experts, in float64 from its weights."""
    logits = (x64 @ layer.router.weight.detach().double().t()).gather(1, torch.as_tensor(ids))
    if not sigmoid:
        return torch.softmax(logits, dim=-1).numpy()
    scores = torch.sigmoid(logits)
    return (scores / scores.sum(dim=-1, keepdim=True) * layer.config.moe_router_topk_scaling_factor).numpy()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


def _run_case(rank: int, case: Case) -> dict:
    from megatron_llep.runtime.state import STATS
    from megatron_llep.runtime.forced_routing import force_routing
    from megatron_llep.planning.scenarios import imbalanced_topk
    from megatron_llep.testing.moe import build_moe_layer, moe_config

    router = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_topk_scaling_factor=2.5) if case.sigmoid else {}
    config = moe_config(NUM_EXPERTS, HIDDEN, FFN, 4, WORLD, **router)
    llep_config = LLEPConfig(min_chunk_tokens=2, cost_aware=False, enabled=case.llep, ranks_per_node=case.ranks_per_node,
                             pruning=RoutingPruning(case.p, case.method, case.cross_node_cost))
    layer = build_moe_layer(config, llep_config, seed=7).eval()
    observed = []  # a router hook registered after the layer's (as the trace recorder's is)
    layer.router.register_forward_hook(lambda module, inputs, output: observed.append(output[1].clone()))
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, 1, HIDDEN, generator=gen)
    ids = imbalanced_topk(TOKENS, NUM_EXPERTS, 4, 0.95, 2, seed=rank)  # experts 0, 1 (rank 0) hot
    force_routing(layer.router, ids)
    STATS.drain_pruning()
    if case.name == DASHBOARD_CASE:
        from recipes.runtime.dashboard import MoELoadMeter

        meter = MoELoadMeter(layer)
    with torch.no_grad():
        out, _ = layer(x)
    out = out.view(TOKENS, HIDDEN)

    x64 = x.view(TOKENS, HIDDEN).double()
    scores = _scores64(layer, x64, ids, case.sigmoid)
    experts = _all_experts(layer)
    node_size = case.ranks_per_node or WORLD

    def kept_with(**broken) -> list[dict]:
        return [brute_prune(row, s, case.method, case.p, rank, node_size, case.cross_node_cost, **broken)
                for row, s in zip(ids.tolist(), scores.tolist())]

    kept = kept_with()
    stats = layer.token_dispatcher.last_stats
    result = {
        "out_vs_ref": _rel_err(out, _reference(x64, kept, experts, config)),
        "mode": stats.mode if case.llep else "disabled",
        "dropped": sum(len(row) - len(k) for row, k in zip(ids.tolist(), kept)),
        "stats": layer.last_pruning_stats.totals(),
        "brute_stats": brute_counts(ids, kept, rank, 2 * HIDDEN * 4 + 4, node_size),
        "observed_pairs": [int(m.sum()) for m in observed],
        "recorded_layers": sorted(STATS.drain_pruning()) if case.name != DASHBOARD_CASE else None,
    }
    if case.controls:
        broken = {"device_e_mod_P": dict(device_of=lambda e: e % WORLD),
                  "own_and_remote_cost_swapped": dict(swap_own_and_remote_cost=True)}
        result["controls"] = {name: _rel_err(out, _reference(x64, kept_with(**b), experts, config))
                              for name, b in broken.items()}
    if case.name == DASHBOARD_CASE:
        from recipes.runtime.dashboard import gather_moe_metrics

        result["dashboard"] = gather_moe_metrics(meter)[0]
    return result


def _training_refusal(rank: int) -> str:
    from megatron_llep.runtime.forced_routing import force_routing
    from megatron_llep.planning.scenarios import imbalanced_topk
    from megatron_llep.testing.moe import build_moe_layer, moe_config

    layer = build_moe_layer(moe_config(NUM_EXPERTS, HIDDEN, FFN, 4, WORLD),
                            LLEPConfig(cost_aware=False, pruning=RoutingPruning(0.2)), seed=7)
    force_routing(layer.router, imbalanced_topk(8, NUM_EXPERTS, 4, 0.0, 0, seed=rank))
    try:
        layer(torch.randn(8, 1, HIDDEN))
    except ValueError as err:
        return str(err)
    return "no error"


def run_all(rank: int, world: int) -> dict:
    from megatron_llep.testing.moe import init_expert_parallel

    init_expert_parallel(world)
    results = {case.name: _run_case(rank, case) for case in CASES}
    results["training"] = _training_refusal(rank)
    return results


# ---------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def per_rank():
    from megatron_llep.testing.distributed import run_distributed

    return run_distributed(run_all, WORLD, timeout_s=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layer_output_equals_the_pruned_float64_reference(per_rank, case):
    for rank, results in enumerate(per_rank):
        r = results[case.name]
        assert r["out_vs_ref"] <= 2e-5, f"rank {rank}: {r['out_vs_ref']:.3g}"
        assert r["mode"] == ("llep" if case.llep else "disabled"), f"rank {rank}: plan mode {r['mode']}"
    assert sum(results[case.name]["dropped"] for results in per_rank) > 0  # pruning really dropped pairs


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_statistics_equal_brute_force_counts(per_rank, case):
    for results in per_rank:
        r = results[case.name]
        assert r["stats"] == r["brute_stats"]
        assert r["observed_pairs"] == [r["brute_stats"]["pairs"]]  # later router hooks see the pruned routing
        assert r["recorded_layers"] in (None, [1])


def test_negative_controls_detect_a_broken_mapping(per_rank):
    case = next(c for c in CASES if c.controls)
    for name in ("device_e_mod_P", "own_and_remote_cost_swapped"):
        errors = [results[case.name]["controls"][name] for results in per_rank]
        assert max(errors) > 1e-2, (name, errors)
    assert max(results[case.name]["out_vs_ref"] for results in per_rank) <= 2e-5


def test_dashboard_gathers_pruning_metrics_over_ranks(per_rank):
    totals = {k: sum(results[DASHBOARD_CASE]["brute_stats"][k] for results in per_rank)
              for k in per_rank[0][DASHBOARD_CASE]["brute_stats"]}
    metrics = per_rank[-1][DASHBOARD_CASE]["dashboard"]
    tokens = totals["tokens"]
    assert metrics["prune/devices_per_token"] == pytest.approx(totals["device_visits"] / tokens)
    assert metrics["prune/devices_per_token_unpruned"] == pytest.approx(totals["device_visits_unpruned"] / tokens)
    assert metrics["prune/remote_devices_per_token"] == pytest.approx(totals["remote_device_visits"] / tokens)
    assert metrics["prune/cross_node_devices_per_token"] == pytest.approx(totals["cross_node_device_visits"] / tokens)
    assert metrics["prune/cross_node_devices_per_token_unpruned"] > 0  # ranks_per_node=1: the other rank is another node
    assert metrics["prune/dropped_pair_fraction"] == pytest.approx(1 - totals["pairs"] / totals["pairs_unpruned"])
    assert metrics["prune/alltoall_bytes"] == totals["alltoall_bytes"]
    assert metrics["prune/alltoall_bytes_unpruned"] == totals["alltoall_bytes_unpruned"]
    assert metrics["prune/alltoall_bytes"] < metrics["prune/alltoall_bytes_unpruned"]
    assert "moe/layer_1/max_mean_load" in metrics


def test_training_is_refused_in_one_line(per_rank):
    for results in per_rank:
        message = results["training"]
        assert "inference-only" in message and "model.eval()" in message and "pruning=None" in message
        assert "\n" not in message


@pytest.mark.parametrize(
    "kwargs, knob",
    [(dict(p=1.0), "pruning.p"), (dict(p=-0.1), "pruning.p"), (dict(p=math.nan), "pruning.p"),
     (dict(p=0.2, method="tokens"), "pruning.method"), (dict(p=0.2, cross_node_cost=0.5), "pruning.cross_node_cost"),
     (dict(p=0.2, cross_node_cost=math.inf), "pruning.cross_node_cost")],
)
def test_config_validation_names_the_knob(kwargs, knob):
    with pytest.raises(LLEPConfigError, match=f"LLEPConfig.{knob} ") as err:
        RoutingPruning(**kwargs)
    assert err.value.knob == knob and err.value.for_flag("--prune-x").startswith("--prune-x ")


def test_config_takes_pruning_or_none():
    assert LLEPConfig().pruning is None
    assert LLEPConfig(pruning=RoutingPruning(0.3, "experts")).pruning.method == "experts"
    with pytest.raises(TypeError, match="LLEPConfig.pruning must be a RoutingPruning"):
        LLEPConfig(pruning=0.3)


def test_device_costs_own_node_and_other_nodes():
    assert device_costs(2, 4, 2, 4.0).tolist() == [4.0, 4.0, 0.0, 1.0]
    assert device_costs(1, 4, None, 4.0).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert device_costs(1, 2, 8, 4.0).tolist() == [1.0, 0.0]  # a node larger than the EP group: one node


@pytest.mark.parametrize("method", ["devices", "experts"])
@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("own", [0, 3])
def test_routing_map_pruning_across_nodes_matches_the_loop(method, p, own):
    """P=4 devices of 2 experts, 2 devices per node, c=4; unnormalised (sigmoid-like) scores."""
    rng = np.random.default_rng(int(p * 10) + own)
    tokens, experts, topk, per_device = 64, 8, 4, 2
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk]
    scores = rng.random((tokens, topk)) * 2.5
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, torch.as_tensor(ids), True)
    probs = torch.zeros(tokens, experts, dtype=torch.float64).scatter_(1, torch.as_tensor(ids), torch.as_tensor(scores))
    cost = device_costs(own, 4, 2, 4.0)
    pruned_map, pruned_probs = prune_routing_map(routing_map, probs, per_device, cost, p, method)
    for t in range(tokens):
        kept = brute_prune(ids[t].tolist(), scores[t].tolist(), method, p, own, 2, 4.0, device_of=lambda e: e // per_device)
        assert set(torch.nonzero(pruned_map[t]).flatten().tolist()) == set(kept)
        for e, s in kept.items():
            assert pruned_probs[t, e].item() == pytest.approx(s, rel=1e-12)
        assert pruned_probs[t].sum().item() == pytest.approx(scores[t].sum(), rel=1e-12)
    assert (~pruned_map & (pruned_probs != 0)).sum() == 0


def test_prune_experts_is_the_naive_rule_with_the_same_normalisation():
    rng = np.random.default_rng(5)
    ids = torch.as_tensor(np.argsort(rng.random((40, 8)), axis=1)[:, :4])
    probs = torch.as_tensor(rng.dirichlet(np.ones(4), 40))
    out = prune_experts(ids, probs, torch.arange(8) // 2, 0.4)
    for t in range(40):
        kept = brute_prune(ids[t].tolist(), probs[t].tolist(), "experts", 0.4, 0, 4, 4.0)
        assert set(ids[t][out.expert_mask[t]].tolist()) == set(kept)
        assert out.device_mask[t].tolist() == [d in {e // 2 for e in kept} for d in range(4)]
        assert out.probs[t].sum().item() == pytest.approx(probs[t].sum().item())
    assert torch.equal(prune_experts(ids, probs, torch.arange(8) // 2, 0.4, renormalize=False).probs,
                       torch.where(out.expert_mask, probs, 0.0))


def test_pruning_statistics_derive_sums_over_steps_and_layers():
    before = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]], dtype=torch.bool)  # 2 devices of 2 experts
    after = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 0]], dtype=torch.bool)
    step = PruningStepStats.from_routing(3, before, after, own_device=0, experts_per_device=2, alltoall_bytes_per_pair=10)
    assert step.totals() == {"tokens": 2.0, "device_visits": 2.0, "device_visits_unpruned": 4.0,
                             "remote_device_visits": 1.0, "remote_device_visits_unpruned": 2.0,
                             "cross_node_device_visits": 0.0, "cross_node_device_visits_unpruned": 0.0, "pairs": 3.0,
                             "pairs_unpruned": 5.0, "alltoall_bytes": 10.0, "alltoall_bytes_unpruned": 20.0}
    tracker = LLEPStatsTracker(max_steps=4)
    tracker.record_pruning(step)
    with tracker.set_aside():  # an evaluation whose statistics are gathered elsewhere
        tracker.record_pruning(step)
    tracker.record_pruning(PruningStepStats.from_routing(4, before, after, 0, 2, 10))
    assert tracker.drain() == {}
    totals = tracker.drain_pruning_totals()
    assert totals == {k: 2 * v for k, v in step.totals().items()} == pruning_totals([step, step])
    metrics = pruning_metrics(totals)
    assert metrics["prune/devices_per_token"] == 1.0 and metrics["prune/devices_per_token_unpruned"] == 2.0
    assert metrics["prune/dropped_pair_fraction"] == 0.4 and metrics["prune/alltoall_bytes"] == 20.0
    assert tracker.drain_pruning_totals() == {} and pruning_metrics({}) == {}
    for _ in range(9):  # past max_steps: the oldest entries are merged, never dropped
        tracker.record_pruning(step)
    assert tracker.drain_pruning_totals() == {k: 9 * v for k, v in step.totals().items()}
