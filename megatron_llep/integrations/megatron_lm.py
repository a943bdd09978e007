"""LLEP inside Megatron-LM's own training loop (``megatron.training.pretrain``).

Three pieces a Megatron-LM pretraining script plugs in (``recipes/pretrain_gpt.py`` is
Megatron-LM's ``pretrain_gpt.py`` with them):

* :func:`add_llep_args`, an ``extra_args_provider``: ``--llep`` and ``--llep-*`` flags, one per
  :class:`~megatron_llep.config.LLEPConfig` field, and ``--llep-placement`` (a CAP placement);
  :func:`precheck_llep_flags` (before Megatron-LM is imported) and :func:`check_llep_args` (on its
  parsed arguments) validate them with one-line messages before anything is built;
  :func:`record_checkpoint_placement` notes in ``--save`` which expert order its checkpoints hold,
  and a later ``--load`` with another placement is refused.
* :func:`model_provider`: Megatron-LM's GPT model (the layer spec its ``gpt_builders.py`` picks) with
  every MoE layer an ``LLEPMoELayer`` under ``--llep``, and the placement applied before DDP and the
  optimizer see the parameters.
* :func:`install_llep_logging`: at Megatron-LM's log interval, every rank's per-layer LLEP statistics
  are merged and written through Megatron-LM's own TensorBoard and wandb writers (the keys the
  fine-tuning dashboard uses, ``moe/layer_<n>/<statistic>``), with one line next to its iteration line.

It lives in the library (not in ``recipes/``) so that any Megatron-LM script can import it once
megatron-llep is installed. Needs ``megatron.training`` as megatron-core 0.17+ ships it.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
from collections import defaultdict
from typing import Any, Optional, Sequence

import torch

from megatron_llep.integrations.flags import (add_llep_flags, ignored_tuning_note, llep_config_from_flags,
                                              tuning_flags_given)
from megatron_llep.integrations.placement import apply_placement
from megatron_llep.placement import ExpertPlacement, read_checkpoint_placement, same_expert_order, write_checkpoint_placement
from megatron_llep.placement.placement import CHECKPOINT_PLACEMENT_FILE
from megatron_llep.runtime.layer import with_llep
from megatron_llep.runtime.megatron_checks import check_megatron_config
from megatron_llep.runtime.state import STATS, accumulating_gradients
from megatron_llep.runtime.statistics import budget_phrase, merge_layer_statistic

LOG_PREFIX = "moe/layer_"
"""Writer keys are ``moe/layer_<n>/<statistic>`` (as recipes/runtime/dashboard.py's)."""


def add_llep_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: the LLEP flags (:mod:`megatron_llep.integrations.flags`),
    LLEP off unless ``--llep``."""
    return add_llep_flags(parser, llep_default=False)


def _load_placement(path: str):
    try:
        return ExpertPlacement.load(path)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"--llep-placement {path}: {err}") from None


def _check_own_flags(args: argparse.Namespace) -> None:
    """The LLEP knobs and the placement file (``args.num_experts`` is compared when present)."""
    if args.llep_placement is not None:
        placement = _load_placement(args.llep_placement)
        num_experts = getattr(args, "num_experts", None)
        if num_experts is not None and placement.num_experts != num_experts:
            raise ValueError(f"--llep-placement {args.llep_placement}: placement is for {placement.num_experts} "
                             f"experts, the model has --num-experts {num_experts}")
    if args.llep:
        llep_config_from_flags(args)


def _holds_checkpoints(directory: str) -> bool:
    """Whether Megatron-LM saved into ``directory`` (its tracker file or an ``iter_*`` directory)."""
    if not os.path.isdir(directory):
        return False
    return os.path.isfile(os.path.join(directory, "latest_checkpointed_iteration.txt")) or any(
        name.startswith("iter_") for name in os.listdir(directory))


def check_checkpoint_placement(args: argparse.Namespace) -> None:
    """The placement is applied to the model before Megatron-LM loads into it, so a checkpoint holds
    the experts in the order of the run that saved it (recorded as ``expert_placement.json`` in the
    directory by :func:`record_checkpoint_placement`). Checkpoints already in ``--load`` or
    ``--save`` must be in this run's ``--llep-placement`` order. Raises ``ValueError`` (one line)."""
    placement = _load_placement(args.llep_placement) if args.llep_placement else None
    ours = f"--llep-placement {args.llep_placement}" if placement is not None else "original order (no --llep-placement)"
    for flag in ("load", "save"):
        directory = getattr(args, flag, None)
        if not directory or not _holds_checkpoints(directory):
            continue
        try:
            saved = read_checkpoint_placement(directory)
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"--{flag} {directory}: unreadable {CHECKPOINT_PLACEMENT_FILE} ({err})") from None
        if not same_expert_order(saved, placement):
            theirs = "original order" if saved is None else f"the placement in {directory}/{CHECKPOINT_PLACEMENT_FILE}"
            raise ValueError(f"--{flag} {directory}: its checkpoints hold the experts in {theirs}, this run uses "
                             f"{ours}; pass the placement they were saved with, or another --{flag} directory")


def record_checkpoint_placement(args: argparse.Namespace) -> None:
    """Note in ``--save`` which expert order its checkpoints will hold (call once, from rank 0, after
    :func:`check_checkpoint_placement`): the placement's file, or none for the original order."""
    if not getattr(args, "save", None):
        return
    if args.llep_placement:
        os.makedirs(args.save, exist_ok=True)
        write_checkpoint_placement(args.save, _load_placement(args.llep_placement))
    elif not _holds_checkpoints(args.save):  # a note left by a run that saved nothing
        stale = os.path.join(args.save, CHECKPOINT_PLACEMENT_FILE)
        if os.path.isfile(stale):
            os.remove(stale)


def precheck_llep_flags(argv: Sequence[str]) -> None:
    """LLEP's own flags in a command line, checked before Megatron-LM is even imported, so a typo
    fails in seconds. Raises ``ValueError`` (one line)."""
    parser = add_llep_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False))
    try:
        args, _ = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as err:
        raise ValueError(str(err)) from None
    _check_own_flags(args)


def check_llep_args(args: argparse.Namespace) -> None:
    """Everything about the LLEP flags that can be checked before building, on Megatron-LM's parsed
    arguments: the knobs, the placement file (and the order of the checkpoints in ``--load`` and
    ``--save``), and the Megatron settings LLEP needs. Raises ``ValueError`` (one line)."""
    _check_own_flags(args)
    check_checkpoint_placement(args)
    if not args.llep:
        return
    if not args.num_experts:
        raise ValueError("--llep needs an MoE model: set --num-experts")
    if args.moe_token_dispatcher_type != "alltoall":
        raise ValueError(f"--llep extends Megatron's alltoall dispatcher: use --moe-token-dispatcher-type alltoall "
                         f"(got {args.moe_token_dispatcher_type})")
    from megatron.training.arguments import core_transformer_config_from_args

    expert_tp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    try:
        check_megatron_config(core_transformer_config_from_args(args), expert_tp)
    except ValueError as err:  # one problem per line there: one line here
        head, *problems = str(err).split("\n  - ")
        raise ValueError(f"{head} {'; '.join(problems)}") from None


def gpt_layer_spec(args: argparse.Namespace, config: Any, vp_stage: Optional[int] = None) -> Any:
    """The decoder spec Megatron-LM's ``gpt_builders.py`` picks (``--spec local`` is the local
    spec), with LLEP under ``--llep``."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.spec_utils import import_module

    use_te = args.transformer_impl == "transformer_engine" and args.spec != ["local"]
    if args.spec is not None and args.spec != ["local"]:
        spec = import_module(args.spec)
    elif args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm,
                                                          multi_latent_attention=args.multi_latent_attention)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention,
                                        normalization=args.normalization)
    if args.llep:
        spec = with_llep(spec, llep_config_from_flags(args))
    return spec


def _mtp_block_spec(args: argparse.Namespace, config: Any, vp_stage: Optional[int]) -> Any:
    """Multi-token prediction: the last decoder layer's spec (LLEP under ``--llep``), as gpt_builders.py."""
    if args.mtp_num_layers is None:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    use_te = args.transformer_impl == "transformer_engine" and args.spec != ["local"]
    layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te, normalization=args.normalization,
                                        qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
    if args.llep and args.num_experts:
        layer = with_llep(layer, llep_config_from_flags(args))
    return get_gpt_mtp_block_spec(config, layer, use_transformer_engine=use_te, vp_stage=vp_stage)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config: Any = None, pg_collection: Any = None) -> torch.nn.Module:
    """Megatron-LM model provider: a GPTModel from Megatron-LM's arguments, LLEP under ``--llep``,
    experts in ``--llep-placement``'s order when given."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    print_rank_0(f"building GPT model ({'LLEP' if args.llep else 'plain EP'}) ...")
    config = config if config is not None else core_transformer_config_from_args(args)
    if args.llep and not args.overlap_grad_reduce and config.no_sync_func is None:
        # Megatron-LM sets no_sync_func only with --overlap-grad-reduce (then DDP's no_sync); without it
        # DDP's no_sync would change nothing, and marking a step's earlier micro-batches tells LLEP which
        # backward is the step's last, from where kept gradients return behind the layers below
        config.no_sync_func = accumulating_gradients
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        mtp_block_spec=_mtp_block_spec(args, config, vp_stage),
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    if args.llep_placement is not None:
        if torch.cuda.is_available():  # the experts move between ranks over NCCL
            model.cuda(torch.cuda.current_device())
        apply_placement(model, _load_placement(args.llep_placement))
        print_rank_0(f"applied the expert placement {args.llep_placement}")
    return model


def layer_statistics() -> dict[str, float]:
    """Collective over the world group: this interval's LLEP statistics of every rank, merged per
    layer (token and byte counts summed over micro-batches, ratios averaged; then averaged over the
    ranks reporting a layer; the most rows a rank computed and the row budget: their maximum), keyed
    ``moe/layer_<n>/<statistic>``."""
    local = STATS.drain_by_layer()
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    merged: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for entry in gathered:
        for layer, row in entry.items():
            for key, value in row.items():
                merged[layer][key].append(value)
    return {f"{LOG_PREFIX}{layer}/{key}": merge_layer_statistic(key, values)
            for layer in sorted(merged) for key, values in merged[layer].items()}


def summary_line(metrics: dict[str, float]) -> str:
    """One stdout line about an interval's statistics."""
    active = [key for key in metrics if key.endswith("/llep_active")]
    if not active:
        return " LLEP: no MoE statistics this interval |"
    total = lambda name: sum(metrics[key.replace("llep_active", name)] for key in active)  # noqa: E731
    before = max(metrics[key.replace("llep_active", "max_mean_before")] for key in active)
    after = max(metrics[key.replace("llep_active", "max_mean_after")] for key in active)
    spilling = sum(metrics[key] > 0 for key in active)
    budget = budget_phrase(metrics)
    return (f" LLEP: {spilling}/{len(active)} layers spilled | max/mean load {before:.2f} -> {after:.2f} | "
            f"spilled tokens: {total('spilled_tokens'):.0f} | weights sent: {total('weight_bytes') / 2**20:.2f} MiB | "
            f"plan time: {total('plan_time_ms'):.2f} ms |" + (f" {budget} |" if budget else ""))


def write_statistics(metrics: dict[str, float], iteration: int) -> None:
    """Through Megatron-LM's writers (each exists on the last rank only, when configured)."""
    from megatron.training import get_tensorboard_writer, get_wandb_writer

    writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
    if writer:
        for key, value in metrics.items():
            writer.add_scalar(key, value, iteration)
    if wandb_writer and metrics:
        wandb_writer.log(metrics, iteration)


def install_llep_logging() -> None:
    """Log LLEP statistics with every Megatron-LM ``training_log`` call at ``--log-interval``: after
    Megatron-LM's own line and writes (``training_log`` runs on every rank, so the statistics
    gather is collective); the forwards of Megatron-LM's evaluations are not counted. Idempotent."""
    from megatron.training import get_args, training
    from megatron.training.utils import print_rank_last

    original = training.training_log
    if getattr(original, "llep_logging", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def training_log(*call_args: Any, **call_kwargs: Any) -> Any:
        result = original(*call_args, **call_kwargs)
        args = get_args()
        iteration = signature.bind(*call_args, **call_kwargs).arguments["iteration"]
        if args.llep and args.llep_record_stats and iteration % args.log_interval == 0:
            metrics = layer_statistics()
            write_statistics(metrics, iteration)
            print_rank_last(f" iteration {iteration:8d}/{args.train_iters:8d} |{summary_line(metrics)}")
        return result

    training_log.llep_logging = True  # type: ignore[attr-defined]
    training.training_log = training_log
    evaluate = training.evaluate

    @functools.wraps(evaluate)
    def evaluate_apart(*call_args: Any, **call_kwargs: Any) -> Any:
        """Megatron-LM's ``evaluate``, its forwards' LLEP statistics kept out of the training interval's."""
        with STATS.set_aside():
            return evaluate(*call_args, **call_kwargs)

    training.evaluate = evaluate_apart


def note_when_idle(args: argparse.Namespace) -> Optional[str]:
    """A line for the user when LLEP has nothing to do: ``--llep`` at EP = 1, or LLEP knobs
    (``--llep-*``; the placement aside, which plain EP uses too) without ``--llep``."""
    if args.llep and args.expert_model_parallel_size == 1:
        return "--llep with --expert-model-parallel-size 1: every expert is local, LLEP has no work (plain EP)"
    if not args.llep:
        given = tuning_flags_given(add_llep_args(argparse.ArgumentParser(add_help=False)), args)
        return ignored_tuning_note(given, "is off without --llep")
    return None

