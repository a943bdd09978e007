"""The LLEP planner as it was before its fast path: a frozen, straightforward reference (least-loaded
assignment, copy repacking and copy rules as per-chunk Python loops; token transport and pricing as
before), kept apart from the library so that the equivalence test compares two implementations
(tests/planning/test_fast_planner.py). Not used by the library; do not optimise."""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_llep.planning.cost_model import CostModel, ExpertShape
from megatron_llep.planning.plan import InfeasibleBudgetError, LLEPPlan

# fields of a split row: its slot, the slot's expert, the destination and the tokens it computes
# there; for a row that needs a new weight copy, the copy's wave, its source rank (-1: no copy),
# whether the helper keeps it, and the row in which a relay source receives its own copy (-1: the
# source already has the expert)
SLOT, EXPERT, DST, TOKENS, WAVE, SOURCE, KEPT, SOURCE_ROW = range(8)
# fields of a token chunk: tokens of an expert that a source rank sends a destination, and the slot
CHUNK_EXPERT, CHUNK_SRC, CHUNK_DST, CHUNK_COUNT, CHUNK_SLOT = range(5)


def least_loaded_assignment(
    counts: np.ndarray,
    loads: np.ndarray,
    rank_loads_before: np.ndarray,
    capacity: float,
    config: LLEPConfig,
    held: Optional[dict[int, tuple[int, ...]]] = None,
    repacked: bool = True,
) -> dict[int, list[tuple[int, int]]]:
    """LLA/LLAS. Returns ``{expert: [(dst, tokens), ...]}`` for experts that leave their native rank.

    ``held[e]``: ranks that already keep a copy of ``e``; they are its first helpers (a spill there
    moves no weights). ``repacked``: with ``config.repack_copies``, end with :func:`repack`.

    Plain Python ints on purpose: the loop is short and numpy's per-call overhead would dominate.
    """
    ep, num_experts = counts.shape
    local = num_experts // ep
    m = config.min_chunk_tokens
    ranks_per_node = config.ranks_per_node or ep  # None: all ranks share one node
    expert_loads = loads.tolist()
    # effective[g]: tokens assigned to g so far plus its native experts' load not yet visited
    effective = rank_loads_before.tolist()
    # the row budget bounds every rank's load (capacity <= budget already): it caps the slack of the
    # min-chunk rule and the overflow when all ranks are full, so a chunk may be smaller than m
    budget = math.inf if config.max_tokens_per_rank is None else config.max_tokens_per_rank
    slack_limit = min(capacity + m, budget)
    splits: dict[int, list[tuple[int, int]]] = {}
    floor = math.floor
    one_node = ranks_per_node >= ep
    node_of = [g // ranks_per_node for g in range(ep)]

    def visit_keys(g: int) -> list[int]:
        """Keys of rank g's loaded experts; ascending keys are descending loads, ties by id."""
        return [-expert_loads[e] * num_experts + e for e in range(g * local, (g + 1) * local) if expert_loads[e] > 0]

    # A rank whose effective load never exceeds the capacity keeps every native expert whole, so
    # only the experts of ranks that are (or become) overloaded are visited, in load order.
    overloaded = [load > capacity for load in effective]
    to_visit = [key for g in range(ep) if overloaded[g] for key in visit_keys(g)]
    heapq.heapify(to_visit)
    # Ranks with room for one more token, in rank order: only they can be helpers (a chunk has at
    # least one token). A rank's room only shrinks, except while its own expert is visited, which
    # happens once it is overloaded and leaves it with under one token of room; so a rank that
    # leaves this set never comes back.
    open_ranks = dict.fromkeys([g for g in range(ep) if capacity - effective[g] >= 1])

    while to_visit:
        key = heapq.heappop(to_visit)
        e = key % num_experts
        load = expert_loads[e]
        n = e // local
        effective[n] -= load
        room = floor(capacity - effective[n])
        keep = load if room >= load else (room if room > 0 else 0)
        if keep == load or (load - keep < m and effective[n] + load <= slack_limit):
            effective[n] += load
            continue

        parts: dict[int, int] = {}
        remaining = load
        if keep:
            parts[n] = keep
            effective[n] += keep
            remaining -= keep
        # Helpers in ascending effective load, native node first. A helper's load only grows when
        # this expert fills it, so the order holds for the whole expert and one pass suffices.
        candidates = sorted(open_ranks, key=effective.__getitem__)
        if not one_node:
            home = node_of[n]
            candidates = [g for g in candidates if node_of[g] == home] + [
                g for g in candidates if node_of[g] != home
            ]
        holders = held.get(e) if held else None
        if holders:
            near = {node_of[g] for g in holders} | {node_of[n]}
            candidates = ([g for g in candidates if g in holders]
                          + [g for g in candidates if g not in holders and node_of[g] in near]
                          + [g for g in candidates if node_of[g] not in near])
        num = len(candidates)
        cursor = 0
        while remaining > 0:
            need = (remaining if remaining < m else m) if m > 0 else 1
            if need < m:
                cursor = 0  # a smaller final piece may fit ranks skipped for lack of room
            while cursor < num and capacity - effective[candidates[cursor]] < need:
                cursor += 1
            if cursor < num:
                helper = candidates[cursor]
                room = floor(capacity - effective[helper])
                take = remaining if remaining < room else room
            else:
                # Nobody has room for a worthwhile chunk: the least-loaded rank takes up to cap + m
                # (at least one token, so integer rounding cannot stall); past that, everything, up
                # to the budget. Under a budget the least-loaded rank is below it while tokens
                # remain (the loads sum to the tokens assigned, < P x budget), so it takes >= 1.
                helper = min(range(ep), key=effective.__getitem__)
                slack = slack_limit - effective[helper]
                take = min(remaining, max(math.ceil(slack), 1)) if slack > 0 else min(remaining, budget - effective[helper])
            parts[helper] = parts.get(helper, 0) + take
            effective[helper] += take
            if capacity - effective[helper] < 1:
                open_ranks.pop(helper, None)
                if effective[helper] > capacity and not overloaded[helper]:
                    overloaded[helper] = True
                    for later in visit_keys(helper):
                        if later > key:
                            heapq.heappush(to_visit, later)
            remaining -= take
            if 0 < remaining < m and effective[n] + remaining <= slack_limit:
                parts[n] = parts.get(n, 0) + remaining
                effective[n] += remaining
                remaining = 0
        if len(parts) > 1 or n not in parts:
            splits[e] = sorted(parts.items())
    if repacked and config.repack_copies and splits:
        splits = repack(splits, expert_loads, local, held or {}, m, ranks_per_node)
    return splits


def repack(splits: dict[int, list[tuple[int, int]]], loads: list[int], local: int,
           held: dict[int, tuple[int, ...]], m: int, ranks_per_node: int) -> dict[int, list[tuple[int, int]]]:
    """The same rank loads with fewer weight copies where possible (MoonEP's planning rule on the
    plan's own totals). Each home rank's tokens for other ranks (its quotas) are refilled from all
    its experts: those a helper already holds into that helper's quota first, then the largest
    expert into the largest remaining quota, the home rank keeping the rest. The quotas are first
    the plan's own; then, if no rank both sends and receives, rebuilt from the same totals (what
    each home rank sends, what each helper receives) by letting the home rank with the most left
    fill the helper with the most room, inside its node first, so a helper serves one home rank
    where it can. The result with the fewest new copies wins, the plan's own on ties; a rebuilt
    plan never gives a helper a piece smaller than the smallest it had (or ``m``)."""
    def copies_of(plan: dict[int, list[tuple[int, int]]]) -> int:
        return sum(dst != e // local and dst not in held.get(e, ()) for e, parts in plan.items() for dst, _ in parts)

    def smallest_piece(plan: dict[int, list[tuple[int, int]]]) -> int:
        return min((t for e, parts in plan.items() for dst, t in parts if dst != e // local), default=0)

    quotas: dict[int, dict[int, int]] = {}
    for e, parts in splits.items():
        home = e // local
        for dst, tokens in parts:
            if dst != home:
                quotas.setdefault(home, {})
                quotas[home][dst] = quotas[home].get(dst, 0) + tokens
    floor_piece = min(smallest_piece(splits), m if m > 0 else 1)
    best, best_copies = splits, copies_of(splits)
    helpers = {dst for q in quotas.values() for dst in q}
    if best_copies <= len(helpers):
        return splits  # one copy per helper at most (held ones aside): nothing to gain
    own = _fill_quotas(splits, quotas, loads, local, held)
    if copies_of(own) < best_copies and smallest_piece(own) >= floor_piece:
        best, best_copies = own, copies_of(own)
    sending = {home: sum(q.values()) for home, q in quotas.items()}
    receiving: dict[int, int] = {}
    for q in quotas.values():
        for dst, tokens in q.items():
            receiving[dst] = receiving.get(dst, 0) + tokens
    if len(quotas) > 1 and not set(sending) & set(receiving):
        for per_node in dict.fromkeys([ranks_per_node, None]):  # inside nodes first; then as if one node
            if best_copies <= len(helpers):
                break
            other = _fill_quotas(splits, _rebuild_quotas(sending, receiving, per_node), loads, local, held)
            if copies_of(other) < best_copies and smallest_piece(other) >= floor_piece:
                best, best_copies = other, copies_of(other)
    return best


def _rebuild_quotas(sending: dict[int, int], receiving: dict[int, int],
                    per_node: Optional[int]) -> dict[int, dict[int, int]]:
    """Quotas from totals: the home rank with the most left to send fills the receiving rank with the
    most room (inside its node first when ``per_node``), until all is sent. Heaps by node."""
    key = (lambda d: d // per_node) if per_node else (lambda d: 0)
    senders = [(-t, h) for h, t in sending.items() if t > 0]
    heapq.heapify(senders)
    pools: dict[int, list[tuple[int, int]]] = {}
    for d, t in receiving.items():
        if t > 0:
            pools.setdefault(key(d), []).append((-t, d))
    for pool in pools.values():
        heapq.heapify(pool)
    rebuilt: dict[int, dict[int, int]] = {}
    while senders:
        t, home = heapq.heappop(senders)
        pool = pools.get(key(home))
        if not pool:  # none left in its node: the roomiest anywhere
            pool = min((p for p in pools.values() if p), key=lambda p: (p[0][0], p[0][1]))
        r, dst = heapq.heappop(pool)
        amount = min(-t, -r)
        rebuilt.setdefault(home, {})
        rebuilt[home][dst] = rebuilt[home].get(dst, 0) + amount
        if -t > amount:
            heapq.heappush(senders, (t + amount, home))
        if -r > amount:
            heapq.heappush(pool, (r + amount, dst))
    return rebuilt


def _fill_quotas(splits: dict[int, list[tuple[int, int]]], quotas: dict[int, dict[int, int]], loads: list[int],
                 local: int, held: dict[int, tuple[int, ...]]) -> dict[int, list[tuple[int, int]]]:
    """Splits that send each home rank's quotas (``quotas[home][dst]`` tokens), filled per home from
    its experts: held experts into their holder's quota first, then largest expert into largest
    quota; the home keeps the rest. Homes without quotas keep their splits."""
    result = {e: parts for e, parts in splits.items() if e // local not in quotas}
    for home, home_quotas in quotas.items():
        room = dict(home_quotas)
        left = {e: loads[e] for e in range(home * local, (home + 1) * local) if loads[e] > 0}
        pieces: dict[int, dict[int, int]] = {}

        def give(e: int, dst: int, tokens: int) -> None:
            pieces.setdefault(e, {})[dst] = pieces.get(e, {}).get(dst, 0) + tokens
            left[e] -= tokens
            room[dst] -= tokens

        holding = [(e, dst) for e in sorted(left, key=lambda e: (-left[e], e)) for dst in held.get(e, ()) if dst in room]
        for e, dst in sorted(holding, key=lambda pair: pair[1]):  # held experts first: no copy at all
            if room[dst] > 0 and left[e] > 0:
                give(e, dst, min(left[e], room[dst]))
        open_quotas = [(-q, dst) for dst, q in room.items() if q > 0]
        heapq.heapify(open_quotas)
        experts = [(-t, e) for e, t in left.items() if t > 0]
        heapq.heapify(experts)
        while open_quotas and experts:
            q, dst = heapq.heappop(open_quotas)
            t, e = heapq.heappop(experts)
            give(e, dst, min(-q, -t))
            if left[e] > 0:
                heapq.heappush(experts, (-left[e], e))
            if room[dst] > 0:
                heapq.heappush(open_quotas, (-room[dst], dst))
        for e, parts in pieces.items():
            result[e] = sorted(list(parts.items()) + ([(home, left[e])] if left[e] > 0 else []))
    return dict(sorted(result.items()))


@dataclass(frozen=True)
class CopyRules:
    """What decides a plan's weight copies besides its splits: ``held[e]``, the ranks that already
    keep expert ``e`` (ascending); ``keep_room[p]``, how many more copies rank ``p`` may keep
    (``None``: no bound); ``relay``, whether copies are relayed inside nodes of ``ranks_per_node``."""

    held: dict[int, tuple[int, ...]]
    keep_room: Optional[list[int]]
    relay: bool
    ranks_per_node: int

    @classmethod
    def of(cls, held: Optional[np.ndarray], keep_room: Optional[np.ndarray], config: LLEPConfig, ep: int,
           local: int) -> "CopyRules":
        holders: dict[int, tuple[int, ...]] = {}
        if held is not None:
            held = np.asarray(held)
            if held.shape != (ep * local, ep) or held.dtype != bool:
                raise ValueError(f"plan_llep: held must be a bool [num_experts, ep_size] = [{ep * local}, {ep}] "
                                 f"array, got {held.dtype} {held.shape}")
            experts, ranks = np.nonzero(held)
            if (ranks == experts // local).any():
                raise ValueError("plan_llep: held marks an expert as a kept copy at its own native rank; "
                                 "held[e, p] must be False where rank p owns expert e")
            for e, p in zip(experts.tolist(), ranks.tolist()):
                holders[e] = holders.get(e, ()) + (p,)
        room = None
        if keep_room is not None:
            room = np.asarray(keep_room)
            if room.shape != (ep,) or room.dtype.kind not in "iu" or (room < 0).any():
                raise ValueError(f"plan_llep: keep_room must be {ep} non-negative integers (copies each rank may "
                                 f"still keep), got {room.dtype} {room.shape}")
            room = room.tolist()
        return cls(holders, room, config.relay_within_node, config.ranks_per_node or ep)


def split_rows(
    candidates: list[dict[int, list[tuple[int, int]]]], num_local_experts: int, rules: CopyRules
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The split rows (``[8, rows]``, fields :data:`SLOT` ... :data:`SOURCE_ROW`) of one or more
    plans' splits, each slot's expert and each slot's plan. A slot is one spilled expert of one
    plan; slots count up across the plans, and within a plan follow ascending expert ids,
    destinations ascending within a slot. A row whose destination needs a new weight copy (a
    helper that does not hold the expert) has its ``source`` (else -1), ``wave`` (else 0) and
    ``kept`` flag (:func:`mark_copies`); ``source row`` is the row in which a relay source receives
    its own copy (-1: the source already has the expert)."""
    rows, experts, owners = [], [], []
    for k, splits in enumerate(candidates):
        copy_rows = []
        for e in sorted(splits):
            native = e // num_local_experts
            holders = rules.held.get(e, ())
            for d, t in splits[e]:
                if d != native and d not in holders:
                    copy_rows.append(len(rows))
                rows.append([len(owners), e, d, t, 0, -1, 0, -1])
            experts.append(e)
            owners.append(k)
        mark_copies(rows, copy_rows, num_local_experts, rules)
    rows = np.fromiter(itertools.chain.from_iterable(rows), np.int64, 8 * len(rows)).reshape(-1, 8).T
    return rows, np.array(experts, np.int64), np.array(owners, np.int64)


def mark_copies(rows: list[list[int]], copy_rows: list[int], local: int, rules: CopyRules) -> None:
    """Fill in source, wave, kept flag and source row of one plan's new copies (``rows[i]`` for
    ``i`` in ``copy_rows``, in expert order), in place.

    Kept: in ascending (wave, expert, helper) order, with the waves every copy would have coming
    from its native rank, while the helper has ``keep_room``. Source, with relays: for an expert
    and a node other than its native rank's, the lowest rank there that holds it sends every new
    copy on that node; failing that, the lowest helper there whose copy is kept receives it from
    the native rank and sends the others (transient copies are never sources); everything else
    comes from the native rank. Waves: :func:`copy_waves` per (source, helper); a relayed copy
    travels at least one wave after its relay's own copy.
    """
    def number_waves() -> None:
        depth: dict[tuple[int, int], int] = {}
        for i in copy_rows:
            key = (rows[i][SOURCE], rows[i][DST])
            d = depth.get(key, 0)
            depth[key] = d + 1
            rows[i][WAVE] = d.bit_length()

    for i in copy_rows:
        rows[i][SOURCE] = rows[i][EXPERT] // local
    number_waves()
    if rules.keep_room is None:
        for i in copy_rows:
            rows[i][KEPT] = 1
    else:
        room = list(rules.keep_room)  # each candidate plan starts afresh
        for i in sorted(copy_rows, key=lambda i: (rows[i][WAVE], rows[i][EXPERT], rows[i][DST])):
            if room[rows[i][DST]] > 0:
                room[rows[i][DST]] -= 1
                rows[i][KEPT] = 1
    if not rules.relay:
        return
    per_node = rules.ranks_per_node
    groups: dict[tuple[int, int], list[int]] = {}
    for i in copy_rows:
        e, d = rows[i][EXPERT], rows[i][DST]
        if d // per_node != (e // local) // per_node:
            groups.setdefault((e, d // per_node), []).append(i)
    relayed = False
    for (e, node), members in groups.items():
        holders = [g for g in rules.held.get(e, ()) if g // per_node == node]
        if holders:
            source, source_row = holders[0], -1
        else:
            kept = [i for i in members if rows[i][KEPT]]
            if not kept:
                continue
            source_row = kept[0]
            source = rows[source_row][DST]
        for i in members:
            if i != source_row:
                rows[i][SOURCE], rows[i][SOURCE_ROW] = source, source_row
                relayed = True
    if relayed:
        number_waves()
        for i in copy_rows:
            if rows[i][SOURCE_ROW] >= 0:
                rows[i][WAVE] = max(rows[i][WAVE], rows[rows[i][SOURCE_ROW]][WAVE] + 1)


def transport(counts: np.ndarray, splits: np.ndarray, experts: np.ndarray,
              ranks_per_node: Optional[int] = None) -> np.ndarray:
    """Decide which source sends how many tokens of each spilled expert to each destination.

    ``splits`` is ``[8, rows]`` from :func:`split_rows` (slot, expert, destination, tokens, ...): how
    many tokens each destination computes; ``experts[slot]`` is the slot's expert. Returns
    ``[5, chunks]`` rows (expert, src, dst, count, slot). Each destination first takes its own
    routed tokens; with ``ranks_per_node`` below the EP size, then tokens routed inside its node
    (per slot and node, as much as the node's supply and demand match, shared among the node's
    sources and destinations in proportion to what each has left, so what must cross is spread over
    the node's ranks rather than piled on the last ones); the rest of every slot's
    supply is matched to the rest of its demand in rank order (north-west corner) — all slots at
    once, since the running sums of supply and demand meet at every slot (and slot-node)
    boundary. So no more of a slot's tokens cross nodes than its demand outside each node exceeds
    that node's supply.
    """
    slot, split_expert, split_dst, split_tokens = splits[SLOT:WAVE]
    ep = counts.shape[0]
    supply = counts.T[experts]  # [slots, src], a copy
    own = np.minimum(supply[slot, split_dst], split_tokens)
    supply[slot, split_dst] -= own
    need = split_tokens - own
    stays = np.array([split_expert, split_dst, split_dst, own, slot])[:, own > 0]
    supply = supply.ravel()
    parts = [stays]
    per_node = ranks_per_node or ep
    if per_node < ep and supply.any():
        nodes = ep // per_node
        supply_group = np.arange(supply.size) // per_node  # (slot, node of src), ascending
        demand_group = slot * nodes + split_dst // per_node  # ascending: rows by slot, dst ascending
        groups = experts.size * nodes
        matched = np.minimum(np.bincount(supply_group, supply, groups), np.bincount(demand_group, need, groups))
        take_supply = _even_share(supply, supply_group, matched, groups)
        take_demand = _even_share(need, demand_group, matched, groups)
        if take_supply.any():
            parts.append(_northwest(take_supply, take_demand, split_dst, experts, ep))
            supply = supply - take_supply
            need = need - take_demand
    if supply.any():
        parts.append(_northwest(supply, need, split_dst, experts, ep))
    return np.concatenate(parts, axis=1)


def _even_share(values: np.ndarray, group: np.ndarray, share: np.ndarray, groups: int) -> np.ndarray:
    """Per entry, its part of ``share[g]`` of its group ``g`` (entries grouped in order), in
    proportion to its value (integers by cumulative rounding: they sum to ``share[g]`` exactly), so
    what is left to cross nodes is spread over a node's ranks as their supply and demand are."""
    values = values.astype(np.int64, copy=False)
    total = np.bincount(group, values, groups).astype(np.int64)
    group_start = np.concatenate([[0], np.cumsum(total)[:-1]])
    upto = np.cumsum(values) - group_start[group]  # inclusive running sum inside the group
    scaled = upto * share.astype(np.int64)[group] // np.maximum(total[group], 1)
    before = np.concatenate([[0], scaled[:-1]])
    before[np.concatenate([[True], group[1:] != group[:-1]])] = 0
    return scaled - before


def _northwest(supply: np.ndarray, need: np.ndarray, split_dst: np.ndarray, experts: np.ndarray,
               ep: int) -> np.ndarray:
    """``[5, chunks]`` that match ``supply`` (``[slots * ep]``, slot-major) to the split rows'
    ``need`` in order; both sum alike per slot."""
    sources = supply.nonzero()[0]  # slot * ep + src
    if not sources.size:
        return np.zeros((5, 0), np.int64)
    supply_end = supply[sources].cumsum()
    open_rows = need > 0
    demand_end = need[open_rows].cumsum()
    ends = np.concatenate([supply_end, demand_end])
    ends.sort(kind="stable")  # two sorted runs: a linear merge
    ends = ends[np.concatenate([[True], ends[1:] != ends[:-1]])]  # both sums increase strictly
    starts = np.concatenate([[0], ends[:-1]])
    source = sources[supply_end.searchsorted(starts, "right")]
    destination = split_dst[open_rows][demand_end.searchsorted(starts, "right")]
    return np.array([experts[source // ep], source % ep, destination, ends - starts, source // ep])


def build_plan(
    counts: np.ndarray,
    loads: np.ndarray,
    local: int,
    capacity: float,
    before: np.ndarray,
    rows: np.ndarray,
    spilled: np.ndarray,
    chunks: np.ndarray,
) -> LLEPPlan:
    split_expert, split_dst, split_tokens, split_wave, split_source, split_kept = rows[EXPERT:SOURCE_ROW]
    native = split_expert // local
    after = before.copy()
    np.subtract.at(after, spilled // local, loads[spilled])
    np.add.at(after, split_dst, split_tokens)
    copy = split_source >= 0
    return LLEPPlan(
        counts=counts,
        num_local_experts=local,
        capacity=capacity,
        rank_loads_before=before,
        rank_loads_after=after,
        fallback=False,
        spilled_experts=spilled,
        chunk_expert=chunks[CHUNK_EXPERT],
        chunk_src=chunks[CHUNK_SRC],
        chunk_dst=chunks[CHUNK_DST],
        chunk_count=chunks[CHUNK_COUNT],
        transfer_expert=split_expert[copy],
        transfer_native=native[copy],
        transfer_helper=split_dst[copy],
        transfer_wave=split_wave[copy],
        transfer_source=split_source[copy],
        transfer_kept=split_kept[copy].astype(bool),
    )


@functools.lru_cache(maxsize=64)
def _rank_layout(ep: int, num_local_experts: int, ranks_per_node: int) -> tuple[np.ndarray, ...]:
    """Read-only ``(ranks, native rank of each expert, node of each rank, cross)`` where
    ``cross[src, dst]`` is ``ep`` for a link across nodes and 0 inside one: the offset of the link
    class in :class:`LayerTimeModel`'s ``[link class, rank]`` layout. Cached: the planner prices
    every step of every layer on the same layout."""
    ranks = np.arange(ep)
    node = ranks // ranks_per_node
    layout = (ranks, np.arange(ep * num_local_experts) // num_local_experts, node,
              (node[:, None] != node[None, :]) * ep)
    for array in layout:
        array.flags.writeable = False
    return layout


class ReferenceTimeModel:
    """The layer time a :class:`CostModel` predicts for a plan: the quantity cost-aware planning
    minimises.

    ``dispatch + compute + combine``, as the implementation runs them:

    * dispatch and combine: the token all-to-all. A rank's link time is
      ``CostModel.link_time(max(bytes out, bytes in))``; links inside a node and across nodes are
      separate and run in parallel, as do all ranks' links, so a phase takes the slowest link;
    * compute: a rank runs one GEMM per expert it computes with tokens,
      ``CostModel.gemm_time(tokens)`` each, its native experts first (from the end of the
      dispatch), then its borrowed ones wave by wave (:func:`~megatron_llep.planning.plan.copy_waves`), each wave once its
      weights have arrived. A wave's weight copies share their native rank's and helper's links
      with the tokens; counted after the tokens, and after the earlier waves, they arrive at
      ``link_time(tokens + copies of this and earlier waves)`` of the busier of the two links. The
      phase ends with the last rank's last GEMM. (A native rank waits for its sends after its own
      GEMMs; they are done when the helper has the copies, before the helper's GEMMs on them end,
      so they never set the phase's end.) A spill to a helper that holds the expert has no copy:
      its GEMM runs with the native ones. A relayed copy (:attr:`LLEPPlan.transfer_source` not the
      native rank) uses the relay's and the helper's links inside the node, and arrives no earlier
      than one intra-node copy time after the relay's own copy.

    With ``cost_model.training`` bytes count twice (activations and their gradients, weights and
    their gradients) and GEMMs three times (forward and backward): the backward mirrors the
    forward, the gradients of the first wave returning last while the native rank's own backward
    runs. A kept copy's gradient returns once per step; it is charged to the micro-batch that
    creates the copy (a new copy costs twice its weights, kept or not; a held one nothing). ``ranks_per_node=None`` puts all EP ranks in one node. Built once per count matrix;
    pricing a plan is a few vector operations.
    """

    def __init__(
        self,
        counts: np.ndarray,
        num_local_experts: int,
        shape: ExpertShape,
        cost_model: CostModel,
        ranks_per_node: Optional[int] = None,
    ) -> None:
        counts = np.asarray(counts, np.int64)
        ep, num_experts = counts.shape
        local = num_local_experts
        per_node = min(ranks_per_node or ep, ep)
        if ep % per_node or counts.shape[1] != ep * num_local_experts:
            raise ValueError(f"LayerTimeModel: {ep} ranks of {num_local_experts} experts cannot hold {counts.shape[1]} "
                             f"experts, or do not split into nodes of {per_node}")
        nodes = ep // per_node
        self.ep = ep
        self.cost_model = cost_model
        self._ranks, self.native, self.node, self._cross = _rank_layout(ep, local, per_node)
        ranks = self._ranks
        self.gemm_a, self.gemm_b = cost_model.gemm_coefficients(shape)
        loads = counts.sum(axis=0)
        self.expert_gemm = (loads > 0) * (self.gemm_a + self.gemm_b * loads)
        self.ep_compute = self.expert_gemm.reshape(ep, local).sum(axis=1)
        scale = 2.0 if cost_model.training else 1.0
        self.token_bytes = shape.token_bytes * scale
        self.weight_bytes = shape.weight_bytes * scale
        # Plain EP's token traffic: [link class (0 inside a node, 1 across), rank], in tokens.
        to_rank = counts.reshape(ep, ep, local).sum(axis=2)  # [source, native rank]
        own = to_rank.diagonal()
        self._ep_out, self._ep_in = np.zeros((2, ep)), np.zeros((2, ep))
        if nodes == 1:
            self._ep_out[0], self._ep_in[0] = to_rank.sum(axis=1) - own, to_rank.sum(axis=0) - own
        else:
            to_node = to_rank.reshape(ep, nodes, per_node).sum(axis=2)[ranks, self.node]
            from_node = to_rank.reshape(nodes, per_node, ep).sum(axis=1)[self.node, ranks]
            self._ep_out[0], self._ep_out[1] = to_node - own, to_rank.sum(axis=1) - to_node
            self._ep_in[0], self._ep_in[1] = from_node - own, to_rank.sum(axis=0) - from_node
        self._counts = counts

    def phases(self, plan: LLEPPlan) -> dict[str, float]:
        """``{"dispatch_s", "compute_s", "combine_s", "layer_s"}`` of ``plan``."""
        if plan.is_plain_ep:
            dispatch, compute, combine = self._plain_ep_phases()
        else:
            ep = self.ep
            key = plan.chunk_expert * ep + plan.chunk_dst
            cells, index = np.unique(key, return_inverse=True)
            experts = cells // ep
            helpers = cells % ep
            # each cell's new copy (if any): its source, wave and the cell its source received it in
            transfer_key = plan.transfer_expert * ep + plan.transfer_helper
            order = np.argsort(transfer_key)
            at = np.minimum(np.searchsorted(transfer_key[order], cells), max(order.size - 1, 0))
            copied = transfer_key[order][at] == cells if order.size else np.zeros(cells.size, bool)
            transfer = order[at[copied]]
            source, waves, source_row = (np.full(cells.size, -1, np.int64), np.zeros(cells.size, np.int64),
                                         np.full(cells.size, -1, np.int64))
            source[copied], waves[copied] = plan.transfer_source[transfer], plan.transfer_wave[transfer]
            upstream = np.minimum(np.searchsorted(cells, experts * ep + source), cells.size - 1)
            relayed = copied & (cells[upstream] == experts * ep + source) & copied[upstream]
            source_row[relayed] = upstream[relayed]
            rows = np.array([np.searchsorted(plan.spilled_experts, experts), experts, helpers,
                             np.bincount(index.ravel(), plan.chunk_count).astype(np.int64), waves, source,
                             np.zeros(cells.size, np.int64), source_row])
            chunks = np.array([plan.chunk_expert, plan.chunk_src, plan.chunk_dst, plan.chunk_count,
                               np.searchsorted(plan.spilled_experts, plan.chunk_expert)])
            one = np.zeros(plan.spilled_experts.size, np.int64)
            dispatch, compute, combine = self._candidate_phases(rows, plan.spilled_experts, chunks, one, 1)[0]
        return {"dispatch_s": dispatch, "compute_s": compute, "combine_s": combine,
                "layer_s": dispatch + compute + combine}

    def time(self, plan: LLEPPlan) -> float:
        """Predicted layer time of ``plan`` in seconds."""
        return self.phases(plan)["layer_s"]

    def _plain_ep_phases(self) -> tuple[float, float, float]:
        link_time = self.cost_model.link_time
        tokens = np.maximum(self._ep_out.max(axis=1), self._ep_in.max(axis=1)) * self.token_bytes
        combine = max(link_time(tokens[0], False), link_time(tokens[1], True))
        return combine, float(self.ep_compute.max()), combine  # dispatch moves the same tokens

    def _candidate_phases(
        self, rows: np.ndarray, spilled: np.ndarray, chunks: np.ndarray, slot_candidate: np.ndarray,
        num_candidates: int,
    ) -> list[tuple[float, float, float]]:
        """(dispatch, compute, combine) of several spill plans at once.

        ``rows``: :func:`~megatron_llep.planning.assignment.split_rows` of all candidates, slots numbered across them (a row with
        a source gets a new weight copy from it; one with a source row gets it from a relay, once the
        relay's own copy, in that row, is in);
        ``spilled[slot]``: the slot's expert; ``chunks``: :func:`~megatron_llep.planning.assignment.transport` of those rows;
        ``slot_candidate[slot]``: the slot's candidate. Per-rank quantities are laid out
        ``[candidate, link class, rank]`` (flattened where they are built by ``bincount``).
        """
        ep, native, ranks, k = self.ep, self.native, self._ranks, num_candidates
        slot, split_expert, split_dst, split_tokens, split_wave, split_source, _, source_row = rows
        owner = native[spilled]
        slot_base = slot_candidate * ep
        row_base = slot_base[slot]
        gemm = self.gemm_a + self.gemm_b * split_tokens
        copy = split_source >= 0
        # GEMMs: each spilled expert's leaves its native rank; its parts' are added where they run.
        compute = self.ep_compute - np.bincount(slot_base + owner, self.expert_gemm[spilled], k * ep).reshape(k, ep)
        compute += np.bincount(row_base + split_dst, gemm, k * ep).reshape(k, ep)
        # Tokens: take the spilled experts' plain-EP traffic out, put the plan's chunks in.
        moved = self._counts[:, spilled]
        moved[owner, np.arange(spilled.size)] = 0
        index = 2 * slot_base + self._cross[:, owner]
        moved = moved.ravel()
        size = 2 * k * ep
        src, dst = chunks[CHUNK_SRC], chunks[CHUNK_DST]
        count = chunks[CHUNK_COUNT] * (src != dst)
        chunk_index = 2 * slot_base[chunks[CHUNK_SLOT]] + self._cross[src, dst]
        out = self._ep_out + (np.bincount(chunk_index + src, count, size)
                              - np.bincount((index + ranks[:, None]).ravel(), moved, size)).reshape(k, 2, ep)
        into = self._ep_in + (np.bincount(chunk_index + dst, count, size)
                              - np.bincount((index + owner).ravel(), moved, size)).reshape(k, 2, ep)
        out = out.ravel() * self.token_bytes
        into = into.ravel() * self.token_bytes
        peak = np.maximum(out, into).reshape(k, 2, ep).max(axis=2)
        link_time = self.cost_model.link_time
        tokens = [max(link_time(intra, False), link_time(inter, True)) for intra, inter in peak.tolist()]
        latest = np.array(tokens) + compute.max(axis=1)  # no rank waited for weights
        # Weights: the borrowed GEMMs of each wave start once the wave's copies are in.
        helper, giver, base, wave = split_dst[copy], split_source[copy], row_base[copy], split_wave[copy]
        waves = int(wave.max()) + 1 if wave.size else 0
        if waves:
            inter = self._cross[giver, helper]
            sender, receiver = 2 * base + inter + giver, 2 * base + inter + helper  # the copy's two links
            # copies of this and the earlier waves on each link
            at_sender, at_receiver = sender * waves + wave, receiver * waves + wave
            sent = np.bincount(at_sender, minlength=size * waves).reshape(size, waves).cumsum(axis=1)
            got = np.bincount(at_receiver, minlength=size * waves).reshape(size, waves).cumsum(axis=1)
            sent, got = sent.ravel()[at_sender], got.ravel()[at_receiver]
            busy = np.maximum(out[sender] + sent * self.weight_bytes, into[receiver] + got * self.weight_bytes)
            model = self.cost_model
            gbps = np.where(inter > 0, model.inter_node_gbps, model.intra_node_gbps)
            arrival = model.link_latency_s + busy / (gbps * 1e9)
            relayed = source_row[copy] >= 0
            if relayed.any():  # a relay forwards its copy once it has it, over its link inside the node
                position = np.cumsum(copy) - 1
                upstream = arrival[position[source_row[copy][relayed]]]
                arrival[relayed] = np.maximum(arrival[relayed], upstream + model.link_time(self.weight_bytes, False))
            # a wave's GEMMs and every later wave's run back to back once it has arrived
            at = (base + helper) * waves + wave
            remaining = np.bincount(at, gemm[copy], k * ep * waves).reshape(k * ep, waves)[:, ::-1].cumsum(axis=1)
            np.maximum.at(latest, base // ep, arrival + remaining[:, ::-1].ravel()[at])
        return [(t, end - t, t) for t, end in zip(tokens, latest.tolist())]


def reference_plan_llep(
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
        plan = _spill_plan(counts, loads, local, before, capacity, config, expert_shape, copies)
    plan.budget = budget
    return plan


def _spill_plan(
    counts: np.ndarray,
    loads: np.ndarray,
    local: int,
    before: np.ndarray,
    capacity: float,
    config: LLEPConfig,
    expert_shape: Optional[ExpertShape],
    copies: CopyRules,
) -> LLEPPlan:
    """The least-loaded plan at ``capacity`` (or, cost-aware, the cheapest candidate)."""
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
    rows, spilled, slot_candidate = split_rows(candidates, local, copies)
    chunks = transport(counts, rows, spilled, _transport_nodes(config))
    timer = ReferenceTimeModel(counts, local, shape, config.cost_model, config.ranks_per_node)
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
