"""Row permutations of the spilling path, built on the device they run on from ``[chunks]``
vectors alone: the receive-side reorder (:class:`RowPermutation`) and the plan folded into
Megatron's own permute (:class:`SendColumns`)."""

from __future__ import annotations

import numpy as np
import torch

from megatron_llep.planning.plan import RankPlan


class _PermuteRows(torch.autograd.Function):
    """``x[index]`` for a row permutation; the backward is the inverse gather (exact, deterministic)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Reorder the rows of ``x`` by the permutation ``index`` (``inverse`` is its inverse)."""
    return _PermuteRows.apply(x, index, inverse)


class RowPermutation:
    """A row permutation and its inverse, built on the device they are applied on.

    Rows come in chunks (e.g. source-major blocks of each expert); the permutation puts the chunks
    in another order. The host knows the chunk sizes, so it computes each chunk's shift (new start
    minus old start) for both directions; only those ``[chunks]`` vectors cross to the device,
    where both indices come out of one ``arange + repeat_interleave(shift)`` over the two
    directions laid end to end: no host loop over rows, no row-sized copy, four device ops.
    """

    def __init__(self, chunk_sizes: np.ndarray, chunk_order: np.ndarray, device: torch.device) -> None:
        sizes = np.asarray(chunk_sizes, np.int64)
        new_sizes = sizes[chunk_order]
        total = int(new_sizes.sum())
        if total != int(sizes.sum()):
            raise ValueError("RowPermutation: the chunk order leaves out non-empty chunks")
        # forward[new row] = old row: each new chunk shifted by (its old start - its new start)
        shift = (np.cumsum(sizes) - sizes)[chunk_order] - (np.cumsum(new_sizes) - new_sizes)
        kept = new_sizes > 0
        forward_shift = shift[kept]
        # inverse[old row] = new row: the same chunks in their old order, shifted back; its rows
        # follow the forward's in the joint index, hence the extra - total
        old_order = np.sort(chunk_order[kept])
        inverse_shift = np.zeros(sizes.size, np.int64)
        inverse_shift[chunk_order[kept]] = -forward_shift
        host = np.concatenate([new_sizes[kept], sizes[old_order], forward_shift, inverse_shift[old_order] - total])
        packed = torch.from_numpy(host).to(device, non_blocking=True)  # one copy
        half = host.size // 2
        both = torch.arange(2 * total, device=device)
        both += torch.repeat_interleave(packed[half:], packed[:half], output_size=2 * total)
        self.forward, self.inverse = both[:total], both[total:]

    @classmethod
    def recv_order(cls, rank_plan: RankPlan, device: torch.device) -> "RowPermutation":
        """a2a output (source-major) -> slot-major expert input (native slots, then borrowed)."""
        ep, num_experts = rank_plan.recv_counts.shape
        chunk_order = (np.arange(ep)[None, :] * num_experts + rank_plan.slot_experts[:, None]).ravel()
        return cls(rank_plan.recv_counts.ravel(), chunk_order, device)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return permute_rows(x, self.forward, self.inverse)

    def undo(self, x: torch.Tensor) -> torch.Tensor:
        return permute_rows(x, self.inverse, self.forward)


class SendColumns:
    """The plan folded into Megatron's permute: the routing map's columns split and reordered so
    that Megatron's own (expert-major) permute emits the all-to-all's destination-major order.

    Column ``(e, dst)`` holds the tokens of expert ``e`` that this rank sends to ``dst``: the
    ``lo+1``-th to ``hi``-th of its routed tokens in token order (the split the plan's
    ``send_counts`` make; all of them when the expert goes to one destination). Columns are
    ordered by destination, then expert, so no row is gathered beyond stock EP's permute;
    Megatron's unpermute with the same map restores the token order on combine. Only ``[columns]``
    vectors cross from the host.
    """

    def __init__(self, rank_plan: RankPlan, device: torch.device) -> None:
        send = rank_plan.send_counts  # [N, P]
        expert, dst = np.nonzero(send.T)[::-1]  # non-empty (e, dst) chunks, destination-major
        lo = (np.cumsum(send, axis=1) - send)[expert, dst]  # tokens of e before this chunk's first
        host = np.stack([expert, lo, lo + send[expert, dst]]).astype(np.int32)  # token counts fit int32
        packed = torch.from_numpy(host).to(device, non_blocking=True)  # one copy
        self.expert, self.lo, self.hi = packed[0], packed[1:2].T, packed[2:3].T  # lo, hi: [columns, 1]

    def apply(self, routing_map: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[tokens, columns]`` routing map and probabilities for Megatron's permute.

        Built column-major and returned as transposed views: Megatron's permute transposes both to
        ``[columns, tokens]`` first, which is then free, and the running count is contiguous."""
        columns = routing_map.T.index_select(0, self.expert)  # [columns, tokens]
        position = torch.cumsum(columns, dim=1, dtype=torch.int32)  # 1-based index among e's tokens
        columns &= (position > self.lo) ^ (position > self.hi)  # lo < position <= hi, as hi >= lo
        return columns.T, probs.T.index_select(0, self.expert).T
