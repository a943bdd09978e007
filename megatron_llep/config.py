"""The one dataclass that holds every LLEP knob, validated with messages that say what to change."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from megatron_llep.planning.cost_model import CostModel


class LLEPConfigError(ValueError):
    """A knob outside its domain. ``knob`` names the field, so a command line can name its own flag
    instead (:meth:`for_flag`)."""

    def __init__(self, knob: str, requirement: str, value: object) -> None:
        self.knob, self.requirement, self.value = knob, requirement, value
        super().__init__(f"LLEPConfig.{knob} {requirement}, got {value!r}")

    def for_flag(self, flag: str) -> str:
        """The same message naming ``flag`` (e.g. ``--llep-alpha``) instead of the field."""
        return f"{flag} {self.requirement}, got {self.value!r}"


PRUNING_METHODS = ("devices", "experts")

KEEP_AUTO = "auto"
"""``LLEPConfig.max_kept_weight_bytes`` that derives each rank's bound from what it can spare."""


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RoutingPruning:
    """Inference-only, lossy pruning of each token's routing before dispatch (CAP; docs/design.md).

    Attributes:
        p: fraction of a token's routing-score mass that may be dropped, ``0 <= p < 1``.
        method: ``"devices"`` (CAP): the token's destination devices ranked by ``a_d / c_d``
            (``a_d``: its scores on experts of device ``d``; ``c_d``: the device's cost) are kept until
            ``1 - p`` of the mass is covered, the rest dropped with all their experts. ``"experts"``
            (the naive baseline): its highest-score experts are kept until ``1 - p`` is covered.
        cross_node_cost: ``c_d`` of a device in another node (the token's own device costs 0,
            another device of its node 1); nodes are :attr:`LLEPConfig.ranks_per_node` EP ranks.
    """

    p: float
    method: str = "devices"
    cross_node_cost: float = 4.0

    def __post_init__(self) -> None:
        if not (_finite_number(self.p) and 0.0 <= self.p < 1.0):
            raise LLEPConfigError("pruning.p", "(the score mass a token may drop) must be within [0, 1)", self.p)
        if self.method not in PRUNING_METHODS:
            raise LLEPConfigError("pruning.method", f"must be one of {', '.join(map(repr, PRUNING_METHODS))}",
                                  self.method)
        if not (_finite_number(self.cross_node_cost) and self.cross_node_cost >= 1.0):
            raise LLEPConfigError("pruning.cross_node_cost", "must be a finite number >= 1 (the cost of a device in "
                                  "the token's own node)", self.cross_node_cost)


@dataclass(frozen=True)
class LLEPConfig:
    """Knobs of Least-Loaded Expert Parallelism (docs/design.md).

    Attributes:
        alpha: rank capacity as a multiple of the mean rank load, ``m_alpha = alpha * sum(l) / P``.
        min_chunk_tokens: ``m``; a spill smaller than this is not worth a GEMM and stays native.
        imbalance_threshold: ``lambda``; plain EP runs while ``max_rank_load / mean_rank_load`` is
            below it.
        ranks_per_node: EP ranks that share a node (helpers are preferred inside the native rank's
            node). ``None`` means all EP ranks share one node.
        cost_aware: pick, among plain EP, the plain least-loaded plan and least-loaded plans at
            1.1x/1.3x capacity, the one with the lowest layer time the :class:`CostModel` predicts
            (never predicted slower than either plain plan).
        cost_model: the timing model behind ``cost_aware``; defaults to one H200 node.
        enabled: ``False`` makes the LLEP layer behave exactly like plain EP (for A/B runs).
        record_stats: keep per-layer step statistics for logging.
        pruning: prune each token's routing before dispatch (:class:`RoutingPruning`; inference
            only, lossy); ``None`` (default) leaves the routing alone.
        max_tokens_per_rank: a hard budget of token-expert rows each EP rank receives to compute
            in one step of one MoE layer, whatever the routing: the plan spills even below
            ``lambda`` and in chunks smaller than ``m`` when that is what keeps every rank within
            it, and a step whose rows cannot fit (more than ``P x budget``) raises
            :class:`~megatron_llep.planning.plan.InfeasibleBudgetError` on every EP rank before the
            dispatch. ``None`` (default): no budget. Not applied where no plan is made (EP = 1,
            ``enabled=False``).
        max_kept_weight_bytes: bytes a rank may spend on borrowed experts it keeps for the rest of
            the optimizer step, over all its LLEP layers: each kept expert costs its weights plus
            an fp32 gradient accumulator. Later micro-batches compute a kept expert without a
            new copy (the planner prices such spills without one and prefers those helpers), and
            its gradient, accumulated across the step's micro-batches, returns to the native
            rank once, before Megatron's gradient reduction. Copies beyond the bound serve one
            micro-batch and return their gradients in its backward. ``"auto"`` (default): one copy
            per rank and LLEP layer, and on a GPU within a quarter of the memory the rank can spare
            (:func:`megatron_llep.runtime.kept_weights.spare_bytes`); ``0``: keep nothing; ``None``:
            no bound.
        relay_within_node: a copy bound for a node other than its native rank's crosses the node
            boundary once: other helpers in that node get it from the rank there that keeps it,
            and kept gradients return as a hierarchical sum in stripes, inside nodes and across
            the helper nodes, before one sum per node enters the native rank's node
            (:func:`megatron_llep.planning.gradient_return.gradient_return_phases`).
        node_aware_tokens: across nodes (``ranks_per_node`` below the EP size), a spilled
            expert's tokens are matched to the ranks that compute them inside each node first (a
            helper in another node than the native rank's serves that node's own tokens, which
            plain EP sends across), and what a node's ranks must still receive from other nodes
            goes to those that receive the fewest rows across nodes so far (water-filling), so no
            rank's cross-node link takes the whole remainder; cost-aware plans across nodes also
            weigh a plan whose helpers sit where each hot expert's tokens are routed.
            ``False``: tokens matched in rank order, helpers in the native node first.
        repack_copies: after least-loaded assignment, refill the tokens each home rank sends each
            helper from its experts largest first into the largest quota (MoonEP's planning rule),
            keeping the remainders at home, where that needs fewer weight copies; every rank's
            load stays as it was.
    """

    alpha: float = 1.0
    min_chunk_tokens: int = 1024
    imbalance_threshold: float = 1.3
    ranks_per_node: Optional[int] = None
    cost_aware: bool = True
    cost_model: CostModel = field(default_factory=CostModel)
    enabled: bool = True
    record_stats: bool = True
    pruning: Optional[RoutingPruning] = None
    max_tokens_per_rank: Optional[int] = None
    max_kept_weight_bytes: Union[int, str, None] = KEEP_AUTO
    relay_within_node: bool = True
    node_aware_tokens: bool = True
    repack_copies: bool = True

    def __post_init__(self) -> None:
        number = _finite_number
        if not (number(self.alpha) and self.alpha > 0):
            raise LLEPConfigError("alpha", "must be a finite number > 0 (capacity factor)", self.alpha)
        m = self.min_chunk_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise LLEPConfigError("min_chunk_tokens", "(m) must be an integer >= 0", self.min_chunk_tokens)
        if not (number(self.imbalance_threshold) and self.imbalance_threshold >= 1.0):
            raise LLEPConfigError("imbalance_threshold", "(lambda) must be >= 1.0 because max/mean rank load is never "
                                  "below 1", self.imbalance_threshold)
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or isinstance(self.ranks_per_node, bool) or self.ranks_per_node <= 0
        ):
            raise LLEPConfigError("ranks_per_node", "must be a positive integer (or None: one node)", self.ranks_per_node)
        budget = self.max_tokens_per_rank
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise LLEPConfigError("max_tokens_per_rank", "(the token-expert rows an EP rank may receive per layer "
                                  "step) must be a positive integer, or None for no budget", budget)
        kept = self.max_kept_weight_bytes
        if kept is not None and kept != KEEP_AUTO and (not isinstance(kept, int) or isinstance(kept, bool) or kept < 0):
            raise LLEPConfigError("max_kept_weight_bytes", "(the bytes of borrowed experts a rank keeps for the step) "
                                  f"must be an integer >= 0 (0: keep none), {KEEP_AUTO!r} (what the rank can spare), "
                                  "or None for no bound", kept)
        if not isinstance(self.relay_within_node, bool):
            raise LLEPConfigError("relay_within_node", "must be True or False", self.relay_within_node)
        if not isinstance(self.node_aware_tokens, bool):
            raise LLEPConfigError("node_aware_tokens", "must be True or False", self.node_aware_tokens)
        if not isinstance(self.repack_copies, bool):
            raise LLEPConfigError("repack_copies", "must be True or False", self.repack_copies)
        if not isinstance(self.cost_model, CostModel):
            raise TypeError(f"LLEPConfig.cost_model must be a CostModel, got {type(self.cost_model).__name__}")
        if self.pruning is not None and not isinstance(self.pruning, RoutingPruning):
            raise TypeError(f"LLEPConfig.pruning must be a RoutingPruning or None, got {type(self.pruning).__name__}")

    def validate_layout(self, num_experts: int, ep_size: int) -> int:
        """Check the expert layout this config is used with; returns experts per rank ``M``."""
        if ep_size <= 0:
            raise ValueError(f"expert-parallel size must be positive, got {ep_size}")
        if num_experts <= 0:
            raise ValueError(f"number of experts must be positive, got {num_experts}")
        if num_experts % ep_size != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}; "
                "LLEP needs the same number of native experts on every rank"
            )
        if self.ranks_per_node is not None and ep_size % self.ranks_per_node != 0 and ep_size > self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} does not divide the expert-parallel size {ep_size}"
            )
        return num_experts // ep_size
