"""CAP step 4: choose the spectrum point by timing the live model on this machine (``--profile auto``).

Every layer has its own spectrum (comm-optimal first, most balanced last) of its own length, so a
*profile position* is a fraction ``f`` in ``[0, 1]`` of the way along every spectrum at once: a
layer of ``L`` points takes step ``round(f * (L - 1))`` (halves round up). ``f = 0`` is the
comm-optimal placement of every layer, ``f = 1`` the most balanced one.

:func:`~megatron_llep.integrations.placement.profile_spectrum` applies the placement of each candidate position to the live model, times
a caller-supplied forward, restores the original order and keeps the fastest: which point wins
depends on the machine's bandwidth between GPUs against its compute, which no cost model knows as
well as a measurement. Times are the maximum over ranks (the step ends when the slowest rank does)
and every rank decides on the same all-reduced numbers, so all ranks pick the same placement.

This module is the pure part (:func:`placement_at`, :func:`profile_positions`,
:meth:`ProfileReport.from_times`), needing no process group; the timing on a live model is
:func:`megatron_llep.integrations.placement.profile_spectrum`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from megatron_llep.placement.cap import CAPResult
from megatron_llep.placement.metrics import devices_per_token
from megatron_llep.placement.placement import ExpertPlacement
from megatron_llep.placement.trace import RoutingTrace

PROFILE_SELECTION = "profile auto"


def spectrum_step(num_points: int, position: float) -> int:
    """The step of a spectrum of ``num_points`` points at profile position ``position``:
    ``round(position * (num_points - 1))``, halves up (the epsilon absorbs the float error of
    ``i / (n - 1)`` so that exact halves are not rounded down)."""
    if not 0.0 <= position <= 1.0:
        raise ValueError(f"a profile position is a fraction within [0, 1], got {position}")
    if num_points < 1:
        raise ValueError("a spectrum has at least one point")
    return int(math.floor(position * (num_points - 1) + 0.5 + 1e-9))


def layer_steps(results: dict[int, CAPResult], position: float) -> dict[int, int]:
    """Per layer, the spectrum step taken at ``position``."""
    return {n: spectrum_step(len(r.spectrum), position) for n, r in sorted(results.items())}


def placement_at(
    results: dict[int, CAPResult], position: float, ep_size: int, routing_groups: int = 1
) -> ExpertPlacement:
    """The placement where every layer takes the point at ``position`` of its own spectrum; the
    metadata records each layer's step, number of points, C and B."""
    if not results:
        raise ValueError("no CAP results: plan at least one layer")
    steps = layer_steps(results, position)
    layers, summary = {}, {}
    for number, step in steps.items():
        point = results[number].spectrum[step]
        layers[number] = point.slot_to_expert(ep_size)
        summary[str(number)] = {"spectrum_step": step, "spectrum_points": len(results[number].spectrum),
                                "comm_cost": point.comm_cost, "imbalance": point.imbalance}
    num_experts = results[min(results)].spectrum[0].device_of_expert.size
    metadata = {"method": "cap", "selection": f"position {position:g}", "position": position, "layers": summary}
    return ExpertPlacement(num_experts, ep_size, layers, routing_groups, metadata)


def profile_positions(results: dict[int, CAPResult], candidates: int = 5) -> list[float]:
    """``candidates`` positions evenly spread over ``[0, 1]``, both ends included, without those
    that give every layer the same step as an earlier one (short spectra repeat points)."""
    if candidates < 2:
        raise ValueError(f"candidates must be >= 2 (both ends of the spectrum), got {candidates}")
    positions, seen = [], set()
    for i in range(candidates):
        position = i / (candidates - 1)
        key = tuple(layer_steps(results, position).values())
        if key not in seen:
            seen.add(key)
            positions.append(position)
    return positions


@dataclass
class ProfileRow:
    """One timed candidate: its position and per-layer steps, the means over layers of C, B and
    (with a trace) devices per token, and the rank-agreed forward time."""

    position: float
    steps: dict[int, int]
    comm_cost: float
    imbalance: float
    devices_per_token: Optional[float]
    seconds: float
    tokens_per_second: Optional[float]
    times: list[float]  # per timed repeat, the maximum over ranks

    def to_json(self) -> dict:
        return {**asdict(self), "steps": {str(n): s for n, s in self.steps.items()}}


_COLUMNS = ("", "position", "steps", "C mean", "B mean", "dev/tok", "ms/forward", "tokens/s")


@dataclass
class ProfileReport:
    """The timed candidates, the index of the fastest and its placement (metadata: selection
    ``"profile auto"`` and the table under ``"profile"``)."""

    rows: list[ProfileRow]
    chosen: int
    placement: ExpertPlacement

    @property
    def chosen_row(self) -> ProfileRow:
        return self.rows[self.chosen]

    @classmethod
    def from_times(
        cls,
        results: dict[int, CAPResult],
        ep_size: int,
        times: Sequence[tuple[float, Sequence[float]]],
        tokens: Optional[int] = None,
        trace: Optional[RoutingTrace] = None,
        routing_groups: int = 1,
    ) -> "ProfileReport":
        """The report of ``(position, rank-agreed repeat times)`` pairs: median over repeats, the
        fastest wins, ties to the lower position (less communication)."""
        rows = []
        for position, repeat_times in times:
            steps = layer_steps(results, position)
            points = [results[n].spectrum[s] for n, s in steps.items()]
            dpt = None
            if trace is not None:
                shared = [n for n in steps if n in trace.layers]
                if shared:
                    dpt = float(np.mean([devices_per_token(trace.layer(n).expert_ids,
                                                           results[n].spectrum[steps[n]].device_of_expert).mean()
                                         for n in shared]))
            seconds = float(statistics.median(repeat_times))
            rows.append(ProfileRow(position, steps, float(np.mean([p.comm_cost for p in points])),
                                   float(np.mean([p.imbalance for p in points])), dpt, seconds,
                                   None if tokens is None or seconds <= 0 else tokens / seconds, list(repeat_times)))
        if not rows:
            raise ValueError("no timed candidates")
        chosen = min(range(len(rows)), key=lambda i: (rows[i].seconds, rows[i].position))
        placement = placement_at(results, rows[chosen].position, ep_size, routing_groups)
        placement.metadata.update(selection=PROFILE_SELECTION, profile=[row.to_json() for row in rows])
        return cls(rows, chosen, placement)

    def table(self) -> str:
        """A printable table, one line per candidate, ``*`` on the chosen one."""
        cells = []
        for i, row in enumerate(self.rows):
            steps = sorted(set(row.steps.values()))
            cells.append(["*" if i == self.chosen else "", f"{row.position:.3f}",
                          str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}",
                          f"{row.comm_cost:.2f}", f"{row.imbalance:.3f}",
                          "-" if row.devices_per_token is None else f"{row.devices_per_token:.2f}",
                          f"{row.seconds * 1e3:.3f}",
                          "-" if row.tokens_per_second is None else f"{row.tokens_per_second:.1f}"])
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(_COLUMNS)]
        return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in [list(_COLUMNS), *cells])
