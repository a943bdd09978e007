"""A tiny GPTModel with MoE layers, Megatron DDP and the distributed optimizer: three training steps
with LLEP give the same losses and parameters as with plain EP (routing forced to be imbalanced)."""

import pytest

from megatron_llep.testing.distributed import run_distributed
from training_worker import train_and_compare


@pytest.mark.parametrize(
    "ep, overlap_grad_reduce",
    [(2, False), (2, True), (4, True)],
    ids=["ep2-sync-grad-reduce", "ep2-overlap-grad-reduce", "ep4-overlap-grad-reduce"],
)
def test_training_steps_match_plain_ep(ep, overlap_grad_reduce):
    _check_equal_training(run_distributed(train_and_compare, ep, overlap_grad_reduce, timeout_s=600))


def test_overlapped_param_gather_sends_this_steps_expert_weights():
    """4 ranks, EP=2: experts are sharded over 2 data-parallel ranks by the distributed optimizer,
    and with overlap_param_gather their all-gather waits for the next forward; LLEP sends expert
    weights before the experts module runs, so it must finish that all-gather first."""
    _check_equal_training(run_distributed(train_and_compare, 4, True, 4, 2, True, timeout_s=600))


def _check_equal_training(per_rank: list) -> None:
    for rank, r in enumerate(per_rank):
        assert r["llep_losses"] == pytest.approx(r["plain_losses"], rel=1e-6, abs=1e-6), f"rank {rank}"
        worst = max(r["param_rel_diff"], key=r["param_rel_diff"].get)
        assert r["param_rel_diff"][worst] < 1e-5, f"rank {rank}: {worst} differs by {r['param_rel_diff'][worst]:.3g}"
        # training really moved every parameter (expert weights included), and LLEP really spilled
        assert min(r["param_moved"].values()) > 0
        assert "llep" in r["modes"] and r["weight_transfers"] > 0
