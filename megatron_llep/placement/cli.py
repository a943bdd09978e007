"""Command line: routing traces -> expert placement file (and synthetic traces for trying it).

    python -m megatron_llep.placement plan trace_rank*.npz --ep-size 8 [--gpus-per-node 8]
        [--cross-node-cost 5] [--lambda 0.5 | --profile my.module:score] [--spectrum-steps N]
        [--routing-groups G] --out placement.json
    python -m megatron_llep.placement synthetic trace.npz --experts 64 --topk 4 --tokens 16384
        --clusters 8 --affinity 0.8 [--skew 0.8] [--layers 1 2]

``--profile module:function`` imports ``function(layer: int, point: SpectrumPoint) -> float``
(lower is better, e.g. a measured step time) and selects by it instead of lambda.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_llep.placement.cap import SpectrumPoint, plan_trace
from megatron_llep.placement.metrics import Topology
from megatron_llep.placement.placement import experts_per_rank
from megatron_llep.placement.trace import RoutingTrace, load_traces, synthetic_trace

_SUMMARY_COLUMNS = (
    ("layer", "layer", "d"), ("tokens", "tokens", "d"), ("comm_cost_sequential", "C seq", ".1f"),
    ("comm_cost_optimal", "C opt", ".1f"), ("comm_cost", "C chosen", ".1f"),
    ("imbalance_sequential", "B seq", ".3f"), ("imbalance_optimal", "B opt", ".3f"), ("imbalance", "B chosen", ".3f"),
    ("devices_per_token_sequential", "dev/tok seq", ".2f"), ("devices_per_token", "dev/tok chosen", ".2f"),
    ("spectrum_step", "step", "d"), ("spectrum_points", "points", "d"),
)


def _load_profile(spec: str) -> Callable[[int, SpectrumPoint], float]:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--profile must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def _table(rows: list[dict]) -> str:
    cells = [[format(r[key], fmt) for key, _, fmt in _SUMMARY_COLUMNS] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(_SUMMARY_COLUMNS)]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(_SUMMARY_COLUMNS, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(c, widths)) for c in cells]
    return "\n".join(lines)


def _plan(args: argparse.Namespace) -> None:
    trace = load_traces(args.traces, args.num_experts)
    if args.layers:
        trace = RoutingTrace(trace.num_experts, trace.topk, {n: trace.layer(n) for n in args.layers},
                             trace.max_tokens_per_layer, trace.sampling, trace.sources)
    experts_per_rank(trace.num_experts, args.ep_size)
    topology = Topology(args.ep_size, args.gpus_per_node, args.cross_node_cost)
    profile = _load_profile(args.profile) if args.profile else None
    print(f"{len(args.traces)} trace file(s): {trace.num_experts} experts, top-{trace.topk}, "
          f"{len(trace.layers)} layer(s); EP {topology.ep_size}, {topology.num_nodes} node(s), c = {topology.cross_node_cost:g}")
    done: list[int] = []

    def progress(number: int, summary: dict) -> None:
        done.append(number)
        print(f"[{len(done)}/{len(trace.layers)}] layer {number}: {summary['tokens']} tokens, "
              f"{summary['spectrum_points']} spectrum points, chose step {summary['spectrum_step']} "
              f"({summary['selection']}) in {summary['seconds']:.2f} s", flush=True)

    placement, _ = plan_trace(trace, topology, args.lam, profile, args.spectrum_steps, args.routing_groups,
                              args.max_evaluations, on_layer=progress)
    placement.metadata["traces"] = list(args.traces)
    placement.save(args.out)
    print()
    print(_table([{"layer": int(n), **s} for n, s in placement.metadata["layers"].items()]))
    print(f"\nwrote {args.out}")


def _synthetic(args: argparse.Namespace) -> None:
    trace, _ = synthetic_trace(args.tokens, args.experts, args.topk, args.clusters, args.affinity, args.skew,
                               args.layers, args.seed)
    trace.save(args.out)
    loads = np.stack([layer.expert_counts for layer in trace.layers.values()])
    print(f"wrote {args.out}: {len(trace.layers)} layer(s) x {args.tokens} tokens, {args.experts} experts top-{args.topk}, "
          f"hottest expert {loads.max() / loads.mean():.2f}x the mean load")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_llep.placement", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="routing trace file(s) -> placement JSON")
    plan.add_argument("traces", nargs="+",
                      help=".npz trace files (e.g. one per rank), or Megatron-Core 0.19 router-trace .jsonl files; merged")
    plan.add_argument("--num-experts", type=int, default=None,
                      help="experts per MoE layer (needed for Megatron .jsonl router traces, which do not record it)")
    plan.add_argument("--ep-size", type=int, required=True, help="expert-parallel size P")
    plan.add_argument("--gpus-per-node", type=int, default=None, help="EP ranks per node (default: one node)")
    plan.add_argument("--cross-node-cost", type=float, default=5.0, help="distance c between nodes (1 inside a node)")
    select = plan.add_mutually_exclusive_group()
    select.add_argument("--lambda", dest="lam", type=float, default=0.5,
                        help="weight of normalised C against normalised B (1: comm-optimal, 0: most balanced)")
    select.add_argument("--profile", default=None, help="module:function scoring (layer, SpectrumPoint); lowest wins")
    plan.add_argument("--spectrum-steps", type=int, default=None, help="max swap steps (default 2 x movable units)")
    plan.add_argument("--max-evaluations", type=int, default=None, help="points scored by --profile (default all)")
    plan.add_argument("--routing-groups", type=int, default=1, help="moe_router_num_groups of the model (group-limited routing)")
    plan.add_argument("--layers", type=int, nargs="+", default=None, help="only these MoE layer numbers")
    plan.add_argument("--out", "-o", required=True, help="placement JSON to write")
    plan.set_defaults(run=_plan)
    synth = sub.add_parser("synthetic", help="write a synthetic trace with planted co-activation clusters")
    synth.add_argument("out")
    synth.add_argument("--experts", type=int, required=True)
    synth.add_argument("--topk", type=int, required=True)
    synth.add_argument("--tokens", type=int, default=16384)
    synth.add_argument("--clusters", type=int, required=True)
    synth.add_argument("--affinity", type=float, default=0.8, help="q: chance a pick lies in the token's cluster")
    synth.add_argument("--skew", type=float, default=0.0, help="load skew (popularity exponent)")
    synth.add_argument("--layers", type=int, nargs="+", default=[1])
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(run=_synthetic)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, KeyError, OSError, ImportError, AttributeError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
