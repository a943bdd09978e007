"""Least-Loaded Assignment with spilling (LLA/LLAS), and what turns its splits into a plan: the
weight copy each spill needs (its source, wave, and whether the helper keeps it), the token chunks
that carry the spilled rows, the plan. Pure numpy.

Internally a set of splits is an ``[8, rows]`` array of *split rows*, one column per (slot,
destination), a slot being one spilled expert of one candidate plan, with the fields below; the
token chunks are a ``[5, chunks]`` array."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from megatron_llep.planning.plan import LLEPPlan

if TYPE_CHECKING:  # the config holds a CostModel of this package: imported for annotations only
    from megatron_llep.config import LLEPConfig

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
    supply_first: bool = False,
) -> dict[int, list[tuple[int, int]]]:
    """LLA/LLAS. Returns ``{expert: [(dst, tokens), ...]}`` for experts that leave their native rank.

    ``held[e]``: ranks that already keep a copy of ``e``; they are its first helpers (a spill there
    moves no weights). ``repacked``: with ``config.repack_copies``, end with :func:`repack`.
    ``supply_first``: across nodes, helpers are tried node by node in descending order of the
    expert's tokens routed inside the node beyond what the node already computes of it (the native
    node's keep counted), rather than native node first: a node that routes many of a hot expert's
    tokens computes them itself, so fewer of them cross nodes (one weight copy crosses instead).

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
    if supply_first and not one_node:  # [expert][node]: the expert's tokens routed inside each node
        node_supply = counts.reshape(ep // ranks_per_node, ranks_per_node, num_experts).sum(axis=1).T.tolist()

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
            if supply_first:
                unmet = list(node_supply[e])
                unmet[home] -= keep
                by_node: list[list[int]] = [[] for _ in unmet]
                for g in candidates:
                    by_node[node_of[g]].append(g)
                candidates = [g for node in sorted(range(len(unmet)), key=lambda x: (-unmet[x], x != home, x))
                              for g in by_node[node]]
            else:
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
                quota = quotas.setdefault(home, {})
                quota[dst] = quota.get(dst, 0) + tokens
    floor_piece = min(smallest_piece(splits), m if m > 0 else 1)
    best, best_copies = splits, copies_of(splits)
    helpers = {dst for q in quotas.values() for dst in q}
    if best_copies <= len(helpers):
        return splits  # one copy per helper at most (held ones aside): nothing to gain

    def may_win(home_quotas: dict[int, dict[int, int]]) -> bool:
        """False when filling these quotas provably cannot give an accepted plan: every positive
        quota is filled whole by pieces no larger than it, each a new copy unless its helper holds
        the expert, so a quota under ``floor_piece`` makes a smaller piece, and the quotas to
        helpers holding none of their home's experts need a copy each at least."""
        needed = 0
        for home, q in home_quotas.items():
            for dst, tokens in q.items():
                if tokens <= 0:
                    continue
                if tokens < floor_piece:
                    return False
                if not held or not any(dst in held.get(e, ()) for e in range(home * local, (home + 1) * local)):
                    needed += 1
        return needed < best_copies

    def consider(home_quotas: dict[int, dict[int, int]]) -> None:
        """Fill ``home_quotas`` and keep the result if it needs fewer copies (and no smaller piece)."""
        nonlocal best, best_copies
        if not may_win(home_quotas):
            return
        filled = _fill_quotas(splits, home_quotas, loads, local, held)
        copies = copies_of(filled)
        if copies < best_copies and smallest_piece(filled) >= floor_piece:
            best, best_copies = filled, copies

    consider(quotas)
    sending = {home: sum(q.values()) for home, q in quotas.items()}
    receiving: dict[int, int] = {}
    for q in quotas.values():
        for dst, tokens in q.items():
            receiving[dst] = receiving.get(dst, 0) + tokens
    if len(quotas) > 1 and not set(sending) & set(receiving):
        for per_node in dict.fromkeys([ranks_per_node, None]):  # inside nodes first; then as if one node
            if best_copies <= len(helpers):
                break
            consider(_rebuild_quotas(sending, receiving, per_node))
    return best


def _rebuild_quotas(sending: dict[int, int], receiving: dict[int, int],
                    per_node: Optional[int]) -> dict[int, dict[int, int]]:
    """Quotas from totals: the home rank with the most left to send fills the receiving rank with the
    most room (inside its node first when ``per_node``), until all is sent. Heaps by node."""
    senders = [(-t, h) for h, t in sending.items() if t > 0]
    heapq.heapify(senders)
    pools: dict[int, list[tuple[int, int]]] = {}
    for d, t in receiving.items():
        if t > 0:
            pools.setdefault(d // per_node if per_node else 0, []).append((-t, d))
    for pool in pools.values():
        heapq.heapify(pool)
    heappop, heappush = heapq.heappop, heapq.heappush
    rebuilt: dict[int, dict[int, int]] = {}
    while senders:
        t, home = heappop(senders)
        pool = pools.get(home // per_node if per_node else 0)
        if not pool:  # none left in its node: the roomiest anywhere (most room, then lowest rank)
            pool = None
            for p in pools.values():
                if p and (pool is None or p[0] < pool[0]):
                    pool = p
        r, dst = heappop(pool)
        amount = -t if t > r else -r
        quota = rebuilt.setdefault(home, {})
        quota[dst] = quota.get(dst, 0) + amount
        if t + amount < 0:
            heappush(senders, (t + amount, home))
        if r + amount < 0:
            heappush(pool, (r + amount, dst))
    return rebuilt


def _fill_quotas(splits: dict[int, list[tuple[int, int]]], quotas: dict[int, dict[int, int]], loads: list[int],
                 local: int, held: dict[int, tuple[int, ...]]) -> dict[int, list[tuple[int, int]]]:
    """Splits that send each home rank's quotas (``quotas[home][dst]`` tokens), filled per home from
    its experts: held experts into their holder's quota first, then largest expert into largest
    quota; the home keeps the rest. Homes without quotas keep their splits."""
    heappop, heappush = heapq.heappop, heapq.heappush
    result = {e: parts for e, parts in splits.items() if e // local not in quotas}
    for home, home_quotas in quotas.items():
        room = dict(home_quotas)
        first = home * local
        left = {e: loads[e] for e in range(first, first + local) if loads[e] > 0}
        pieces: dict[int, dict[int, int]] = {}
        if held:
            holding = [(e, dst) for e in sorted(left, key=lambda e: (-left[e], e)) for dst in held.get(e, ())
                       if dst in room]
            for e, dst in sorted(holding, key=lambda pair: pair[1]):  # held experts first: no copy at all
                if room[dst] > 0 and left[e] > 0:
                    take = min(left[e], room[dst])
                    piece = pieces.setdefault(e, {})
                    piece[dst] = piece.get(dst, 0) + take
                    left[e] -= take
                    room[dst] -= take
        open_quotas = [(-q, dst) for dst, q in room.items() if q > 0]
        heapq.heapify(open_quotas)
        experts = [(-t, e) for e, t in left.items() if t > 0]
        heapq.heapify(experts)
        while open_quotas and experts:
            q, dst = heappop(open_quotas)
            t, e = heappop(experts)
            take = -q if q > t else -t  # min(-q, -t)
            piece = pieces.get(e)
            if piece is None:
                pieces[e] = {dst: take}
            else:
                piece[dst] = piece.get(dst, 0) + take
            left[e] = -t - take
            room[dst] = -q - take
            if t + take < 0:
                heappush(experts, (t + take, e))
            if q + take < 0:
                heappush(open_quotas, (q + take, dst))
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
              ranks_per_node: Optional[int] = None, slot_candidate: Optional[np.ndarray] = None) -> np.ndarray:
    """Decide which source sends how many tokens of each spilled expert to each destination.

    ``splits`` is ``[8, rows]`` from :func:`split_rows` (slot, expert, destination, tokens, ...): how
    many tokens each destination computes; ``experts[slot]`` is the slot's expert. Returns
    ``[5, chunks]`` rows (expert, src, dst, count, slot). Each destination first takes its own
    routed tokens; with ``ranks_per_node`` below the EP size, then tokens routed inside its node
    (per slot and node, as much as the node's supply and demand match, shared among the node's
    sources in proportion to what each has left; what the node's destinations must still receive
    from other nodes goes to those with the fewest rows arriving across nodes so far, water-filling
    (:func:`_crossing_by_level`), so no helper's cross-node link is loaded while another of its
    node idles; ``slot_candidate[slot]`` says which plan a slot belongs to, each plan filled
    alone); the rest of every slot's
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
        candidate = np.zeros(experts.size, np.int64) if slot_candidate is None else slot_candidate
        take_demand = need - _crossing_by_level(counts, need, demand_group, matched, split_dst, experts, candidate,
                                                per_node)
        if take_supply.any():
            parts.append(_northwest(take_supply, take_demand, split_dst, experts, ep))
            supply = supply - take_supply
            need = need - take_demand
    if supply.any():
        parts.append(_northwest(supply, need, split_dst, experts, ep))
    return np.concatenate(parts, axis=1)


def _crossing_by_level(counts: np.ndarray, need: np.ndarray, demand_group: np.ndarray, matched: np.ndarray,
                       split_dst: np.ndarray, experts: np.ndarray, slot_candidate: np.ndarray,
                       per_node: int) -> np.ndarray:
    """Per split row, how many of the rows it still needs come from other nodes. Per (slot, node)
    group, that is the group's need beyond what the node supplies (``matched``); it is given to
    the group's destinations by water-filling their rows arriving across nodes so far (plain EP's
    for the experts the plan does not spill, then the plan's slots before this one), each at most
    its need, ties to the lower rank. A few destinations per group: plain Python."""
    ep, num_experts = counts.shape
    nodes, local = ep // per_node, num_experts // ep
    native = np.arange(num_experts) // local
    # plain EP's rows arriving across nodes, per expert and per rank
    from_other_nodes = counts.sum(axis=0) - counts.reshape(nodes, per_node, num_experts).sum(axis=1)[
        native // per_node, np.arange(num_experts)]
    plain_in = np.bincount(native, from_other_nodes, ep).astype(np.int64)
    excess = (np.bincount(demand_group, need, experts.size * nodes) - matched).astype(np.int64)
    groups = np.flatnonzero(excess > 0)
    if not groups.size:
        return np.zeros(need.size, np.int64)
    crossing = [0] * need.size
    starts = np.searchsorted(demand_group, groups).tolist()
    ends = np.searchsorted(demand_group, groups, side="right").tolist()
    need_list, dst_list, excess_list = need.tolist(), split_dst.tolist(), excess[groups].tolist()
    candidates = slot_candidate.tolist()
    owner = None
    for g, start, end, amount in zip((groups // nodes).tolist(), starts, ends, excess_list):
        if candidates[g] != owner:  # a new plan: its unspilled experts' plain-EP arrivals
            owner = candidates[g]
            mine = experts[slot_candidate == owner]
            level = (plain_in - np.bincount(native[mine], from_other_nodes[mine], ep).astype(np.int64)).tolist()
        rows = [r for r in range(start, end) if need_list[r] > 0]
        for r, rise in zip(rows, _water_fill([level[dst_list[r]] for r in rows], [need_list[r] for r in rows], amount)):
            crossing[r] = rise
            level[dst_list[r]] += rise
    return np.array(crossing, np.int64)


def _water_fill(levels: list[int], caps: list[int], amount: int) -> list[int]:
    """Integers ``rise[i]`` in ``[0, caps[i]]`` summing to ``amount`` (at most ``sum(caps)``) that
    raise the lowest ``levels`` first: every ``levels[i] + rise[i]`` is the water level ``W`` or
    ``W + 1`` unless its cap or its own level stops it, the ``+ 1``s to the first entries. ``W`` is
    found in one pass over the levels at which an entry starts and stops rising."""
    if len(levels) == 1:
        return [amount]
    events = sorted([(level, 1) for level in levels] + [(level + cap, -1) for level, cap in zip(levels, caps)])
    filled, slope, at, water = 0, 0, events[0][0], None
    for position, change in events:
        if position != at:
            reached = filled + slope * (position - at)
            if reached >= amount:  # W: the highest level up to which the rises sum to at most amount
                water = at + (amount - filled) // slope
                break
            filled, at = reached, position
        slope += change
    if water is None:
        water = at
    rise = [min(cap, max(0, water - level)) for level, cap in zip(levels, caps)]
    left = amount - sum(rise)
    for i, (level, cap) in enumerate(zip(levels, caps)):
        if left == 0:
            break
        if level + rise[i] == water and rise[i] < cap:
            rise[i] += 1
            left -= 1
    return rise


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
