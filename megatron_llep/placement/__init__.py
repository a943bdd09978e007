"""CAP: communication-aware expert placement for Megatron-Core MoE models (SPEC section 2).

Pure numpy, usable without a process group: routing traces (:mod:`.trace`), the cost metrics
(:mod:`.metrics`), the two-stage greedy placement with its C/B spectrum (:mod:`.cap`), the
placement file (:mod:`.placement`), device-level pruning and its expert-level baseline
(:mod:`.pruning`, torch; in a model: ``LLEPConfig.pruning``) and the EPLB
replication baseline (:mod:`.replication`). Megatron-facing: :class:`RoutingTraceRecorder`
(:mod:`.recorder`) and :func:`apply_placement` / :func:`restore_original_order` (:mod:`.apply`).
Command line: ``python -m megatron_llep.placement --help``.
"""

from megatron_llep.placement.cap import CAPResult, SpectrumPoint, plan_cap, plan_trace, select_by_lambda, select_by_profiling
from megatron_llep.placement.metrics import Topology, coactivation, comm_cost, devices_per_token, load_imbalance
from megatron_llep.placement.placement import (
    ExpertPlacement,
    read_checkpoint_placement,
    same_expert_order,
    write_checkpoint_placement,
)
from megatron_llep.placement.pruning import PrunedRouting, device_costs, prune_devices, prune_experts, prune_routing_map
from megatron_llep.placement.trace import RoutingTrace, load_traces, merge_traces, synthetic_trace

__all__ = [
    "CAPResult",
    "ExpertPlacement",
    "PrunedRouting",
    "RoutingTrace",
    "RoutingTraceRecorder",
    "SpectrumPoint",
    "Topology",
    "apply_placement",
    "coactivation",
    "comm_cost",
    "device_costs",
    "devices_per_token",
    "load_imbalance",
    "load_traces",
    "merge_traces",
    "plan_cap",
    "plan_trace",
    "prune_devices",
    "prune_experts",
    "prune_routing_map",
    "read_checkpoint_placement",
    "restore_original_order",
    "same_expert_order",
    "select_by_lambda",
    "select_by_profiling",
    "synthetic_trace",
    "write_checkpoint_placement",
]


def __getattr__(name):
    # These import megatron.core; keep the algorithms importable without it.
    if name in ("apply_placement", "restore_original_order"):
        from megatron_llep.placement import apply

        return getattr(apply, name)
    if name == "RoutingTraceRecorder":
        from megatron_llep.placement.recorder import RoutingTraceRecorder

        return RoutingTraceRecorder
    raise AttributeError(name)
from megatron_llep.placement.profile import ProfileReport, ProfileRow, placement_at, profile_positions, profile_spectrum  # noqa: E402
