"""What a placement costs: co-activation, communication cost C, devices per token, load imbalance B.

Conventions: ``expert_ids [T, K]`` (``-1`` = no expert), ``device_of_expert [N]`` the EP rank
(GPU) that serves each expert, GPUs ``g`` on node ``g // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Topology:
    """EP ranks grouped into nodes; ``cross_node_cost`` is ``c``, the distance between GPUs of
    different nodes (1 within a node, 0 on the same GPU). ``gpus_per_node=None``: one node."""

    ep_size: int
    gpus_per_node: Optional[int] = None
    cross_node_cost: float = 5.0

    def __post_init__(self) -> None:
        if self.ep_size <= 0:
            raise ValueError(f"ep_size must be positive, got {self.ep_size}")
        if self.gpus_per_node is not None and (self.gpus_per_node <= 0 or self.ep_size % self.gpus_per_node):
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be positive and divide ep_size={self.ep_size}")
        if not self.cross_node_cost >= 1.0:
            raise ValueError(f"cross_node_cost c must be >= 1 (the intra-node distance), got {self.cross_node_cost}")

    @property
    def node_size(self) -> int:
        return self.ep_size if self.gpus_per_node is None else self.gpus_per_node

    @property
    def num_nodes(self) -> int:
        return self.ep_size // self.node_size

    def node_of(self, device: np.ndarray) -> np.ndarray:
        return np.asarray(device) // self.node_size

    def distance(self) -> np.ndarray:
        """``[P, P]`` GPU distances d: 0 same GPU, 1 same node, c across nodes."""
        node = self.node_of(np.arange(self.ep_size))
        dist = np.where(node[:, None] == node[None, :], 1.0, self.cross_node_cost)
        np.fill_diagonal(dist, 0.0)
        return dist


def _valid_pairs(expert_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(expert_ids)
    first, second = np.triu_indices(ids.shape[1], k=1)
    a, b = ids[:, first].ravel(), ids[:, second].ravel()
    keep = (a >= 0) & (b >= 0) & (a != b)
    return a[keep], b[keep]


def coactivation(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``p_ij = count(i and j chosen by one token) / count(i or j chosen)``, ``[N, N]``, symmetric,
    zero diagonal (and zero where neither expert was chosen)."""
    ids = np.asarray(expert_ids)
    if ids.ndim != 2:
        raise ValueError(f"expert ids must be [tokens, topk], got shape {ids.shape}")
    if ids.size and ids.max() >= num_experts:
        raise ValueError(f"expert id {ids.max()} is out of range for {num_experts} experts")
    a, b = _valid_pairs(ids)
    both = np.bincount(a * num_experts + b, minlength=num_experts * num_experts).reshape(num_experts, num_experts)
    both = both + both.T
    single = np.bincount(ids[ids >= 0].ravel(), minlength=num_experts)  # tokens choosing each expert
    either = single[:, None] + single[None, :] - both
    p = np.divide(both, either, out=np.zeros((num_experts, num_experts)), where=either > 0)
    np.fill_diagonal(p, 0.0)
    return p


def comm_cost(coact: np.ndarray, device_of_expert: np.ndarray, topology: Topology) -> float:
    """``C(pi) = sum_{i<j} p_ij d(pi(i), pi(j))``."""
    device = np.asarray(device_of_expert)
    dist = topology.distance()[device][:, device]
    return float(0.5 * np.sum(coact * dist))


def distinct_per_row(values: np.ndarray) -> np.ndarray:
    """Number of distinct non-negative entries in each row of ``[T, K]`` (``-1`` = none)."""
    values = np.sort(np.asarray(values), axis=1)
    new = np.concatenate([values[:, :1] >= 0, (values[:, 1:] != values[:, :-1]) & (values[:, 1:] >= 0)], axis=1)
    return new.sum(axis=1)


def devices_per_token(expert_ids: np.ndarray, device_of_expert: np.ndarray) -> np.ndarray:
    """Per token, the number of distinct devices its experts live on (its real traffic)."""
    ids = np.asarray(expert_ids)
    return distinct_per_row(np.where(ids >= 0, np.asarray(device_of_expert)[np.maximum(ids, 0)], -1))


def device_loads(expert_loads: np.ndarray, device_of_expert: np.ndarray, ep_size: int) -> np.ndarray:
    """Tokens each GPU computes: the loads of the experts it serves."""
    return np.bincount(np.asarray(device_of_expert), weights=np.asarray(expert_loads, np.float64), minlength=ep_size)


def max_over_mean(loads: np.ndarray) -> float:
    """``max / mean`` of per-GPU loads (1.0 for no load at all)."""
    loads = np.asarray(loads, np.float64)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def load_imbalance(expert_loads: np.ndarray, device_of_expert: np.ndarray, ep_size: int) -> float:
    """``B(pi) = max_g L_g / mean_g L_g``."""
    return max_over_mean(device_loads(expert_loads, device_of_expert, ep_size))
