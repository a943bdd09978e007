"""Rank-side code of the memory tests: one forward+backward of plain EP on balanced routing and of
LLEP on 95 % of tokens forced into the experts of rank 0, each inside
:class:`megatron_llep.testing.memory.LiveTensors` (live tensor bytes, deterministic); and, with 95 %
forced into one expert (max/mean below lambda), LLEP under the row budget and stock EP."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from megatron_llep.config import LLEPConfig
from megatron_llep.planning.cost_model import CostModel
from megatron_llep.runtime.forced_routing import force_routing
from megatron_llep.planning.scenarios import imbalanced_topk
from megatron_llep.testing.memory import by_site, step_live_bytes
from megatron_llep.testing.moe import build_moe_layer, init_expert_parallel, moe_config

EXPERTS, HIDDEN, TOKENS, TOPK = 16, 96, 512, 4


def _step(layer, x):
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    return step_live_bytes(lambda: layer(xi)[0], lambda out: out.sum().backward())


def _borrowed_bytes(layer) -> int:
    expert_bytes = sum(t.numel() * t.element_size() for t in layer.expert_adapter.expert_tensors(0))
    return len(layer.token_dispatcher.rank_plan.weights_to_receive) * expert_bytes


def peaks(rank: int, world: int) -> dict:
    """Live-bytes peaks of the balanced run and of LLEP, this rank's borrowed weight bytes, and
    what LLEP still holds of its received weights after the backward; then, as a negative control,
    LLEP's peak again with its combine keeping a copy of the expert outputs alive to the step's end.
    Last, 95 % into one expert: LLEP with ``max_tokens_per_rank`` 5 % above the balanced run's rows
    per rank (it spills below lambda) and stock EP."""
    init_expert_parallel(world)
    cfg = moe_config(EXPERTS, HIDDEN, HIDDEN, TOPK, world, gpt_oss_experts=True)
    llep_cfg = LLEPConfig(min_chunk_tokens=8, cost_model=CostModel.cpu())
    torch.manual_seed(0)
    balanced, llep = (build_moe_layer(cfg, c, seed=3, weight_scale=0.05) for c in (None, llep_cfg))
    force_routing(balanced.router, imbalanced_topk(TOKENS, EXPERTS, TOPK, 0.0, 0, seed=17 + rank))
    force_routing(llep.router, imbalanced_topk(TOKENS, EXPERTS, TOPK, 0.95, EXPERTS // world, seed=17 + rank))
    x = torch.randn(TOKENS, 1, HIDDEN, generator=torch.Generator().manual_seed(rank))
    _step(llep, x)  # warm-up (first-call caches)
    out = {}
    for name, layer in (("balanced", balanced), ("llep", llep)):
        tracker = _step(layer, x)
        out[name] = tracker.peak.bytes
        out[name + "_sites"] = by_site(tracker.peak.live)
    dispatcher = llep.token_dispatcher
    out["mode"] = dispatcher.last_stats.mode
    out["borrowed"] = _borrowed_bytes(llep)
    exchange = dispatcher._exchange
    out["received_after_backward"] = 0 if exchange is None else sum(
        t.numel() * t.element_size() for ts in exchange.received.values() for t in ts)

    kept = []  # negative control: one retained copy of the expert outputs
    original = dispatcher.combine_preprocess

    def combine_preprocess(hidden_states):
        kept.append(hidden_states.clone())
        return original(hidden_states)

    dispatcher.combine_preprocess = combine_preprocess
    tracker = _step(llep, x)
    out["extra"] = tracker.peak.bytes
    out["extra_kept"] = kept[0].numel() * kept[0].element_size()
    out["extra_sites"] = by_site(tracker.peak.live)

    dispatcher.combine_preprocess = original
    one_hot = imbalanced_topk(TOKENS, EXPERTS, TOPK, 0.95, 1, seed=17 + rank)
    llep.llep_config = dispatcher.llep_config = replace(llep_cfg, max_tokens_per_rank=math.ceil(TOKENS * TOPK * 1.05))
    for layer in (llep, balanced):  # the balanced run's layer, stock EP, is the control on this routing
        force_routing(layer.router, one_hot)
    _step(llep, x)  # warm-up (the budget's plan)
    out["budget"], out["plain_ep"] = (_step(layer, x).peak.bytes for layer in (llep, balanced))
    out["budget_mode"] = dispatcher.last_stats.mode
    out["budget_max_mean_before"] = dispatcher.last_stats.max_mean_before
    out["budget_borrowed"] = _borrowed_bytes(llep)
    return out
