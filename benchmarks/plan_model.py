"""Plan-level model of the LLEP paper's layer experiment at full shapes, P = 8..64 (no GPU needed).

For every layer shape (gpt-oss-120b, DeepSeek-V3, Kimi-K2), EP size and scenario it samples the
routed-token counts, plans plain EP, the plain least-loaded plan (``cost_aware=False``) and LLEP
(cost-aware, the library default), and reports max/mean rank load, token and weight bytes moved,
the layer time the cost model predicts, the force-balanced ideal, a peak-memory model and the
planner's own time per call. It ends with a count of the points where the cost-aware plan is
predicted slower than either plain plan (there should be none). ``--bursts`` adds burst
scenarios: every rank of the first node sends ``f`` of its tokens to ``h`` experts of one rank.

    python benchmarks/plan_model.py [--ep 8 16 32 64] [--bursts] [--out results/plan_model.json]

Time model (documented in docs/benchmarks.md): a layer is dispatch all-to-all, expert GEMMs, combine
all-to-all. A rank's link time is latency + max(bytes out, bytes in) / bandwidth, intra-node and
inter-node links in parallel (8 ranks per node); GEMM time is the cost model's per-expert
roofline with a small-GEMM ramp. Each rank runs its native experts first, then its borrowed ones
wave by wave as their weights arrive (weights counted on the links after the tokens); the
all-to-alls and the compute phase take their slowest rank. The ideal is the same layer with
balanced routing (every expert gets the mean load).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from common import FULL_SHAPES, PAPER_SPEEDUP, SCENARIOS, LayerShape, print_table, sample_counts, write_results

from megatron_llep.config import LLEPConfig
from megatron_llep.planning.cost_model import CostModel, ExpertShape
from megatron_llep.planning import LLEPPlan, gradient_return_phases, plan_llep

RANKS_PER_NODE = 8


def expert_shape(shape: LayerShape) -> ExpertShape:
    return ExpertShape(shape.hidden, shape.ffn, gated=True, bias=shape.bias, dtype_bytes=2)


def _phase_time(out_bytes: np.ndarray, in_bytes: np.ndarray, model: CostModel, inter: bool) -> float:
    return max(model.link_time(float(max(o, i)), inter) for o, i in zip(out_bytes, in_bytes))


def predict(plan: LLEPPlan, shape: LayerShape, model: CostModel, kept_gradients_per_step: bool = False,
            free_weights: bool = False) -> dict:
    """Predicted phase times, traffic and per-rank activation memory of one plan, rank by rank.

    A rank runs its native experts (and those whose copy it already keeps) once the tokens are in,
    then its newly borrowed experts wave by wave (the plan's waves): a copy arrives once its link
    (the sender's out, the helper's in, whichever is busier) has carried the tokens and this and the
    earlier waves' copies, and, when a relay inside the node sends it, one intra-node copy time
    after the relay's own copy is in. With ``model.training`` bytes count twice (activations and
    weights, and their gradients), except that with ``kept_gradients_per_step`` a kept copy's
    gradient is left out (it returns once per step: :func:`step_gradient_return`). With
    ``free_weights`` the copies cost no link time (what the plan's token traffic alone costs).

    ``no_overlap_s`` is the same plan's no-overlap roofline: the token dispatch, then every weight
    copy (the cross-node ones, then the ones inside a node, a relay's after its own copy), then
    the busiest rank's GEMMs, then the combine, one after the other.
    """
    ep = plan.ep_size
    es = expert_shape(shape)
    scale = 2 if model.training else 1
    node = np.arange(ep) // RANKS_PER_NODE
    chunks = plan.token_chunks()
    src, dst, count = chunks[:, 1], chunks[:, 2], chunks[:, 3]
    remote = src != dst
    crossing = node[src] != node[dst]
    token_bytes = es.token_bytes * scale
    token_out = {inter: np.bincount(src[remote & (crossing == inter)], count[remote & (crossing == inter)], ep) * token_bytes for inter in (False, True)}
    token_in = {inter: np.bincount(dst[remote & (crossing == inter)], count[remote & (crossing == inter)], ep) * token_bytes for inter in (False, True)}
    dispatch = max(_phase_time(token_out[i], token_in[i], model, i) for i in (False, True))
    combine = max(_phase_time(token_in[i], token_out[i], model, i) for i in (False, True))

    per_slot = np.zeros((plan.num_experts, ep), np.int64)
    np.add.at(per_slot, (chunks[:, 0], dst), count)
    copies = list(zip(plan.transfer_source.tolist(), plan.transfer_helper.tolist(), plan.transfer_expert.tolist(),
                      plan.transfer_wave.tolist(), plan.transfer_kept.tolist()))
    copied = {(e, h) for _, h, e, _, _ in copies}
    gemms = np.zeros(ep)  # every GEMM of a rank
    own = np.zeros(ep)  # the GEMMs it can run without waiting for a copy
    for e, d in zip(*np.nonzero(per_slot)):
        t = model.gemm_time(int(per_slot[e, d]), es)
        gemms[d] += t
        if (e, d) not in copied:
            own[d] += t
    size = [es.weight_bytes * (1 if kept and kept_gradients_per_step else scale) for *_, kept in copies]
    if free_weights:
        size = [0] * len(copies)
    copy_out = {inter: np.zeros(ep) for inter in (False, True)}
    copy_in = {inter: np.zeros(ep) for inter in (False, True)}
    for (s, h, *_), nbytes in zip(copies, size):
        copy_out[bool(node[s] != node[h])][s] += nbytes
        copy_in[bool(node[s] != node[h])][h] += nbytes
    copies_alone = sum(_phase_time(copy_out[i], copy_in[i], model, i) for i in (False, True))
    arrival_of: dict[tuple[int, int], float] = {}  # (expert, helper) -> when its copy is in
    for (s, h, e, w, _), nbytes in zip(copies, size):
        inter = bool(node[s] != node[h])
        sent = sum(b for (s2, h2, _, w2, _), b in zip(copies, size) if s2 == s and w2 <= w and bool(node[h2] != node[s]) == inter)
        got = sum(b for (s2, h2, _, w2, _), b in zip(copies, size) if h2 == h and w2 <= w and bool(node[s2] != node[h]) == inter)
        arrival_of[(e, h)] = model.link_time(max(token_out[inter][s] + sent, token_in[inter][h] + got), inter)
    for (s, h, e, _, _), nbytes in zip(copies, size):
        if (e, s) in arrival_of:  # relayed: the relay forwards its copy once it has it
            arrival_of[(e, h)] = max(arrival_of[(e, h)], arrival_of[(e, s)] + model.link_time(nbytes, False))
    end = dispatch + own
    borrowed: dict[int, dict[int, float]] = {}
    arrival: dict[tuple[int, int], float] = {}
    for s, h, e, w, _ in copies:
        arrival[(h, w)] = max(arrival.get((h, w), 0.0), arrival_of[(e, h)])
        borrowed.setdefault(h, {})
        borrowed[h][w] = borrowed[h].get(w, 0.0) + model.gemm_time(int(per_slot[e, h]), es)
    for h, per_wave in borrowed.items():
        t = end[h]
        for w in sorted(per_wave):
            t = max(t, arrival[(h, w)]) + per_wave[w]
        end[h] = t
    compute = float(end.max()) - dispatch
    # Activation memory kept for backward per computed token-expert pair: expert input (D), fc1
    # output (2H), activation (H), expert output (D); plus borrowed weights.
    act_bytes = (2 * shape.hidden + 3 * shape.ffn) * es.dtype_bytes
    tokens_here = per_slot.sum(axis=0)
    borrowed_here = (per_slot > 0) & (plan.native_rank[:, None] != np.arange(ep))
    memory = tokens_here * act_bytes + borrowed_here.sum(axis=0) * es.weight_bytes
    return {
        "dispatch_s": dispatch,
        "compute_s": compute,
        "combine_s": combine,
        "layer_s": dispatch + compute + combine,
        "no_overlap_s": dispatch + copies_alone + float(gemms.max()) + combine,
        "weights_wait_s": compute - float(gemms.max()),  # the compute phase beyond the slowest rank's GEMMs
        "token_bytes": int(count[remote].sum()) * es.token_bytes * 2,
        "weight_bytes": plan.num_weight_transfers * es.weight_bytes,
        "peak_act_bytes": int(memory.max()),
        "max_mean": float(tokens_here.max() / tokens_here.mean()),
        # token rows on the busiest cross-node link (a rank's rows out of or into its node)
        "cross_node_rows": int(max(token_out[True].max(), token_in[True].max()) // token_bytes),
        "cross_node_total_rows": int(count[remote & crossing].sum()),
    }


def count_exchange_s(ep: int, num_experts: int, model: CostModel) -> float:
    """The all-gather of the ``[P, N]`` count matrix every rank plans from (int64; Megatron's
    alltoall dispatcher gathers the same matrix to size its all-to-all, so plain EP and the ideal
    pay it too): a ring of ``P - 1`` steps, each a link latency and one rank's row, over the slowest
    link class in the group (across nodes beyond ``RANKS_PER_NODE`` ranks)."""
    if ep <= 1:
        return 0.0
    return (ep - 1) * model.link_time(8.0 * num_experts, ep > RANKS_PER_NODE)


def overlapped(phases: dict) -> float:
    """A layer whose token all-to-alls hide behind computation (Megatron's EP overlap of one
    micro-batch's dispatch and combine with another's expert GEMMs): the longer of the two."""
    return max(phases["dispatch_s"] + phases["combine_s"], phases["compute_s"])


def balanced_counts(shape: LayerShape, ep: int) -> np.ndarray:
    """Every rank routes tokens x K assignments evenly over the experts (the force-balanced ideal)."""
    per = shape.tokens_per_gpu * shape.topk // shape.num_experts
    return np.full((ep, shape.num_experts), per, np.int64)


@dataclass(frozen=True)
class Burst:
    """Every rank of the first node (``RANKS_PER_NODE`` ranks) sends ``fraction`` of its tokens to
    ``num_hot`` experts (uniformly) of one rank: the first rank (inside the bursting node) or the
    last one (across nodes when P > 8); everything else is uniform over the other experts."""

    fraction: float
    num_hot: int
    hot_rank: str  # "first" or "last"

    @property
    def label(self) -> str:
        return f"burst {self.fraction:g}:{self.num_hot}@{self.hot_rank}"


BURSTS = tuple(Burst(f, h, where) for where in ("first", "last") for h in (1, 2, 4) for f in (0.8, 1.0))


def burst_counts(shape: LayerShape, ep: int, burst: Burst, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n, k, local = shape.num_experts, shape.topk, shape.num_experts // ep
    first = 0 if burst.hot_rank == "first" else (ep - 1) * local
    hot = np.arange(first, first + min(burst.num_hot, local))
    cold = np.setdiff1d(np.arange(n), hot)
    counts = np.zeros((ep, n), np.int64)
    for rank in range(ep):
        tokens = shape.tokens_per_gpu
        hot_tokens = rng.binomial(tokens, burst.fraction) if rank < RANKS_PER_NODE else 0
        on_hot = hot_tokens * min(hot.size, k)
        counts[rank, hot] = rng.multinomial(on_hot, np.full(hot.size, 1.0 / hot.size))
        counts[rank, cold] = rng.multinomial(tokens * k - on_hot, np.full(cold.size, 1.0 / cold.size))
    return counts


def time_planner(counts: np.ndarray, config: LLEPConfig, es: ExpertShape, repeats: int, **planning) -> float:
    """Seconds of one :func:`plan_llep` call on this host, the least of ``repeats`` (``planning``:
    its ``held`` and ``keep_room``); the planner runs on every rank's host between the count
    exchange and the dispatch, so the step model adds it to LLEP's layer time."""
    plan_llep(counts, config, es, **planning)
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        plan_llep(counts, config, es, **planning)
        times.append(time.perf_counter() - start)
    return float(np.min(times))


def ep_config(config: LLEPConfig, model: CostModel, ep: int) -> LLEPConfig:
    """``config``'s knobs at EP size ``ep``: ``RANKS_PER_NODE`` ranks per node, ``model``'s costs."""
    return replace(config, ranks_per_node=min(RANKS_PER_NODE, ep), cost_model=model)


def ideal_prediction(shape: LayerShape, ep: int, config: LLEPConfig) -> dict:
    """:func:`predict` of the force-balanced ideal: the same layer with balanced routing."""
    return predict(plan_llep(balanced_counts(shape, ep), config, expert_shape(shape)), shape, config.cost_model)


def compare_plans(counts: np.ndarray, shape: LayerShape, config: LLEPConfig, ideal: dict, repeats: int) -> dict:
    """One row's figures for a ``[P, N]`` count matrix: plain EP, the plain least-loaded plan and
    LLEP as ``config`` (from :func:`ep_config`) plans it, against the ``ideal`` prediction; shared
    by every caller so that scenario and trace-replay rows are computed alike."""
    model, es = config.cost_model, expert_shape(shape)
    plain = plan_llep(counts, LLEPConfig(imbalance_threshold=1e9, cost_aware=False))
    unaware = plan_llep(counts, replace(config, cost_aware=False))
    llep = plan_llep(counts, config, es)
    p_ep, p_llep = predict(plain, shape, model), predict(llep, shape, model)
    p_unaware = predict(unaware, shape, model)
    return {
        "ep_max_mean": p_ep["max_mean"], "llep_max_mean": p_llep["max_mean"],
        "unaware_max_mean": p_unaware["max_mean"],
        "ep_ms": p_ep["layer_s"] * 1e3, "llep_ms": p_llep["layer_s"] * 1e3, "ideal_ms": ideal["layer_s"] * 1e3,
        "unaware_ms": p_unaware["layer_s"] * 1e3, "aware_vs_unaware": p_llep["layer_s"] / p_unaware["layer_s"],
        "capacity_x": llep.capacity * plain.ep_size / max(int(counts.sum()), 1) / config.alpha,
        "speedup": p_ep["layer_s"] / p_llep["layer_s"], "llep_vs_ideal": p_llep["layer_s"] / ideal["layer_s"],
        "ep_token_gb": p_ep["token_bytes"] / 1e9, "llep_token_gb": p_llep["token_bytes"] / 1e9,
        "weight_gb": p_llep["weight_bytes"] / 1e9, "weight_copies": llep.num_weight_transfers,
        "llep_no_overlap_vs_ideal": p_llep["no_overlap_s"] / ideal["no_overlap_s"],
        "llep_free_weights_vs_ideal": predict(llep, shape, model, free_weights=True)["layer_s"] / ideal["layer_s"],
        "llep_cross_node_rows_vs_ideal": (p_llep["cross_node_rows"] / ideal["cross_node_rows"]
                                          if ideal["cross_node_rows"] else None),
        "ep_mem_vs_ideal": p_ep["peak_act_bytes"] / ideal["peak_act_bytes"],
        "llep_mem_vs_ideal": p_llep["peak_act_bytes"] / ideal["peak_act_bytes"],
        "mode": "llep" if not llep.is_plain_ep else ("fallback" if llep.fallback else "plain"),
        "plan_ms": time_planner(counts, config, es, repeats) * 1e3,
    }


def run(eps: list[int], scenarios: tuple, seed: int, repeats: int, config: LLEPConfig, model: CostModel) -> list[dict]:
    rows = []
    for shape in FULL_SHAPES:
        for ep in eps:
            if shape.num_experts % ep:
                continue
            configured = ep_config(config, model, ep)
            ideal = ideal_prediction(shape, ep, configured)
            for scenario in scenarios:
                if isinstance(scenario, Burst):
                    counts = burst_counts(shape, ep, scenario, seed)
                else:
                    counts = sample_counts(shape, ep, scenario, seed)
                rows.append({
                    "model": shape.name, "ep": ep, "scenario": scenario.label,
                    **compare_plans(counts, shape, configured, ideal, repeats),
                    "paper_speedup": PAPER_SPEEDUP.get(shape.name, {}).get(scenario.label) if ep == 8 else None,
                })
    return rows


# Step-level model: micro-batches per optimizer step, EP sizes, and the two ways of
# handling borrowed weights: BEFORE copies them afresh every micro-batch (and returns their gradients
# in its backward), AFTER keeps them for the step and relays them inside nodes (LLEPConfig defaults).
MICRO_BATCHES = (1, 4, 8)
DEFAULT_EPS = [8, 16, 32, 64]
STEP_EPS = (8, 16, 64)


# Kept copies per rank and layer in the step model unless --max-kept-copies says otherwise: the
# library's default bound (LLEPConfig.max_kept_weight_bytes = "auto": one copy per rank and layer).
DEFAULT_KEPT_COPIES = 1


def weight_handling(config: LLEPConfig) -> dict[str, LLEPConfig]:
    return {"before": replace(config, max_kept_weight_bytes=0, relay_within_node=False),
            "after": replace(config, max_kept_weight_bytes=None, relay_within_node=True)}


def step_gradient_return(held: np.ndarray, shape: LayerShape, model: CostModel, relay: bool) -> tuple[list[float], int]:
    """Seconds of each phase, and cross-node bytes, of the once-per-step return of the kept
    copies' gradients (``held[e, p]``: rank ``p`` keeps a copy of ``e``): the runtime's phases
    (:func:`gradient_return_phases`; with relays a hierarchical sum in stripes inside and across
    nodes, phases without transfers left out as the runtime does), each as long as its busiest
    link (both link classes in parallel). A kept copy's gradient is its fp32 accumulator (4 bytes
    per parameter, what the runtime sends)."""
    ep = held.shape[1]
    numel = expert_shape(shape).num_params
    node = np.arange(ep) // RANKS_PER_NODE
    seconds, crossing = [], 0
    for phase in gradient_return_phases(held, shape.num_experts // ep, numel, RANKS_PER_NODE, relay):
        if not phase:
            continue
        links = {inter: (np.zeros(ep), np.zeros(ep)) for inter in (False, True)}
        for _, src, dst, lo, hi in phase:
            inter = bool(node[src] != node[dst])
            out, into = links[inter]
            out[src] += 4 * (hi - lo)
            into[dst] += 4 * (hi - lo)
            crossing += 4 * (hi - lo) * inter
        seconds.append(max(_phase_time(out, into, model, inter) for inter, (out, into) in links.items()))
    return seconds, crossing


# MoE layers of the whole model: gpt-oss-120b 36 layers; DeepSeek-V3 61, the first 3 dense; Kimi-K2 61, the first one dense (its config.json: first_k_dense_replace = 1).
MOE_LAYERS = {"gpt-oss-120b": 36, "deepseek-v3": 58, "kimi-k2": 60}


def behind_backward(phases: list[float], window_s: float, moe_layers: int) -> float:
    """Seconds per layer that a return run behind the backward of the layers below (under Megatron
    DDP) adds to the step: phase k is posted at the k-th LLEP layer's
    backward below and waited for at the next, so it hides in that layer's backward GEMMs
    (``window_s``, when the links are free of its token all-to-all) and shows only beyond them;
    the layer ``i`` from the bottom has only ``i - 1`` layers below, so phases ``i - 1 ..`` of it
    wait at ``finish_grad_sync``: ``sum_k (k + 1) t_k`` over the model, per layer over ``moe_layers``."""
    beyond = sum(max(0.0, t - window_s) for t in phases)
    return beyond + sum((k + 1) * t for k, t in enumerate(phases)) / moe_layers


def step_rows(shape: LayerShape, ep: int, scenario, config: LLEPConfig, seed: int, repeats: int,
              kept_copies: Optional[int] = DEFAULT_KEPT_COPIES, overlap: bool = False) -> list[dict]:
    """:func:`step_replay` of ``max(MICRO_BATCHES)`` micro-batches of a forced scenario, each with
    its own count matrix."""
    counts = [sample_counts(shape, ep, scenario, seed * 1009 + k) for k in range(max(MICRO_BATCHES))]
    return step_replay(shape, ep, counts, {"scenario": scenario.label}, config, repeats, kept_copies, overlap)


def step_replay(shape: LayerShape, ep: int, micro_batches: list[np.ndarray], label: dict, config: LLEPConfig,
                repeats: int, kept_copies: Optional[int] = DEFAULT_KEPT_COPIES, overlap: bool = False) -> list[dict]:
    """LLEP over one optimizer step of one layer (forward and backward, ``config.cost_model`` a
    training model), the micro-batches' count matrices planned in order; a row per step length in
    MICRO_BATCHES (a shorter step is the first micro-batches of a longer one) and weight handling,
    against that many micro-batches of the force-balanced ideal. Kept copies carry forward as
    ``held`` and return their gradients once, at the end of the step (``llep_vs_ideal``: in the
    layer's last backward, as loops without Megatron DDP; ``llep_vs_ideal_behind``: behind the
    layers below, as under Megatron DDP); transient copies return theirs in their micro-batch.
    ``kept_copies``: "after" keeps at most that many copies per rank (this one layer is the whole
    model's share: the library's default bound is one per rank and layer); ``None``: no bound.

    Every micro-batch of LLEP, plain EP and the ideal pays the count exchange
    (:func:`count_exchange_s`); LLEP also pays its planner's host time, measured here
    (:func:`time_planner`, least of ``repeats``). ``llep_vs_ideal_no_overlap`` is the no-overlap
    roofline: every micro-batch's ``predict(...)["no_overlap_s"]`` plus the whole step-end return,
    against the ideal's. With ``overlap`` the baselines (plain EP and the ideal) hide their token
    all-to-alls behind computation (:func:`overlapped`), and so does LLEP, whose compute phase
    includes its waits for weight copies; its planner and return are not hidden."""
    es, model = expert_shape(shape), config.cost_model
    ideal_layer = ideal_prediction(shape, ep, config)
    exchange = count_exchange_s(ep, shape.num_experts, model)
    ideal = (overlapped(ideal_layer) if overlap else ideal_layer["layer_s"]) + exchange
    ideal_no_overlap = ideal_layer["no_overlap_s"] + exchange
    window_s = ideal_layer["compute_s"] * 2 / 3  # one layer's backward GEMMs (a third of the compute is forward)
    plain_config = LLEPConfig(imbalance_threshold=1e9, cost_aware=False)
    rows = []
    for handling, configured in weight_handling(config).items():
        if kept_copies is not None and handling == "after":
            configured = replace(configured, max_kept_weight_bytes=kept_copies * es.kept_copy_bytes)
        kept_bound = configured.max_kept_weight_bytes
        room = None if kept_bound is None else np.full(ep, kept_bound // es.kept_copy_bytes, np.int64)
        held = np.zeros((shape.num_experts, ep), bool)
        node = np.arange(ep) // RANKS_PER_NODE
        layer_s, no_overlap_s, copies, transient, crossing, crossing_transient = 0.0, 0.0, 0, 0, 0, 0
        ep_s, planner_s, cross_rows, ep_cross_rows, cross_total, ep_cross_total = 0.0, 0.0, 0, 0, 0, 0
        for k, counts in enumerate(micro_batches):
            planning = dict(held=held.copy(), keep_room=None if room is None else room.copy())
            plan = plan_llep(counts, configured, es, **planning)
            plan_s = time_planner(counts, configured, es, repeats, **planning)
            predicted = predict(plan, shape, model, kept_gradients_per_step=True)
            plain = predict(plan_llep(counts, plain_config), shape, model)
            planner_s += plan_s
            layer_s += (overlapped(predicted) if overlap else predicted["layer_s"]) + plan_s + exchange
            no_overlap_s += predicted["no_overlap_s"] + plan_s + exchange
            ep_s += (overlapped(plain) if overlap else plain["layer_s"]) + exchange
            cross_rows = max(cross_rows, predicted["cross_node_rows"])
            ep_cross_rows = max(ep_cross_rows, plain["cross_node_rows"])
            cross_total += predicted["cross_node_total_rows"]
            ep_cross_total += plain["cross_node_total_rows"]
            copies += plan.num_weight_transfers
            transient += int((~plan.transfer_kept).sum())
            crosses = node[plan.transfer_source] != node[plan.transfer_helper]
            crossing += int(crosses.sum())
            crossing_transient += int((crosses & ~plan.transfer_kept).sum())
            kept = plan.transfer_kept
            held[plan.transfer_expert[kept], plan.transfer_helper[kept]] = True
            if room is not None:
                room -= np.bincount(plan.transfer_helper[kept], minlength=ep)
            if k + 1 not in MICRO_BATCHES:
                continue
            phases, return_crossing = step_gradient_return(held, shape, model, configured.relay_within_node)
            return_s = sum(phases)
            # the runtime knows a step's last backward only from the earlier micro-batches' no_sync: a
            # step of one returns at finish_grad_sync, after the whole backward
            behind_s = behind_backward(phases, window_s, MOE_LAYERS.get(shape.name, 36)) if k > 0 else return_s
            step_s = layer_s + return_s
            rows.append({
                "model": shape.name, "ep": ep, **label, "micro_batches": k + 1,
                "weights": handling, "step_ms": step_s * 1e3, "ideal_ms": (k + 1) * ideal * 1e3,
                "ep_vs_ideal": ep_s / ((k + 1) * ideal),
                "llep_vs_ideal": step_s / ((k + 1) * ideal), "grad_return_ms": return_s * 1e3,
                "llep_vs_ideal_behind": (layer_s + behind_s) / ((k + 1) * ideal), "grad_return_behind_ms": behind_s * 1e3,
                "llep_vs_ideal_no_overlap": (no_overlap_s + return_s) / ((k + 1) * ideal_no_overlap),
                "planner_ms": planner_s / (k + 1) * 1e3, "count_exchange_ms": exchange * 1e3,
                "overlapped_baseline": overlap,
                "cross_node_rows": cross_rows, "ep_cross_node_rows": ep_cross_rows,
                "cross_node_rows_vs_ep": cross_total / ep_cross_total if ep_cross_total else None,
                "weight_gb": copies * es.weight_bytes / 1e9,
                "grad_gb": (transient * es.weight_bytes + held.sum() * 4 * es.num_params) / 1e9,  # kept: fp32
                "cross_node_weight_gb": crossing * es.weight_bytes / 1e9,
                "cross_node_grad_gb": (crossing_transient * es.weight_bytes + return_crossing) / 1e9,
                "kept_copies": int(held.sum()), "max_kept_per_rank": int(held.sum(axis=0).max()),
                "max_kept_gb_per_rank": int(held.sum(axis=0).max()) * es.kept_copy_bytes / 1e9,
                "kept_bound_copies": kept_copies if handling == "after" else 0,
                "plan_ms": plan_s * 1e3,
            })
    return rows


def kept_copies_arg(text: str) -> Optional[int]:
    """``--max-kept-copies``: a number of copies or ``none``."""
    if text.lower() == "none":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of copies >= 0 or 'none', got {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=DEFAULT_EPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--planner-repeats", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--min-chunk-tokens", type=int, default=1024)
    parser.add_argument("--imbalance-threshold", type=float, default=1.3)
    parser.add_argument("--bursts", action="store_true", help="add the burst scenarios (BURSTS)")
    parser.add_argument("--steps", action="store_true",
                        help="the step-level model instead: 1, 4 and 8 micro-batches per step at P = 8, 16, 64 "
                             "(--ep to change), training cost model, borrowed weights copied per micro-batch "
                             "(before) or kept for the step and relayed inside nodes (after)")
    parser.add_argument("--quick", action="store_true", help="with --steps: DeepSeek-V3 and the 95 %% scenarios only")
    parser.add_argument("--max-kept-copies", type=kept_copies_arg, default=DEFAULT_KEPT_COPIES,
                        help="with --steps: 'after' keeps at most this many copies per rank and layer (default "
                             f"{DEFAULT_KEPT_COPIES}, the library's default bound; 'none': no bound)")
    parser.add_argument("--overlapped-baseline", action="store_true",
                        help="with --steps: plain EP and the ideal hide their token all-to-alls behind computation "
                             "(Megatron's EP overlap), and so does LLEP (its waits for weight copies inside its compute); its "
                             "planner and return stay exposed")
    parser.add_argument("--out", default=None, help="default: results/plan_model.json (results/plan_model_steps.json with --steps)")
    args = parser.parse_args()
    config = LLEPConfig(alpha=args.alpha, min_chunk_tokens=args.min_chunk_tokens, imbalance_threshold=args.imbalance_threshold)
    if args.steps:
        run_steps(args, config)
        return
    args.out = args.out or "results/plan_model.json"
    model = CostModel()
    rows = run(args.ep, SCENARIOS + (BURSTS if args.bursts else ()), args.seed, args.planner_repeats, config, model)
    print_table(rows, [
        ("model", "model", ""), ("ep", "P", "d"), ("scenario", "scenario", ""), ("mode", "plan", ""),
        ("ep_max_mean", "EP max/mean", ".2f"), ("llep_max_mean", "LLEP max/mean", ".2f"),
        ("ep_ms", "EP ms", ".2f"), ("unaware_ms", "plain LLA ms", ".2f"), ("llep_ms", "LLEP ms", ".2f"),
        ("ideal_ms", "ideal ms", ".2f"), ("capacity_x", "cap x", ".2f"),
        ("speedup", "speedup", ".2f"), ("llep_vs_ideal", "LLEP/ideal", ".3f"),
        ("ep_token_gb", "EP tok GB", ".2f"), ("llep_token_gb", "LLEP tok GB", ".2f"), ("weight_gb", "weights GB", ".2f"),
        ("ep_mem_vs_ideal", "EP mem", ".2f"), ("llep_mem_vs_ideal", "LLEP mem", ".2f"), ("plan_ms", "plan ms", ".3f"),
    ])
    print()
    print(summary(rows))
    write_results(args.out, "plan_model", rows, {**vars(args), "cost_model": model, "ranks_per_node": RANKS_PER_NODE})


def run_steps(args: argparse.Namespace, config: LLEPConfig) -> None:
    model = CostModel(training=True)
    eps = args.ep if args.ep != DEFAULT_EPS else list(STEP_EPS)
    shapes = [s for s in FULL_SHAPES if s.name == "deepseek-v3"] if args.quick else FULL_SHAPES
    scenarios = [s for s in SCENARIOS if s.hot_fraction in (0.0, 0.95)] if args.quick else SCENARIOS
    rows = []
    for shape in shapes:
        for ep in eps:
            if shape.num_experts % ep == 0:
                for scenario in scenarios:
                    rows += step_rows(shape, ep, scenario, ep_config(config, model, ep), args.seed, args.planner_repeats,
                                      args.max_kept_copies, args.overlapped_baseline)
    print_table(rows, [
        ("model", "model", ""), ("ep", "P", "d"), ("scenario", "scenario", ""), ("micro_batches", "K", "d"),
        ("weights", "weights", ""), ("step_ms", "step ms", ".2f"), ("ideal_ms", "ideal ms", ".2f"),
        ("llep_vs_ideal", "LLEP/ideal", ".3f"), ("grad_return_ms", "grad return ms", ".2f"),
        ("llep_vs_ideal_behind", "behind: LLEP/ideal", ".3f"), ("grad_return_behind_ms", "behind: ms", ".2f"),
        ("llep_vs_ideal_no_overlap", "no overlap: LLEP/ideal", ".3f"), ("max_kept_per_rank", "kept/rank", "d"),
        ("weight_gb", "weights GB", ".2f"), ("grad_gb", "grads GB", ".2f"),
        ("cross_node_weight_gb", "x-node w GB", ".2f"), ("cross_node_grad_gb", "x-node g GB", ".2f"),
        ("kept_copies", "kept", "d"), ("planner_ms", "planner ms", ".3f"),
        ("cross_node_rows_vs_ep", "x-node rows / EP", ".2f"),
    ])
    print()
    print(step_summary(rows))
    write_results(args.out or "results/plan_model_steps.json", "plan_model_steps", rows,
                  {**vars(args), "cost_model": model, "ranks_per_node": RANKS_PER_NODE})


def step_summary(rows: list[dict], where: str = "scenario") -> str:
    """Per (P, K, weight handling): median and worst LLEP/ideal and the points above 1.10, in the
    last layer's backward, behind the layers below (kept copies, as under Megatron DDP) and as the
    no-overlap roofline; the slowest planner call, the most copies one rank keeps, and the points
    where LLEP moves more token rows across nodes than plain EP (``where`` names a point)."""
    lines = []
    for key in sorted({(r["ep"], r["micro_batches"], r["weights"]) for r in rows}):
        group = [r for r in rows if (r["ep"], r["micro_batches"], r["weights"]) == key]
        for field, label in (("llep_vs_ideal", ""), ("llep_vs_ideal_behind", ", behind"),
                             ("llep_vs_ideal_no_overlap", ", no overlap")):
            if label == ", behind" and key[2] == "before":
                continue
            worst = max(group, key=lambda r: r[field])
            over = sum(r[field] > 1.10 for r in group)
            more_cross = sum((r["cross_node_rows_vs_ep"] or 0) > 1 for r in group)
            lines.append(f"P = {key[0]:2d}, K = {key[1]}, {key[2] + label:14s}: LLEP/ideal median "
                         f"{float(np.median([r[field] for r in group])):.3f}, worst {worst[field]:.3f} "
                         f"({worst['model']} {worst.get(where, '')}), {over} of {len(group)} points above 1.10, "
                         f"slowest plan {max(r['plan_ms'] for r in group):.3f} ms, "
                         f"most copies kept on one rank {max(r['max_kept_per_rank'] for r in group)}, "
                         f"points with more cross-node token rows than plain EP {more_cross}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Where the cost-aware plan is predicted slower than the plain least-loaded plan or plain EP."""
    slower = [r for r in rows if r["llep_ms"] > r["unaware_ms"] * (1 + 1e-9) or r["llep_ms"] > r["ep_ms"] * (1 + 1e-9)]
    ratios = [r["aware_vs_unaware"] for r in rows]
    return (f"cost-aware LLEP predicted slower than the plain least-loaded plan or plain EP at {len(slower)} of "
            f"{len(rows)} points; cost-aware / plain least-loaded layer time: worst {max(ratios):.3f}, "
            f"best {min(ratios):.3f}, {sum(x < 1 - 1e-9 for x in ratios)} points faster")


if __name__ == "__main__":
    main()
