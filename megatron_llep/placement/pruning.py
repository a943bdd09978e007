"""Device-level pruning for inference (lossy, off unless called): drop whole destination devices
of a token whose accuracy contribution is small for their cost.

Per token, a device's contribution ``a_d`` is the sum of the routing scores of the token's experts
on it; its cost ``c_d`` is the price of sending the token there (e.g. 0 for the token's own GPU, 1
in its node, c across nodes). Devices are kept in descending ``a_d / c_d`` (free devices first; ties
by larger ``a_d``, then lower device id) until the kept mass reaches ``(1 - p)`` of the token's total score; the rest are dropped with all
of their experts. ``p = 0`` keeps every device, even ones whose experts have zero score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrunedRouting:
    """``device_mask [T, P]``: devices a token still visits; ``expert_mask [T, K]``: its kept
    experts; ``probs [T, K]``: routing scores with dropped experts zeroed (rescaled to the token's
    original total when ``renormalize``)."""

    device_mask: torch.Tensor
    expert_mask: torch.Tensor
    probs: torch.Tensor


def prune_devices(
    expert_ids: torch.Tensor,
    probs: torch.Tensor,
    device_of_expert: torch.Tensor,
    device_cost: torch.Tensor,
    p: float,
    renormalize: bool = True,
) -> PrunedRouting:
    """Prune destination devices per token (see the module docstring).

    ``expert_ids`` and ``probs`` are ``[T, K]`` (top-K ids and their routing scores);
    ``device_of_expert [N]`` maps experts to devices; ``device_cost`` is ``[P]`` or ``[T, P]``
    (non-negative; broadcast over tokens).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"pruning fraction p must be within [0, 1), got {p}")
    if expert_ids.shape != probs.shape or expert_ids.dim() != 2:
        raise ValueError(f"expert_ids and probs must both be [tokens, topk], got {tuple(expert_ids.shape)} and {tuple(probs.shape)}")
    device = torch.as_tensor(device_of_expert, device=expert_ids.device)[expert_ids]
    num_tokens, num_devices = expert_ids.shape[0], int(torch.as_tensor(device_of_expert).max()) + 1
    cost = torch.as_tensor(device_cost, dtype=probs.dtype, device=probs.device).expand(num_tokens, -1)
    if cost.shape[1] < num_devices or (cost < 0).any():
        raise ValueError(f"device_cost must be non-negative with an entry per device ({num_devices}), got {tuple(cost.shape)}")
    num_devices = cost.shape[1]
    visited = torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=probs.device).scatter_(1, device, True)
    if p == 0.0:
        return PrunedRouting(visited, torch.ones_like(expert_ids, dtype=torch.bool), probs)
    mass = torch.zeros(num_tokens, num_devices, dtype=probs.dtype, device=probs.device).scatter_add_(1, device, probs)
    ratio = torch.where(cost > 0, mass / cost.clamp_min(torch.finfo(probs.dtype).tiny), torch.inf)
    ratio = torch.where(visited, ratio, -torch.inf)
    by_mass = torch.argsort(mass, dim=1, descending=True, stable=True)  # ties: more mass, then lower id
    order = by_mass.gather(1, torch.argsort(ratio.gather(1, by_mass), dim=1, descending=True, stable=True))
    sorted_mass = mass.gather(1, order)
    mass_before = torch.cumsum(sorted_mass, dim=1) - sorted_mass
    total = mass.sum(dim=1, keepdim=True)
    keep_sorted = (mass_before < (1.0 - p) * total) & visited.gather(1, order)
    keep_sorted[:, 0] = True  # a token always keeps its best device (it has at least one)
    device_mask = torch.zeros_like(visited).scatter_(1, order, keep_sorted)
    expert_mask = device_mask.gather(1, device)
    kept = torch.where(expert_mask, probs, torch.zeros_like(probs))
    if renormalize:
        kept_total = kept.sum(dim=1, keepdim=True)
        kept = torch.where(kept_total > 0, kept * (total / kept_total.clamp_min(torch.finfo(probs.dtype).tiny)), kept)
    return PrunedRouting(device_mask, expert_mask, kept)
