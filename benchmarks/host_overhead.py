"""Per-layer host work LLEP adds to a step, and the token rows it gathers beyond stock EP.

At the gpt-oss-120b layer shape (32K tokens per GPU, N = 128, K = 4, P = 8 by default), for every
scenario and every rank: the planner's time, and the time to build that rank's send and receive
row permutations, side by side for

* ``numpy`` — the per-row gather indices built on the host (``RankPlan.send_order``) and copied
  over (what the dispatcher did before), and
* ``device`` — the dispatcher's :class:`_RowPermutation`, built from the ``[N * P]`` chunk sizes
  with a few tensor ops on the device (here the CPU, so its time includes what on a GPU is
  kernel work: an upper bound for the host part).

On a GPU the device path's row work is kernels; its host part is the dispatch of its few tensor
ops, measured here by running them on chunks of at most one row. Stock EP does neither (it plans
nothing and its order is Megatron's permute), so planner + dispatch is LLEP's extra host time per
layer on a GPU (target: under 0.3 ms). Token rows: LLEP gathers the dispatched tokens once more than stock EP in
forward (the destination-major send order after Megatron's permute; the slot order on the receiver
replaces stock's chunk sort) and once more in backward; their bytes are reported.

    python benchmarks/host_overhead.py [--ep 8] [--repeats 20] [--out results/host_overhead.json]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from common import GPT_OSS_120B, SCENARIOS, print_table, sample_counts, write_results

from megatron_llep.config import LLEPConfig
from megatron_llep.cost_model import ExpertShape
from megatron_llep.dispatcher import _RowPermutation
from megatron_llep.planner import plan_llep


def _best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _numpy_orders(view) -> None:
    """The former host path: per-row indices in numpy, their inverses, copies into tensors."""
    for index in (view.send_order(), view.recv_order()):
        inverse = np.empty_like(index)
        inverse[index] = np.arange(index.size, dtype=index.dtype)
        torch.from_numpy(index).to("cpu"), torch.from_numpy(inverse).to("cpu")


def _device_orders(view) -> None:
    _RowPermutation.send_order(view, torch.device("cpu"))
    _RowPermutation.recv_order(view, torch.device("cpu"))


def _device_orders_dispatch_only(view) -> None:
    """The same tensor ops on chunks of at most one row: what remains is the per-op dispatch
    (host) cost, an estimate of the host time of the device path on a GPU."""
    device = torch.device("cpu")
    num_experts, ep = view.send_counts.shape
    _RowPermutation(np.minimum(view.send_counts.ravel(), 1), np.arange(num_experts * ep).reshape(num_experts, ep).T.ravel(), device)
    chunk_order = (np.arange(ep)[None, :] * num_experts + view.slot_experts[:, None]).ravel()
    _RowPermutation(np.minimum(view.recv_counts.ravel(), 1), chunk_order, device)


def run(ep: int, repeats: int) -> list[dict]:
    shape = GPT_OSS_120B
    expert = ExpertShape(shape.hidden, shape.ffn, gated=True, bias=shape.bias, dtype_bytes=2)
    config = LLEPConfig()  # the library defaults: m = 1024, lambda 1.3, cost-aware
    rows = []
    for scenario in [s for s in SCENARIOS if s.hot_fraction in (0.0, 0.95)]:
        counts = sample_counts(shape, ep, scenario, seed=7)
        plan_ms = _best_ms(lambda: plan_llep(counts, config, expert), repeats)
        plan = plan_llep(counts, config, expert)
        row = dict(scenario=scenario.label, ep=ep, mode="plain" if plan.is_plain_ep else "llep", plan_ms=plan_ms,
                   numpy_orders_ms=0.0, device_orders_ms=0.0, device_orders_dispatch_ms=0.0, extra_rows=0)
        if not plan.is_plain_ep:
            per_rank = []
            for rank in range(ep):
                view = plan.rank_view(rank)
                per_rank.append((_best_ms(lambda: _numpy_orders(view), repeats),
                                 _best_ms(lambda: _device_orders(view), repeats),
                                 _best_ms(lambda: _device_orders_dispatch_only(view), repeats),
                                 int(view.send_counts.sum())))
            row["numpy_orders_ms"] = max(p[0] for p in per_rank)
            row["device_orders_ms"] = max(p[1] for p in per_rank)
            row["device_orders_dispatch_ms"] = max(p[2] for p in per_rank)
            row["extra_rows"] = max(p[3] for p in per_rank)
        # on a GPU the device path's row work runs as kernels; the host pays the planner and dispatch
        row["extra_host_ms"] = row["plan_ms"] + row.get("device_orders_dispatch_ms", 0.0)
        # one more gather of the dispatched rows in forward, and one in backward
        row["extra_gather_mb"] = 2 * row["extra_rows"] * expert.token_bytes / 2**20
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="results/host_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(args.ep, args.repeats)
    print_table(rows, [("scenario", "scenario", "s"), ("mode", "mode", "s"), ("plan_ms", "plan ms", ".3f"),
                       ("numpy_orders_ms", "orders numpy ms", ".3f"), ("device_orders_ms", "orders device ms", ".3f"),
                       ("device_orders_dispatch_ms", "of it dispatch ms", ".3f"),
                       ("extra_host_ms", "extra host ms", ".3f"), ("extra_rows", "extra rows", "d"),
                       ("extra_gather_mb", "extra gather MB", ".1f")])
    write_results(args.out, "host_overhead", rows,
                  dict(shape=GPT_OSS_120B.name, tokens_per_gpu=GPT_OSS_120B.tokens_per_gpu, ep=args.ep,
                       repeats=args.repeats, timing="best of repeats, slowest rank, 1 thread"))


if __name__ == "__main__":
    main()
