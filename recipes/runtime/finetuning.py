"""The fine-tuning run's pieces that recipes/finetune.py shares with ``python -m recipes.hf import``
and the evaluation entry points: its flags, the model with Megatron DDP, the distributed optimizer
and the LR schedule, what a checkpoint records about the run, the forward step and the validation
loop."""

from __future__ import annotations

import argparse
import math
import os
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from recipes.runtime import model_building
from recipes.runtime import sft_data
from recipes.runtime.entry_point import (EntryPoint, RankZeroArgumentParser, check_existing_files, check_numeric_domains,
                                         check_writable_directories)
from recipes.runtime.model_building import model_dtype

if TYPE_CHECKING:
    from recipes.runtime import dashboard

ENTRY = EntryPoint("finetune")  # fine-tuning's lines, "[finetune] ...", errors once per job from rank 0

# run_info entries a resumed run must share with the saved one
RESUME_MUST_MATCH = ("recipe", "seq_length", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size")


# numeric flags and their domains, checked before any process group or model exists
POSITIVE = ("train_iters", "micro_batch_size", "global_batch_size", "seq_length", "lr", "log_interval",
            "heatmap_interval", "save_interval", "exit_interval", "eval_interval", "eval_iters",
            *model_building.POSITIVE_FLAGS)


NON_NEGATIVE = ("min_lr", "lr_warmup_iters", "weight_decay", "clip_grad", "seed", "moe_aux_loss_coeff")


# validation global batches per evaluation without --eval-iters
DEFAULT_EVAL_ITERS = 10


# the sample order --valid-data is packed in: fixed, not --seed's, so that runs with other seeds are
# evaluated on the same windows
VALID_PACKING_SEED = 0


def parse_args(argv: Optional[Sequence[str]] = None, description: Optional[str] = None) -> argparse.Namespace:
    """recipes/finetune.py's flags, checked (usage errors exit 2 from rank 0); ``description``: its usage text."""
    parser = RankZeroArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model_building.add_model_arguments(model)
    model.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                       help="the router's load-balancing loss coefficient while fine-tuning (default: the model's "
                            "own; 0 turns the loss off, as many post-training runs do)")

    data = parser.add_argument_group("data")
    data.add_argument("--data", default=sft_data.DEFAULT_DATA, help="SFT JSONL file (see recipes/runtime/sft_data.py for the formats)")
    data.add_argument("--tokenizer", default=sft_data.DEFAULT_TOKENIZER,
                      help="local tokenizer.json (file or directory) or a byte-tokenizer file")
    data.add_argument("--valid-data", default=None, metavar="PATH",
                      help="validation JSONL file (the formats of --data): evaluated after the last iteration and "
                           "every --eval-interval iterations")
    data.add_argument("--eval-interval", type=int, default=None,
                      help="evaluate every N iterations too (default: only after the last one); needs --valid-data")
    data.add_argument("--eval-iters", type=int, default=None,
                      help=f"validation global batches per evaluation, the same ones from the start of --valid-data "
                           f"each time (default {DEFAULT_EVAL_ITERS}, capped at what it holds); needs --valid-data")

    train = parser.add_argument_group("training")
    train.add_argument("--train-iters", type=int, default=6)
    train.add_argument("--micro-batch-size", type=int, default=2)
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="default: micro batch x data-parallel size (no gradient accumulation)")
    train.add_argument("--seq-length", type=int, default=64)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--min-lr", type=float, default=1e-4)
    train.add_argument("--lr-warmup-iters", type=int, default=1)
    train.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="cosine")
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--memory-check", action=argparse.BooleanOptionalAction, default=True,
                       help="refuse to start when the estimated parameter + gradient + optimizer memory per rank "
                            "exceeds the memory available (GPU memory, or host memory shared by a node's ranks); "
                            "--no-memory-check starts anyway")

    model_building.add_parallel_arguments(parser)

    ckpt = parser.add_argument_group("checkpointing")
    ckpt.add_argument("--save", default=None, help="directory to save checkpoints to (also on exit and on SIGTERM)")
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--exit-interval", type=int, default=None,
                      help="stop (and save, with --save) after an iteration divisible by this, e.g. a job time slice")
    ckpt.add_argument("--load", default=None, help="resume from this save directory (or one iter_* directory)")
    model_building.add_checkpoint_reading_arguments(ckpt)

    log = parser.add_argument_group("logging")
    log.add_argument("--log-interval", type=int, default=1)
    model_building.add_wandb_arguments(log, "finetune-<recipe>", "<save>/wandb or ./runs/wandb")
    log.add_argument("--heatmap-interval", type=int, default=10, help="log the expert-load heatmap every N steps")
    model_building.add_llep_arguments(parser)
    args = parser.parse_args(argv)
    check_numeric_domains(parser, args, POSITIVE, NON_NEGATIVE)
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} exceeds --lr {args.lr}; the schedule decays from --lr down to --min-lr")
    if args.seed >= 2**32:
        parser.error(f"--seed must be below 2**32, got {args.seed}")
    model_building.check_checkpoint_reading_arguments(parser, args)
    if args.save_interval and not args.save:
        parser.error("--save-interval needs --save")
    for flag in ("eval_interval", "eval_iters"):
        if getattr(args, flag) is not None and args.valid_data is None:
            parser.error(f"--{flag.replace('_', '-')} needs --valid-data")
    model_building.check_llep_arguments(parser, args, recipe_is_known=not (args.hf_checkpoint or args.pretrained))
    check_existing_files(parser, [(args.data, "--data"), (args.valid_data, "--valid-data"),
                                  (args.tokenizer, "--tokenizer")], directories_allowed=["--tokenizer"])
    check_writable_directories(parser, [(args.save, "--save")])
    model_building.check_wandb_arguments(parser, args)
    # --load == --save with nothing there yet: the first run of a resumable job (train() says so)
    load_is_save = args.load is not None and args.save is not None and \
        os.path.realpath(args.load) == os.path.realpath(args.save)
    if args.load is not None and not os.path.isdir(args.load) and not (load_is_save and not os.path.exists(args.load)):
        parser.error(f"--load: {args.load} is not a directory")
    model_building.check_model_arguments(parser, args)
    return args


def build(args: argparse.Namespace, layout: dict[str, int], device: torch.device, vocab_needed: int, placement=None,
          hf_config: Optional[dict] = None, import_hf: Optional[str] = None, import_pretrained: Optional[str] = None):
    """The model of :func:`recipes.runtime.model_building.build_model` wrapped in Megatron DDP, the distributed
    optimizer and the LR scheduler (the arguments are build_model's)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = model_dtype(args, device)
    recipe, model = model_building.build_model(args, layout, device, vocab_needed, placement, hf_config, import_hf,
                                               import_pretrained, say=ENTRY.say)
    config = recipe.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                        clip_grad=args.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                        use_distributed_optimizer=True),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=max(args.train_iters, args.lr_warmup_iters + 1), lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant",
    )
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return recipe, model, optimizer, scheduler


def run_info_for(args: argparse.Namespace, layout: dict[str, int], world: int, hf_config: Optional[dict] = None) -> dict:
    """What a checkpoint records about the run (RESUME_MUST_MATCH entries must match on resume)."""
    run_info = dict(recipe=args.recipe, seq_length=args.seq_length, world_size=world, llep=args.llep,
                    tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
                    expert_model_parallel_size=layout["ep"], data_parallel_size=layout["dp"],
                    global_batch_size=layout["global_batch"], micro_batch_size=args.micro_batch_size,
                    tokenizer=os.path.abspath(args.tokenizer))
    if hf_config is not None:
        run_info["hf_config"] = hf_config  # the model's sizes, for resuming and exporting (python -m recipes.hf)
    if getattr(args, "megatron_lm_args", None) is not None:  # the model's arguments, for resuming
        run_info["megatron_lm_args"] = vars(args.megatron_lm_args)
    return run_info


def validation_set(args: argparse.Namespace, tokenizer: sft_data.Tokenizer,
                   global_batch: int) -> tuple[sft_data.PackedSFTDataset, int]:
    """``--valid-data`` read and packed like ``--data`` (in a fixed order) and the global batches an
    evaluation takes: ``--eval-iters``, capped at the whole global batches the data holds."""
    samples = sft_data.read_sft_jsonl(args.valid_data, tokenizer)
    try:
        dataset = sft_data.PackedSFTDataset(samples, args.seq_length, seed=VALID_PACKING_SEED)
    except sft_data.DataError as err:  # too short: name the file, as read errors do
        raise sft_data.DataError(f"--valid-data {args.valid_data}: {err}") from None
    batches = min(args.eval_iters or DEFAULT_EVAL_ITERS, dataset.num_windows // global_batch)
    if batches == 0:
        raise sft_data.DataError(f"--valid-data {args.valid_data} holds {dataset.num_windows} sequence(s) of "
                                 f"{args.seq_length} tokens, fewer than one global batch of {global_batch}")
    return dataset, batches


def global_loss(reported: list[dict]) -> tuple[float, int]:
    """Per-token mean loss and loss-token count of the micro-batches' ``"lm loss"`` sums, over every
    data-parallel rank (collective over the DP group; last pipeline stage only)."""
    from megatron.core import parallel_state

    totals = torch.stack([r["lm loss"] for r in reported]).sum(dim=0)
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return (float(totals[0] / totals[1]) if totals[1] > 0 else math.nan), int(totals[1])


def evaluate(model: torch.nn.Module, forward_backward: Callable, forward_step: Callable, step_state: dict,
             dataset: sft_data.PackedSFTDataset, batches: int, args: argparse.Namespace, layout: dict[str, int],
             iteration: int, load_meter: dashboard.MoELoadMeter) -> tuple[float, int, dict[str, float]]:
    """Validation after ``iteration``: Megatron's schedule forward only, in eval mode without autograd
    (LLEP balancing as in training), over the first ``batches`` global batches of ``dataset``. The
    same windows every time, so values compare across evaluations and between LLEP and plain EP.

    Returns the per-token mean loss and its token count (last pipeline stage; nan and 0 elsewhere)
    and these forwards' MoE metrics, kept apart from the training steps'. Collective (all ranks)."""
    from megatron.core import parallel_state

    from recipes.runtime import dashboard, watchdog

    iterator = sft_data.micro_batches(dataset, 0, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                                      layout["dp"])
    step_state["microbatch"] = 0  # forced routing: the same seeds at every evaluation
    reported = []
    model.eval()
    with torch.no_grad(), dashboard.moe_metrics_apart(load_meter):
        for batch in range(batches):
            watchdog.progress(f"validation batch {batch + 1}/{batches} after step {iteration}")
            reported += forward_backward(
                forward_step_func=forward_step, data_iterator=iterator, model=[model],
                num_microbatches=layout["num_microbatches"], seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True,
            )
        moe_metrics, _, _ = dashboard.gather_moe_metrics(load_meter)
    model.train()
    loss, tokens = global_loss(reported) if parallel_state.is_pipeline_last_stage() else (math.nan, 0)
    return loss, tokens, moe_metrics


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the masked per-token losses and the token count (Megatron's per-token-loss form)."""
    loss = (output_tensor.float() * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def forward_step(device: torch.device, layers: list, args: argparse.Namespace, config, state: dict,
                 data_iterator, model):
    """Megatron's forward-step function: the next micro-batch through ``model`` with its per-token loss;
    with ``--force-routing``, every MoE layer's routing first forced (seeded by micro-batch, rank, layer)."""
    from megatron_llep.runtime.forced_routing import force_routing
    from megatron_llep.planning.scenarios import imbalanced_topk

    batch = next(data_iterator)
    tokens = torch.from_numpy(batch["tokens"]).to(device)
    labels = torch.from_numpy(batch["labels"]).to(device)
    loss_mask = torch.from_numpy(batch["loss_mask"]).to(device)
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    if args.force_routing:
        fraction, hot = args.force_routing
        state["microbatch"] += 1
        for i, layer in enumerate(layers):
            seed = args.seed + 1_000_003 * state["microbatch"] + 1009 * dist.get_rank() + i
            ids = imbalanced_topk(tokens.numel(), config.num_moe_experts, config.moe_router_topk, fraction, hot, seed=seed)
            force_routing(layer.router, ids)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, loss_mask)
