"""Per-layer LLEP step statistics, kept for loggers (wandb, stdout) to read and reset."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from megatron_llep.planner import LLEPPlan


@dataclass
class LLEPStepStats:
    """What one MoE layer's plan did in one forward step."""

    layer_number: Optional[int]
    mode: str  # "llep", "plain" (no spill needed) or "fallback" (balanced below lambda)
    max_mean_before: float
    max_mean_after: float
    spilled_tokens: int
    moved_tokens: int
    weight_transfers: int
    weight_bytes: int
    plan_time_s: float
    expert_loads: np.ndarray
    rank_loads_after: np.ndarray

    @classmethod
    def from_plan(
        cls, plan: LLEPPlan, layer_number: Optional[int], expert_weight_bytes: int, plan_time_s: float
    ) -> "LLEPStepStats":
        before, after = plan.rank_loads_before, plan.rank_loads_after
        mean = max(before.mean(), 1e-12)
        mode = "llep" if not plan.is_plain_ep else ("fallback" if plan.fallback else "plain")
        return cls(
            layer_number=layer_number,
            mode=mode,
            max_mean_before=float(before.max() / mean) if before.sum() else 1.0,
            max_mean_after=float(after.max() / mean) if after.sum() else 1.0,
            spilled_tokens=plan.spilled_tokens,
            moved_tokens=plan.moved_tokens(),
            weight_transfers=plan.num_weight_transfers,
            weight_bytes=plan.num_weight_transfers * expert_weight_bytes,
            plan_time_s=plan_time_s,
            expert_loads=plan.counts.sum(axis=0),
            rank_loads_after=after.copy(),
        )

    def scalars(self) -> dict[str, float]:
        """The numeric fields, for a metrics sink."""
        row = asdict(self)
        row.pop("expert_loads")
        row.pop("rank_loads_after")
        row.pop("layer_number")
        row["llep_active"] = float(row.pop("mode") == "llep")
        return {k: float(v) for k, v in row.items()}


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

    def summary(self) -> dict[str, float]:
        """Mean of every scalar over all recorded steps and layers (without clearing)."""
        rows = [s.scalars() for layer in self._steps.values() for s in layer]
        if not rows:
            return {}
        return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


STATS = LLEPStatsTracker()
