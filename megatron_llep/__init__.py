"""megatron-llep: Least-Loaded Expert Parallelism (LLEP) for Megatron-Core MoE models.

The planner (:mod:`megatron_llep.planner`), cost model and scenarios are pure and need no process
group; :class:`LLEPMoELayer` and :func:`with_llep` put LLEP into a Megatron model;
:func:`accumulating_gradients` and :func:`finish_borrowed_gradients` end a training step in loops
that do not run Megatron DDP.
"""

from megatron_llep.config import LLEPConfig, RoutingPruning
from megatron_llep.cost_model import CostModel, ExpertShape
from megatron_llep.planner import InfeasibleBudgetError, LLEPPlan, RankPlan, plan_llep

__version__ = "0.1.0"

__all__ = [
    "CostModel",
    "ExpertShape",
    "InfeasibleBudgetError",
    "LLEPConfig",
    "LLEPMoELayer",
    "LLEPPlan",
    "RankPlan",
    "RoutingPruning",
    "accumulating_gradients",
    "drop_kept_experts",
    "finish_borrowed_gradients",
    "plan_llep",
    "with_llep",
]


def __getattr__(name):
    # The Megatron-facing pieces import megatron.core; keep the pure planner importable without it.
    if name in ("LLEPMoELayer", "with_llep"):
        from megatron_llep import layer

        return getattr(layer, name)
    if name in ("accumulating_gradients", "drop_kept_experts", "finish_borrowed_gradients"):
        from megatron_llep import kept_weights

        return getattr(kept_weights, name)
    raise AttributeError(f"module 'megatron_llep' has no attribute {name!r}")
