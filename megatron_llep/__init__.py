"""megatron-llep: Least-Loaded Expert Parallelism (LLEP) for Megatron-Core MoE models.

The package is grouped by what runs when:

* :mod:`megatron_llep.planning`: the plan of each MoE layer step, its cost, forced-routing scenarios
  (pure numpy, no process group);
* :mod:`megatron_llep.placement`: CAP, which experts live together on a GPU (pure numpy);
* :mod:`megatron_llep.runtime`: the MoE layer, its dispatcher and the borrowed experts inside a
  training or inference step (Megatron-Core, torch.distributed);
* :mod:`megatron_llep.integrations`: Megatron-LM's loop, the LLEP command-line flags, applying a
  placement to a live model, recording routing traces;
* :mod:`megatron_llep.compat`: where Megatron-Core releases differ; :mod:`megatron_llep.testing`:
  test tools, the CPU emulation of CUDA included.

:class:`LLEPMoELayer` and :func:`with_llep` put LLEP into a Megatron model;
:func:`accumulating_gradients` and :func:`finish_borrowed_gradients` end a training step in loops
that do not run Megatron DDP.
"""

from megatron_llep.config import LLEPConfig, RoutingPruning
from megatron_llep.planning import CostModel, ExpertShape, InfeasibleBudgetError, LLEPPlan, RankPlan, plan_llep

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
        from megatron_llep.runtime import layer

        return getattr(layer, name)
    if name in ("accumulating_gradients", "drop_kept_experts", "finish_borrowed_gradients"):
        from megatron_llep.runtime import state

        return getattr(state, name)
    raise AttributeError(f"module 'megatron_llep' has no attribute {name!r}")
