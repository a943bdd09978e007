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
    while possible (never drop a token): with ``alpha >= 1`` no rank ends above ``ceil(cap) + m``.
Spilled tokens of an expert are first taken from the helper's own routed tokens (no traffic).

Borrowed weights over an optimizer step (issue 25): a helper may keep the copies it receives for
the rest of the step (``keep_room``, from ``LLEPConfig.max_kept_weight_bytes``); the next
micro-batches' plans are told which rank holds which expert (``held``). LLA tries the holders of an
expert first, then the ranks of the native node and of the holders' nodes, then the rest; a spill
to a holder moves tokens but no weights. With ``LLEPConfig.relay_within_node`` a copy bound for
another node crosses the node boundary once and is forwarded inside that node
(:func:`_copy_rows`).

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
``cost_aware=False`` returns) and least-loaded plans at raised capacities (fewer, fuller helpers: fewer weight copies, more GEMM time on the slowest rank),
so a cost-aware plan is never predicted slower than either plain plan (under a budget, plain EP
is a candidate only within it and raised capacities stop at it). Ties keep the plain
least-loaded plan, then plain EP. No decision is taken chunk by chunk: a spill that does not pay
for itself in isolation can still shorten the slowest rank, and vice versa.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatron_llep.config import LLEPConfig
from megatron_llep.cost_model import CostModel, ExpertShape


@dataclass
class RankPlan:
    """What one rank does under a plan (all host-side numpy).

    ``send_counts[e, dst]``: tokens of expert ``e`` this rank sends to ``dst`` (itself included);
    ``recv_counts[src, e]``: tokens of expert ``e`` this rank receives from ``src``;
    ``slot_experts``: experts this rank computes: its ``num_native_slots`` native experts, then
    ``held_experts`` (borrowed copies it already keeps for the step, ascending id), then the copies
    it receives in arrival order (by wave, then id); ``tokens_per_slot`` their token counts;
    ``weights_to_send``: ``(expert, helper)`` copies this rank sends, as the expert's native rank or
    as a relay inside its node, in sending order (by wave, helper, id); ``weights_to_receive``:
    ``(expert, source)`` pairs in slot order, ``receive_kept`` whether each copy is kept for the
    rest of the step; ``send_waves`` and ``receive_waves``: each pair's wave (:func:`copy_waves`).
    """

    rank: int
    send_counts: np.ndarray
    recv_counts: np.ndarray
    slot_experts: np.ndarray
    tokens_per_slot: np.ndarray
    weights_to_send: list[tuple[int, int]]
    weights_to_receive: list[tuple[int, int]]
    send_waves: list[int]
    receive_waves: list[int]
    num_native_slots: int
    held_experts: list[int] = field(default_factory=list)
    receive_kept: list[bool] = field(default_factory=list)

    @property
    def input_splits(self) -> np.ndarray:
        return self.send_counts.sum(axis=0)

    @property
    def output_splits(self) -> np.ndarray:
        return self.recv_counts.sum(axis=1)

    @property
    def borrowed_experts(self) -> np.ndarray:
        return self.slot_experts[self.num_native_slots :]

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
    # New weight copies (a helper that already holds the expert gets none): (expert, native, helper),
    # the rank that sends it (the native rank, or a relay inside the helper's node), the wave it
    # travels in (:func:`copy_waves`) and whether the helper keeps it for the rest of the step.
    # A plan built without sources or kept flags sends every copy from the native rank, transient.
    transfer_expert: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    transfer_native: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    transfer_helper: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    transfer_wave: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    transfer_source: Optional[np.ndarray] = None
    transfer_kept: Optional[np.ndarray] = None
    # The row budget the plan was made under (LLEPConfig.max_tokens_per_rank); None: no budget.
    budget: Optional[int] = None

    def __post_init__(self) -> None:
        if self.transfer_source is None:
            self.transfer_source = self.transfer_native.copy()
        if self.transfer_kept is None:
            self.transfer_kept = np.zeros(self.transfer_expert.size, bool)

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
        transfers = list(zip(self.transfer_wave.tolist(), self.transfer_expert.tolist(),
                             self.transfer_source.tolist(), self.transfer_helper.tolist(), self.transfer_kept.tolist()))
        sends = sorted((w, h, e) for w, e, s, h, _ in transfers if s == rank)
        receives = sorted((w, e, s, kept) for w, e, s, h, kept in transfers if h == rank)
        received = {e for _, e, _, _ in receives}
        computed = np.unique(self.chunk_expert[self.chunk_dst == rank]).tolist()
        held = [e for e in computed if native[e] != rank and e not in received]
        slots = np.array(list(range(mine.start, mine.stop)) + held + [e for _, e, _, _ in receives], np.int64)
        return RankPlan(
            rank=rank,
            send_counts=send,
            recv_counts=recv,
            slot_experts=slots,
            tokens_per_slot=recv[:, slots].sum(axis=0),
            weights_to_send=[(e, h) for _, h, e in sends],
            weights_to_receive=[(e, s) for _, e, s, _ in receives],
            send_waves=[w for w, _, _ in sends],
            receive_waves=[w for w, _, _, _ in receives],
            num_native_slots=local,
            held_experts=held,
            receive_kept=[bool(kept) for _, _, _, kept in receives],
        )


class LayerTimeModel:
    """The layer time a :class:`CostModel` predicts for a plan: the quantity cost-aware planning
    minimises.

    ``dispatch + compute + combine``, as the implementation runs them:

    * dispatch and combine: the token all-to-all. A rank's link time is
      ``CostModel.link_time(max(bytes out, bytes in))``; links inside a node and across nodes are
      separate and run in parallel, as do all ranks' links, so a phase takes the slowest link;
    * compute: a rank runs one GEMM per expert it computes with tokens,
      ``CostModel.gemm_time(tokens)`` each, its native experts first (from the end of the
      dispatch), then its borrowed ones wave by wave (:func:`copy_waves`), each wave once its
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

    def phases(self, plan: "LLEPPlan") -> dict[str, float]:
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

    def time(self, plan: "LLEPPlan") -> float:
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

        ``rows``: :func:`_split_rows` rows of all candidates, slots numbered across them (a row with
        a source gets a new weight copy from it; one with a source row gets it from a relay, once the
        relay's own copy, in that row, is in);
        ``spilled[slot]``: the slot's expert; ``chunks``: :func:`_transport` of those rows;
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
        src, dst, count = chunks[1], chunks[2], chunks[3] * (chunks[1] != chunks[2])
        chunk_index = 2 * slot_base[chunks[4]] + self._cross[src, dst]
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


class InfeasibleBudgetError(ValueError):
    """A step routes more token-expert rows than ``P x max_tokens_per_rank``: no plan can keep every
    rank within the budget. Raised by :func:`plan_llep` from the global counts alone, so every EP
    rank of the step raises it, before the dispatch (no rank enters the all-to-all alone)."""

    def __init__(self, total_rows: int, ep_size: int, budget: int, layer_number: Optional[int] = None) -> None:
        self.total_rows, self.ep_size, self.budget, self.layer_number = total_rows, ep_size, budget, layer_number
        where = f"MoE layer {layer_number}" if layer_number is not None else "an MoE layer"
        needed = -(-total_rows // ep_size)
        super().__init__(
            f"LLEP row budget cannot be met in {where}: {total_rows} token-expert rows over {ep_size} EP ranks "
            f"exceed {ep_size} x max_tokens_per_rank {budget} = {ep_size * budget}; raise max_tokens_per_rank "
            f"(--llep-max-tokens-per-rank) to at least {needed} or route fewer tokens per micro-batch")


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
    node than their native rank's come from one rank of that node (:func:`_copy_rows`).

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
    copies = _CopyRules.of(held, keep_room, config, ep, local)

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
    copies: "_CopyRules",
) -> LLEPPlan:
    """The least-loaded plan at ``capacity`` (or, cost-aware, the cheapest candidate)."""
    splits = _least_loaded_assignment(counts, loads, before, capacity, config, copies.held)
    if not splits:
        return LLEPPlan(counts, local, capacity, before, before.copy(), fallback=False)
    if config.cost_aware:
        return _cheapest_plan(counts, loads, local, before, capacity, splits, config, expert_shape, copies)
    rows, spilled, _ = _split_rows([splits], local, copies)
    return _build_plan(counts, loads, local, capacity, before, rows, spilled, _transport(counts, rows, spilled))


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
    copies: "_CopyRules",
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
            more = _least_loaded_assignment(counts, loads, before, raised, config, copies.held)
            if not more:
                break  # a higher capacity spills no more than this one
            capacities.append(raised)
            candidates.append(more)
            slots, last = slots + len(more), len(more)
    rows, spilled, slot_candidate = _split_rows(candidates, local, copies)
    chunks = _transport(counts, rows, spilled)
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
        kept_rows = mine[rows[0]]
        first_row = int(np.argmax(kept_rows))
        rows, spilled, chunks = rows[:, kept_rows], spilled[mine], chunks[:, mine[chunks[4]]]
        rows[0] -= first
        rows[7][rows[7] >= 0] -= first_row
        chunks[4] -= first
    return _build_plan(counts, loads, local, capacities[best], before, rows, spilled, chunks)


def _weight_copies_weigh(
    splits: dict[int, list[tuple[int, int]]],
    before: np.ndarray,
    loads: np.ndarray,
    local: int,
    config: LLEPConfig,
    shape: ExpertShape,
    rules: "_CopyRules",
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


def _least_loaded_assignment(
    counts: np.ndarray,
    loads: np.ndarray,
    rank_loads_before: np.ndarray,
    capacity: float,
    config: LLEPConfig,
    held: Optional[dict[int, tuple[int, ...]]] = None,
) -> dict[int, list[tuple[int, int]]]:
    """LLA/LLAS. Returns ``{expert: [(dst, tokens), ...]}`` for experts that leave their native rank.

    ``held[e]``: ranks that already keep a copy of ``e``; they are its first helpers (a spill there
    moves no weights).

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
    return splits


@dataclass(frozen=True)
class _CopyRules:
    """What decides a plan's weight copies besides its splits: ``held[e]``, the ranks that already
    keep expert ``e`` (ascending); ``keep_room[p]``, how many more copies rank ``p`` may keep
    (``None``: no bound); ``relay``, whether copies are relayed inside nodes of ``ranks_per_node``."""

    held: dict[int, tuple[int, ...]]
    keep_room: Optional[list[int]]
    relay: bool
    ranks_per_node: int

    @classmethod
    def of(cls, held: Optional[np.ndarray], keep_room: Optional[np.ndarray], config: LLEPConfig, ep: int,
           local: int) -> "_CopyRules":
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


def _split_rows(
    candidates: list[dict[int, list[tuple[int, int]]]], num_local_experts: int, rules: _CopyRules
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[8, rows]`` (slot, expert, destination, tokens, wave, source, kept, source row) of one or
    more plans' splits, each slot's expert and each slot's plan. A slot is one spilled expert of one
    plan; slots count up across the plans, and within a plan follow ascending expert ids,
    destinations ascending within a slot. A row whose destination needs a new weight copy (a
    helper that does not hold the expert) has its ``source`` (else -1), ``wave`` (else 0) and
    ``kept`` flag (:func:`_copy_rows`); ``source row`` is the row in which a relay source receives
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
        _copy_rows(rows, copy_rows, num_local_experts, rules)
    rows = np.fromiter(itertools.chain.from_iterable(rows), np.int64, 8 * len(rows)).reshape(-1, 8).T
    return rows, np.array(experts, np.int64), np.array(owners, np.int64)


def _copy_rows(rows: list[list[int]], copy_rows: list[int], local: int, rules: _CopyRules) -> None:
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
            key = (rows[i][5], rows[i][2])
            d = depth.get(key, 0)
            depth[key] = d + 1
            rows[i][4] = d.bit_length()

    for i in copy_rows:
        rows[i][5] = rows[i][1] // local
    number_waves()
    if rules.keep_room is None:
        for i in copy_rows:
            rows[i][6] = 1
    else:
        room = list(rules.keep_room)  # each candidate plan starts afresh
        for i in sorted(copy_rows, key=lambda i: (rows[i][4], rows[i][1], rows[i][2])):
            if room[rows[i][2]] > 0:
                room[rows[i][2]] -= 1
                rows[i][6] = 1
    if not rules.relay:
        return
    per_node = rules.ranks_per_node
    groups: dict[tuple[int, int], list[int]] = {}
    for i in copy_rows:
        e, d = rows[i][1], rows[i][2]
        if d // per_node != (e // local) // per_node:
            groups.setdefault((e, d // per_node), []).append(i)
    relayed = False
    for (e, node), members in groups.items():
        holders = [g for g in rules.held.get(e, ()) if g // per_node == node]
        if holders:
            source, source_row = holders[0], -1
        else:
            kept = [i for i in members if rows[i][6]]
            if not kept:
                continue
            source_row = kept[0]
            source = rows[source_row][2]
        for i in members:
            if i != source_row:
                rows[i][5], rows[i][7] = source, source_row
                relayed = True
    if relayed:
        number_waves()
        for i in copy_rows:
            if rows[i][7] >= 0:
                rows[i][4] = max(rows[i][4], rows[rows[i][7]][4] + 1)


def _build_plan(
    counts: np.ndarray,
    loads: np.ndarray,
    local: int,
    capacity: float,
    before: np.ndarray,
    rows: np.ndarray,
    spilled: np.ndarray,
    chunks: np.ndarray,
) -> LLEPPlan:
    split_expert, split_dst, split_tokens, split_wave, split_source, split_kept = rows[1:7]
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
        chunk_expert=chunks[0],
        chunk_src=chunks[1],
        chunk_dst=chunks[2],
        chunk_count=chunks[3],
        transfer_expert=split_expert[copy],
        transfer_native=native[copy],
        transfer_helper=split_dst[copy],
        transfer_wave=split_wave[copy],
        transfer_source=split_source[copy],
        transfer_kept=split_kept[copy].astype(bool),
    )


def copy_waves(pair: np.ndarray) -> np.ndarray:
    """The wave of each weight copy, given its (native, helper) ``pair`` key, copies in expert order.

    A native rank sends its copies in waves, each helper's first copy in wave 0, its second in
    wave 1, then 2, 4, 8 ... copies per wave (the ``d``-th copy goes in wave ``d.bit_length()``): a
    helper starts on its first borrowed expert while the rest arrive, and a layer has only about
    ``log2`` of the copies per helper waves (one P2P batch and one borrowed GEMM call each).
    Plain Python: a plan has a few dozen copies, where numpy's per-call overhead would dominate."""
    copies_so_far: dict[int, int] = {}
    waves = []
    for key in pair.tolist():
        depth = copies_so_far.get(key, 0)
        copies_so_far[key] = depth + 1
        waves.append(depth.bit_length())
    return np.array(waves, np.int64)


def stripe_bounds(lo: int, hi: int, pieces: int) -> list[int]:
    """Edges of ``[lo, hi)`` cut into ``pieces`` near-equal contiguous ranges (the stripes and
    parts of :func:`gradient_return_phases`)."""
    return [lo + (hi - lo) * i // pieces for i in range(pieces + 1)]


def gradient_return_phases(held: np.ndarray, num_local_experts: int, numel: int, ranks_per_node: Optional[int],
                           relay: bool) -> list[list[tuple[int, int, int, int, int]]]:
    """The once-per-step return of kept copies' gradients to their native ranks, as phases of
    transfers ``(expert, source, target, lo, hi)``: elements ``[lo, hi)`` of the expert's flat
    gradient (``numel`` elements), which the target adds to its own. A phase starts once the one
    before it has arrived.

    ``held[e, p]``: rank ``p`` keeps a copy of expert ``e``. Helpers return straight to the native
    rank when they share its node, or without ``relay``. Otherwise a hierarchical sum, so that no
    single link carries one whole gradient per node: (0) on every node that keeps the expert, the
    native rank's included, each helper cuts its gradient into one stripe per rank of the node and
    stripe ``j`` is summed at the node's ``j``-th rank; (1) the helper nodes other than the native
    rank's reduce-scatter their stripe sums, rank ``j`` with rank ``j`` (each node ends with the sum
    of one part of every stripe); (2) each part crosses once, to rank ``j`` of the native rank's
    node; (3) those ranks send their stripe sums to the native rank. Every EP rank computes the
    same phases from the same ledger. Plain Python: a step has a few hundred kept copies."""
    ep = held.shape[1]
    per_node = min(ranks_per_node or ep, ep)
    phases: list[list[tuple[int, int, int, int, int]]] = [[], [], [], []]
    stripes = stripe_bounds(0, numel, per_node)
    for expert in np.flatnonzero(held.any(axis=1)).tolist():
        native = expert // num_local_experts
        home = native // per_node
        keepers = np.flatnonzero(held[expert]).tolist()
        remote = sorted({k // per_node for k in keepers} - {home}) if relay else []
        if not remote:
            phases[0] += [(expert, keeper, native, 0, numel) for keeper in keepers]
            continue
        for keeper in keepers:
            node = keeper // per_node
            phases[0] += [(expert, keeper, node * per_node + j, stripes[j], stripes[j + 1])
                          for j in range(per_node) if node * per_node + j != keeper and stripes[j] < stripes[j + 1]]
        for j in range(per_node):
            parts = stripe_bounds(stripes[j], stripes[j + 1], len(remote))
            for q, owner in enumerate(remote):
                if parts[q] == parts[q + 1]:
                    continue
                phases[1] += [(expert, node * per_node + j, owner * per_node + j, parts[q], parts[q + 1])
                              for node in remote if node != owner]
                phases[2].append((expert, owner * per_node + j, home * per_node + j, parts[q], parts[q + 1]))
            if home * per_node + j != native and stripes[j] < stripes[j + 1]:
                phases[3].append((expert, home * per_node + j, native, stripes[j], stripes[j + 1]))
    return phases


def _transport(counts: np.ndarray, splits: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """Decide which source sends how many tokens of each spilled expert to each destination.

    ``splits`` is ``[8, rows]`` from :func:`_split_rows` (slot, expert, destination, tokens, ...): how
    many tokens each destination computes; ``experts[slot]`` is the slot's expert. Returns
    ``[5, chunks]`` rows (expert, src, dst, count, slot). Each destination first takes its own
    routed tokens; the rest of every slot's supply is matched to the rest of its demand in rank
    order (north-west corner) — all slots at once, since the running sums of supply and demand
    meet at every slot boundary. Ranks are numbered node by node, so this keeps traffic inside
    nodes where it can.
    """
    slot, split_expert, split_dst, split_tokens = splits[:4]
    ep = counts.shape[0]
    supply = counts.T[experts]  # [slots, src], a copy
    own = np.minimum(supply[slot, split_dst], split_tokens)
    supply[slot, split_dst] -= own
    need = split_tokens - own
    stays = np.array([split_expert, split_dst, split_dst, own, slot])[:, own > 0]
    supply = supply.ravel()
    sources = supply.nonzero()[0]  # slot * ep + src
    if not sources.size:
        return stays
    supply_end = supply[sources].cumsum()
    open_rows = need > 0
    demand_end = need[open_rows].cumsum()
    ends = np.concatenate([supply_end, demand_end])
    ends.sort(kind="stable")  # two sorted runs: a linear merge
    ends = ends[np.concatenate([[True], ends[1:] != ends[:-1]])]  # both sums increase strictly
    starts = np.concatenate([[0], ends[:-1]])
    source = sources[supply_end.searchsorted(starts, "right")]
    destination = split_dst[open_rows][demand_end.searchsorted(starts, "right")]
    moves = np.array([experts[source // ep], source % ep, destination, ends - starts, source // ep])
    return np.concatenate([stays, moves], axis=1)
