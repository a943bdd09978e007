"""Routing pruning for inference (lossy, off unless asked for): drop part of a token's routing
whose accuracy contribution is small for its communication cost.

* **Device-level pruning** (CAP, :func:`prune_devices`): per token, a device's contribution ``a_d``
  is the sum of the routing scores of the token's experts on it; its cost ``c_d`` is the price of
  sending the token there (e.g. 0 for the token's own GPU, 1 in its node, c across nodes:
  :func:`device_costs`). Devices are kept in descending ``a_d / c_d`` (free devices first; ties by
  larger ``a_d``, then lower device id) until the kept mass reaches ``(1 - p)`` of the token's total
  score; the rest are dropped with all of their experts.
* **Expert-level pruning** (the naive baseline, :func:`prune_experts`): the token's experts are
  kept in descending score (ties: lower expert id) until the kept mass reaches ``(1 - p)`` of its
  total; costs play no part.

Both always keep a token's first-ranked device (expert), and ``p = 0`` keeps everything, even
zero-score experts. :func:`prune_routing_map` applies either rule to Megatron's ``[tokens,
experts]`` routing (what :class:`~megatron_llep.runtime.layer.LLEPMoELayer` does with
``LLEPConfig.pruning``).

**Normalisation.** The kept scores are rescaled so that their sum equals the token's original
total. The MoE output ``sum_e s_e * expert_e(x)`` then stays a combination of the same scale as the
unpruned layer's (a convex one for softmax routing, whose top-K scores are themselves renormalised
to sum to 1), so the residual stream sees no systematic shrinkage of the MoE branch, the same
reasoning as top-K renormalisation. The alternative, zeroing the dropped scores without rescaling,
keeps each kept expert's weight exactly as the router chose it but scales the branch down by the
dropped mass (up to ``p``); ``prune_devices``/``prune_experts`` offer it with ``renormalize=False``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_llep.placement.metrics import Topology


@dataclass
class PrunedRouting:
    """``device_mask [T, P]``: devices a token still visits; ``expert_mask [T, K]``: its kept
    experts; ``probs [T, K]``: routing scores with dropped experts zeroed (rescaled to the token's
    original total when ``renormalize``)."""

    device_mask: torch.Tensor
    expert_mask: torch.Tensor
    probs: torch.Tensor


def _check_p(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"pruning fraction p must be within [0, 1), got {p}")


def _keep_until_covered(
    mass: torch.Tensor, present: torch.Tensor, p: float, cost: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The rule shared by every form: per row, the ``present`` columns ranked by ``mass / cost``
    (by ``mass`` when ``cost`` is ``None``; cost 0 first; ties: larger mass, then lower column) and
    kept while the mass kept before them is below ``(1 - p)`` of the row's total; the first is
    always kept. ``mass``, ``present`` are ``[T, C]``; ``cost`` broadcasts to them."""
    if p == 0.0:
        return present
    if cost is None:
        order = torch.argsort(torch.where(present, mass, -torch.inf), dim=1, descending=True, stable=True)
    else:
        cost = cost.to(mass.dtype)
        ratio = torch.where(cost > 0, mass / cost.clamp_min(torch.finfo(mass.dtype).tiny), torch.inf)
        ratio = torch.where(present, ratio, -torch.inf)
        by_mass = torch.argsort(mass, dim=1, descending=True, stable=True)  # ties: more mass, then lower id
        order = by_mass.gather(1, torch.argsort(ratio.gather(1, by_mass), dim=1, descending=True, stable=True))
    sorted_mass = mass.gather(1, order)
    mass_before = torch.cumsum(sorted_mass, dim=1) - sorted_mass
    keep_sorted = mass_before < (1.0 - p) * mass.sum(dim=1, keepdim=True)
    keep_sorted[:, :1] = True  # a row always keeps its best column (if it has one: masked below)
    keep_sorted &= present.gather(1, order)
    return torch.zeros_like(present).scatter_(1, order, keep_sorted)


def _kept_scores(probs: torch.Tensor, keep: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """``probs`` with the dropped entries zeroed and, with ``renormalize``, the kept ones rescaled
    to each row's original total (see the module docstring)."""
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    if not renormalize:
        return kept
    total, kept_total = probs.sum(dim=1, keepdim=True), kept.sum(dim=1, keepdim=True)
    scale = torch.where(kept_total > 0, total / kept_total.clamp_min(torch.finfo(probs.dtype).tiny), 1.0)
    return kept * scale


def _check_topk(expert_ids: torch.Tensor, probs: torch.Tensor) -> None:
    if expert_ids.shape != probs.shape or expert_ids.dim() != 2:
        raise ValueError(f"expert_ids and probs must both be [tokens, topk], got {tuple(expert_ids.shape)} and {tuple(probs.shape)}")


def device_costs(
    own_device: int, num_devices: int, devices_per_node: Optional[int], cross_node_cost: float
) -> torch.Tensor:
    """``c_d`` for a token on ``own_device``: 0 there, 1 on another device of its node,
    ``cross_node_cost`` in another node (``devices_per_node=None`` or ``>= num_devices``: one node)."""
    per_node = None if devices_per_node is None or devices_per_node >= num_devices else devices_per_node
    return torch.from_numpy(Topology(num_devices, per_node, cross_node_cost).distance()[own_device].copy())


def prune_devices(
    expert_ids: torch.Tensor,
    probs: torch.Tensor,
    device_of_expert: torch.Tensor,
    device_cost: torch.Tensor,
    p: float,
    renormalize: bool = True,
) -> PrunedRouting:
    """Prune destination devices per token (CAP; see the module docstring).

    ``expert_ids`` and ``probs`` are ``[T, K]`` (top-K ids and their routing scores);
    ``device_of_expert [N]`` maps experts to devices; ``device_cost`` is ``[P]`` or ``[T, P]``
    (non-negative; broadcast over tokens).
    """
    _check_p(p)
    _check_topk(expert_ids, probs)
    device = torch.as_tensor(device_of_expert, device=expert_ids.device)[expert_ids]
    num_tokens, num_devices = expert_ids.shape[0], int(torch.as_tensor(device_of_expert).max()) + 1
    cost = torch.as_tensor(device_cost, dtype=probs.dtype, device=probs.device).expand(num_tokens, -1)
    if cost.shape[1] < num_devices or (cost < 0).any():
        raise ValueError(f"device_cost must be non-negative with an entry per device ({num_devices}), got {tuple(cost.shape)}")
    num_devices = cost.shape[1]
    visited = torch.zeros(num_tokens, num_devices, dtype=torch.bool, device=probs.device).scatter_(1, device, True)
    mass = torch.zeros(num_tokens, num_devices, dtype=probs.dtype, device=probs.device).scatter_add_(1, device, probs)
    device_mask = _keep_until_covered(mass, visited, p, cost)
    expert_mask = device_mask.gather(1, device)
    return PrunedRouting(device_mask, expert_mask, _kept_scores(probs, expert_mask, renormalize))


def prune_experts(
    expert_ids: torch.Tensor,
    probs: torch.Tensor,
    device_of_expert: torch.Tensor,
    p: float,
    renormalize: bool = True,
) -> PrunedRouting:
    """Naive expert-level pruning per token (the baseline CAP is measured against; see the module
    docstring). Arguments as :func:`prune_devices` without costs; ``device_mask`` reports the
    devices the kept experts still need."""
    _check_p(p)
    _check_topk(expert_ids, probs)
    device_of_expert = torch.as_tensor(device_of_expert, device=expert_ids.device)
    num_tokens, num_experts = expert_ids.shape[0], device_of_expert.numel()
    # dense [T, N] rows, so that ties between equal scores go to the lower expert id
    scores = torch.zeros(num_tokens, num_experts, dtype=probs.dtype, device=probs.device).scatter_add_(1, expert_ids, probs)
    chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=probs.device).scatter_(1, expert_ids, True)
    expert_mask = _keep_until_covered(scores, chosen, p).gather(1, expert_ids)
    num_devices = int(device_of_expert.max()) + 1
    kept_per_device = torch.zeros(num_tokens, num_devices, dtype=torch.long, device=probs.device)
    kept_per_device.scatter_add_(1, device_of_expert[expert_ids], expert_mask.long())
    return PrunedRouting(kept_per_device > 0, expert_mask, _kept_scores(probs, expert_mask, renormalize))


def prune_routing_map(
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    experts_per_device: int,
    device_cost: torch.Tensor,
    p: float,
    method: str = "devices",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's routing (``routing_map [T, N]`` bool, dense ``probs [T, N]``) pruned per token by
    ``method`` (``"devices"`` or ``"experts"``; ``device_cost [P]`` is used by the former only):
    dropped pairs cleared in the map and zeroed in the scores, kept scores rescaled to each token's
    original total. Devices are blocks of ``experts_per_device`` consecutive experts (Megatron's
    physical layout: expert ``e`` on EP rank ``e // M``; a model with an applied CAP placement has
    its router rows permuted to that layout). Works on whatever scores the router produced
    (softmax, sigmoid, scaled), in at least float32; returns scores in ``probs``' dtype."""
    _check_p(p)
    if p == 0.0:
        return routing_map, probs
    num_tokens, num_experts = routing_map.shape
    scores = torch.where(routing_map, probs.to(torch.promote_types(probs.dtype, torch.float32)), 0.0)
    if method == "devices":
        blocks = (num_tokens, num_experts // experts_per_device, experts_per_device)
        mass = scores.view(blocks).sum(dim=2)
        keep_device = _keep_until_covered(mass, routing_map.view(blocks).any(dim=2), p, device_cost.to(mass.device))
        keep = routing_map & keep_device.repeat_interleave(experts_per_device, dim=1)
    elif method == "experts":
        keep = _keep_until_covered(scores, routing_map, p)
    else:
        raise ValueError(f"pruning method must be 'devices' or 'experts', got {method!r}")
    return keep, _kept_scores(scores, keep, renormalize=True).to(probs.dtype)
