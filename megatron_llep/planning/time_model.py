"""The layer time a :class:`~megatron_llep.planning.cost_model.CostModel` predicts for a plan
(:class:`LayerTimeModel`): the quantity cost-aware planning minimises. Pure numpy."""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from megatron_llep.planning.assignment import CHUNK_COUNT, CHUNK_DST, CHUNK_SLOT, CHUNK_SRC
from megatron_llep.planning.cost_model import CostModel, ExpertShape
from megatron_llep.planning.plan import LLEPPlan


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


class LayerTimeModel:
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
        to_rank = counts[:, ::local].copy()  # [source, native rank]: strided sums beat a reshaped sum
        for offset in range(1, local):
            to_rank += counts[:, offset::local]
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
