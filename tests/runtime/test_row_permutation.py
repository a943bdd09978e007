"""The dispatcher's device-side orders equal the planner's host-built gather indices
(RankPlan.send_order / recv_order, which the planner property tests check against a simulated
all-to-all): the receive permutation (with its exact inverse), and the send order that Megatron's
own permute emits when the plan is folded into the routing map (restored by Megatron's unpermute)."""

import numpy as np
import pytest
import torch

from megatron_llep.config import LLEPConfig
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from megatron_llep.runtime.permutation import RowPermutation, SendColumns
from megatron_llep.planning import chunk_gather_index, plan_llep
from megatron_llep.planning.scenarios import imbalanced_topk


@pytest.mark.parametrize("ep, experts, topk, hot", [(2, 8, 2, 1), (4, 16, 4, 4), (8, 32, 4, 16), (8, 64, 8, 1)])
def test_device_orders_equal_the_planners_host_orders(ep, experts, topk, hot):
    counts = np.stack([np.bincount(imbalanced_topk(256, experts, topk, 0.95, hot, seed=r).ravel(), minlength=experts)
                       for r in range(ep)])
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=2, cost_aware=False))
    assert not plan.is_plain_ep
    for rank in range(ep):
        view = plan.rank_view(rank)
        built, reference = RowPermutation.recv_order(view, torch.device("cpu")), view.recv_order()
        assert np.array_equal(built.forward.numpy(), reference)
        assert torch.equal(built.forward[built.inverse], torch.arange(reference.size))
        assert torch.equal(built.inverse[built.forward], torch.arange(reference.size))


def _routing_map(ids: np.ndarray, experts: int) -> torch.Tensor:
    routing = torch.zeros(ids.shape[0], experts, dtype=torch.bool)
    routing[torch.arange(ids.shape[0])[:, None], torch.as_tensor(ids)] = True
    return routing


@pytest.mark.parametrize("ep, experts, topk, hot", [(2, 8, 2, 1), (4, 16, 4, 4), (8, 32, 4, 16)])
@pytest.mark.parametrize("broken", [False, True], ids=["", "broken_column_order"])
def test_megatrons_permute_with_the_send_columns_emits_the_send_order(ep, experts, topk, hot, broken):
    ids = [imbalanced_topk(256, experts, topk, 0.95, hot, seed=r) for r in range(ep)]
    counts = np.stack([np.bincount(i.ravel(), minlength=experts) for i in ids])
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=2, cost_aware=False))
    assert not plan.is_plain_ep
    matches = []
    for rank in range(ep):
        view = plan.rank_view(rank)
        routing = _routing_map(ids[rank], experts)
        tokens = torch.randn(256, 6, dtype=torch.float64)
        probs = torch.rand(256, experts, dtype=torch.float64) * routing
        stock_rows, stock_probs, _ = permute(tokens, routing, probs=probs, num_out_tokens=256 * topk)[:3]
        columns = SendColumns(view, torch.device("cpu"))
        if broken:  # negative control: destinations in reverse order
            order = torch.argsort(torch.as_tensor(np.nonzero(view.send_counts.T)[0]), descending=True, stable=True)
            columns.expert, columns.lo, columns.hi = columns.expert[order], columns.lo[order], columns.hi[order]
        split_map, split_probs = columns.apply(routing, probs)
        rows, row_probs, mapping = permute(tokens, split_map, probs=split_probs, num_out_tokens=256 * topk)[:3]
        matches.append(torch.equal(rows, stock_rows[view.send_order()]) and torch.equal(row_probs, stock_probs[view.send_order()]))
        restored = unpermute(rows, mapping, restore_shape=tokens.shape, routing_map=split_map)
        assert torch.allclose(restored, unpermute(stock_rows, permute(tokens, routing, num_out_tokens=256 * topk)[2],
                                                  restore_shape=tokens.shape, routing_map=routing))
    assert all(matches) != broken


def test_a_rank_without_rows():
    empty = RowPermutation(np.zeros(6, np.int64), np.arange(6)[::-1].copy(), torch.device("cpu"))
    assert empty.forward.numel() == 0 and empty.inverse.numel() == 0


@pytest.mark.parametrize("seed", range(5))
def test_any_chunk_order_with_empty_chunks(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 4, 40) * (rng.random(40) < 0.6)  # many empty chunks
    order = rng.permutation(40)
    built = RowPermutation(sizes, order, torch.device("cpu"))
    reference = chunk_gather_index(sizes, order)
    assert np.array_equal(built.forward.numpy(), reference)
    assert np.array_equal(built.inverse.numpy(), np.argsort(reference))
    with pytest.raises(ValueError, match="leaves out non-empty chunks"):
        RowPermutation(sizes + 1, order[:-1], torch.device("cpu"))
