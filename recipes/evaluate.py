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
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402

quiet_known_cpu_warnings()  # before the first Megatron-Core import, which warns at import time

from recipes import data as sft_data  # noqa: E402
from recipes import finetune, model_building, model_sources  # noqa: E402
from recipes.entry_point import EntryPoint, RankZeroArgumentParser, check_existing_files  # noqa: E402
from recipes.model_sources import ModelSource  # noqa: E402

ENTRY = EntryPoint("evaluate")
POSITIVE = ("seq_length", "micro_batch_size", "eval_iters", "max_tokens")


def build_parser(description: str = __doc__, entry_name: str = "evaluate") -> argparse.ArgumentParser:
    """evaluate.py's flags (data, model source, layout, LLEP, output); cap_pipeline.py adds its own."""
    parser = RankZeroArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--data", default=sft_data.DEFAULT_DATA, metavar="PATH",
                      help="a JSONL file (the formats of recipes/data.py: text, prompt/response, messages) or a "
                           "Megatron indexed dataset prefix (PATH.bin + PATH.idx, e.g. recipes/corpus.py's "
                           "indexed/legal_valid_text_document); default: the shipped tiny SFT data")
    data.add_argument("--seq-length", type=int, default=64)
    data.add_argument("--micro-batch-size", type=int, default=2, help="sequences per forward and data-parallel rank")
    data.add_argument("--eval-iters", type=int, default=None,
                      help="evaluate at most this many global batches (micro batch x DP sequences); default: all data")
    data.add_argument("--max-tokens", type=int, default=None,
                      help="evaluate at most this many tokens (whole --seq-length windows); default: all data")
    model_sources.add_arguments(parser, entry_name, "write the result (loss, ppl, tokens, tokens/s, LLEP statistics) "
                                                    "to this JSON file")
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    placement_uses_cost: bool = False) -> argparse.Namespace:
    """Usage errors of :func:`build_parser`'s flags; sets ``args.data_format``."""
    model_sources.check_arguments(parser, args, POSITIVE, placement_uses_cost=placement_uses_cost)
    if args.max_tokens is not None and args.max_tokens < args.seq_length:
        parser.error(f"--max-tokens {args.max_tokens} is less than one window of --seq-length {args.seq_length}")
    args.data_format = _data_format(parser, args.data)
    return args


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    return check_arguments(parser, parser.parse_args(argv))


def _data_format(parser: argparse.ArgumentParser, path: str) -> str:
    """``"indexed"`` for a Megatron indexed dataset prefix, ``"jsonl"`` for a file (usage error else)."""
    if os.path.isfile(f"{path}.bin") and os.path.isfile(f"{path}.idx"):
        return "indexed"
    if path.endswith((".bin", ".idx")) and os.path.isfile(path):
        parser.error(f"--data: {path} is one file of an indexed dataset; give its prefix {path[:-4]}")
    if not os.path.exists(path):
        parser.error(f"--data: {path} does not exist (neither a JSONL file nor an indexed dataset prefix with "
                     f"{path}.bin and {path}.idx)")
    check_existing_files(parser, [(path, "--data")])
    return "jsonl"


def read_indexed_documents(prefix: str, max_tokens: Optional[int] = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The documents of a Megatron indexed dataset in file order (each already ends with its
    end-of-document id), every token with loss; reading stops once ``max_tokens`` are in."""
    from recipes import pretrain_checks

    try:  # a .bin or .idx cut short is named here, as pretrain_gpt.py names it
        dataset = pretrain_checks.open_indexed_dataset(prefix)
    except (ValueError, OSError) as err:
        raise sft_data.DataError(f"--data {prefix}: {str(err).removeprefix(f'data prefix {prefix}: ')}") from None
    documents, tokens = [], 0
    for index in range(len(dataset)):
        ids = np.asarray(dataset[index], dtype=np.int64)
        documents.append((ids, np.ones(ids.size, dtype=bool)))
        tokens += ids.size
        if max_tokens is not None and tokens >= max_tokens:
            break
    if not documents:
        raise sft_data.DataError(f"--data {prefix}: the indexed dataset holds no documents")
    return documents


class EvaluatedWindows:
    """The first ``count`` windows of ``dataset``; the windows after them (filling the last global
    batch, so that every rank runs the same forwards) carry no loss, so each window counts once."""

    def __init__(self, dataset: sft_data.PackedSFTDataset, count: int) -> None:
        self.dataset, self.count = dataset, count

    def window(self, index: int) -> dict[str, np.ndarray]:
        row = self.dataset.window(index)
        return row if index < self.count else dict(row, loss_mask=np.zeros_like(row["loss_mask"]))


def windows_wanted(args: argparse.Namespace, global_batch: int) -> Optional[int]:
    """The windows ``--eval-iters`` and ``--max-tokens`` allow (None: no limit)."""
    limits = [args.eval_iters * global_batch] if args.eval_iters else []
    if args.max_tokens:
        limits.append(args.max_tokens // args.seq_length)
    return min(limits) if limits else None


def pack_windows(samples: list[tuple[np.ndarray, np.ndarray]], seq_length: int) -> sft_data.PackedSFTDataset:
    """``samples`` packed into windows as finetune.py packs ``--valid-data`` (a fixed order)."""
    return sft_data.PackedSFTDataset(samples, seq_length, seed=finetune.VALID_PACKING_SEED)


def window_count(dataset: sft_data.PackedSFTDataset, wanted: Optional[int], global_batch: int) -> tuple[int, int]:
    """How many windows are evaluated (all, or at most ``wanted``) and the global batches they take."""
    count = min(dataset.num_windows, wanted or dataset.num_windows)
    return count, math.ceil(count / global_batch)


def read_data(args: argparse.Namespace, world: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], int, str]:
    """The samples of ``--data``, the ids the model must know (vocabulary size needed) and what was read."""
    if args.data_format == "jsonl":
        tokenizer = sft_data.load_tokenizer(args.tokenizer)
        samples = sft_data.read_sft_jsonl(args.data, tokenizer)
        return samples, tokenizer.vocab_size, f"{args.data} (tokenizer {args.tokenizer})"
    data_parallel = max(1, world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size))
    wanted = windows_wanted(args, args.micro_batch_size * data_parallel)
    samples = read_indexed_documents(args.data, None if wanted is None else wanted * args.seq_length + 1)
    return samples, 1 + max(int(ids.max()) for ids, _ in samples), f"the indexed dataset {args.data}"


@dataclass
class Evaluation:
    """A started rank with its model and the windows of ``--data`` it evaluates: what evaluate.py and
    cap_pipeline.py (which traces routing over the same windows) both begin with."""

    rank: int
    world: int
    device: torch.device
    source: ModelSource
    recipe: Any
    model: torch.nn.Module
    layout: dict[str, int]
    described: str
    dataset: sft_data.PackedSFTDataset
    count: int
    batches: int
    step_state: dict[str, int]
    step: Callable

    @property
    def windows(self) -> EvaluatedWindows:
        return EvaluatedWindows(self.dataset, self.count)


def prepare(args: argparse.Namespace, entry: EntryPoint) -> Evaluation:
    """Start the rank, open the model source, read and pack ``--data``, build the model; a bad file
    or source ends the run in one line (``entry.fail``)."""
    rank, world, device = entry.start(args.watchdog_timeout)
    source = model_sources.open_source(args, entry, rank)
    entry.progress(rank, f"reading {args.data}")
    try:
        samples, vocab_needed, described = read_data(args, world)
    except sft_data.DataError as err:  # names the file (and line)
        entry.fail(err, rank)
    try:
        dataset = pack_windows(samples, args.seq_length)
    except sft_data.DataError as err:  # too short for one window
        entry.fail(sft_data.DataError(f"--data {args.data}: {err}"), rank)
    recipe, model, layout = model_sources.build(args, source, entry, rank, world, device, vocab_needed)
    count, batches = window_count(dataset, windows_wanted(args, layout["global_batch"]), layout["global_batch"])
    step_state = {"microbatch": 0}  # forced routing: seeds by micro-batch, as finetune.py's validation
    step = partial(finetune.forward_step, device, model_building.moe_layers(model), args, recipe.config, step_state)
    return Evaluation(rank, world, device, source, recipe, model, layout, described, dataset, count, batches,
                      step_state, step)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the evaluation; returns the result (the JSON written by ``--output``) on every rank."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from recipes import dashboard, watchdog

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
    loss, loss_tokens, moe_metrics = finetune.evaluate(model, get_forward_backward_func(), run.step, run.step_state,
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
