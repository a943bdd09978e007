"""What the evaluation entry points share (recipes/evaluate.py, recipes/cap_pipeline.py): their flags
and checks, the data read and packed into windows (JSONL or a Megatron indexed dataset) and the
model prepared for Megatron's forward-only schedule."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import numpy as np
import torch

from recipes.runtime import finetuning, model_building, model_sources, sft_data
from recipes.runtime.entry_point import EntryPoint, RankZeroArgumentParser, check_existing_files
from recipes.runtime.model_sources import ModelSource

POSITIVE = ("seq_length", "micro_batch_size", "eval_iters", "max_tokens")


def build_parser(description: str, entry_name: str) -> argparse.ArgumentParser:
    """evaluate.py's flags (data, model source, layout, LLEP, output); cap_pipeline.py adds its own."""
    parser = RankZeroArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--data", default=sft_data.DEFAULT_DATA, metavar="PATH",
                      help="a JSONL file (the formats of recipes/runtime/sft_data.py: text, prompt/response, messages) or a "
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
    from recipes.runtime import pretrain_checks

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
    return sft_data.PackedSFTDataset(samples, seq_length, seed=finetuning.VALID_PACKING_SEED)


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
    step = partial(finetuning.forward_step, device, model_building.moe_layers(model), args, recipe.config, step_state)
    return Evaluation(rank, world, device, source, recipe, model, layout, described, dataset, count, batches,
                      step_state, step)
