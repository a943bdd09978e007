"""The once-per-step return of kept borrowed experts' gradients to their native ranks, as phases
of transfers every EP rank computes alike from the same ledger. Pure numpy."""

from __future__ import annotations

from typing import Optional

import numpy as np


def stripe_bounds(lo: int, hi: int, pieces: int) -> list[int]:
    """Edges of ``[lo, hi)`` cut into ``pieces`` near-equal contiguous ranges (the stripes and
    parts of :func:`gradient_return_phases`)."""
    return [lo + (hi - lo) * i // pieces for i in range(pieces + 1)]


def gradient_return_phases(held: np.ndarray, num_local_experts: int, numel: int, ranks_per_node: Optional[int],
                           relay: bool) -> list[list[tuple[int, int, int, int, int]]]:
    """The once-per-step return of kept copies' gradients to their native ranks, as phases of
    transfers ``(expert, source, target, lo, hi)``: elements ``[lo, hi)`` of the expert's flat
    gradient (``numel`` elements), which the target adds to its own. A phase starts once the one
    before it has arrived.

    ``held[e, p]``: rank ``p`` keeps a copy of expert ``e``. Helpers return straight to the native
    rank when they share its node, or without ``relay``. Otherwise a hierarchical sum, so that no
    single link carries one whole gradient per node: (0) on every node that keeps the expert, the
    native rank's included, each helper cuts its gradient into one stripe per rank of the node and
    stripe ``j`` is summed at the node's ``j``-th rank; (1) the helper nodes other than the native
    rank's reduce-scatter their stripe sums, rank ``j`` with rank ``j`` (each node ends with the sum
    of one part of every stripe); (2) each part crosses once, to rank ``j`` of the native rank's
    node; (3) those ranks send their stripe sums to the native rank. Every EP rank computes the
    same phases from the same ledger. Plain Python: a step has a few hundred kept copies."""
    ep = held.shape[1]
    per_node = min(ranks_per_node or ep, ep)
    phases: list[list[tuple[int, int, int, int, int]]] = [[], [], [], []]
    stripes = stripe_bounds(0, numel, per_node)
    for expert in np.flatnonzero(held.any(axis=1)).tolist():
        native = expert // num_local_experts
        home = native // per_node
        keepers = np.flatnonzero(held[expert]).tolist()
        remote = sorted({k // per_node for k in keepers} - {home}) if relay else []
        if not remote:
            phases[0] += [(expert, keeper, native, 0, numel) for keeper in keepers]
            continue
        for keeper in keepers:
            node = keeper // per_node
            phases[0] += [(expert, keeper, node * per_node + j, stripes[j], stripes[j + 1])
                          for j in range(per_node) if node * per_node + j != keeper and stripes[j] < stripes[j + 1]]
        for j in range(per_node):
            parts = stripe_bounds(stripes[j], stripes[j + 1], len(remote))
            for q, owner in enumerate(remote):
                if parts[q] == parts[q + 1]:
                    continue
                phases[1] += [(expert, node * per_node + j, owner * per_node + j, parts[q], parts[q + 1])
                              for node in remote if node != owner]
                phases[2].append((expert, owner * per_node + j, home * per_node + j, parts[q], parts[q + 1]))
            if home * per_node + j != native and stripes[j] < stripes[j + 1]:
                phases[3].append((expert, home * per_node + j, native, stripes[j], stripes[j + 1]))
    return phases
