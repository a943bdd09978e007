"""Per-layer LLEP step statistics (and routing-pruning statistics), kept for loggers (wandb,
stdout) to read and reset."""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from megatron_llep.planning import LLEPPlan


@dataclass(frozen=True)
class LLEPStepStats:
    """What one MoE layer's plan did in one forward step.

    Recording keeps the plan; the figures are derived when a logger reads them (once per logging
    interval), not on the step's critical path."""

    layer_number: Optional[int]
    plan: LLEPPlan
    expert_weight_bytes: int
    plan_time_s: float
    # bytes of borrowed experts each EP rank keeps for the step (weights and fp32 accumulators, over
    # all its LLEP layers) once the plan is recorded; None where the ledger was not asked
    kept_bytes: Optional[np.ndarray] = None

    @classmethod
    def from_plan(
        cls, plan: LLEPPlan, layer_number: Optional[int], expert_weight_bytes: int, plan_time_s: float,
        kept_bytes: Optional[np.ndarray] = None,
    ) -> "LLEPStepStats":
        return cls(layer_number, plan, expert_weight_bytes, plan_time_s, kept_bytes)

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

    @property
    def max_rank_rows(self) -> int:
        """The most token-expert rows any EP rank computes under the plan (its received rows)."""
        return int(self.plan.rank_loads_after.max())

    @property
    def budget_rows(self) -> Optional[int]:
        """The row budget the plan was made under (``LLEPConfig.max_tokens_per_rank``), or None."""
        return self.plan.budget

    def scalars(self) -> dict[str, float]:
        """The numeric figures, for a metrics sink (``budget_rows`` only under a budget)."""
        names = ("max_mean_before", "max_mean_after", "spilled_tokens", "moved_tokens", "weight_transfers",
                 "weight_bytes", "plan_time_s", "max_rank_rows")
        row = {name: float(getattr(self, name)) for name in names}
        row["llep_active"] = float(self.mode == "llep")
        if self.kept_bytes is not None:
            row["max_kept_bytes"] = float(self.kept_bytes.max())
        if self.budget_rows is not None:
            row["budget_rows"] = float(self.budget_rows)
        return row


MAX_MERGED_STATISTICS = frozenset({"max_rank_rows", "budget_rows", "max_kept_bytes"})
"""Per-layer statistics merged by their maximum (over micro-batches, and over ranks when loggers
gather them), so that they can be read against the budget; the others are summed or averaged."""


def merge_layer_statistic(key: str, values: list[float]) -> float:
    """One rank-merged value of a per-layer statistic (:meth:`LLEPStatsTracker.drain_by_layer`'s keys)
    from each reporting rank's: the maximum for :data:`MAX_MERGED_STATISTICS`, else the mean."""
    return float(max(values)) if key in MAX_MERGED_STATISTICS else float(np.mean(values))


def budget_phrase(metrics: dict[str, float]) -> str:
    """``"rows/rank max R of budget B"`` over the layers of logged ``metrics`` (keys
    ``<prefix><layer>/max_rank_rows`` and ``.../budget_rows``): the most rows a rank computed against
    the budget, for a log line; "" without a row budget."""
    budgets = [(metrics[k.replace("budget_rows", "max_rank_rows")], metrics[k])
               for k in metrics if k.endswith("/budget_rows") and k.replace("budget_rows", "max_rank_rows") in metrics]
    if not budgets:
        return ""
    return f"rows/rank max {max(rows for rows, _ in budgets):.0f} of budget {min(b for _, b in budgets):.0f}"


PRUNING_COUNTS = ("device_visits_unpruned", "device_visits", "own_device_visits_unpruned", "own_device_visits",
                  "cross_node_device_visits_unpruned", "cross_node_device_visits", "pairs_unpruned", "pairs",
                  "own_pairs_unpruned", "own_pairs", "alltoall_bytes_unpruned", "alltoall_bytes")
"""The raw counts :class:`PruningStepStats` keeps, in order: (token, device) visits, those of the
token's own device, those of devices in other nodes, (token, expert) pairs, those on its own device, and the all-to-all bytes of the
remote pairs; before and after pruning. All additive, so steps merge exactly."""


@dataclass(frozen=True)
class PruningStepStats:
    """What routing pruning (``LLEPConfig.pruning``) did in one MoE layer's forward on one rank.

    Recording keeps the raw counts (:data:`PRUNING_COUNTS`) as one small integer tensor where the
    routing lives, so the forward adds no host sync; totals and ratios are derived when a logger
    reads them (:func:`pruning_totals`, :func:`pruning_metrics`).

    All-to-all bytes model Megatron's alltoall dispatcher, which sends one row per (token, expert)
    pair whose expert lives on another EP rank, with no per-device deduplication: a token with
    two experts on one remote rank travels twice. Each such pair costs
    ``alltoall_bytes_per_pair = 2 * hidden * element size + prob element size`` (the token and its
    routing score in the dispatch, the expert output in the combine). On steps where LLEP spills,
    its plan moves some pairs to other ranks than their experts' (see its own statistics); the
    figures here are those of the experts' native ranks.
    """

    layer_number: Optional[int]
    tokens: int
    counts: torch.Tensor
    alltoall_bytes_per_pair: int

    @classmethod
    def from_routing(
        cls,
        layer_number: Optional[int],
        routing_map: torch.Tensor,
        pruned_map: torch.Tensor,
        own_device: int,
        experts_per_device: int,
        alltoall_bytes_per_pair: int,
        devices_per_node: Optional[int] = None,
    ) -> "PruningStepStats":
        """Counts of the ``[T, N]`` routing maps before and after pruning on EP rank ``own_device``
        (devices: blocks of ``experts_per_device`` consecutive experts; nodes: blocks of
        ``devices_per_node`` devices, None: one node)."""
        num_tokens, num_experts = routing_map.shape
        own = slice(own_device * experts_per_device, (own_device + 1) * experts_per_device)
        blocks = (num_tokens, num_experts // experts_per_device, experts_per_device)
        before, after = routing_map, pruned_map
        visited_before, visited_after = before.reshape(blocks).any(dim=2), after.reshape(blocks).any(dim=2)
        node_size = devices_per_node or blocks[1]
        node = slice(own_device // node_size * node_size, (own_device // node_size + 1) * node_size)
        pairs = torch.stack([before.sum(), after.sum(), before[:, own].sum(), after[:, own].sum()])
        remote_bytes = (pairs[:2] - pairs[2:]) * alltoall_bytes_per_pair
        counts = torch.cat([torch.stack([
            visited_before.sum(), visited_after.sum(), visited_before[:, own_device].sum(),
            visited_after[:, own_device].sum(), visited_before.sum() - visited_before[:, node].sum(),
            visited_after.sum() - visited_after[:, node].sum()]), pairs, remote_bytes])
        return cls(layer_number, num_tokens, counts, alltoall_bytes_per_pair)

    @classmethod
    def merged(cls, steps: list["PruningStepStats"]) -> "PruningStepStats":
        """One entry holding the sums of ``steps`` (of one layer): what a bounded tracker keeps of
        its oldest steps, so that totals over a long evaluation stay exact."""
        counts = torch.stack([s.counts.to(steps[0].counts.device) for s in steps]).sum(dim=0)
        return cls(steps[0].layer_number, sum(s.tokens for s in steps), counts, steps[0].alltoall_bytes_per_pair)

    def totals(self) -> dict[str, float]:
        """This step's additive totals (see :func:`pruning_totals`)."""
        return pruning_totals([self])


def pruning_totals(steps: list[PruningStepStats]) -> dict[str, float]:
    """Additive totals over steps (and layers, and, summed again, ranks): ``tokens`` (one per token
    and layer), ``device_visits``, ``remote_device_visits``, ``pairs`` and ``alltoall_bytes``, each
    also ``*_unpruned``. One host copy for all steps."""
    if not steps:
        return {}
    raw = torch.stack([s.counts.to(steps[0].counts.device) for s in steps]).cpu().numpy().astype(np.float64)
    c = dict(zip(PRUNING_COUNTS, raw.T))
    totals = {"tokens": float(sum(s.tokens for s in steps))}
    for suffix in ("", "_unpruned"):
        totals["device_visits" + suffix] = float(c["device_visits" + suffix].sum())
        totals["remote_device_visits" + suffix] = float((c["device_visits" + suffix] - c["own_device_visits" + suffix]).sum())
        totals["cross_node_device_visits" + suffix] = float(c["cross_node_device_visits" + suffix].sum())
        totals["pairs" + suffix] = float(c["pairs" + suffix].sum())
        totals["alltoall_bytes" + suffix] = float(c["alltoall_bytes" + suffix].sum())
    return totals


def pruning_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Logged figures from (possibly rank-summed) :func:`pruning_totals`, keyed ``prune/...``:
    devices and remote devices per token and layer (before pruning: ``*_unpruned``), dropped
    (token, expert) pairs and their fraction, all-to-all bytes of dispatch + combine with and
    without pruning. ``{}`` without totals (pruning off)."""
    if not totals:
        return {}
    tokens, pairs = totals["tokens"], totals["pairs_unpruned"]
    metrics = {"prune/tokens": tokens}
    for suffix in ("", "_unpruned"):
        metrics["prune/devices_per_token" + suffix] = totals["device_visits" + suffix] / tokens if tokens else 0.0
        metrics["prune/remote_devices_per_token" + suffix] = (
            totals["remote_device_visits" + suffix] / tokens if tokens else 0.0)
        metrics["prune/cross_node_devices_per_token" + suffix] = (
            totals["cross_node_device_visits" + suffix] / tokens if tokens else 0.0)
        metrics["prune/alltoall_bytes" + suffix] = totals["alltoall_bytes" + suffix]
    metrics["prune/dropped_pairs"] = pairs - totals["pairs"]
    metrics["prune/dropped_pair_fraction"] = (pairs - totals["pairs"]) / pairs if pairs else 0.0
    return metrics


class LLEPStatsTracker:
    """Collects :class:`LLEPStepStats` (and :class:`PruningStepStats`) by layer; ``drain()``
    (``drain_pruning()``) returns and clears them.

    Bounded, so that a run without a logger that drains it does not grow without limit: only the
    newest ``max_steps`` LLEP entries per layer are kept; pruning entries, whose totals a whole
    evaluation reports, are merged (:meth:`PruningStepStats.merged`) instead of dropped.
    """

    def __init__(self, max_steps: int = 256) -> None:
        self.max_steps = max_steps
        self._steps: dict[Optional[int], deque[LLEPStepStats]] = {}
        self._pruning: dict[Optional[int], deque[PruningStepStats]] = {}

    def _append(self, store: dict, stats: object, layer: Optional[int]) -> None:
        steps = store.get(layer)
        if steps is None:
            steps = store[layer] = deque(maxlen=self.max_steps)
        steps.append(stats)

    def record(self, stats: LLEPStepStats) -> None:
        self._append(self._steps, stats, stats.layer_number)

    def record_pruning(self, stats: PruningStepStats) -> None:
        steps = self._pruning.get(stats.layer_number)
        if steps is not None and len(steps) == self.max_steps:
            merged = PruningStepStats.merged(list(steps))
            steps.clear()
            steps.append(merged)
        self._append(self._pruning, stats, stats.layer_number)

    def drain_pruning(self) -> dict[Optional[int], list[PruningStepStats]]:
        steps, self._pruning = self._pruning, {}
        return {layer: list(entries) for layer, entries in steps.items()}

    def drain_pruning_totals(self) -> dict[str, float]:
        """Drain the pruning statistics, summed over layers and steps (:func:`pruning_totals`;
        ``{}`` when pruning is off); ranks' totals add up, then :func:`pruning_metrics`."""
        return pruning_totals([s for entries in self.drain_pruning().values() for s in entries])

    def drain(self) -> dict[Optional[int], list[LLEPStepStats]]:
        steps, self._steps = self._steps, {}
        return {layer: list(entries) for layer, entries in steps.items()}

    def drain_by_layer(self) -> dict[int, dict[str, float]]:
        """Drain, summarised per layer over the micro-batches since the last drain: token and byte
        counts and planner time summed, ratios averaged, the most rows a rank computed
        (``max_rank_rows``), the row budget (``budget_rows``, only under one) and the most bytes a
        rank keeps (``max_kept_bytes``, only where the ledger was asked) their maximum (what the
        dashboards log)."""
        summary = {}
        for layer, steps in self.drain().items():
            if layer is None or not steps:
                continue
            row = summary[int(layer)] = {
                "max_mean_before": float(np.mean([s.max_mean_before for s in steps])),
                "max_mean_after": float(np.mean([s.max_mean_after for s in steps])),
                "spilled_tokens": float(sum(s.spilled_tokens for s in steps)),
                "weight_bytes": float(sum(s.weight_bytes for s in steps)),
                "plan_time_ms": 1e3 * float(sum(s.plan_time_s for s in steps)),
                "llep_active": float(np.mean([s.mode == "llep" for s in steps])),
                "max_rank_rows": float(max(s.max_rank_rows for s in steps)),
            }
            budgets = [s.budget_rows for s in steps if s.budget_rows is not None]
            if budgets:
                row["budget_rows"] = float(max(budgets))
            kept = [float(s.kept_bytes.max()) for s in steps if s.kept_bytes is not None]
            if kept:
                row["max_kept_bytes"] = max(kept)
        return summary

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Statistics recorded inside the block are dropped and those recorded before it kept, so
        that evaluation forwards stay out of a training interval's statistics."""
        kept, self._steps, self._pruning = (self._steps, self._pruning), {}, {}
        try:
            yield
        finally:
            self._steps, self._pruning = kept

    def summary(self) -> dict[str, float]:
        """Mean of every scalar over all recorded steps and layers (without clearing); the maximum
        for :data:`MAX_MERGED_STATISTICS`."""
        rows = [s.scalars() for layer in self._steps.values() for s in layer]
        if not rows:
            return {}
        keys = dict.fromkeys(k for r in rows for k in r)
        return {k: merge_layer_statistic(k, [r[k] for r in rows if k in r]) for k in keys}
