"""Per-layer host work LLEP adds to a step, and the token rows it gathers beyond stock EP.

At the gpt-oss-120b layer shape (32K tokens per GPU, N = 128, K = 4, P = 8 by default), for every
scenario and every rank, the work the dispatcher does beyond stock Megatron:

* the planner (host numpy, the same on every rank) and the rank's view of the plan
  (:meth:`LLEPPlan.rank_view`: its send/receive counts, slots and weight transfers);
* the send columns (:class:`SendColumns`): the plan folded into the routing map, so that
  Megatron's own permute emits the destination-major all-to-all order — ``[columns]`` vectors
  copied over and a few ``[tokens, columns]`` mask ops, no row gather;
* the receive order (:class:`RowPermutation`): per-chunk shifts from the host, the row indices
  built on the device; its gathers of the received tokens and probabilities and of the expert
  output replace stock's chunk sorts (``sort_chunks_by_idxs``).

Their device work is timed here on the CPU (an upper bound for the host part); the host part on a
GPU is the dispatch of their few tensor ops, measured by running them on inputs of one row per
chunk and one column. planner + rank view + dispatch is LLEP's extra host time per layer on a GPU
(target: under 0.3 ms). Stock's chunk sorts, which LLEP's receive gathers replace, are timed the
same way (Megatron's unfused ``sort_chunks_by_idxs``, the default: a split and a cat over the
``P * M`` chunks for the tokens, the probabilities and the expert output; TE's fused sort, with
``moe_permute_fusion``, is one kernel launch per tensor instead): the net is LLEP's host time
beyond the stock layer's.
Token rows gathered beyond stock: none in forward or backward when each rank owns more than one
expert (stock sorts its received rows too); with one expert per rank stock sorts nothing and the
receive order is one gather more.

    python benchmarks/host_overhead.py [--ep 8] [--repeats 20] [--out results/host_overhead.json]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from common import GPT_OSS_120B, SCENARIOS, print_table, sample_counts, write_results

from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

from megatron_llep.config import LLEPConfig
from megatron_llep.planning.cost_model import ExpertShape
from megatron_llep.runtime.permutation import RowPermutation, SendColumns
from megatron_llep.planning import plan_llep


def _best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _routing_map(send_counts: np.ndarray, tokens: int) -> torch.Tensor:
    """A ``[tokens, N]`` routing map with ``send_counts.sum(1)[e]`` tokens on expert ``e``."""
    per_expert = send_counts.sum(axis=1)
    routing = torch.zeros(tokens, per_expert.size, dtype=torch.bool)
    row = 0
    for expert, count in enumerate(per_expert):  # fill column by column, wrapping over the tokens
        rows = (np.arange(count) + row) % tokens
        routing[torch.from_numpy(rows), expert] = True
        row = (row + count) % tokens
    return routing


def _send_columns(view, routing: torch.Tensor, probs: torch.Tensor) -> None:
    SendColumns(view, torch.device("cpu")).apply(routing, probs)


def _recv_order(view) -> None:
    RowPermutation.recv_order(view, torch.device("cpu"))


def _dispatch_only(view, routing: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> None:
    """The same tensor ops on one token (``routing``, ``probs``) and on chunks of at most one row
    of one column (``rows``): what remains is the per-op dispatch (host) cost, an estimate of the
    host time of the device work on a GPU. The inputs are built once, outside the timing, as the
    layer's own inputs are."""
    device = torch.device("cpu")
    SendColumns(view, device).apply(routing, probs)
    ep, num_experts = view.recv_counts.shape
    chunk_order = (np.arange(ep)[None, :] * num_experts + view.slot_experts[:, None]).ravel()
    receive = RowPermutation(np.minimum(view.recv_counts.ravel(), 1), chunk_order, device)
    receive.apply(rows), receive.apply(rows[:, 0]), receive.undo(rows)  # tokens, probs; expert output


def _stock_sort_inputs(ep: int, local: int) -> tuple[torch.Tensor, ...]:
    """One row per chunk and the chunk orders, as stock's dispatcher holds them across steps
    (``sort_input_by_local_experts``, ``restore_output_by_local_experts``)."""
    by_expert = torch.arange(ep * local).reshape(ep, local).T.ravel()
    by_source = torch.arange(ep * local).reshape(local, ep).T.ravel()
    return torch.ones(ep * local, dtype=torch.long), by_expert, by_source, torch.zeros(ep * local, 1)


def _stock_sorts(sizes: torch.Tensor, by_expert: torch.Tensor, by_source: torch.Tensor, rows: torch.Tensor) -> None:
    """Stock's chunk sorts: received tokens and probabilities by local expert
    (``dispatch_postprocess``), the expert output back (``combine_preprocess``)."""
    sort_chunks_by_idxs(rows, sizes, by_expert, probs=rows[:, 0])
    sort_chunks_by_idxs(rows, sizes, by_source)


def run(ep: int, repeats: int) -> list[dict]:
    shape = GPT_OSS_120B
    expert = ExpertShape(shape.hidden, shape.ffn, gated=True, bias=shape.bias, dtype_bytes=2)
    config = LLEPConfig()  # the library defaults: m = 1024, lambda 1.3, cost-aware
    num_experts = shape.num_experts
    local = num_experts // ep
    rows = []
    for scenario in [s for s in SCENARIOS if s.hot_fraction in (0.0, 0.95)]:
        counts = sample_counts(shape, ep, scenario, seed=7)
        plan_ms = _best_ms(lambda: plan_llep(counts, config, expert), repeats)
        plan = plan_llep(counts, config, expert)
        row = dict(scenario=scenario.label, ep=ep, mode="plain" if plan.is_plain_ep else "llep", plan_ms=plan_ms,
                   view_ms=0.0, send_columns_ms=0.0, recv_order_ms=0.0, dispatch_ms=0.0, columns=0, extra_rows=0,
                   stock_sorts_ms=0.0)
        if not plan.is_plain_ep:
            per_rank = []
            token = torch.ones(1, num_experts, dtype=torch.bool), torch.ones(1, num_experts)
            for rank in range(ep):
                view = plan.rank_view(rank)
                routing = _routing_map(view.send_counts, shape.tokens_per_gpu)
                probs = torch.rand(routing.shape) * routing
                received = int(view.recv_counts.sum())
                chunk_rows = torch.zeros(int(np.count_nonzero(view.recv_counts)), 1)
                per_rank.append((_best_ms(lambda: plan.rank_view(rank), repeats),
                                 _best_ms(lambda: _send_columns(view, routing, probs), repeats),
                                 _best_ms(lambda: _recv_order(view), repeats),
                                 _best_ms(lambda: _dispatch_only(view, *token, chunk_rows), repeats),
                                 int(np.count_nonzero(view.send_counts)),
                                 received if local == 1 else 0))
            for i, key in enumerate(("view_ms", "send_columns_ms", "recv_order_ms", "dispatch_ms", "columns", "extra_rows")):
                row[key] = max(p[i] for p in per_rank)
            if local > 1:  # stock sorts nothing with one expert per rank
                stock = _stock_sort_inputs(ep, local)
                row["stock_sorts_ms"] = _best_ms(lambda: _stock_sorts(*stock), repeats)
        # on a GPU the device work runs as kernels; the host pays the planner and their dispatch
        row["extra_host_ms"] = row["plan_ms"] + row["view_ms"] + row["dispatch_ms"]
        row["net_host_ms"] = row["extra_host_ms"] - row["stock_sorts_ms"]
        row["extra_gather_mb"] = 2 * row["extra_rows"] * expert.token_bytes / 2**20  # forward and backward
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
                       ("view_ms", "rank view ms", ".3f"),
                       ("send_columns_ms", "send columns ms", ".3f"), ("recv_order_ms", "recv order ms", ".3f"),
                       ("dispatch_ms", "of them dispatch ms", ".3f"), ("columns", "columns", "d"),
                       ("extra_host_ms", "extra host ms", ".3f"), ("stock_sorts_ms", "stock sorts ms", ".3f"),
                       ("net_host_ms", "net host ms", ".3f"), ("extra_rows", "extra rows", "d"),
                       ("extra_gather_mb", "extra gather MB", ".1f")])
    write_results(args.out, "host_overhead", rows,
                  dict(shape=GPT_OSS_120B.name, tokens_per_gpu=GPT_OSS_120B.tokens_per_gpu, ep=args.ep,
                       repeats=args.repeats, timing="best of repeats, slowest rank, 1 thread",
                       stock_sorts="Megatron's unfused sort_chunks_by_idxs, dispatch only"))


if __name__ == "__main__":
    main()
