"""Perplexity of a Megatron-Core GPT MoE model (LLEP or plain EP) over a JSONL file or a Megatron
indexed dataset, on every rank of a torchrun job.

CPU smoke run (tiny gpt-oss at random weights, the shipped data, 2 gloo ranks, LLEP spilling)::

    python launch/torchrun.py --nproc_per_node 2 recipes/evaluate.py --random-init --force-routing 0.9:1

A fine-tuned model on held-out data, or a Megatron-LM model on an indexed dataset::

    python launch/torchrun.py --nproc_per_node 2 recipes/evaluate.py --load ckpt --data valid.jsonl --output result.json
    python launch/torchrun.py --nproc_per_node 2 recipes/evaluate.py --pretrained pretrain_ckpt \\
        --data ~/.cache/megatron_llep/corpus/indexed/legal_valid_text_document --seq-length 256

The data is packed into ``--seq-length`` windows as finetune.py packs ``--valid-data`` (a fixed
order), sharded over the data-parallel ranks in Megatron's sampler order and run through Megatron's
forward-only schedule (pipeline stages included). The loss is the exact token-weighted mean over
every window evaluated: the last global batch is filled with windows that carry no loss. JSONL
records count their loss tokens as in fine-tuning (``text``: every token; ``prompt``/``response``:
the response; ``messages``: the assistant turns); indexed datasets count every token.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings

quiet_known_cpu_warnings()  # before the first Megatron-Core import, which warns at import time

from recipes.runtime import finetuning, model_building, model_sources  # noqa: E402
from recipes.runtime.entry_point import EntryPoint  # noqa: E402
from recipes.runtime.evaluation import build_parser, check_arguments, prepare  # noqa: E402

ENTRY = EntryPoint("evaluate")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser(__doc__, "evaluate")
    return check_arguments(parser, parser.parse_args(argv))


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the evaluation; returns the result (the JSON written by ``--output``) on every rank."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from recipes.runtime import dashboard, watchdog

    started = time.perf_counter()
    run = prepare(args, ENTRY)
    rank, world, device, source, recipe, model, layout = (run.rank, run.world, run.device, run.source, run.recipe,
                                                          run.model, run.layout)
    count, batches, global_batch = run.count, run.batches, layout["global_batch"]
    recorder = model_building.start_routing_trace(model, args, rank)
    load_meter = dashboard.MoELoadMeter(model)
    ENTRY.say(f"{recipe.name} on {world} {device.type} ranks: TP={layout['tp']} PP={layout['pp']} EP={layout['ep']} "
              f"DP={layout['dp']}, {'LLEP' if args.llep else 'plain EP'}; evaluating {count} of the "
              f"{run.dataset.num_windows} windows of {args.seq_length} tokens in {run.described}: {batches} global batch(es) "
              f"of {args.micro_batch_size} x DP {layout['dp']}")
    if args.force_routing:
        ENTRY.say(f"forcing routing: {args.force_routing[0]:.0%} of tokens into {args.force_routing[1]} hot expert(s)")

    watchdog.progress("evaluating")
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss, loss_tokens, moe_metrics = finetuning.evaluate(model, get_forward_backward_func(), run.step, run.step_state,
                                                         run.windows, batches, args, layout, source.iteration, load_meter)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # the loss lives on the last pipeline stage: every rank reports the last rank's
    shared = [(loss, loss_tokens)]
    dist.broadcast_object_list(shared, src=world - 1)
    loss, loss_tokens = shared[0]
    processed = batches * global_batch * args.seq_length
    ppl = float(torch.tensor(loss, dtype=torch.float64).exp())  # inf, not an error, past e^709
    result = dict(
        loss=loss, ppl=ppl, loss_tokens=loss_tokens, sequences=count, seq_length=args.seq_length,
        tokens_processed=processed, seconds=seconds, prefill_tokens_per_sec=processed / seconds,
        model=source.describe(args), recipe=recipe.name, data=args.data, llep=args.llep,
        force_routing=args.force_routing, layout=layout, moe=moe_metrics,
        pruning=model_building.pruning_result(args),
    )
    ENTRY.say(f"loss {loss:.6f} | ppl {ppl:.3f} | {loss_tokens:,} loss tokens in {count} sequence(s) of "
              f"{args.seq_length} | {processed / seconds:,.0f} prefill tokens/s ({seconds:.2f} s) | "
              f"{model_building.moe_summary(args, moe_metrics)}")
    metrics = {"eval/loss": loss, "eval/ppl": ppl, "eval/tokens": loss_tokens,
               "throughput/prefill_tokens_per_sec": processed / seconds, **moe_metrics}
    model_sources.publish(args, ENTRY, rank, layout["ep"], recorder, source, recipe.name, metrics,
                          json.dumps(result, indent=1) + "\n", started)
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    with ENTRY.ending_cleanly():  # a rank that died: one line, not gloo's traceback
        evaluate(args)


if __name__ == "__main__":
    main()
