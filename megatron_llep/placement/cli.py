"""Command line: routing traces -> expert placement file (and synthetic traces for trying it).

    python -m megatron_llep.placement plan trace_rank*.npz --ep-size 8 [--gpus-per-node 8]
        [--cross-node-cost 5] [--lambda 0.5 | --profile my.module:score] [--spectrum-steps N]
        [--routing-groups G] --out placement.json
    python -m megatron_llep.placement synthetic trace.npz --experts 64 --topk 4 --tokens 16384
        --clusters 8 --affinity 0.8 [--skew 0.8] [--layers 1 2]

``--profile module:function`` imports ``function(layer: int, point: SpectrumPoint) -> float``
(lower is better, e.g. a measured step time) and selects by it instead of lambda. Timing the live
model (``--profile auto``) needs the model, which this command does not have: the model entry
point ``recipes/cap_pipeline.py`` offers it.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import zipfile
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_llep.writable import OutputError, file_problem
from megatron_llep.placement.cap import SpectrumPoint, plan_trace
from megatron_llep.placement.metrics import Topology
from megatron_llep.placement.placement import experts_per_rank
from megatron_llep.placement.trace import RoutingTrace, load_traces, merge_traces, synthetic_trace

_SUMMARY_COLUMNS = (
    ("layer", "layer", "d"), ("tokens", "tokens", "d"), ("comm_cost_sequential", "C seq", ".1f"),
    ("comm_cost_optimal", "C opt", ".1f"), ("comm_cost", "C chosen", ".1f"),
    ("imbalance_sequential", "B seq", ".3f"), ("imbalance_optimal", "B opt", ".3f"), ("imbalance", "B chosen", ".3f"),
    ("devices_per_token_sequential", "dev/tok seq", ".2f"), ("devices_per_token", "dev/tok chosen", ".2f"),
    ("spectrum_step", "step", "d"), ("spectrum_points", "points", "d"),
)


def _integer(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _number(low: float, high: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high):
            bounds = f"within [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text}")
        return value

    return parse


def _input_problem(path: str) -> Optional[str]:
    if not os.path.exists(path):
        return f"{path}: no such file"
    if os.path.isdir(path):
        return f"{path} is a directory; give the trace files (e.g. DIR/trace_rank*.npz)"
    if not path.endswith(".jsonl") and not zipfile.is_zipfile(path):
        return f"{path}: not a routing trace file (not an .npz archive: truncated, or another format)"
    return None


def _load_trace_files(paths: Sequence[str], num_experts: Optional[int]) -> RoutingTrace:
    """The merged traces; a file that cannot be read is named in the error."""
    traces = []
    for path in paths:
        try:
            traces.append(load_traces([path], num_experts))
        except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as err:
            message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
            raise ValueError(message if message.startswith(path) else f"{path}: {message}") from None
    return merge_traces(traces)


def _load_profile(spec: str) -> Callable[[int, SpectrumPoint], float]:
    if spec == "auto":
        raise ValueError("--profile auto times the live model, which this command does not have: run it through "
                         "recipes/cap_pipeline.py, or give --profile module:function here")
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
    profile = _load_profile(args.profile) if args.profile else None  # a bad --profile fails before the traces load
    trace = _load_trace_files(args.traces, args.num_experts)
    if args.layers:
        trace = RoutingTrace(trace.num_experts, trace.topk, {n: trace.layer(n) for n in args.layers},
                             trace.max_tokens_per_layer, trace.sampling, trace.sources)
    experts_per_rank(trace.num_experts, args.ep_size)
    topology = Topology(args.ep_size, args.gpus_per_node, args.cross_node_cost)
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
    placement.save(args.out, "--out")
    print()
    print(_table([{"layer": int(n), **s} for n, s in placement.metadata["layers"].items()]))
    print(f"\nwrote {args.out}")


def _synthetic(args: argparse.Namespace) -> None:
    trace, _ = synthetic_trace(args.tokens, args.experts, args.topk, args.clusters, args.affinity, args.skew,
                               args.layers, args.seed)
    trace.save(args.out, "--out")
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
    plan.add_argument("--num-experts", type=_integer(1), default=None,
                      help="experts per MoE layer (needed for Megatron .jsonl router traces, which do not record it)")
    plan.add_argument("--ep-size", type=_integer(1), required=True, help="expert-parallel size P")
    plan.add_argument("--gpus-per-node", type=_integer(1), default=None, help="EP ranks per node (default: one node)")
    plan.add_argument("--cross-node-cost", type=_number(1.0), default=5.0, help="distance c between nodes (1 inside a node)")
    select = plan.add_mutually_exclusive_group()
    select.add_argument("--lambda", dest="lam", type=_number(0.0, 1.0), default=0.5,
                        help="weight of normalised C against normalised B (1: comm-optimal, 0: most balanced)")
    select.add_argument("--profile", default=None,
                        help="module:function scoring (layer, SpectrumPoint); lowest wins ('auto', timing the live model, "
                             "is offered by the model entry point recipes/cap_pipeline.py)")
    plan.add_argument("--spectrum-steps", type=_integer(0), default=None, help="max swap steps (default 2 x movable units)")
    plan.add_argument("--max-evaluations", type=_integer(1), default=None, help="points scored by --profile (default all)")
    plan.add_argument("--routing-groups", type=_integer(1), default=1, help="moe_router_num_groups of the model (group-limited routing)")
    plan.add_argument("--layers", type=_integer(1), nargs="+", default=None, help="only these MoE layer numbers")
    plan.add_argument("--out", "-o", required=True, help="placement JSON to write")
    plan.set_defaults(run=_plan)
    synth = sub.add_parser("synthetic", help="write a synthetic trace with planted co-activation clusters")
    synth.add_argument("out")
    synth.add_argument("--experts", type=_integer(1), required=True)
    synth.add_argument("--topk", type=_integer(1), required=True)
    synth.add_argument("--tokens", type=_integer(1), default=16384)
    synth.add_argument("--clusters", type=_integer(1), required=True)
    synth.add_argument("--affinity", type=_number(0.0, 1.0), default=0.8, help="q: chance a pick lies in the token's cluster")
    synth.add_argument("--skew", type=_number(0.0), default=0.0, help="load skew (popularity exponent)")
    synth.add_argument("--layers", type=_integer(1), nargs="+", default=[1])
    synth.add_argument("--seed", type=_integer(0), default=0)
    synth.set_defaults(run=_synthetic)
    return parser


def _check_files_and_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors argparse's types cannot see (several flags together, files), before any work."""
    if args.command == "synthetic":
        if args.topk > args.experts:
            parser.error(f"--topk {args.topk} exceeds --experts {args.experts}")
        if args.experts % args.clusters:
            parser.error(f"--clusters {args.clusters} must divide --experts {args.experts}")
    else:
        for path in args.traces:
            problem = _input_problem(path)
            if problem:
                parser.error(problem)
        if args.num_experts is not None and args.ep_size > args.num_experts:
            parser.error(f"--ep-size {args.ep_size} exceeds --num-experts {args.num_experts}")
    problem = file_problem(args.out)
    if problem:
        parser.error(f"{'--out' if args.command == 'plan' else 'out'}: {problem}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_files_and_sizes(parser, args)
    try:
        args.run(args)
    except (ValueError, KeyError, OSError, ImportError, AttributeError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        sys.exit(1 if isinstance(err, OutputError) else 2)  # a write that failed (full disk) is no usage error
