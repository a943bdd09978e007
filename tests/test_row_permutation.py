"""The dispatcher's device-built row permutations equal the planner's host-built gather indices
(RankPlan.send_order / recv_order, which the planner property tests check against a simulated
all-to-all), and each comes with its exact inverse."""

import numpy as np
import pytest
import torch

from megatron_llep.config import LLEPConfig
from megatron_llep.dispatcher import _RowPermutation
from megatron_llep.planner import plan_llep
from megatron_llep.scenarios import imbalanced_topk


@pytest.mark.parametrize("ep, experts, topk, hot", [(2, 8, 2, 1), (4, 16, 4, 4), (8, 32, 4, 16), (8, 64, 8, 1)])
def test_device_orders_equal_the_planners_host_orders(ep, experts, topk, hot):
    counts = np.stack([np.bincount(imbalanced_topk(256, experts, topk, 0.95, hot, seed=r).ravel(), minlength=experts)
                       for r in range(ep)])
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=2, cost_aware=False))
    assert not plan.is_plain_ep
    for rank in range(ep):
        view = plan.rank_view(rank)
        for built, reference in ((_RowPermutation.send_order(view, torch.device("cpu")), view.send_order()),
                                 (_RowPermutation.recv_order(view, torch.device("cpu")), view.recv_order())):
            assert np.array_equal(built.forward.numpy(), reference)
            assert torch.equal(built.forward[built.inverse], torch.arange(reference.size))


def test_a_rank_without_rows():
    empty = _RowPermutation(np.zeros(6, np.int64), np.arange(6)[::-1].copy(), torch.device("cpu"))
    assert empty.forward.numel() == 0 and empty.inverse.numel() == 0
