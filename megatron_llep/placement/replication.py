"""DeepSeek EPLB-style static replication of hot experts — the peer CAP is compared against.

From past per-expert loads: the ``r * P`` redundant slots (``r`` per GPU) go one by one to the
expert with the highest load per copy (EPLB's ``replicate_experts``); then all copies, heaviest
share first, are packed onto the least-loaded GPU that still has a free slot and no copy of that
expert yet (EPLB's balanced packing). Co-activation is ignored.

At run time a token visiting a replicated expert uses a copy on a device the token already visits
(its single-copy experts' devices and earlier picks), else the copy on the currently least-loaded
device (loads counted online over the evaluated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_llep.placement.placement import experts_per_rank


@dataclass(frozen=True)
class ReplicatedPlacement:
    """``replicas[e]``: devices holding a copy of expert ``e``; every device has ``slots`` slots."""

    replicas: tuple[np.ndarray, ...]
    ep_size: int
    slots: int


def eplb_placement(loads: np.ndarray, ep_size: int, redundant_per_device: int = 1) -> ReplicatedPlacement:
    """Replicate hot experts into ``redundant_per_device`` extra slots per GPU and pack by load."""
    loads = np.asarray(loads, np.float64)
    num_experts = loads.size
    slots = experts_per_rank(num_experts, ep_size) + redundant_per_device
    if redundant_per_device < 0:
        raise ValueError(f"redundant_per_device must be >= 0, got {redundant_per_device}")
    copies = np.ones(num_experts, np.int64)
    for _ in range(redundant_per_device * ep_size):
        share = np.where(copies < ep_size, loads / copies, -np.inf)  # at most one copy per device
        copies[int(np.argmax(share))] += 1
    experts = np.repeat(np.arange(num_experts), copies)
    shares = (loads / copies)[experts]
    device_load = np.zeros(ep_size)
    free = np.full(ep_size, slots)
    hosts: list[list[int]] = [[] for _ in range(num_experts)]
    for e in experts[np.argsort(-shares, kind="stable")]:
        allowed = (free > 0) & ~np.isin(np.arange(ep_size), hosts[e])
        d = int(np.flatnonzero(allowed)[np.argmin(device_load[allowed])])
        hosts[e].append(d)
        device_load[d] += loads[e] / copies[e]
        free[d] -= 1
    return ReplicatedPlacement(tuple(np.array(sorted(h)) for h in hosts), ep_size, slots)


def route_with_replicas(expert_ids: np.ndarray, placement: ReplicatedPlacement) -> tuple[np.ndarray, np.ndarray]:
    """Serve every token (see the module docstring); returns the device of each assignment
    ``[T, K]`` (``-1`` where the expert id is ``-1``) and the tokens each device computes ``[P]``."""
    ids = np.asarray(expert_ids)
    device_load = np.zeros(placement.ep_size)
    single = np.array([h[0] if h.size == 1 else -1 for h in placement.replicas])
    served = np.where(ids >= 0, single[np.maximum(ids, 0)], -1)
    np.add.at(device_load, served[served >= 0], 1.0)
    for t, k in zip(*np.nonzero((ids >= 0) & (served < 0))):  # row-major: a token's picks in order
        visited = served[t][served[t] >= 0]
        hosts = placement.replicas[ids[t, k]]
        near = hosts[np.isin(hosts, visited)]
        options = near if near.size else hosts
        served[t, k] = d = int(options[np.argmin(device_load[options])])
        device_load[d] += 1.0
    return served, device_load
