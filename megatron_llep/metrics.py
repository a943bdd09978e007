"""Per-layer LLEP step statistics, kept for loggers (wandb, stdout) to read and reset."""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from megatron_llep.planner import LLEPPlan


@dataclass(frozen=True)
class LLEPStepStats:
    """What one MoE layer's plan did in one forward step.

    Recording keeps the plan; the figures are derived when a logger reads them (once per logging
    interval), not on the step's critical path."""

    layer_number: Optional[int]
    plan: LLEPPlan
    expert_weight_bytes: int
    plan_time_s: float

    @classmethod
    def from_plan(
        cls, plan: LLEPPlan, layer_number: Optional[int], expert_weight_bytes: int, plan_time_s: float
    ) -> "LLEPStepStats":
        return cls(layer_number, plan, expert_weight_bytes, plan_time_s)

    @property
    def mode(self) -> str:
        """"llep", "plain" (no spill worthwhile) or "fallback" (balanced below lambda)."""
        return "llep" if not self.plan.is_plain_ep else ("fallback" if self.plan.fallback else "plain")

    def _max_mean(self, loads: np.ndarray) -> float:
        mean = self.plan.rank_loads_before.mean()
        return float(loads.max() / mean) if mean > 0 else 1.0

    @property
    def max_mean_before(self) -> float:
        return self._max_mean(self.plan.rank_loads_before)

    @property
    def max_mean_after(self) -> float:
        return self._max_mean(self.plan.rank_loads_after)

    @property
    def spilled_tokens(self) -> int:
        return self.plan.spilled_tokens

    @property
    def moved_tokens(self) -> int:
        return self.plan.moved_tokens()

    @property
    def weight_transfers(self) -> int:
        return self.plan.num_weight_transfers

    @property
    def weight_bytes(self) -> int:
        return self.plan.num_weight_transfers * self.expert_weight_bytes

    @property
    def expert_loads(self) -> np.ndarray:
        return self.plan.counts.sum(axis=0)

    @property
    def rank_loads_after(self) -> np.ndarray:
        return self.plan.rank_loads_after

    def scalars(self) -> dict[str, float]:
        """The numeric figures, for a metrics sink."""
        names = ("max_mean_before", "max_mean_after", "spilled_tokens", "moved_tokens", "weight_transfers",
                 "weight_bytes", "plan_time_s")
        row = {name: float(getattr(self, name)) for name in names}
        row["llep_active"] = float(self.mode == "llep")
        return row


class LLEPStatsTracker:
    """Collects :class:`LLEPStepStats` by layer; ``drain()`` returns and clears them.

    Bounded: only the newest ``max_steps`` entries per layer are kept, so a run without a logger
    that drains it does not grow without limit.
    """

    def __init__(self, max_steps: int = 256) -> None:
        self.max_steps = max_steps
        self._steps: dict[Optional[int], deque[LLEPStepStats]] = {}

    def record(self, stats: LLEPStepStats) -> None:
        steps = self._steps.get(stats.layer_number)
        if steps is None:
            steps = self._steps[stats.layer_number] = deque(maxlen=self.max_steps)
        steps.append(stats)

    def drain(self) -> dict[Optional[int], list[LLEPStepStats]]:
        steps, self._steps = self._steps, {}
        return {layer: list(entries) for layer, entries in steps.items()}

    def drain_by_layer(self) -> dict[int, dict[str, float]]:
        """Drain, summarised per layer over the micro-batches since the last drain: token and byte
        counts and planner time summed, ratios averaged (what the dashboards log)."""
        summary = {}
        for layer, steps in self.drain().items():
            if layer is None or not steps:
                continue
            summary[int(layer)] = {
                "max_mean_before": float(np.mean([s.max_mean_before for s in steps])),
                "max_mean_after": float(np.mean([s.max_mean_after for s in steps])),
                "spilled_tokens": float(sum(s.spilled_tokens for s in steps)),
                "weight_bytes": float(sum(s.weight_bytes for s in steps)),
                "plan_time_ms": 1e3 * float(sum(s.plan_time_s for s in steps)),
                "llep_active": float(np.mean([s.mode == "llep" for s in steps])),
            }
        return summary

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Statistics recorded inside the block are dropped and those recorded before it kept, so
        that evaluation forwards stay out of a training interval's statistics."""
        kept, self._steps = self._steps, {}
        try:
            yield
        finally:
            self._steps = kept

    def summary(self) -> dict[str, float]:
        """Mean of every scalar over all recorded steps and layers (without clearing)."""
        rows = [s.scalars() for layer in self._steps.values() for s in layer]
        if not rows:
            return {}
        return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


STATS = LLEPStatsTracker()
