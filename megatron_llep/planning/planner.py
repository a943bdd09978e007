"""The per-step LLEP plan: :func:`plan_llep`, Least-Loaded Assignment with spilling, cost-aware.

Pure numpy, no torch.distributed: every EP rank calls :func:`plan_llep` on the same global count
matrix and gets the same plan, so no plan is ever broadcast.

Notation: ``P`` EP ranks, ``N`` experts, ``M = N / P`` native experts per rank (rank ``p`` owns
experts ``pM .. (p+1)M-1``), ``C[src, e]`` tokens that rank ``src`` routes to expert ``e``.

The algorithm (docs/design.md):
  * capacity ``cap = alpha * sum(l) / P``;
  * experts are visited in descending load order; a rank's *effective* load is what it has been
    assigned plus the load of its native experts not visited yet, so a helper is never picked
    while its own hot experts are still to come;
  * the native rank keeps an expert's tokens up to its remaining capacity, the excess goes to the
    least-loaded rank with room (inside the native rank's node first), repeating until assigned;
  * a remainder smaller than ``m`` is not worth a GEMM and stays native, as long as that keeps the
    native rank within ``cap + m``;
  * when no rank has room the remainder goes to the least-loaded rank anyway, up to ``cap + m``
    while possible (never drop a token): with ``alpha >= 1`` no rank ends above ``ceil(cap) + m``.
Spilled tokens of an expert are first taken from the helper's own routed tokens (no traffic).

Borrowed weights over an optimizer step: a helper may keep the copies it receives for
the rest of the step (``keep_room``, from ``LLEPConfig.max_kept_weight_bytes``); the next
micro-batches' plans are told which rank holds which expert (``held``). LLA tries the holders of an
expert first, then the ranks of the native node and of the holders' nodes, then the rest; a spill
to a holder moves tokens but no weights. With ``LLEPConfig.relay_within_node`` a copy bound for
another node crosses the node boundary once and is forwarded inside that node
(:func:`mark_copies`).

A row budget (``config.max_tokens_per_rank``, ``B``) is a hard limit on every rank's load in the
plan, and wins over the rules above: plain EP is kept below ``lambda`` only when no rank's load
exceeds ``B``; the capacity is ``min(cap, B)`` and the ``cap + m`` slack ``min(cap + m, B)``, so a
remainder under ``m`` stays native only within ``B`` and otherwise goes to helpers in chunks as
small as ``B`` leaves room for; when every rank is full, the least-loaded rank takes tokens only up
to ``B``. Since the ranks' loads always sum to the tokens assigned so far, some rank is below ``B``
while tokens remain whenever ``sum(l) <= P * B``; a step with more rows raises
:class:`InfeasibleBudgetError` from the global counts alone, so every EP rank raises it alike.

Cost-aware planning (``config.cost_aware``) picks, among whole candidate plans, the one whose
predicted layer time is lowest (:class:`LayerTimeModel`: the token dispatch all-to-all, then each
rank's native GEMMs and its borrowed GEMMs wave by wave as the weight copies arrive, then the
combine all-to-all; every rank's links run in parallel, intra- and inter-node links separately).
The candidates are plain EP, the plain least-loaded plan at ``alpha`` (exactly what
``cost_aware=False`` returns), least-loaded plans at raised capacities (fewer, fuller helpers: fewer weight copies, more GEMM time on the slowest rank)
and, across nodes with node-aware tokens, the least-loaded plan at ``alpha`` whose helpers are
tried node by node where the expert's tokens are routed (``supply_first``: fewer token rows cross
nodes, a weight copy crosses instead), so a cost-aware plan is never predicted slower than either plain plan (under a budget, plain EP
is a candidate only within it and raised capacities stop at it). Ties keep the plain
least-loaded plan, then plain EP. No decision is taken chunk by chunk: a spill that does not pay
for itself in isolation can still shorten the slowest rank, and vice versa.

The plan is on every MoE layer's critical path (between the count exchange and the token
all-to-all), so setup.py compiles the spill planning above into ``_spill_core`` (C++17, pybind11):
0.09-0.24 ms at N = 384, P = 64 where this Python takes 0.9-4.1 ms (benchmarks/planner_copies.py).
The Python functions here and in ``assignment`` and ``time_model`` stay the reference it is held
to, plan for plan, and plan where no compiler was available at install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from megatron_llep.planning.assignment import (CHUNK_SLOT, CopyRules, SLOT, SOURCE_ROW, build_plan,
                                               least_loaded_assignment, split_rows, transport)
from megatron_llep.planning.cost_model import ExpertShape
from megatron_llep.planning.plan import InfeasibleBudgetError, LLEPPlan
from megatron_llep.planning.time_model import LayerTimeModel

if TYPE_CHECKING:  # the config holds a CostModel of this package: imported for annotations only
    from megatron_llep.config import LLEPConfig

try:  # built by setup.py from _spill_core.cpp; without a C++ compiler at install, the Python reference plans
    from megatron_llep.planning import _spill_core
except ImportError:
    _spill_core = None

COMPILED_PLANNER = _spill_core is not None
"""Whether plans come from the compiled core (the same plans as the Python reference, 10-17x faster)."""

_NO_HOLDERS = np.zeros(0, np.int64)


def plan_llep(
    counts: np.ndarray,
    config: LLEPConfig,
    expert_shape: Optional[ExpertShape] = None,
    layer_number: Optional[int] = None,
    held: Optional[np.ndarray] = None,
    keep_room: Optional[np.ndarray] = None,
) -> LLEPPlan:
    """Compute the LLEP plan for one MoE layer step from the global ``[P, N]`` count matrix.

    ``held[e, p]`` (bool ``[N, P]``, never at ``e``'s native rank): rank ``p`` already keeps a copy
    of expert ``e`` for this optimizer step, so a spill there moves tokens but no weights, and such
    helpers are tried first. ``keep_room[p]``: how many more copies rank ``p`` may keep; new copies
    are marked kept in ascending (wave, expert, helper) order while their helper has room (waves as
    if every copy came from its native rank), the rest serve this micro-batch only. ``None``: nothing
    held; no bound on kept copies. With ``config.relay_within_node`` new copies bound for another
    node than their native rank's come from one rank of that node (:func:`mark_copies`).

    ``expert_shape`` is needed only when ``config.cost_aware`` (it sizes GEMMs and transfers). A
    cost-aware plan reports the capacity it was made at: the configured one or a raised rung
    (clipped to the budget). With ``config.max_tokens_per_rank`` no rank's load in the plan exceeds
    it, or :class:`InfeasibleBudgetError` (naming ``layer_number``) is raised when none can.
    """
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be a [ep_size, num_experts] matrix, got shape {counts.shape}")
    if counts.dtype.kind not in "iu":
        raise TypeError(f"counts must be integers, got dtype {counts.dtype}")
    if counts.size and counts.min() < 0:
        raise ValueError("counts must be non-negative")
    counts = counts.astype(np.int64, copy=False)
    ep, num_experts = counts.shape
    local = config.validate_layout(num_experts, ep)
    if config.cost_aware and expert_shape is None:
        raise ValueError("a cost-aware LLEP plan needs the expert shape (pass expert_shape or set cost_aware=False)")
    copies = CopyRules.of(held, keep_room, config, ep, local)

    loads = counts.sum(axis=0)
    before = loads.reshape(ep, local).sum(axis=1)
    total = int(loads.sum())
    budget = config.max_tokens_per_rank
    if budget is not None and total > ep * budget:
        raise InfeasibleBudgetError(total, ep, budget, layer_number)
    capacity = config.alpha * total / ep
    if budget is not None:
        capacity = min(capacity, budget)  # total <= ep * budget: still at least the mean load
    within_budget = budget is None or before.max() <= budget
    if total == 0 or ep == 1 or (before.max() * ep < config.imbalance_threshold * total and within_budget):
        plan = LLEPPlan(counts, local, capacity, before, before.copy(), fallback=True)
    else:
        plan = _spill_plan(counts, loads, local, before, capacity, config, expert_shape, copies, held)
    plan.budget = budget
    return plan


def _spill_plan(counts: np.ndarray, loads: np.ndarray, local: int, before: np.ndarray, capacity: float,
                config: LLEPConfig, expert_shape: Optional[ExpertShape], copies: CopyRules,
                held: Optional[np.ndarray] = None) -> LLEPPlan:
    """The least-loaded plan at ``capacity`` (or, cost-aware, the cheapest candidate): from the
    compiled core when it is built (:data:`COMPILED_PLANNER`), else from the Python reference
    (:func:`_spill_plan_reference`, the same plans)."""
    if _spill_core is None:
        return _spill_plan_reference(counts, loads, local, before, capacity, config, expert_shape, copies)
    if held is not None and copies.held:
        held_experts, held_ranks = np.nonzero(held)
    else:
        held_experts = held_ranks = _NO_HOLDERS
    pricing = None
    if config.cost_aware:
        model = config.cost_model
        gemm_a, gemm_b = model.gemm_coefficients(expert_shape)
        scale = 2.0 if model.training else 1.0
        pricing = (gemm_a, gemm_b, expert_shape.token_bytes * scale, expert_shape.weight_bytes * scale,
                   model.intra_node_gbps, model.inter_node_gbps, model.link_latency_s)
    chosen = _spill_core.spill_plan(
        counts, loads, before, local, float(capacity), config.min_chunk_tokens, config.max_tokens_per_rank,
        copies.ranks_per_node, _transport_nodes(config) or 0, config.repack_copies, copies.relay, held_experts,
        held_ranks, copies.keep_room, config.cost_aware, pricing, _CAPACITY_RUNGS, _SEARCH_GATE, _SEARCH_SLOTS)
    if chosen is None or chosen[1] is None:  # nothing spills, or plain EP is predicted fastest
        return LLEPPlan(counts, local, capacity, before, before.copy(), fallback=False)
    chosen_capacity, rows, spilled, chunks = chosen
    return build_plan(counts, loads, local, chosen_capacity, before, rows, spilled, chunks)


def _spill_plan_reference(counts: np.ndarray, loads: np.ndarray, local: int, before: np.ndarray, capacity: float,
                          config: LLEPConfig, expert_shape: Optional[ExpertShape], copies: CopyRules) -> LLEPPlan:
    """:func:`_spill_plan` in Python: the reference the compiled core is held to, plan for plan
    (tests/planning/test_spill_core.py), and the planner where the core is not built."""
    splits = least_loaded_assignment(counts, loads, before, capacity, config, copies.held)
    if not splits:
        return LLEPPlan(counts, local, capacity, before, before.copy(), fallback=False)
    if config.cost_aware:
        return _cheapest_plan(counts, loads, local, before, capacity, splits, config, expert_shape, copies)
    rows, spilled, _ = split_rows([splits], local, copies)
    return build_plan(counts, loads, local, capacity, before, rows, spilled,
                      transport(counts, rows, spilled, _transport_nodes(config)))


def _transport_nodes(config: LLEPConfig) -> Optional[int]:
    """Ranks per node for :func:`transport`: token chunks matched inside nodes first when node aware."""
    return config.ranks_per_node if config.node_aware_tokens else None


# Raised capacities the cost-aware search tries, as multiples of the configured one. They are tried
# only when the plain plan's busiest native rank spends more than _SEARCH_GATE of the slowest rank's
# GEMM time sending weight copies: filling the ranks 10 % further costs the slowest rank about 10 %
# more GEMM time, and below that fewer copies do not buy it back. The rungs stop before the
# candidates could hold more than _SEARCH_SLOTS spilled experts in all (a rung spills at most about
# as many as the one before), which bounds the planner's time (under 1 ms at N = 384, P = 64).
_CAPACITY_RUNGS = (1.1, 1.3)


_SEARCH_GATE = 0.2


_SEARCH_SLOTS = 40


def _cheapest_plan(
    counts: np.ndarray,
    loads: np.ndarray,
    local: int,
    before: np.ndarray,
    capacity: float,
    splits: dict[int, list[tuple[int, int]]],
    config: LLEPConfig,
    shape: ExpertShape,
    copies: CopyRules,
) -> LLEPPlan:
    """The candidate plan with the lowest predicted layer time (:class:`LayerTimeModel`).

    Candidates, in order of preference on ties: the plain least-loaded plan at ``capacity`` (what
    ``cost_aware=False`` returns), plain EP (only where it keeps every rank within the row budget),
    then least-loaded plans at capacities raised by :data:`_CAPACITY_RUNGS` (at most to the budget). A raised capacity lets ranks fill further past the mean before
    spilling, so a hot expert needs fewer helpers: fewer weight copies (its native rank sends one
    per helper over its own links) and, at the cost of a slower slowest rank, less token traffic.
    Across nodes with node-aware tokens, last, the least-loaded plan at ``capacity`` with helpers
    where the expert's tokens are routed (not repacked: repacking moves experts between helpers
    and would undo the match of helpers to tokens).
    All candidates are priced by the same model in one vectorised pass, so the result is never
    predicted slower than plain EP or the plain least-loaded plan.
    """
    capacities, candidates = [capacity], [splits]
    budget = config.max_tokens_per_rank
    if _weight_copies_weigh(splits, before, loads, local, config, shape, copies):
        ceiling = float(before.max())  # from this capacity on no rank is overloaded: plain EP
        slots, last = len(splits), len(splits)
        for factor in _CAPACITY_RUNGS:
            raised = capacity * factor if budget is None else min(capacity * factor, budget)
            if raised >= ceiling or raised <= capacities[-1] or slots + last > _SEARCH_SLOTS:
                break
            # raised rungs already trade balance for fewer helpers: not repacked (planner time)
            more = least_loaded_assignment(counts, loads, before, raised, config, copies.held, repacked=False)
            if not more:
                break  # a higher capacity spills no more than this one
            capacities.append(raised)
            candidates.append(more)
            slots, last = slots + len(more), len(more)
    per_node = _transport_nodes(config)
    if per_node is not None and per_node < counts.shape[0]:
        # helpers where the expert's tokens are routed, rather than native node first
        matched = least_loaded_assignment(counts, loads, before, capacity, config, copies.held, repacked=False,
                                          supply_first=True)
        if matched and matched != splits:
            capacities.append(capacity)
            candidates.append(matched)
    rows, spilled, slot_candidate = split_rows(candidates, local, copies)
    chunks = transport(counts, rows, spilled, per_node, slot_candidate)
    timer = LayerTimeModel(counts, local, shape, config.cost_model, config.ranks_per_node)
    phases = timer._candidate_phases(rows, spilled, chunks, slot_candidate, len(candidates))
    times = [sum(candidate) for candidate in phases]
    best, best_time = 0, times[0]
    ep_time = sum(timer._plain_ep_phases())
    if ep_time < best_time and (budget is None or before.max() <= budget):
        best, best_time = None, ep_time
    for k in range(1, len(candidates)):
        if times[k] < best_time:
            best, best_time = k, times[k]
    if best is None:
        return LLEPPlan(counts, local, capacity, before, before.copy(), fallback=False)
    if len(candidates) > 1:
        mine = slot_candidate == best
        first = int(np.argmax(mine))
        kept_rows = mine[rows[SLOT]]
        first_row = int(np.argmax(kept_rows))
        rows, spilled, chunks = rows[:, kept_rows], spilled[mine], chunks[:, mine[chunks[CHUNK_SLOT]]]
        rows[SLOT] -= first
        rows[SOURCE_ROW][rows[SOURCE_ROW] >= 0] -= first_row
        chunks[CHUNK_SLOT] -= first
    return build_plan(counts, loads, local, capacities[best], before, rows, spilled, chunks)


def _weight_copies_weigh(
    splits: dict[int, list[tuple[int, int]]],
    before: np.ndarray,
    loads: np.ndarray,
    local: int,
    config: LLEPConfig,
    shape: ExpertShape,
    rules: CopyRules,
) -> bool:
    """Whether the busiest native rank's new weight copies (per link class; one per expert and
    node across nodes when copies are relayed) take more than :data:`_SEARCH_GATE` of the GEMM time
    of the plan's most loaded rank."""
    ep = before.size
    per_node = config.ranks_per_node or ep
    model = config.cost_model
    copies = {}
    relayed = set()
    after = before.tolist()
    for e, parts in splits.items():
        native = e // local
        holders = rules.held.get(e, ())
        after[native] -= int(loads[e])
        for dst, tokens in parts:
            after[dst] += tokens
            if dst != native and dst not in holders:
                inter = native // per_node != dst // per_node
                if inter and rules.relay:
                    if (e, dst // per_node) in relayed:
                        continue
                    relayed.add((e, dst // per_node))
                copies[(native, inter)] = copies.get((native, inter), 0) + 1
    weight_bytes = shape.weight_bytes * (2 if model.training else 1)
    sending = max(model.link_time(count * weight_bytes, inter) for (_, inter), count in copies.items()) if copies else 0.0
    return sending > _SEARCH_GATE * model.gemm_coefficients(shape)[1] * max(after)
