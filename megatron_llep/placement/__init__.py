"""CAP: communication-aware expert placement. Pure numpy, usable without a process group.

Routing traces (:mod:`.trace`), the cost metrics (:mod:`.metrics`), the two-stage greedy
placement with its C/B spectrum (:mod:`.cap`), the placement file (:mod:`.placement`), choosing a
spectrum point from timings (:mod:`.profile`) and the EPLB replication baseline
(:mod:`.replication`). Command line: ``python -m megatron_llep.placement --help``.

What touches a live model lives in :mod:`megatron_llep.integrations`: applying a placement
(:mod:`~megatron_llep.integrations.placement`, which also times the spectrum on the model) and
recording routing traces (:mod:`~megatron_llep.integrations.routing_traces`); CAP's device-level
routing pruning runs inside the MoE layer (:mod:`megatron_llep.runtime.pruning`).
"""

from megatron_llep.placement.cap import CAPResult, SpectrumPoint, plan_cap, plan_trace, select_by_lambda, select_by_profiling
from megatron_llep.placement.metrics import Topology, coactivation, comm_cost, devices_per_token, load_imbalance
from megatron_llep.placement.placement import (
    ExpertPlacement,
    read_checkpoint_placement,
    same_expert_order,
    write_checkpoint_placement,
)
from megatron_llep.placement.profile import ProfileReport, ProfileRow, placement_at, profile_positions
from megatron_llep.placement.trace import RoutingTrace, load_traces, merge_traces, synthetic_trace

__all__ = [
    "CAPResult",
    "ExpertPlacement",
    "ProfileReport",
    "ProfileRow",
    "RoutingTrace",
    "SpectrumPoint",
    "Topology",
    "coactivation",
    "comm_cost",
    "devices_per_token",
    "load_imbalance",
    "load_traces",
    "merge_traces",
    "placement_at",
    "plan_cap",
    "plan_trace",
    "profile_positions",
    "read_checkpoint_placement",
    "same_expert_order",
    "select_by_lambda",
    "select_by_profiling",
    "synthetic_trace",
    "write_checkpoint_placement",
]
