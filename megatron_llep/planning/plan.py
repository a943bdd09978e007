"""What an LLEP plan is: the token chunks and weight copies of one MoE layer step, and each EP rank's
view of them (the send and receive layouts the dispatcher runs). Pure numpy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


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
