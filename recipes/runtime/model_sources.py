"""The model evaluate.py and generate.py run, from exactly one source:

* ``--load DIR``: a fine-tuning checkpoint (``recipes/finetune.py --save DIR`` or ``python -m
  recipes.hf import``; the save directory or one ``iter_*`` directory). The model is rebuilt from
  what the run recorded (recipe, Hugging Face config.json or Megatron-LM arguments) and only its
  weights are loaded, at any TP/PP/EP layout (dist_checkpointing reshards). Its experts stay in the
  CAP placement the checkpoint was saved in, or move to ``--llep-placement``. The tokenizer the run was
  fine-tuned with is the default ``--tokenizer``.
* ``--pretrained DIR``: a Megatron-LM checkpoint (``recipes/pretrain_gpt.py --save DIR``), rebuilt
  from the arguments it records (megatron-core >= 0.17).
* ``--hf-checkpoint DIR --recipe NAME``: a Hugging Face checkpoint of the recipe's family, sizes
  from its config.json; its tokenizer.json is the default ``--tokenizer``.
* ``--random-init``: ``--recipe`` at its random initial weights (``--seed``): smoke tests and demos.

Every path builds the model with :func:`recipes.runtime.model_building.build_model` (LLEP unless
``--no-llep``; routing pruned with ``--prune-p``), without DDP or an optimizer, in eval mode.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_llep.writable import write_text
from recipes.runtime import sft_data
from recipes.runtime import model_building
from recipes.runtime.entry_point import EntryPoint, check_existing_files, check_numeric_domains, check_writable_files
from recipes.runtime.model_building import ConfigError

SOURCE_FLAGS = ("--load", "--pretrained", "--hf-checkpoint", "--random-init")
NO_SOURCE = ("no model given: pass --load DIR (a fine-tuning checkpoint), --pretrained DIR (a Megatron-LM "
             "checkpoint), --hf-checkpoint DIR --recipe NAME (Hugging Face), or --random-init (smoke tests: "
             "--recipe at random weights)")


def add_arguments(parser: argparse.ArgumentParser, entry_name: str, output_help: str) -> None:
    """The model-source, layout, LLEP, routing-pruning, output and wandb flags evaluate.py and generate.py share."""
    source = parser.add_argument_group("model (exactly one of --load, --pretrained, --hf-checkpoint, --random-init)")
    source.add_argument("--load", default=None, metavar="DIR",
                        help="a fine-tuning checkpoint: recipes/finetune.py's --save directory (its latest checkpoint) "
                             "or one iter_* directory; the model is rebuilt from what the run recorded")
    model_building.add_model_arguments(source)
    source.add_argument("--random-init", action="store_true",
                        help="smoke tests and demos only: --recipe at its random initial weights (seeded by --seed)")
    parser.set_defaults(recipe=None)  # --load/--pretrained bring their own; else gpt-oss-tiny
    source.add_argument("--tokenizer", default=None,
                        help="local tokenizer.json (file or directory) or byte-tokenizer file; default: the one the "
                             "--load run was fine-tuned with, the --hf-checkpoint directory's, else the shipped byte "
                             "tokenizer")
    source.add_argument("--seed", type=int, default=1234,
                        help="--random-init's weights, --force-routing's choices and sampling (every rank alike)")
    model_building.add_checkpoint_reading_arguments(source)
    model_building.add_parallel_arguments(parser)
    model_building.add_llep_arguments(parser)
    model_building.add_pruning_arguments(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--output", default=None, metavar="FILE", help=output_help)
    model_building.add_wandb_arguments(output, f"{entry_name}-<recipe>", "./runs/wandb")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, positive: Sequence[str] = (),
                    non_negative: Sequence[str] = (), placement_uses_cost: bool = False) -> None:
    """Usage errors of :func:`add_arguments`' flags (and ``positive`` / ``non_negative`` ones of the
    entry point), before any process group exists (``placement_uses_cost``: see
    :func:`model_building.check_pruning_arguments`)."""
    given = [flag for flag, value in zip(SOURCE_FLAGS, (args.load, args.pretrained, args.hf_checkpoint,
                                                        args.random_init)) if value]
    if not given:
        parser.error(NO_SOURCE)
    if len(given) > 1:
        parser.error(f"{' and '.join(given)} each give the model; choose one")
    if args.hf_checkpoint and args.recipe is None:
        parser.error("--hf-checkpoint needs --recipe: the model family (gpt-oss-20b, gpt-oss-120b, deepseek-v3; "
                     "gpt-oss-tiny or deepseek-v3-tiny take any size from config.json)")
    if args.pretrained and args.recipe is not None:
        parser.error("--recipe is not used with --pretrained (the model is rebuilt from the checkpoint's arguments); drop it")
    if args.load is None:
        args.recipe = args.recipe or "gpt-oss-tiny"
    check_numeric_domains(parser, args, (*positive, *model_building.POSITIVE_FLAGS), ("seed", *non_negative))
    if args.seed >= 2**32:
        parser.error(f"--seed must be below 2**32, got {args.seed}")
    model_building.check_checkpoint_reading_arguments(parser, args)
    if args.load is not None and not os.path.isdir(args.load):
        parser.error(f"--load: {args.load} is not a directory (give a fine-tuning --save directory or an iter_* one)")
    model_building.check_model_arguments(parser, args)
    model_building.check_llep_arguments(parser, args, recipe_is_known=args.random_init)
    model_building.check_pruning_arguments(parser, args, placement_uses_cost)
    check_existing_files(parser, [(args.tokenizer, "--tokenizer")], directories_allowed=["--tokenizer"])
    check_writable_files(parser, [(args.output, "--output")])
    model_building.check_wandb_arguments(parser, args)


@dataclass
class ModelSource:
    """Where the weights come from: a fine-tuning ``checkpoint`` (with the run's ``run_info`` and
    ``iteration``) or none (the other sources read theirs while building)."""

    checkpoint: Optional[str] = None
    run_info: dict = field(default_factory=dict)
    iteration: int = 0

    def describe(self, args: argparse.Namespace) -> str:
        if self.checkpoint:
            return f"the checkpoint {self.checkpoint} (iteration {self.iteration})"
        if args.pretrained:
            return f"the Megatron-LM checkpoint {args.pretrained}"
        if args.hf_checkpoint:
            return f"the Hugging Face checkpoint {args.hf_checkpoint}"
        return f"{args.recipe} at random initial weights (seed {args.seed})"


def open_source(args: argparse.Namespace, entry: EntryPoint, rank: int) -> ModelSource:
    """Find ``--load``'s checkpoint (verified; the recipe and tokenizer of its run become the defaults)
    and settle ``args.tokenizer``. One line and exit 2 on a missing or damaged checkpoint. Collective."""
    from recipes.runtime import checkpointing

    source = ModelSource()
    if args.load:
        entry.progress(rank, f"finding the checkpoint in {args.load}")
        try:
            source.checkpoint = checkpointing.find_checkpoint(args.load, args.checkpoint_verify)
            common = checkpointing.read_run_state(source.checkpoint)
            source.run_info, source.iteration = common["run_info"], int(common.get("iteration", 0))
            recorded = source.run_info.get("recipe")
            if args.recipe is not None and args.recipe != recorded:
                raise ConfigError(f"--recipe {args.recipe} contradicts the recipe {recorded} the checkpoint "
                                  f"{source.checkpoint} was trained with; drop --recipe")
            args.recipe = recorded
            tokenizer = source.run_info.get("tokenizer")
            if args.tokenizer is None and tokenizer is not None and not os.path.exists(tokenizer):
                raise ConfigError(f"the tokenizer {source.checkpoint} was fine-tuned with, {tokenizer}, is not there "
                                  "any more; pass --tokenizer")
            args.tokenizer = args.tokenizer or tokenizer
        except (ConfigError, checkpointing.CheckpointError) as err:
            entry.fail(err, rank)
    if args.tokenizer is None:
        hf_tokenizer = args.hf_checkpoint and os.path.join(args.hf_checkpoint, "tokenizer.json")
        args.tokenizer = args.hf_checkpoint if hf_tokenizer and os.path.isfile(hf_tokenizer) else sft_data.DEFAULT_TOKENIZER
    return source


def load_tokenizer(args: argparse.Namespace, entry: EntryPoint, rank: int) -> sft_data.Tokenizer:
    """``--tokenizer`` (one line and exit 2 if it cannot be read)."""
    try:
        return sft_data.load_tokenizer(args.tokenizer)
    except sft_data.DataError as err:
        entry.fail(err, rank)


def build(args: argparse.Namespace, source: ModelSource, entry: EntryPoint, rank: int, world: int,
          device: torch.device, vocab_needed: int):
    """The recipe, the model in eval mode with its weights, and the parallel layout. ``args.seq_length``
    is the longest sequence the run feeds the model; ``vocab_needed`` the ids it feeds. Collective."""
    from megatron_llep.placement import read_checkpoint_placement, same_expert_order
    from megatron_llep.integrations.placement import restore_original_order
    from recipes.runtime import checkpointing

    try:
        hf_config, layout = model_building.layout_for(args, world, device, source.checkpoint)
    except ConfigError as err:
        entry.fail(err, rank)
    model_building.initialize_model_parallel(layout, args.seed)
    try:
        requested = model_building.load_placement(args.llep_placement) if args.llep_placement else None
        entry.progress(rank, f"building the model of {source.describe(args)}")
        recipe, model = model_building.build_model(
            args, layout, device, vocab_needed, placement=None if source.checkpoint else requested,
            hf_config=hf_config, import_hf=args.hf_checkpoint, import_pretrained=args.pretrained, say=entry.say)
        if source.checkpoint:
            entry.progress(rank, f"loading the model weights of {source.checkpoint}")
            checkpointing.load_model_weights(source.checkpoint, model)
            saved = read_checkpoint_placement(source.checkpoint)  # the experts are in its order now
            if requested is not None and not same_expert_order(saved, requested):
                if saved is not None:
                    try:
                        restore_original_order(model, saved)
                    except ValueError as err:
                        raise ConfigError(f"--llep-placement {args.llep_placement}: the checkpoint's experts are in a CAP "
                                          f"placement that cannot be undone at this layout ({err}); run at its EP "
                                          "size or without --llep-placement") from None
                model_building.apply_placement(model, requested, args.llep_placement, entry.say)
            elif saved is not None:
                entry.say(f"the experts stay in the CAP placement the checkpoint was saved in "
                          f"({source.checkpoint}/expert_placement.json)")
    except (ConfigError, checkpointing.CheckpointError) as err:
        entry.fail(err, rank)
    model.eval()
    return recipe, model, layout


def wandb_dashboard(args: argparse.Namespace, entry_name: str, model_name: str, run_info: dict):
    """The wandb run of ``--wandb-project`` (offline unless told; a no-op without the flag; on the last rank)."""
    from recipes.runtime import dashboard

    return dashboard.WandbDashboard(
        project=args.wandb_project, name=args.wandb_exp_name or f"{entry_name}-{model_name}",
        directory=args.wandb_save_dir or os.path.join("runs", "wandb"),
        mode=args.wandb_mode if args.wandb_project else "disabled", config=dict(vars(args), **run_info),
    )


def publish(args: argparse.Namespace, entry: EntryPoint, rank: int, ep_size: int, recorder, source: ModelSource,
            model_name: str, metrics: dict, output_text: str, started: float) -> None:
    """End a run: its routing traces saved (``--record-routing-trace``), ``metrics`` logged to wandb at
    the checkpoint's iteration (``--wandb-project``), ``output_text`` written to ``--output`` (rank 0),
    the process group closed. Collective."""
    model_building.save_routing_trace(recorder, args, rank, ep_size, entry)
    wandb_board = wandb_dashboard(args, entry.name, model_name, source.run_info)
    wandb_board.log(source.iteration, metrics)
    wandb_board.finish()
    if args.output:  # rank 0 writes; a failure ends every rank in one line, the previous file untouched
        entry.write_or_fail(lambda: rank == 0 and write_text(args.output, output_text, "--output"), rank)
        entry.say(f"wrote {args.output} ({time.perf_counter() - started:.1f} s with start-up)")
    entry.finish()
