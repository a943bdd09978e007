"""CAP's pipeline as one command: routing traces of the model on your data (with the routing pruning
you will serve with), the co-activation placement and its spectrum, and the spectrum point picked by
timing the live model on this machine (``--profile auto``) or by ``--lambda``; writes the placement
file evaluate.py, generate.py and finetune.py take with ``--llep-placement``.

    python launch/torchrun.py --nproc_per_node 8 recipes/cap_pipeline.py --load ckpt --data calib.jsonl \\
        --prune-p 0.2 --llep-ranks-per-node 4 --cross-node-cost 4 --profile auto --out placement.json

1. Traces: evaluate.py's forward over ``--data`` (``--eval-iters`` / ``--max-tokens``; exact loss
   printed too), every MoE router's choices recorded after pruning, every rank's merged.
2. Placement: :func:`megatron_llep.placement.plan_trace` per layer: the comm-optimal placement and
   its spectrum towards balance, for ``--llep-ranks-per-node`` GPUs per node and ``--cross-node-cost``.
3. Choice: ``--profile auto`` applies ``--candidates`` positions along every layer's spectrum to the
   live model in turn, times ``--profile-batches`` forward batches each (warm-up first; slowest
   rank, median of ``--profile-repeats``), restores the original order and keeps the fastest,
   printing the table it chose from; ``--lambda`` picks by the C/B trade-off instead (no timing).

The model's experts must be in their original order: a checkpoint saved in a placement is put back
first. ``--llep-placement`` is refused (this command makes one).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402

quiet_known_cpu_warnings()  # before the first Megatron-Core import, which warns at import time

from recipes.runtime import evaluation, model_building  # noqa: E402
from recipes.runtime.entry_point import EntryPoint, check_writable_directories, check_writable_files  # noqa: E402

ENTRY = EntryPoint("cap_pipeline")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = evaluation.build_parser(__doc__, "cap_pipeline")
    cap = parser.add_argument_group("CAP pipeline")
    cap.add_argument("--out", required=True, metavar="FILE", help="the placement file to write")
    select = cap.add_mutually_exclusive_group()
    select.add_argument("--profile", choices=["auto"], default=None,
                        help="auto: time the live model at points of the spectrum and keep the fastest")
    select.add_argument("--lambda", dest="lam", type=float, default=None,
                        help="pick by lambda * C + (1 - lambda) * B instead, without timing (default 0.5)")
    cap.add_argument("--candidates", type=int, default=5, help="--profile auto: positions timed (both ends included)")
    cap.add_argument("--profile-batches", type=int, default=2, help="--profile auto: forward batches per timing")
    cap.add_argument("--profile-repeats", type=int, default=3, help="--profile auto: timings per position (median)")
    cap.add_argument("--spectrum-steps", type=int, default=None, help="max swap steps of a spectrum (default: "
                                                                       "2 x movable units)")
    cap.add_argument("--keep-traces", default=None, metavar="DIR",
                     help="also write the recorded traces here (trace_rank<r>.npz)")
    args = evaluation.check_arguments(parser, parser.parse_args(argv), placement_uses_cost=True)
    if args.llep_placement:
        parser.error("--llep-placement: this command makes the placement (it writes --out); drop --llep-placement")
    if args.record_routing_trace:
        parser.error("--record-routing-trace: this command records the traces itself; keep them with --keep-traces")
    for name, low in (("candidates", 2), ("profile_batches", 1), ("profile_repeats", 1), ("spectrum_steps", 0)):
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if args.lam is not None and not 0.0 <= args.lam <= 1.0:
        parser.error(f"--lambda must be within [0, 1], got {args.lam}")
    check_writable_files(parser, [(args.out, "--out")])
    check_writable_directories(parser, [(args.keep_traces, "--keep-traces")])
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline; returns a summary (placement file, selection, the profile rows) on every rank."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_llep import RoutingPruning
    from megatron_llep.runtime.state import STATS
    from megatron_llep.integrations.routing_traces import RoutingTraceRecorder
    from megatron_llep.integrations.placement import profile_spectrum, restore_original_order
    from megatron_llep.placement import Topology, merge_traces, plan_trace, read_checkpoint_placement
    from recipes.runtime import dashboard, finetuning, sft_data, watchdog

    started = time.perf_counter()
    run = evaluation.prepare(args, ENTRY)
    rank, world, source, recipe, model, layout = run.rank, run.world, run.source, run.recipe, run.model, run.layout
    saved = read_checkpoint_placement(source.checkpoint) if source.checkpoint else None
    if saved is not None:  # traces and the new placement are in the experts' original ids
        restore_original_order(model, saved)
        ENTRY.say(f"put the experts of {source.checkpoint} back in their original order (it was saved in a CAP placement)")
    if layout["ep"] < 2:
        ENTRY.fail(model_building.ConfigError(f"EP = {layout['ep']}: a placement needs 2+ expert-parallel ranks "
                                              "(run on more ranks or set --expert-model-parallel-size)"), rank)
    global_batch, count, batches, windows, step = layout["global_batch"], run.count, run.batches, run.windows, run.step
    layers = model_building.moe_layers(model)
    pruning = layers[0].llep_config.pruning if layers and hasattr(layers[0], "llep_config") else None
    forward_backward = get_forward_backward_func()

    # 1. routing traces, as the model will be served (pruning included)
    ENTRY.progress(rank, f"step 1/3: recording routing traces over {count} windows of {args.seq_length} tokens in "
                         f"{run.described}{'' if pruning is None else f', routing pruning p = {pruning.p:g} ({pruning.method})'}")
    recorder = RoutingTraceRecorder(model, max_tokens_per_layer=args.trace_tokens_per_layer, seed=args.seed + rank).start()
    load_meter = dashboard.MoELoadMeter(model)
    loss, _, moe_metrics = finetuning.evaluate(model, forward_backward, step, run.step_state, windows, batches, args, layout,
                                             source.iteration, load_meter)
    recorder.stop()
    local = recorder.trace()
    if args.keep_traces:  # a write failing on any rank ends the run in one line, the previous files untouched
        kept = os.path.join(args.keep_traces, f"trace_rank{rank}.npz")
        ENTRY.write_or_fail(lambda: local.save(kept, "--keep-traces"), rank)
    traces: list = [None] * world
    dist.all_gather_object(traces, local)
    trace = merge_traces(traces)
    shared = [loss]
    dist.broadcast_object_list(shared, src=world - 1)
    pruned = dashboard.pruning_summary(moe_metrics, pruning, args.llep_ranks_per_node) or "no routing pruning"
    ENTRY.say(f"traced {len(trace.layers)} MoE layer(s), {count * args.seq_length:,} tokens (loss {shared[0]:.4f}); {pruned}")

    # 2. co-activation placement and its spectrum (rank 0 plans, every rank gets the same result)
    cost = args.cross_node_cost if args.cross_node_cost is not None else RoutingPruning.cross_node_cost
    topology = Topology(layout["ep"], args.llep_ranks_per_node or layout["ep"], cost)
    ENTRY.progress(rank, f"step 2/3: CAP placement and spectrum for EP {topology.ep_size}, {topology.num_nodes} node(s), "
                         f"c = {topology.cross_node_cost:g}")
    planned = [None]
    if rank == 0:
        planned[0] = plan_trace(trace, topology, lam=0.5 if args.lam is None else args.lam,
                                max_steps=args.spectrum_steps, routing_groups=recipe.config.moe_router_num_groups or 1)
    dist.broadcast_object_list(planned, src=0)
    placement, results = planned[0]

    # 3. the spectrum point: timed on this machine, or by lambda
    report = None
    if args.profile == "auto":
        tokens = min(args.profile_batches, batches) * global_batch * args.seq_length
        ENTRY.progress(rank, f"step 3/3: timing up to {args.candidates} points of the spectrum, {tokens:,} tokens per "
                             f"forward, {args.profile_repeats} repeat(s) each")

        def run_forward() -> None:
            iterator = sft_data.micro_batches(windows, 0, args.micro_batch_size,
                                              parallel_state.get_data_parallel_rank(), layout["dp"])
            model.eval()
            with torch.no_grad(), STATS.set_aside():
                for _ in range(min(args.profile_batches, batches)):
                    watchdog.progress("profiling the spectrum")
                    forward_backward(forward_step_func=step, data_iterator=iterator, model=[model],
                                     num_microbatches=layout["num_microbatches"], seq_length=args.seq_length,
                                     micro_batch_size=args.micro_batch_size, forward_only=True)

        report = profile_spectrum(model, results, run_forward, candidates=args.candidates,
                                  repeats=args.profile_repeats, tokens=tokens, trace=trace)
        placement = report.placement
        ENTRY.say(f"the spectrum points timed (position 0: comm-optimal, 1: most balanced):\n{report.table()}")
        ENTRY.say(f"chose position {report.chosen_row.position:g}: {report.chosen_row.seconds * 1e3:,.1f} ms per forward")
    else:
        ENTRY.say(f"step 3/3: chose by lambda = {0.5 if args.lam is None else args.lam:g} (no timing; --profile auto "
                  "times the spectrum on this machine)")
    ENTRY.write_or_fail(lambda: rank == 0 and placement.save(args.out, "--out"), rank)
    ENTRY.say(f"wrote {args.out} in {time.perf_counter() - started:.1f} s; serve with it: recipes/evaluate.py or "
              f"recipes/generate.py ... --llep-placement {args.out}")
    summary = dict(out=args.out, selection="profile auto" if report else "lambda",
                   profile=[row.__dict__ for row in report.rows] if report else None)
    ENTRY.finish()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    with ENTRY.ending_cleanly():  # a rank that died: one line, not gloo's traceback
        run(args)


if __name__ == "__main__":
    main()
