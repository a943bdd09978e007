"""The Megatron-Core ``GPTModel`` a run works on, built one way for every entry point: finetune.py
wraps it in DDP and an optimizer, evaluate.py and generate.py use it as it is.

The model comes from a recipe (``--recipe``, recipes/models/__init__.py), with its sizes from a Hugging Face
config.json (``--hf-checkpoint``) or from a Megatron-LM checkpoint's arguments (``--pretrained``);
every ``MoELayer`` of its layer spec becomes an ``LLEPMoELayer`` (``with_llep``) unless ``--no-llep``
(with ``--prune-p`` an LLEP layer that dispatches as plain EP, to prune);
weights are imported right after construction and a CAP placement (``--llep-placement``) applied last.
The flags these steps read are defined here too (``add_*_arguments``), so that they mean the same in
every entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Callable, Optional

import torch

from megatron_llep.config import PRUNING_METHODS, LLEPConfig, LLEPConfigError, RoutingPruning
from megatron_llep.integrations.flags import (add_llep_flags, ignored_tuning_note, llep_config_from_flags,
                                              tuning_flags_given)
from recipes.runtime import watchdog
from recipes.runtime.entry_point import EntryPoint, check_existing_files, check_writable_directories, utf8_text
from recipes.models import RECIPES

# the RoutingPruning field each pruning flag sets (its validation messages name the flag)
PRUNING_FLAGS = {"pruning.p": "--prune-p", "pruning.method": "--prune-method",
                 "pruning.cross_node_cost": "--cross-node-cost"}
# the numeric flags defined here that must be positive (the entry points check them with theirs)
POSITIVE_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                  "trace_tokens_per_layer")


class ConfigError(ValueError):
    """Parallel layout, batch or model settings that cannot work together."""


# Flags ---------------------------------------------------------------------------------------


def add_model_arguments(group: argparse._ArgumentGroup) -> None:
    """``--recipe``, ``--dtype`` and the checkpoints a model can start from: ``--hf-checkpoint``, ``--pretrained``."""
    group.add_argument("--recipe", default="gpt-oss-tiny", choices=sorted(RECIPES))
    group.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    for flag, what in (
        ("--hf-checkpoint", "a Hugging Face checkpoint (config.json + *.safetensors, MXFP4/FP8 experts dequantized): "
                            "model sizes from its config.json, weights loaded right after the model is built; --recipe "
                            "picks the family (gpt-oss-20b/120b, deepseek-v3: config.json must match; gpt-oss-tiny: any "
                            "size)"),
        ("--pretrained", "the model weights of a Megatron-LM checkpoint (recipes/pretrain_gpt.py --save DIR, or one "
                         "iter_* directory): the model is rebuilt from the arguments it records (--recipe is not "
                         "used); needs megatron-core >= 0.17. finetune.py: the optimizer, schedule and iteration start "
                         "fresh (Megatron-LM's --finetune)"),
    ):
        group.add_argument(flag, default=None, metavar="DIR",
                           help=f"{what}. finetune.py ignores its weights when it resumes with --load")
    group.add_argument("--hf-drop-mtp", action="store_true",
                       help="with --hf-checkpoint: build the model without the checkpoint's multi-token-prediction "
                            "layers (config.json's num_nextn_predict_layers) and ignore their tensors; for "
                            "checkpoints saved without them, e.g. by transformers' save_pretrained")


def add_checkpoint_reading_arguments(group: argparse._ArgumentGroup) -> None:
    """``--checkpoint-verify`` and ``--watchdog-timeout``."""
    group.add_argument("--checkpoint-verify", choices=["sha256", "size"], default="sha256",
                       help="what each checkpoint's manifest records and loading checks: every file's size and "
                            "SHA-256 (each rank hashes its own shards), or sizes only (no read-back, for huge "
                            "checkpoints); a damaged latest checkpoint falls back to the newest complete one")
    watchdog.add_argument(group)


def check_checkpoint_reading_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage error for a ``--watchdog-timeout`` that is negative or not a number."""
    problem = watchdog.timeout_problem(args.watchdog_timeout)
    if problem:
        parser.error(problem)


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=None,
                          help="default: world size / (TP x PP)")


def add_wandb_arguments(group: argparse._ArgumentGroup, default_name: str, default_directory: str) -> None:
    """The wandb flags; ``default_name`` / ``default_directory`` describe the defaults in the help."""
    group.add_argument("--wandb-project", default=None, type=utf8_text,
                       help="enable wandb logging (offline unless --wandb-mode online)")
    group.add_argument("--wandb-exp-name", default=None, type=utf8_text, help=f"default: {default_name}")
    group.add_argument("--wandb-save-dir", default=None, help=f"default: {default_directory}")
    group.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], default=None,
                       help="default: $WANDB_MODE, else offline")


def check_wandb_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage error for a ``--wandb-save-dir`` that is a file or cannot be written (wandb, on the last
    rank, would fail there with a traceback)."""
    check_writable_directories(parser, [(args.wandb_save_dir, "--wandb-save-dir")])


def add_llep_arguments(parser: argparse.ArgumentParser) -> None:
    """The LLEP flags (the one set of :mod:`megatron_llep.integrations.flags`, LLEP on by default),
    routing traces and ``--force-routing``."""
    add_llep_flags(parser, llep_default=True)
    cap = parser.add_argument_group("CAP routing traces (docs/placement.md)")
    cap.add_argument("--record-routing-trace", default=None, metavar="DIR",
                     help="record every MoE router's choices; each rank writes DIR/trace_rank<r>.npz at the end")
    cap.add_argument("--trace-tokens-per-layer", type=int, default=16384,
                     help="bound on the recorded tokens per layer and rank (a uniform sample beyond it)")
    parser.add_argument(
        "--force-routing", default=None, metavar="F:H",
        help="demo/benchmark only: force a fraction F of tokens into H hot experts (Megatron router replay)",
    )


def add_pruning_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prune-p``, ``--prune-method``, ``--cross-node-cost``: CAP's routing pruning, for the
    inference entry points only (training refuses pruning, so finetune.py does not offer them)."""
    defaults = {field.name: field.default for field in dataclasses.fields(RoutingPruning)}
    prune = parser.add_argument_group("CAP routing pruning (inference only, lossy; docs/inference.md)")
    prune.add_argument("--prune-p", type=float, default=None, metavar="P",
                       help="prune each token's routing before dispatch: the fraction of its routing-score mass "
                            "that may be dropped, 0 <= P < 1 (default: off)")
    # default None, so that the two refinements given without --prune-p can be told apart
    prune.add_argument("--prune-method", choices=PRUNING_METHODS, default=None,
                       help=f"devices (CAP): a token's destination devices ranked by score / cost, the last dropped "
                            f"with all their experts; experts: the naive baseline, its lowest-score experts "
                            f"dropped (default: {defaults['method']})")
    prune.add_argument("--cross-node-cost", type=float, default=None, metavar="C",
                       help=f"cost of a device in another node, >= 1 (the token's own device costs 0, another of "
                            f"its node 1); a node is --llep-ranks-per-node GPUs (none given: one node) "
                            f"(default: {defaults['cross_node_cost']})")


def check_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of ``--hf-checkpoint`` / ``--pretrained``: directories that are not, both given, a
    recipe without a Hugging Face conversion."""
    if args.pretrained is not None:
        if not os.path.isdir(args.pretrained):
            parser.error(f"--pretrained: {args.pretrained} is not a directory")
        if args.hf_checkpoint is not None:
            parser.error("--pretrained and --hf-checkpoint both give the starting weights; choose one")
    if getattr(args, "hf_drop_mtp", False) and args.hf_checkpoint is None:
        parser.error("--hf-drop-mtp needs --hf-checkpoint (a run resumed with --load keeps what it was started with)")
    if args.hf_checkpoint is not None:
        if not os.path.isdir(args.hf_checkpoint):
            parser.error(f"--hf-checkpoint: {args.hf_checkpoint} is not a directory")
        from recipes.hf.rules import ConversionError, family_key

        try:
            family_key(args.recipe)
        except ConversionError as err:
            parser.error(f"--hf-checkpoint with --recipe {args.recipe}: {err}")


def check_llep_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, recipe_is_known: bool) -> None:
    """Usage errors of the flags :func:`add_llep_arguments` defines; parses ``--force-routing`` into
    ``(fraction, hot experts)``. ``recipe_is_known``: the model is ``--recipe`` at its own sizes (not a
    checkpoint's), so the hot experts can be checked against it now (else :func:`build_model` does)."""
    try:  # LLEPConfig's own rules, with the flag named
        llep_config_from_flags(args, on_gpu=False)
    except ValueError as err:
        parser.error(str(err))
    args.ignored_llep_note = None if args.llep else ignored_tuning_note(tuning_flags_given(parser, args),
                                                                          "--no-llep turns off")  # build_model says it
    if args.force_routing is not None:
        try:
            fraction, hot = args.force_routing.split(":")
            args.force_routing = (float(fraction), int(hot))
        except ValueError:
            parser.error(f"--force-routing expects F:H (e.g. 0.9:1), got {args.force_routing!r}")
        if not 0.0 <= args.force_routing[0] <= 1.0 or args.force_routing[1] < 1:
            parser.error(f"--force-routing F:H needs 0 <= F <= 1 and H >= 1, got {args.force_routing}")
        experts = RECIPES[args.recipe]().config.num_moe_experts if recipe_is_known else None
        if experts is not None and args.force_routing[1] > experts:
            parser.error(f"--force-routing F:H: H = {args.force_routing[1]} hot experts, but {args.recipe} has {experts}")
    check_existing_files(parser, [(args.llep_placement, "--llep-placement")])
    check_writable_directories(parser, [(args.record_routing_trace, "--record-routing-trace")])


def pruning_settings(args: argparse.Namespace) -> Optional[RoutingPruning]:
    """The :class:`RoutingPruning` of ``--prune-p`` / ``--prune-method`` / ``--cross-node-cost``
    (None: off, also for entry points without these flags, e.g. finetune.py)."""
    if getattr(args, "prune_p", None) is None:
        return None
    return RoutingPruning(args.prune_p, **_pruning_refinements(args))


def _pruning_refinements(args: argparse.Namespace) -> dict:
    """``--prune-method`` / ``--cross-node-cost`` where given (else RoutingPruning's defaults hold)."""
    given = {"method": args.prune_method, "cross_node_cost": args.cross_node_cost}
    return {key: value for key, value in given.items() if value is not None}


def pruning_result(args: argparse.Namespace) -> Optional[dict]:
    """The routing-pruning settings a result records (None: off): what its ``prune/*`` figures
    were measured under."""
    pruning = pruning_settings(args)
    return None if pruning is None else dict(dataclasses.asdict(pruning), ranks_per_node=args.llep_ranks_per_node)


def moe_summary(args: argparse.Namespace, metrics: dict[str, float]) -> str:
    """The MoE phrase of an inference run's last log line: LLEP's statistics (or "plain EP") and,
    with ``--prune-p``, what pruning dropped and saved (:func:`recipes.runtime.dashboard.pruning_summary`)."""
    from recipes.runtime import dashboard

    pruning = dashboard.pruning_summary(metrics, pruning_settings(args), args.llep_ranks_per_node)
    return " | ".join(filter(None, (dashboard.llep_summary(metrics), pruning)))


def check_pruning_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                            placement_uses_cost: bool = False) -> None:
    """Usage errors of :func:`add_pruning_arguments`' flags: RoutingPruning's own rules with the flag
    named, and a refinement (``--prune-method``, ``--cross-node-cost``) without ``--prune-p``
    (``placement_uses_cost``: the entry point also plans a placement with ``--cross-node-cost``)."""
    try:  # each value is checked even without --prune-p (p = 0 stands in), so its own error is named
        RoutingPruning(0.0 if args.prune_p is None else args.prune_p, **_pruning_refinements(args))
    except LLEPConfigError as err:
        parser.error(err.for_flag(PRUNING_FLAGS[err.knob]))
    if args.prune_p is None:
        for flag, value in (("--prune-method", args.prune_method), ("--cross-node-cost", args.cross_node_cost)):
            if value is not None and not (flag == "--cross-node-cost" and placement_uses_cost):
                parser.error(f"{flag} refines routing pruning, which is off without --prune-p P; add --prune-p")


# The model -----------------------------------------------------------------------------------


def hf_config_for(args: argparse.Namespace, checkpoint: Optional[str] = None) -> Optional[dict]:
    """The Hugging Face config.json the model's sizes come from: ``--hf-checkpoint``'s, else the one
    recorded in the fine-tuning ``checkpoint`` of a run that started from one (None: the recipe's sizes)."""
    if args.hf_checkpoint:
        from recipes.hf.checkpoint import HFCheckpoint, HFCheckpointError

        try:
            config = HFCheckpoint(args.hf_checkpoint).config
        except HFCheckpointError as err:
            raise ConfigError(f"--hf-checkpoint: {err}") from None
        return without_mtp(config) if getattr(args, "hf_drop_mtp", False) else config
    if checkpoint:
        return saved_run_info(checkpoint).get("hf_config")
    return None


def without_mtp(hf_config: dict) -> dict:
    """``--hf-drop-mtp``: the config.json the model is built from (and that the checkpoint records,
    so resuming and exporting agree) says no MTP layers; the checkpoint's MTP tensors, if any, are
    ignored on import (recipes/hf/tables/deepseek_v3.py ignore_hf reads the checkpoint's own config.json)."""
    if not hf_config.get("num_nextn_predict_layers"):
        return hf_config
    return {**hf_config, "num_nextn_predict_layers": 0}


def saved_run_info(directory: str) -> dict:
    """The ``run_info`` the fine-tuning checkpoint ``directory`` records (:class:`ConfigError` naming
    the checkpoint where it cannot be read or is none of this project's)."""
    from recipes.runtime import checkpointing

    try:
        return checkpointing.read_run_state(directory)["run_info"]
    except checkpointing.CheckpointError as err:
        raise ConfigError(str(err)) from None


def megatron_lm_arguments_for(args: argparse.Namespace, checkpoint: Optional[str] = None) -> Optional[argparse.Namespace]:
    """The Megatron-LM arguments the model is rebuilt from: the ones recorded in the fine-tuning
    ``checkpoint`` of a run that started from ``--pretrained``, else ``--pretrained``'s (None: not such
    a model)."""
    from recipes.runtime import pretrained

    if checkpoint:
        saved = saved_run_info(checkpoint).get("megatron_lm_args")
        return argparse.Namespace(**saved) if saved is not None else None
    if args.pretrained:
        try:
            return pretrained.saved_arguments(args.pretrained)
        except pretrained.PretrainedError as err:
            raise ConfigError(str(err)) from None
    return None


def make_recipe(args: argparse.Namespace, hf_config: Optional[dict] = None, **kwargs):
    """``--recipe`` at a layout (``ep_size``, ``tp_size``, ``pp_size``, ``dtype``, ``cpu``), its sizes
    from ``hf_config`` when given (``recipe_from_hf_config`` of the recipe's family), or the model
    of a Megatron-LM checkpoint (``args.megatron_lm_args``, from :func:`megatron_lm_arguments_for`)."""
    if getattr(args, "megatron_lm_args", None) is not None:
        from recipes.runtime import pretrained

        try:
            return pretrained.recipe_from_arguments(args.megatron_lm_args, source=args.pretrained, **kwargs)
        except pretrained.PretrainedError as err:
            raise ConfigError(str(err)) from None
    if hf_config is None:
        return RECIPES[args.recipe](**kwargs)
    from recipes.hf.rules import family_module

    family = family_module(args.recipe)
    fixed = getattr(family, "FIXED_SIZE_RECIPES", None)
    name = args.recipe if fixed is None or args.recipe in fixed else None
    try:
        return family.recipe_from_hf_config(hf_config, name, **kwargs)
    except ValueError as err:  # ConversionError: one line naming the config.json field
        source = getattr(args, "hf_config_source", None) or (
            f"--hf-checkpoint {args.hf_checkpoint}" if args.hf_checkpoint else f"the config.json recorded in {args.load}")
        raise ConfigError(f"{source}: {err}") from None


def parallel_layout(args: argparse.Namespace, world: int, num_experts: int) -> dict[str, int]:
    """TP/PP/EP/DP sizes and micro-batches per step, validated against the world and the model
    (``args.micro_batch_size`` and ``args.global_batch_size`` default to 1 sequence per DP rank)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by TP x PP = {tp} x {pp}")
    dp = world // (tp * pp)
    ep = args.expert_model_parallel_size or dp * tp
    if (dp * tp) % ep:
        raise ConfigError(f"EP = {ep} must divide TP x DP = {tp * dp} (world {world} / PP {pp})")
    if num_experts % ep:
        raise ConfigError(f"{args.recipe} has {num_experts} experts, not divisible by EP = {ep}")
    micro_batch = getattr(args, "micro_batch_size", 1)
    global_batch = getattr(args, "global_batch_size", None) or micro_batch * dp
    if global_batch % (micro_batch * dp):
        raise ConfigError(f"--global-batch-size {global_batch} is not a multiple of micro batch x DP = "
                          f"{micro_batch} x {dp}")
    return dict(tp=tp, pp=pp, ep=ep, dp=dp, global_batch=global_batch,
                num_microbatches=global_batch // (micro_batch * dp))


def llep_config(args: argparse.Namespace, on_gpu: bool) -> LLEPConfig:
    """The LLEP layers' config from the flags (routing pruning only where the entry point offers it)."""
    return llep_config_from_flags(args, on_gpu, pruning_settings(args))


def check_megatron_support(recipe, layout: dict[str, int]) -> None:
    """Settings Megatron-Core 0.16 cannot run with this recipe's modules, caught with a reason."""
    from recipes.models import HAVE_TE

    config = recipe.config
    if layout["tp"] > 1 and not HAVE_TE:
        raise ConfigError("TP > 1 with MoE needs sequence parallelism, whose norms need Transformer Engine "
                          "(not installed): use EP/PP on this machine")
    if config.num_layers % layout["pp"]:
        raise ConfigError(f"{recipe.name} has {config.num_layers} layers, not divisible by PP = {layout['pp']}")
    if config.add_bias_linear and not config.moe_grouped_gemm and layout["ep"] == 1 and layout["tp"] == 1:
        raise ConfigError(f"{recipe.name}'s expert biases with local experts need EP >= 2 (Megatron-Core's (0.16-0.19) "
                          "SequentialMLP adds the fc2 bias in place on a view when EP = TP = 1)")


def set_aux_loss_coeff(config, coeff: float, model_name: str) -> None:
    """``--moe-aux-loss-coeff``: the coefficient of the router's one load-balancing loss (0: off)."""
    balancing = config.moe_router_load_balancing_type
    if not isinstance(balancing, str) or (balancing == "none" and coeff > 0):
        raise ConfigError(f"--moe-aux-loss-coeff {coeff}: {model_name}'s router has load-balancing loss {balancing!r}; "
                          "the flag sets the coefficient of a model's one balancing loss")
    config.moe_aux_loss_coeff = coeff


def model_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """``--dtype``, by default bf16 on GPU and fp32 on CPU."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]


def build_model(args: argparse.Namespace, layout: dict[str, int], device: torch.device, vocab_needed: int,
                placement=None, hf_config: Optional[dict] = None, import_hf: Optional[str] = None,
                import_pretrained: Optional[str] = None, say: Callable[[str], None] = print):
    """The recipe and its GPTModel on this rank (LLEP or plain EP; experts in ``placement``'s order if
    given), without DDP or an optimizer. ``hf_config``: model sizes from a Hugging Face config.json;
    ``import_hf`` / ``import_pretrained``: load that Hugging Face / Megatron-LM checkpoint's weights
    right after the model is built, before the placement is applied; ``say`` prints a line once per
    job. ``args.seq_length`` is the longest sequence the run feeds the model. Collective."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_llep.runtime.layer import with_llep

    on_gpu = device.type == "cuda"
    recipe = make_recipe(args, hf_config, ep_size=layout["ep"], tp_size=layout["tp"], pp_size=layout["pp"],
                         dtype=model_dtype(args, device), cpu=not on_gpu)
    if vocab_needed > recipe.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_needed} ids but {recipe.name}'s vocabulary is {recipe.vocab_size}")
    if args.seq_length > recipe.max_sequence_length:
        # generate.py has no --seq-length: its sequences are the longest prompt plus --max-new-tokens
        length, fix = getattr(args, "seq_length_source", ("--seq-length", "lower --seq-length"))
        raise ConfigError(f"{length} = {args.seq_length} tokens exceeds {recipe.name}'s longest sequence, "
                          f"{recipe.max_sequence_length} tokens: {fix}")
    if args.force_routing and not recipe.config.moe_enable_routing_replay:
        raise ConfigError("--force-routing needs Megatron's router replay (moe_enable_routing_replay), on in CPU recipes")
    if args.force_routing and args.force_routing[1] > recipe.config.num_moe_experts:
        raise ConfigError(f"--force-routing F:H: H = {args.force_routing[1]} hot experts, but the model has "
                          f"{recipe.config.num_moe_experts}")
    config = recipe.config
    check_megatron_support(recipe, layout)
    config.calculate_per_token_loss = True  # exact per-token mean over micro-batches and DP ranks
    if getattr(args, "moe_aux_loss_coeff", None) is not None:
        set_aux_loss_coeff(config, args.moe_aux_loss_coeff, recipe.name)
    spec = recipe.layer_spec()
    layer_config = llep_config(args, on_gpu)
    if args.llep:
        spec = with_llep(spec, layer_config)
    elif layer_config.pruning is not None:  # pruning lives in the LLEP layer: disabled, it dispatches as plain EP
        spec = with_llep(spec, dataclasses.replace(layer_config, enabled=False))
    model = GPTModel(
        config, spec, mtp_block_spec=recipe.mtp_spec(spec),
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        **recipe.gpt_model_kwargs(),
    )
    if on_gpu:
        model.cuda(device)
    if import_hf:
        _import_hf(import_hf, model, args.recipe, say)
    if import_pretrained:
        _import_pretrained(import_pretrained, model, say)
    if placement is not None:  # before DDP and an optimizer: they keep per-parameter buffers and state
        apply_placement(model, placement, args.llep_placement, say)
    if getattr(args, "ignored_llep_note", None):
        say(f"note: {args.ignored_llep_note}")
    if args.llep and layout["ep"] == 1:
        say("LLEP has no work at EP=1 (every expert is on every rank): this runs as plain EP; use 2+ "
            "expert-parallel ranks for LLEP to balance")
    return recipe, model


def apply_placement(model: torch.nn.Module, placement, source: str, say: Callable[[str], None]) -> None:
    """Put the model's experts in ``placement``'s order (read from ``source``, named in errors)."""
    import torch.distributed as dist

    from megatron_llep.integrations.placement import apply_placement as permute
    from megatron_llep.integrations.placement import moe_layers as moe_layers_by_number

    stages: list = [None] * dist.get_world_size()  # every pipeline stage's MoE layers (collective)
    dist.all_gather_object(stages, sorted(moe_layers_by_number(model)))
    unknown = sorted(set(placement.layers) - {n for numbers in stages for n in numbers})
    if unknown:
        raise ConfigError(f"--llep-placement {source}: the model has no MoE layer {', '.join(map(str, unknown))} (its MoE "
                          f"layers: {', '.join(map(str, sorted({n for s in stages for n in s})))}); is it this model's file?")
    try:
        permute(model, placement)
    except ValueError as err:
        raise ConfigError(f"--llep-placement {source}: {err}") from None
    say(f"applied the expert placement {source} to MoE layer(s) {', '.join(map(str, sorted(placement.layers)))}")


def _import_hf(directory: str, model, recipe_name: str, say: Callable[[str], None]) -> None:
    from recipes.hf.importing import import_hf_checkpoint
    from recipes.hf.rules import ConversionError

    try:
        report = import_hf_checkpoint([model], directory, recipe_name)
    except ConversionError as err:
        raise ConfigError(f"--hf-checkpoint {directory}: {err}") from None
    mib = 2**20
    say(f"imported {directory} in {report.seconds:.1f} s: rank 0 read {report.bytes_read / mib:.1f} MiB for its "
        f"{report.param_bytes / mib:.1f} MiB of parameters, peak host memory +{report.peak_overhead / mib:.1f} MiB "
        "during the import")


def _import_pretrained(path: str, model, say: Callable[[str], None]) -> None:
    from recipes.runtime import pretrained

    start = time.perf_counter()
    try:
        directory = pretrained.load_weights(model, path)
    except pretrained.PretrainedError as err:
        raise ConfigError(str(err)) from None
    say(f"loaded the model weights of {directory} in {time.perf_counter() - start:.1f} s")


def moe_layers(model: torch.nn.Module) -> list:
    """The model's MoE layers (LLEP's included), in module order."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def load_placement(path: str):
    """The CAP placement file ``--llep-placement path``."""
    from megatron_llep.placement import ExpertPlacement

    try:
        return ExpertPlacement.load(path)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"--llep-placement {path}: {err}") from None


def layout_for(args: argparse.Namespace, world: int, device: torch.device,
               checkpoint: Optional[str] = None) -> tuple[Optional[dict], dict[str, int]]:
    """The Hugging Face config.json the model's sizes come from (if any; sets ``args.megatron_lm_args``
    for a Megatron-LM model) and the parallel layout, for the model of ``--hf-checkpoint``,
    ``--pretrained``, the fine-tuning ``checkpoint`` (whose run recorded them) or ``--recipe``."""
    hf_config = hf_config_for(args, checkpoint)
    args.megatron_lm_args = megatron_lm_arguments_for(args, checkpoint)
    recipe = make_recipe(args, hf_config, cpu=device.type == "cpu")
    layout = parallel_layout(args, world, recipe.config.num_moe_experts)
    check_vocabulary_split(recipe, layout["tp"], hf_config is not None)
    return hf_config, layout


def check_vocabulary_split(recipe, tp: int, from_config_json: bool) -> None:
    """Megatron-Core splits the embedding and the output layer into ``tp`` equal vocabulary shards
    (an uneven vocabulary fails its assertion deep in the model build): one line instead."""
    if recipe.vocab_size % tp:
        where = f"config.json's vocab_size = {recipe.vocab_size}" if from_config_json else \
            f"{recipe.name}'s vocabulary of {recipe.vocab_size}"
        raise ConfigError(f"{where} is not divisible by --tensor-model-parallel-size {tp} (Megatron-Core splits the "
                          f"embedding and output layer into equal vocabulary shards): use a TP size that divides it")


def initialize_model_parallel(layout: dict[str, int], seed: int) -> None:
    """Megatron's process groups for ``layout`` and its seeded RNGs (the model's initial weights are a
    function of ``seed`` and the layout)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(layout["tp"], layout["pp"], expert_model_parallel_size=layout["ep"],
                                             expert_tensor_parallel_size=1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


# Routing traces (--record-routing-trace) -----------------------------------------------------


def start_routing_trace(model: torch.nn.Module, args: argparse.Namespace, rank: int):
    """A started recorder of every MoE router's choices with ``--record-routing-trace`` (else None)."""
    if not args.record_routing_trace:
        return None
    from megatron_llep.integrations.routing_traces import RoutingTraceRecorder

    return RoutingTraceRecorder(model, max_tokens_per_layer=args.trace_tokens_per_layer, seed=args.seed + rank).start()


def save_routing_trace(recorder, args: argparse.Namespace, rank: int, ep_size: int, entry: EntryPoint) -> None:
    """Write this rank's trace to ``--record-routing-trace``/trace_rank<r>.npz (nothing without a
    recorder; a write that fails on any rank ends the run in one line: ``entry``'s
    :meth:`~recipes.runtime.entry_point.EntryPoint.write_or_fail`) and say how to plan a placement from the
    traces. Collective."""
    if recorder is None:
        return
    recorder.stop()
    path = os.path.join(args.record_routing_trace, f"trace_rank{rank}.npz")
    entry.write_or_fail(lambda: recorder.trace().save(path, "--record-routing-trace"), rank)
    entry.say(f"routing traces in {args.record_routing_trace}; plan a placement with: python -m megatron_llep.placement "
              f"plan {args.record_routing_trace}/trace_rank*.npz --ep-size {ep_size} --out placement.json")
