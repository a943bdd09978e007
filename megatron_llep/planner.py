"""Least-Loaded Assignment (LLA) with spilling (LLAS): the per-step LLEP plan.

Pure numpy, no torch.distributed: every EP rank calls :func:`plan_llep` on the same global count
matrix and gets the same plan, so no plan is ever broadcast.

Notation: ``P`` EP ranks, ``N`` experts, ``M = N / P`` native experts per rank (rank ``p`` owns
experts ``pM .. (p+1)M-1``), ``C[src, e]`` tokens that rank ``src`` routes to expert ``e``.

The algorithm (SPEC section 1, step 3):
  * capacity ``cap = alpha * sum(l) / P``;
  * experts are visited in descending load order; a rank's *effective* load is what it has been
    assigned plus the load of its native experts not visited yet, so a helper is never picked
    while its own hot experts are still to come;
  * the native rank keeps an expert's tokens up to its remaining capacity, the excess goes to the
    least-loaded rank with room (inside the native rank's node first), repeating until assigned;
  * a remainder smaller than ``m`` is not worth a GEMM and stays native, as long as that keeps the
    native rank within ``cap + m``;
  * when no rank has room the remainder goes to the least-loaded rank anyway, up to ``cap + m``
    while possible (never drop a token): with ``alpha >= 1`` no rank ends above ``ceil(cap) + m``;
  * with a cost model, a spill happens only if the predicted transfer time (the weight copy plus
    any token that would not have crossed ranks under plain EP) is below the GEMM time it saves
    the native rank.
Spilled tokens of an expert are first taken from the helper's own routed tokens (no traffic).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatron_llep.config import LLEPConfig
from megatron_llep.cost_model import ExpertShape


@dataclass
class RankPlan:
    """What one rank does under a plan (all host-side numpy).

    ``send_counts[e, dst]``: tokens of expert ``e`` this rank sends to ``dst`` (itself included);
    ``recv_counts[src, e]``: tokens of expert ``e`` this rank receives from ``src``;
    ``slot_experts``: experts this rank computes, its ``M`` native experts first, then borrowed
    ones in ascending id; ``tokens_per_slot`` their token counts;
    ``weights_to_send``: ``(expert, helper)`` pairs; ``weights_to_receive``: ``(expert, native)``.
    """

    rank: int
    send_counts: np.ndarray
    recv_counts: np.ndarray
    slot_experts: np.ndarray
    tokens_per_slot: np.ndarray
    weights_to_send: list[tuple[int, int]]
    weights_to_receive: list[tuple[int, int]]

    @property
    def input_splits(self) -> np.ndarray:
        return self.send_counts.sum(axis=0)

    @property
    def output_splits(self) -> np.ndarray:
        return self.recv_counts.sum(axis=1)

    @property
    def borrowed_experts(self) -> np.ndarray:
        return self.slot_experts[self.num_native_slots :]

    @property
    def num_native_slots(self) -> int:
        return self.slot_experts.size - len(self.weights_to_receive)

    def send_order(self) -> np.ndarray:
        """Row gather index: expert-major permuted tokens -> destination-major a2a input."""
        num_experts, ep = self.send_counts.shape
        order = np.arange(num_experts * ep).reshape(num_experts, ep).T.ravel()
        return chunk_gather_index(self.send_counts.ravel(), order)

    def recv_order(self) -> np.ndarray:
        """Row gather index: a2a output (source-major) -> slot-major expert input."""
        ep, num_experts = self.recv_counts.shape
        order = (np.arange(ep)[None, :] * num_experts + self.slot_experts[:, None]).ravel()
        return chunk_gather_index(self.recv_counts.ravel(), order)


@dataclass
class LLEPPlan:
    """A step's plan. Experts not in ``spilled_experts`` send every token to their native rank."""

    counts: np.ndarray
    num_local_experts: int
    capacity: float
    rank_loads_before: np.ndarray
    rank_loads_after: np.ndarray
    fallback: bool
    spilled_experts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # Every token movement of a spilled expert, staying put included: (expert, src, dst, count).
    chunk_expert: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # Weight copies: (expert, native, helper).
    transfer_expert: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    transfer_native: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    transfer_helper: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def ep_size(self) -> int:
        return self.counts.shape[0]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[1]

    @property
    def is_plain_ep(self) -> bool:
        """True when every token goes to its native expert rank (exactly plain EP)."""
        return self.spilled_experts.size == 0

    @property
    def native_rank(self) -> np.ndarray:
        return np.arange(self.num_experts) // self.num_local_experts

    @property
    def num_weight_transfers(self) -> int:
        return int(self.transfer_expert.size)

    @property
    def spilled_tokens(self) -> int:
        """Token-expert assignments computed away from their native rank."""
        native = self.native_rank[self.chunk_expert]
        return int(self.chunk_count[self.chunk_dst != native].sum())

    def token_chunks(self) -> np.ndarray:
        """All non-empty ``(expert, src, dst, count)`` rows, implicit native ones included."""
        counts = self.counts.copy()
        counts[:, self.spilled_experts] = 0
        src, expert = np.nonzero(counts)
        implicit = np.stack([expert, src, self.native_rank[expert], counts[src, expert]], axis=1)
        explicit = np.stack([self.chunk_expert, self.chunk_src, self.chunk_dst, self.chunk_count], axis=1)
        rows = np.concatenate([implicit, explicit.reshape(-1, 4)], axis=0)
        rows = rows[rows[:, 3] > 0]
        return rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]

    def moved_tokens(self) -> int:
        """Token-expert assignments that cross ranks (src != dst)."""
        experts = np.arange(self.num_experts)
        stay = self.counts[self.native_rank, experts]  # routed by the native rank itself
        remote = self.counts.sum(axis=0) - stay
        remote[self.spilled_experts] = 0
        explicit = self.chunk_count[self.chunk_src != self.chunk_dst].sum()
        return int(remote.sum() + explicit)

    def rank_view(self, rank: int) -> RankPlan:
        """The per-rank communication and compute layout of this plan."""
        ep, num_experts, local = self.ep_size, self.num_experts, self.num_local_experts
        if not 0 <= rank < ep:
            raise ValueError(f"rank {rank} is outside the EP group of size {ep}")
        native = self.native_rank
        send = np.zeros((num_experts, ep), np.int64)
        send[np.arange(num_experts), native] = self.counts[rank]
        recv = np.zeros((ep, num_experts), np.int64)
        mine = slice(rank * local, (rank + 1) * local)
        recv[:, mine] = self.counts[:, mine]
        if self.spilled_experts.size:
            send[self.spilled_experts] = 0
            recv[:, self.spilled_experts] = 0
            out = self.chunk_src == rank
            np.add.at(send, (self.chunk_expert[out], self.chunk_dst[out]), self.chunk_count[out])
            into = self.chunk_dst == rank
            np.add.at(recv, (self.chunk_src[into], self.chunk_expert[into]), self.chunk_count[into])
        sends = sorted(
            (int(e), int(h)) for e, n, h in zip(self.transfer_expert, self.transfer_native, self.transfer_helper) if n == rank
        )
        receives = sorted(
            (int(e), int(n)) for e, n, h in zip(self.transfer_expert, self.transfer_native, self.transfer_helper) if h == rank
        )
        slots = np.concatenate([np.arange(mine.start, mine.stop), np.array([e for e, _ in receives], np.int64)])
        return RankPlan(
            rank=rank,
            send_counts=send,
            recv_counts=recv,
            slot_experts=slots.astype(np.int64),
            tokens_per_slot=recv[:, slots].sum(axis=0),
            weights_to_send=sends,
            weights_to_receive=receives,
        )


def chunk_gather_index(sizes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Row index that concatenates chunks (given by ``sizes`` in storage order) in ``order``.

    Chunks not named in ``order`` must be empty. Vectorised: no Python loop over chunks.
    """
    sizes = np.asarray(sizes, np.int64)
    starts = np.cumsum(sizes) - sizes
    picked = sizes[order]
    total = int(picked.sum())
    if total != int(sizes.sum()):
        raise ValueError("chunk_gather_index: order leaves out non-empty chunks")
    offsets = np.repeat(starts[order] - (np.cumsum(picked) - picked), picked)
    return offsets + np.arange(total, dtype=np.int64)


def rank_loads(counts: np.ndarray, num_local_experts: int) -> np.ndarray:
    """Tokens each rank computes under plain EP (``counts`` is ``[P, N]`` or ``[N]``)."""
    loads = np.asarray(counts).reshape(-1, np.asarray(counts).shape[-1]).sum(axis=0)
    return loads.reshape(-1, num_local_experts).sum(axis=1)


def plan_llep(
    counts: np.ndarray,
    config: LLEPConfig,
    expert_shape: Optional[ExpertShape] = None,
) -> LLEPPlan:
    """Compute the LLEP plan for one MoE layer step from the global ``[P, N]`` count matrix.

    ``expert_shape`` is needed only when ``config.cost_aware`` (it sizes GEMMs and transfers).
    """
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be a [ep_size, num_experts] matrix, got shape {counts.shape}")
    if not np.issubdtype(counts.dtype, np.integer):
        raise TypeError(f"counts must be integers, got dtype {counts.dtype}")
    if counts.size and counts.min() < 0:
        raise ValueError("counts must be non-negative")
    counts = counts.astype(np.int64, copy=False)
    ep, num_experts = counts.shape
    local = config.validate_layout(num_experts, ep)
    if config.cost_aware and expert_shape is None:
        raise ValueError("a cost-aware LLEP plan needs the expert shape (pass expert_shape or set cost_aware=False)")

    loads = counts.sum(axis=0)
    before = loads.reshape(ep, local).sum(axis=1)
    total = int(loads.sum())
    capacity = config.alpha * total / ep
    if total == 0 or ep == 1 or before.max() * ep < config.imbalance_threshold * total:
        return LLEPPlan(counts, local, capacity, before, before.copy(), fallback=True)

    splits = _least_loaded_assignment(counts, loads, before, capacity, config, expert_shape)
    if not splits:
        return LLEPPlan(counts, local, capacity, before, before.copy(), fallback=False)
    return _build_plan(counts, loads, local, capacity, before, splits)


def _least_loaded_assignment(
    counts: np.ndarray,
    loads: np.ndarray,
    rank_loads_before: np.ndarray,
    capacity: float,
    config: LLEPConfig,
    shape: Optional[ExpertShape],
) -> dict[int, list[tuple[int, int]]]:
    """LLA/LLAS. Returns ``{expert: [(dst, tokens), ...]}`` for experts that leave their native rank.

    Plain Python ints on purpose: the loop is short and numpy's per-call overhead would dominate.
    """
    ep, num_experts = counts.shape
    local = num_experts // ep
    m = config.min_chunk_tokens
    ranks_per_node = config.ranks_per_node or ep  # None: all ranks share one node
    spill_pays = config.cost_model.spill_oracle(shape) if config.cost_aware else None
    expert_loads = loads.tolist()
    # effective[g]: tokens assigned to g so far plus its native experts' load not yet visited
    effective = rank_loads_before.tolist()
    slack_limit = capacity + m
    splits: dict[int, list[tuple[int, int]]] = {}

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
        keep = min(load, max(0, math.floor(capacity - effective[n])))
        if keep == load or (load - keep < m and effective[n] + load <= slack_limit):
            effective[n] += load
            continue

        parts: dict[int, int] = {}
        remaining = load
        third_party = load - int(counts[n, e])
        if keep:
            parts[n] = keep
            effective[n] += keep
            remaining -= keep
        # Helpers in ascending effective load, native node first. A helper's load only grows when
        # this expert fills it, so the order holds for the whole expert and one pass suffices.
        by_load = sorted(open_ranks, key=effective.__getitem__)
        home = n // ranks_per_node
        candidates = [g for g in by_load if g // ranks_per_node == home]
        candidates += [g for g in by_load if g // ranks_per_node != home]
        column = counts[:, e].tolist()
        cursor = 0
        while remaining > 0:
            need = min(remaining, m) if m > 0 else 1
            if need < m:
                cursor = 0  # a smaller final piece may fit ranks skipped for lack of room
            while cursor < len(candidates) and capacity - effective[candidates[cursor]] < need:
                cursor += 1
            if cursor < len(candidates):
                helper = candidates[cursor]
                take = min(remaining, math.floor(capacity - effective[helper]))
            else:
                # Nobody has room for a worthwhile chunk: the least-loaded rank takes up to cap + m
                # (at least one token, so integer rounding cannot stall); past that, everything.
                helper = min(range(ep), key=effective.__getitem__)
                slack = slack_limit - effective[helper]
                take = min(remaining, max(math.ceil(slack), 1)) if slack > 0 else remaining
            if helper != n and spill_pays is not None:
                # Tokens from third ranks travel under plain EP too; only the native rank's own
                # tokens (used once the helper's own and third-party ones run out) are new traffic.
                own = min(column[helper], take)
                from_third = min(third_party, take - own)
                if not spill_pays(take, take - own - from_third, helper // ranks_per_node != home, helper not in parts):
                    helper, take = n, remaining
                else:
                    third_party -= from_third
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
        if set(parts) != {n}:
            splits[e] = sorted(parts.items())
    return splits


def _build_plan(
    counts: np.ndarray,
    loads: np.ndarray,
    local: int,
    capacity: float,
    before: np.ndarray,
    splits: dict[int, list[tuple[int, int]]],
) -> LLEPPlan:
    experts = sorted(splits)
    spilled = np.array(experts, np.int64)
    # One row per (spilled expert, destination): the expert's index in ``spilled``, the expert,
    # the destination and the tokens it computes; destinations ascending within an expert.
    rows = [(i, e, d, t) for i, e in enumerate(experts) for d, t in splits[e]]
    rows = np.fromiter(itertools.chain.from_iterable(rows), np.int64, 4 * len(rows)).reshape(-1, 4).T
    split_expert, split_dst, split_tokens = rows[1], rows[2], rows[3]
    native = split_expert // local
    after = before.copy()
    np.subtract.at(after, spilled // local, loads[spilled])
    np.add.at(after, split_dst, split_tokens)
    helpers = split_dst != native
    chunks = _transport(counts, spilled, rows)
    return LLEPPlan(
        counts=counts,
        num_local_experts=local,
        capacity=capacity,
        rank_loads_before=before,
        rank_loads_after=after,
        fallback=False,
        spilled_experts=spilled,
        chunk_expert=chunks[0],
        chunk_src=chunks[1],
        chunk_dst=chunks[2],
        chunk_count=chunks[3],
        transfer_expert=split_expert[helpers],
        transfer_native=native[helpers],
        transfer_helper=split_dst[helpers],
    )


def _transport(counts: np.ndarray, experts: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """Decide which source sends how many tokens of each spilled expert to each destination.

    ``splits`` is ``[4, rows]`` (index into ``experts``, expert, destination, tokens), expert by
    expert with destinations ascending: how many tokens each destination computes. Returns
    ``[4, chunks]`` rows (expert, src, dst, count). Each destination first takes its own routed
    tokens; the rest of every expert's supply is matched to the rest of its demand in rank order
    (north-west corner) — all experts at once, since the running sums of supply and demand meet at
    every expert boundary. Ranks are numbered node by node, so this keeps traffic inside nodes
    where it can.
    """
    slot, split_expert, split_dst, split_tokens = splits
    ep = counts.shape[0]
    supply = counts.T[experts]  # [spilled experts, src], a copy
    own = np.minimum(supply[slot, split_dst], split_tokens)
    supply[slot, split_dst] -= own
    need = split_tokens - own
    stays = np.array([split_expert, split_dst, split_dst, own])[:, own > 0]
    supply = supply.ravel()
    sources = np.flatnonzero(supply)  # slot * ep + src
    if not sources.size:
        return stays
    supply_end = np.cumsum(supply[sources])
    open_rows = need > 0
    demand_end = np.cumsum(need[open_rows])
    ends = np.concatenate([supply_end, demand_end])
    ends.sort(kind="stable")  # two sorted runs: a linear merge
    ends = ends[np.concatenate([[True], ends[1:] != ends[:-1]])]  # both sums increase strictly
    starts = np.concatenate([[0], ends[:-1]])
    source = sources[np.searchsorted(supply_end, starts, side="right")]
    destination = split_dst[open_rows][np.searchsorted(demand_end, starts, side="right")]
    moves = np.array([experts[source // ep], source % ep, destination, ends - starts])
    return np.concatenate([stays, moves], axis=1)
