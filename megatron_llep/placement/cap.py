"""Communication-aware placement (CAP): two-stage greedy, the C/B trade-off spectrum, selection.

Stage 1 partitions the experts into P GPU groups of M: the P experts of highest weighted degree
(``sum_j p_ij``) seed the groups, which then grow round-robin, each taking the unassigned expert of
highest cumulative co-activation to the group. Stage 2 partitions the GPUs into nodes the same way
on the GPU-level co-activation. Two additions make this robust: the paper's seeds may fall into one
co-activation cluster, so each stage also grows from *spread* seeds (each next seed the expert least
co-activated with the seeds so far) and keeps the lower cut; and after each greedy stage, and
finally on the expert level with the real distances (0 / 1 / c), Kernighan-Lin swap passes between
every pair of groups lower C further. The result is the *communication-optimal* point.

The spectrum then repeatedly swaps one expert of the highest-loaded GPU with one of the
lowest-loaded GPU: among the swaps that lower the larger of the two loads it takes the one adding
the least C per token of load removed. Every step is a point (C, B). A point is chosen by

* ``lambda``: minimise ``lambda * C / C_seq + (1 - lambda) * B`` where ``C_seq`` is the C of the
  sequential placement, so both terms are 1 for Megatron's default layout under perfect balance
  (``lambda = 1``: the lowest C, ``lambda = 0``: the best balanced point), or
* profiling: a callable that scores a point (a measured or predicted step time); lowest wins.

Group-limited routing (``routing_groups = G > 1``) allows only permutations that keep Megatron's
routing groups together (:func:`~megatron_llep.placement.placement.check_routing_groups`): if a GPU
holds whole groups (``M`` a multiple of ``N/G``) the algorithm places whole groups as units; if a
group spans ``k`` GPUs (``N/G`` a multiple of ``M``) it stays on its own ``k`` GPUs and only its
experts are arranged among them. Pure numpy, no process group.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from megatron_llep.placement.metrics import Topology, coactivation, comm_cost, devices_per_token, load_imbalance
from megatron_llep.placement.placement import ExpertPlacement, experts_per_rank
from megatron_llep.placement.trace import RoutingTrace

ProfileFn = Callable[["SpectrumPoint"], float]


@dataclass(frozen=True)
class SpectrumPoint:
    """One placement of the trade-off spectrum (``step`` 0 is the comm-optimal placement)."""

    step: int
    device_of_expert: np.ndarray
    comm_cost: float
    imbalance: float

    def slot_to_expert(self, ep_size: int) -> np.ndarray:
        return slots_from_devices(self.device_of_expert, ep_size)


@dataclass
class CAPResult:
    """The spectrum of one layer and the point selected from it."""

    spectrum: list[SpectrumPoint]
    chosen: int
    selection: str
    scores: Optional[dict[int, float]] = None

    @property
    def comm_optimal(self) -> SpectrumPoint:
        return self.spectrum[0]

    @property
    def chosen_point(self) -> SpectrumPoint:
        return self.spectrum[self.chosen]


def slots_from_devices(device_of_expert: np.ndarray, ep_size: int) -> np.ndarray:
    """``slot_to_expert`` of an expert -> GPU assignment: GPU-major, ascending ids within a GPU."""
    device = np.asarray(device_of_expert, np.int64)
    local = experts_per_rank(device.size, ep_size)
    per_device = np.bincount(device, minlength=ep_size)
    if per_device.size != ep_size or (per_device != local).any():
        raise ValueError(f"every GPU must hold exactly {local} experts, got {per_device.tolist()}")
    return np.argsort(device, kind="stable")


@dataclass(frozen=True)
class _Units:
    """What the algorithm may move: experts, or whole routing groups, and where to."""

    unit_of_expert: np.ndarray
    capacity: int  # units per GPU
    block_of_gpu: np.ndarray  # a unit may only go to GPUs of its block

    @property
    def num_units(self) -> int:
        return int(self.unit_of_expert.max()) + 1

    @property
    def first_expert(self) -> np.ndarray:
        return np.unique(self.unit_of_expert, return_index=True)[1]

    def block_of_unit(self) -> np.ndarray:
        """A unit's block is that of the GPU natively holding its first expert (expert e on GPU e // M)."""
        return self.block_of_gpu[self.first_expert // (self.unit_of_expert.size // self.block_of_gpu.size)]

    def aggregate(self, coact: np.ndarray, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unit affinity (co-activation summed over expert pairs, pairs inside a unit dropped: they
        never leave their GPU) and unit loads."""
        onehot = np.zeros((self.unit_of_expert.size, self.num_units))
        onehot[np.arange(self.unit_of_expert.size), self.unit_of_expert] = 1.0
        affinity = onehot.T @ coact @ onehot
        np.fill_diagonal(affinity, 0.0)
        return affinity, np.bincount(self.unit_of_expert, weights=np.asarray(loads, np.float64), minlength=self.num_units)


def _units(num_experts: int, ep_size: int, routing_groups: int) -> _Units:
    local = experts_per_rank(num_experts, ep_size)
    experts = np.arange(num_experts)
    if routing_groups <= 1:
        return _Units(experts, local, np.zeros(ep_size, np.int64))
    if num_experts % routing_groups:
        raise ValueError(f"{num_experts} experts cannot form {routing_groups} routing groups")
    group_size = num_experts // routing_groups
    if local % group_size == 0:  # a GPU holds whole groups: place groups
        return _Units(experts // group_size, local // group_size, np.zeros(ep_size, np.int64))
    if group_size % local == 0:  # a group spans k GPUs: arrange experts inside their group's GPUs
        return _Units(experts, local, np.arange(ep_size) // (group_size // local))
    raise ValueError(
        f"routing groups of {group_size} experts neither fill whole GPUs of {local} experts nor tile them; "
        "no group-preserving placement exists for this EP size"
    )


def _seeds(affinity: np.ndarray, num_groups: int, spread: bool) -> np.ndarray:
    """The paper's seeds, the ``num_groups`` items of highest weighted degree; or, ``spread``, the
    highest-degree item and then each time the item least co-activated with the seeds so far
    (ties by degree), which lands every seed in a different co-activation cluster."""
    order = np.argsort(-affinity.sum(axis=1), kind="stable")
    if not spread:
        return order[:num_groups]
    seeds = [int(order[0])]
    for _ in range(1, num_groups):
        pull = affinity[order][:, seeds].sum(axis=1)
        pull[np.isin(order, seeds)] = np.inf
        seeds.append(int(order[np.argmin(pull)]))  # argmin takes the first, i.e. highest degree, tie
    return np.array(seeds)


def _greedy_groups(affinity: np.ndarray, seeds: np.ndarray, capacity: int) -> np.ndarray:
    """Round-robin greedy partition of ``n = len(seeds) * capacity`` items grown from ``seeds``."""
    n, num_groups = affinity.shape[0], seeds.size
    if n != num_groups * capacity:
        raise ValueError(f"{n} items do not fill {num_groups} groups of {capacity}")
    order = np.argsort(-affinity.sum(axis=1), kind="stable")  # weighted degree, descending
    group_of = np.full(n, -1, np.int64)
    group_of[seeds] = np.arange(num_groups)
    to_group = affinity[:, seeds].copy()
    size = np.ones(num_groups, np.int64)
    while (group_of < 0).any():
        for g in range(num_groups):
            if size[g] == capacity:
                continue
            candidates = order[group_of[order] < 0]
            pick = candidates[np.argmax(to_group[candidates, g])]  # ties: higher degree first
            group_of[pick] = g
            size[g] += 1
            to_group[:, g] += affinity[:, pick]
    return group_of


def _partition(affinity: np.ndarray, num_groups: int, capacity: int) -> np.ndarray:
    """One greedy stage: grow from both seed sets, refine each, keep the lower cut (ties: the paper's)."""
    dist = 1.0 - np.eye(num_groups)
    block = np.zeros(affinity.shape[0], np.int64)
    candidates = [
        _kernighan_lin(affinity, _greedy_groups(affinity, _seeds(affinity, num_groups, spread), capacity), dist, block)
        for spread in (False, True)
    ]
    cuts = [float(np.sum(affinity * dist[g][:, g])) for g in candidates]
    return candidates[int(np.argmin(cuts))]


def _swap_delta(affinity: np.ndarray, group_of: np.ndarray, dist: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Change of ``0.5 * sum affinity_ij dist[g_i, g_j]`` when item ``rows[a]`` and item ``cols[b]``
    exchange groups, ``[len(rows), len(cols)]``."""
    gr, gc = group_of[rows], group_of[cols]
    reach = dist[group_of]  # reach[k, h]: distance from item k's group to group h
    r, c = affinity[rows] @ reach, affinity[cols] @ reach  # r[i, h]: cost of i's pairs if i sat in h
    return (r[:, gc] - r[np.arange(rows.size), gr][:, None] + (c[:, gr] - c[np.arange(cols.size), gc][:, None]).T
            + 2.0 * affinity[np.ix_(rows, cols)] * dist[np.ix_(gr, gc)])


def _kernighan_lin(affinity: np.ndarray, group_of: np.ndarray, dist: np.ndarray, block: np.ndarray) -> np.ndarray:
    """Swap refinement: for every pair of groups (items of one block only), a Kernighan-Lin pass
    swaps the best unlocked pair again and again, even uphill, and keeps the best prefix; rounds
    repeat while the cost drops. Unlike single improving swaps this can move half a cluster."""
    group_of = group_of.copy()
    tolerance = 1e-9 * max(float(affinity.sum()), 1e-30)
    groups = np.unique(group_of)
    for _ in range(10):
        improved = False
        for ai, a in enumerate(groups):
            for b in groups[ai + 1:]:
                members = np.flatnonzero((group_of == a) | (group_of == b))
                if np.unique(block[members]).size > 1:
                    continue
                trial, gain, best, best_gain = group_of.copy(), 0.0, None, -tolerance
                free = np.ones(group_of.size, bool)
                while True:
                    rows = np.flatnonzero(free & (trial == a))
                    cols = np.flatnonzero(free & (trial == b))
                    if rows.size == 0 or cols.size == 0:
                        break
                    delta = _swap_delta(affinity, trial, dist, rows, cols)
                    i, j = np.unravel_index(np.argmin(delta), delta.shape)
                    gain += delta[i, j]
                    trial[rows[i]], trial[cols[j]] = b, a
                    free[rows[i]] = free[cols[j]] = False
                    if gain < best_gain:
                        best, best_gain = trial.copy(), gain
                if best is not None:
                    group_of, improved = best, True
        if not improved:
            break
    return group_of


def comm_optimal_placement(coact: np.ndarray, topology: Topology, routing_groups: int = 1) -> np.ndarray:
    """Expert -> GPU of the two-stage greedy with swap refinement (the spectrum's first point)."""
    num_experts = coact.shape[0]
    units = _units(num_experts, topology.ep_size, routing_groups)
    affinity, _ = units.aggregate(coact, np.zeros(num_experts))
    unit_block = units.block_of_unit()
    device_of_unit = np.empty(units.num_units, np.int64)
    for block in np.unique(units.block_of_gpu):
        members = np.flatnonzero(unit_block == block)
        gpus = np.flatnonzero(units.block_of_gpu == block)
        device_of_unit[members] = gpus[_partition(affinity[np.ix_(members, members)], gpus.size, units.capacity)]
    if topology.num_nodes > 1 and np.unique(units.block_of_gpu).size == 1:
        onehot = np.zeros((units.num_units, topology.ep_size))
        onehot[np.arange(units.num_units), device_of_unit] = 1.0
        gpu_affinity = onehot.T @ affinity @ onehot
        np.fill_diagonal(gpu_affinity, 0.0)
        node_of_gpu = _partition(gpu_affinity, topology.num_nodes, topology.node_size)
        new_id = np.argsort(np.lexsort((np.arange(topology.ep_size), node_of_gpu)))  # node-major GPU ids
        device_of_unit = new_id[device_of_unit]
    device_of_unit = _kernighan_lin(affinity, device_of_unit, topology.distance(), units.block_of_gpu[device_of_unit])
    return device_of_unit[units.unit_of_expert]


def tradeoff_spectrum(
    coact: np.ndarray,
    loads: np.ndarray,
    topology: Topology,
    start: np.ndarray,
    max_steps: Optional[int] = None,
    routing_groups: int = 1,
) -> list[SpectrumPoint]:
    """Points (C, B) from ``start`` (expert -> GPU) by load-balancing swaps between the highest-
    and the lowest-loaded GPU (within a routing-group block); stops when no swap lowers the pair's
    larger load or after ``max_steps`` (default: twice the number of movable units)."""
    num_experts = coact.shape[0]
    loads = np.asarray(loads, np.float64)
    if loads.shape != (num_experts,):
        raise ValueError(f"loads must have {num_experts} entries (one per expert), got {loads.shape}")
    units = _units(num_experts, topology.ep_size, routing_groups)
    affinity, unit_loads = units.aggregate(coact, loads)
    device_of_unit = np.asarray(start, np.int64)[units.first_expert]
    if not (device_of_unit[units.unit_of_expert] == start).all():
        raise ValueError("the start placement splits a routing group that must stay together")
    dist = topology.distance()

    def point(step: int) -> SpectrumPoint:
        device = device_of_unit[units.unit_of_expert]
        return SpectrumPoint(step, device, comm_cost(coact, device, topology), load_imbalance(loads, device, topology.ep_size))

    points = [point(0)]
    for step in range(1, (2 * units.num_units if max_steps is None else max_steps) + 1):
        gpu_loads = np.bincount(device_of_unit, weights=unit_loads, minlength=topology.ep_size)
        hi = int(np.argmax(gpu_loads))
        partners = np.flatnonzero(units.block_of_gpu == units.block_of_gpu[hi])
        lo = int(partners[np.argmin(gpu_loads[partners])])
        gap = gpu_loads[hi] - gpu_loads[lo]
        on_hi, on_lo = np.flatnonzero(device_of_unit == hi), np.flatnonzero(device_of_unit == lo)
        shift = unit_loads[on_hi][:, None] - unit_loads[on_lo][None, :]
        relief = np.minimum(shift, gap - shift)  # how much the pair's larger load drops
        if gap <= 0 or not (relief > 0).any():
            break
        delta = _swap_delta(affinity, device_of_unit, dist, on_hi, on_lo)
        score = np.where(relief > 0, delta / np.where(relief > 0, relief, 1.0), np.inf)
        a, b = np.unravel_index(np.argmin(score), score.shape)
        device_of_unit[on_hi[a]], device_of_unit[on_lo[b]] = lo, hi
        points.append(point(step))
    return points


def select_by_lambda(points: list[SpectrumPoint], lam: float, comm_scale: float) -> int:
    """Index minimising ``lam * C / comm_scale + (1 - lam) * B``; ``comm_scale`` is the C of the
    sequential placement (Megatron's default layout), so both terms are ratios where sequential's
    C and a perfect balance are 1. Ties go to the earlier, more communication-friendly point."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be within [0, 1], got {lam}")
    c = np.array([p.comm_cost for p in points]) / (comm_scale if comm_scale > 0 else 1.0)
    b = np.array([p.imbalance for p in points])
    return int(np.argmin(lam * c + (1.0 - lam) * b))


def select_by_profiling(points: list[SpectrumPoint], score: ProfileFn, max_evaluations: Optional[int] = None) -> tuple[int, dict[int, float]]:
    """Score (at most ``max_evaluations``, evenly spread, always including both ends) points with
    ``score`` (lower is better, e.g. a measured step time); returns the best index and all scores."""
    count = len(points)
    if max_evaluations is None or max_evaluations >= count:
        candidates = range(count)
    else:
        if max_evaluations < 2:
            raise ValueError(f"max_evaluations must be >= 2 (both ends of the spectrum), got {max_evaluations}")
        candidates = sorted(set(np.linspace(0, count - 1, max_evaluations).round().astype(int).tolist()))
    scores = {i: float(score(points[i])) for i in candidates}
    return min(scores, key=lambda i: (scores[i], i)), scores


def plan_cap(
    coact: np.ndarray,
    loads: np.ndarray,
    topology: Topology,
    lam: float = 0.5,
    profile: Optional[ProfileFn] = None,
    max_steps: Optional[int] = None,
    routing_groups: int = 1,
    max_evaluations: Optional[int] = None,
) -> CAPResult:
    """Comm-optimal placement, its spectrum, and the point chosen by ``profile`` if given, else by
    ``lam``."""
    coact = np.asarray(coact, np.float64)
    if coact.ndim != 2 or coact.shape[0] != coact.shape[1]:
        raise ValueError(f"co-activation must be a square [N, N] matrix, got {coact.shape}")
    start = comm_optimal_placement(coact, topology, routing_groups)
    points = tradeoff_spectrum(coact, loads, topology, start, max_steps, routing_groups)
    if profile is not None:
        chosen, scores = select_by_profiling(points, profile, max_evaluations)
        return CAPResult(points, chosen, "profiling", scores)
    sequential = np.arange(coact.shape[0]) // experts_per_rank(coact.shape[0], topology.ep_size)
    return CAPResult(points, select_by_lambda(points, lam, comm_cost(coact, sequential, topology)), f"lambda={lam:g}")


def plan_trace(
    trace: RoutingTrace,
    topology: Topology,
    lam: float = 0.5,
    profile: Optional[Callable[[int, SpectrumPoint], float]] = None,
    max_steps: Optional[int] = None,
    routing_groups: int = 1,
    max_evaluations: Optional[int] = None,
    on_layer: Optional[Callable[[int, dict], None]] = None,
) -> tuple[ExpertPlacement, dict[int, CAPResult]]:
    """CAP for every layer of a trace: co-activation from the sampled tokens, loads from the exact
    per-expert counts. ``profile(layer, point)`` scores a point of a layer (lower is better).
    The placement's metadata records C, B and devices per token of sequential and chosen points
    (also passed to ``on_layer(layer, summary)`` as each layer finishes, for progress output)."""
    results: dict[int, CAPResult] = {}
    summary: dict[str, dict] = {}
    sequential = np.arange(trace.num_experts) // experts_per_rank(trace.num_experts, topology.ep_size)
    for number, layer in sorted(trace.layers.items()):
        start = time.perf_counter()
        coact = coactivation(layer.expert_ids, trace.num_experts)
        layer_profile = None if profile is None else functools.partial(profile, number)
        result = plan_cap(coact, layer.expert_counts, topology, lam, layer_profile, max_steps, routing_groups, max_evaluations)
        results[number] = result
        chosen = result.chosen_point
        summary[str(number)] = {
            "tokens": layer.num_sampled,
            "comm_cost_sequential": comm_cost(coact, sequential, topology),
            "imbalance_sequential": load_imbalance(layer.expert_counts, sequential, topology.ep_size),
            "devices_per_token_sequential": float(devices_per_token(layer.expert_ids, sequential).mean()),
            "comm_cost_optimal": result.comm_optimal.comm_cost,
            "imbalance_optimal": result.comm_optimal.imbalance,
            "comm_cost": chosen.comm_cost,
            "imbalance": chosen.imbalance,
            "devices_per_token": float(devices_per_token(layer.expert_ids, chosen.device_of_expert).mean()),
            "spectrum_step": chosen.step,
            "spectrum_points": len(result.spectrum),
            "selection": result.selection,
            "seconds": time.perf_counter() - start,
        }
        if on_layer is not None:
            on_layer(number, summary[str(number)])
    placement = ExpertPlacement(
        trace.num_experts,
        topology.ep_size,
        {n: r.chosen_point.slot_to_expert(topology.ep_size) for n, r in results.items()},
        routing_groups,
        {"method": "cap", "gpus_per_node": topology.gpus_per_node, "cross_node_cost": topology.cross_node_cost,
         "layers": summary},
    )
    return placement, results
