"""Planning: everything LLEP decides before a tensor moves. Pure numpy: no torch, no process group,
so a plan can be made, priced and tested anywhere.

* :mod:`~megatron_llep.planning.plan`: what a plan is (token chunks, weight copies, each rank's view);
* :mod:`~megatron_llep.planning.planner`: :func:`plan_llep`, one MoE layer step's plan from the global counts;
* :mod:`~megatron_llep.planning.assignment`: least-loaded assignment with spilling, and the copies it needs;
* :mod:`~megatron_llep.planning.cost_model` and :mod:`~megatron_llep.planning.time_model`: what a plan costs;
* :mod:`~megatron_llep.planning.gradient_return`: the step-end return of kept copies' gradients;
* :mod:`~megatron_llep.planning.scenarios`: forced routing scenarios (a test and benchmark tool), Megatron-LM PR #7488's W0-W7 among them.
"""

from megatron_llep.planning.cost_model import CostModel, ExpertShape
from megatron_llep.planning.plan import (InfeasibleBudgetError, LLEPPlan, RankPlan, chunk_gather_index, copy_waves,
                                         rank_loads)
from megatron_llep.planning.time_model import LayerTimeModel
from megatron_llep.planning.planner import plan_llep
from megatron_llep.planning.gradient_return import gradient_return_phases, stripe_bounds
from megatron_llep.planning.scenarios import (TOKEN_IMBALANCE_WORKLOADS, imbalanced_topk, token_imbalance_counts,
                                              token_imbalance_topk)

__all__ = [
    "CostModel", "ExpertShape", "InfeasibleBudgetError", "LLEPPlan", "LayerTimeModel", "RankPlan",
    "chunk_gather_index", "copy_waves", "gradient_return_phases", "imbalanced_topk", "plan_llep", "rank_loads",
    "stripe_bounds", "TOKEN_IMBALANCE_WORKLOADS", "token_imbalance_counts", "token_imbalance_topk",
]
