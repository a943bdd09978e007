"""The one dataclass that holds every LLEP knob, validated with messages that say what to change."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_llep.cost_model import CostModel


@dataclass(frozen=True)
class LLEPConfig:
    """Knobs of Least-Loaded Expert Parallelism (see SPEC section 1).

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
    """

    alpha: float = 1.0
    min_chunk_tokens: int = 1024
    imbalance_threshold: float = 1.3
    ranks_per_node: Optional[int] = None
    cost_aware: bool = True
    cost_model: CostModel = field(default_factory=CostModel)
    enabled: bool = True
    record_stats: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LLEPConfig.alpha must be a finite number > 0 (capacity factor), got {self.alpha!r}")
        if not isinstance(self.min_chunk_tokens, int) or isinstance(self.min_chunk_tokens, bool):
            raise TypeError(f"LLEPConfig.min_chunk_tokens must be an int, got {self.min_chunk_tokens!r}")
        if self.min_chunk_tokens < 0:
            raise ValueError(f"LLEPConfig.min_chunk_tokens (m) must be >= 0, got {self.min_chunk_tokens}")
        if not (
            isinstance(self.imbalance_threshold, (int, float))
            and math.isfinite(self.imbalance_threshold)
            and self.imbalance_threshold >= 1.0
        ):
            raise ValueError(
                "LLEPConfig.imbalance_threshold (lambda) must be >= 1.0 because max/mean rank load is "
                f"never below 1; got {self.imbalance_threshold!r}"
            )
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node <= 0
        ):
            raise ValueError(f"LLEPConfig.ranks_per_node must be a positive int or None, got {self.ranks_per_node!r}")
        if not isinstance(self.cost_model, CostModel):
            raise TypeError(f"LLEPConfig.cost_model must be a CostModel, got {type(self.cost_model).__name__}")

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
