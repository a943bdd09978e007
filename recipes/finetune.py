"""Fine-tune a Megatron-Core GPT MoE model (gpt-oss, DeepSeek-V3) with LLEP or plain EP.

CPU default (tiny gpt-oss, the shipped SFT data and byte tokenizer, gloo, 2 processes)::

    python -m torch.distributed.run --nproc_per_node 2 recipes/finetune.py

GPU, e.g. gpt-oss-20b on 8 GPUs with a local tokenizer and data::

    torchrun --nproc_per_node 8 recipes/finetune.py --recipe gpt-oss-20b --expert-model-parallel-size 8 \\
        --tokenizer /models/gpt-oss-20b --data sft.jsonl --seq-length 4096 --global-batch-size 64 \\
        --save ckpt --load ckpt --wandb-project llep

Megatron's own machinery does the work: GPTModel, DDP, the distributed optimizer, the
forward-backward schedules (gradient accumulation, pipeline parallelism), the LR scheduler and
dist_checkpointing. On CPU the gloo backend and megatron_llep.testing.cpu_gloo are used.
SIGTERM/SIGINT (e.g. slurm preemption) finish the current step, save (with --save) and exit with
128 + the signal (143, 130) and one line saying how to resume.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402

quiet_known_cpu_warnings()  # before the first Megatron-Core import, which warns at import time

from recipes import data as sft_data  # noqa: E402
from recipes import model_building  # noqa: E402
from recipes.entry_point import (  # noqa: E402,F401 - launch_rank & co. are imported from here by tests
    PEER_ERROR_GRACE_S,
    EntryPoint,
    RankZeroArgumentParser,
    check_existing_files,
    check_numeric_domains,
    check_writable_directories,
    launch_rank,
    wait_for_rank_zero_report,
)
from recipes.model_building import (  # noqa: E402,F401 - imported from here by recipes/hf and tests
    ConfigError,
    hf_config_for,
    make_recipe,
    megatron_lm_arguments_for,
    model_dtype,
    moe_layers,
    parallel_layout,
    saved_run_info,
    set_aux_loss_coeff,
)

if TYPE_CHECKING:
    from recipes import dashboard

ENTRY = EntryPoint("finetune")
init_distributed = ENTRY.init_distributed
_fail = ENTRY.fail
_progress = ENTRY.progress

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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = RankZeroArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model_building.add_model_arguments(model)
    model.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                       help="the router's load-balancing loss coefficient while fine-tuning (default: the model's "
                            "own; 0 turns the loss off, as many post-training runs do)")

    data = parser.add_argument_group("data")
    data.add_argument("--data", default=sft_data.DEFAULT_DATA, help="SFT JSONL file (see recipes/data.py for the formats)")
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
    """The model of :func:`recipes.model_building.build_model` wrapped in Megatron DDP, the distributed
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

    from recipes import dashboard, watchdog

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


class _StopRequest:
    """SIGTERM/SIGINT record the signal; the loop agrees on it across ranks after each step."""

    def __init__(self) -> None:
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, signum, _frame) -> None:
        self.signum = max(self.signum, signum)

    def agreed(self, device: torch.device) -> int:
        """The signal some rank got (the highest number where they differ: SIGTERM over SIGINT), 0 if none."""
        flag = torch.tensor([float(self.signum)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def _save(args, model, optimizer, scheduler, progress, run_info: dict, placement, is_logger: bool) -> str:
    from recipes import checkpointing, watchdog

    _progress(dist.get_rank(), f"saving iteration {progress.iteration} to {args.save}")
    start = time.perf_counter()
    try:
        with watchdog.long_phases():
            directory = checkpointing.save_checkpoint(args.save, model, optimizer, scheduler, progress, run_info,
                                                      placement, verify=args.checkpoint_verify)
    except checkpointing.CheckpointSaveError as err:  # the run stops: going on would train what cannot be saved
        ENTRY.fail(err, dist.get_rank(), status=1)
    if is_logger:
        print(f"[finetune] saved {directory} in {time.perf_counter() - start:.1f} s", flush=True)
    return directory


def _check_memory(args: argparse.Namespace, layout: dict[str, int], device: torch.device, hf_config: Optional[dict]):
    """The parameter + gradient + optimizer memory per rank (estimated before building), refused with
    the numbers when it exceeds what the tightest rank has (``--no-memory-check``: only estimated)."""
    from recipes import memory

    dtype = model_dtype(args, device)
    recipe = make_recipe(args, hf_config, ep_size=layout["ep"], tp_size=layout["tp"], pp_size=layout["pp"], dtype=dtype,
                         cpu=device.type == "cpu")
    estimate = memory.estimate_training_memory(recipe, layout["tp"], layout["pp"], layout["ep"], layout["dp"], dtype)
    if args.memory_check:
        available = [None] * dist.get_world_size()  # every rank decides on the same numbers
        dist.all_gather_object(available, memory.available_memory(device))
        problem = memory.memory_shortfall(recipe.name, estimate, *min(available, key=lambda a: a[0] / a[1]))
        if problem:
            raise ConfigError(f"{problem}; use more ranks or nodes or a smaller recipe, or --no-memory-check to start "
                              "anyway")
    return estimate


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the fine-tuning loop; returns a summary (last loss, last validation loss or None, steps run,
    checkpoint) on every rank."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from recipes import checkpointing, dashboard, watchdog

    started = time.perf_counter()
    rank, world, device = ENTRY.start(args.watchdog_timeout)
    is_logger = rank == world - 1  # holds the last pipeline stage (and its loss)
    if args.save:
        ENTRY.lock_save_directory(args.save, rank)
    try:
        resume_from = checkpointing.find_checkpoint(args.load, args.checkpoint_verify, allow_none=bool(
            args.save and os.path.realpath(args.load) == os.path.realpath(args.save))) if args.load else None
        _progress(rank, f"reading {args.data} (tokenizer {args.tokenizer})")
        tokenizer = sft_data.load_tokenizer(args.tokenizer)
        samples = sft_data.read_sft_jsonl(args.data, tokenizer)
        dataset = sft_data.PackedSFTDataset(samples, args.seq_length, seed=args.seed)
        hf_config, layout = model_building.layout_for(args, world, device, resume_from)
        valid_set, eval_batches = None, 0
        if args.valid_data:
            _progress(rank, f"reading {args.valid_data}")
            valid_set, eval_batches = validation_set(args, tokenizer, layout["global_batch"])
        estimate = _check_memory(args, layout, device, hf_config)
    except (sft_data.DataError, ConfigError, checkpointing.CheckpointError) as err:
        _fail(err, rank)
    resuming = resume_from is not None
    if args.load and not resuming:  # --load == --save with nothing saved yet: the first run of a resumable job
        _progress(rank, f"nothing to resume in {args.load} yet: starting from scratch (later runs resume from it)")
    start_flag = "--pretrained" if args.pretrained else "--hf-checkpoint" if args.hf_checkpoint else None
    if resuming and start_flag:
        ENTRY.say(f"note: {start_flag} {args.pretrained or args.hf_checkpoint} is ignored: resuming from {resume_from}, "
                  f"whose weights continue the run ({start_flag} gives the starting weights of a run's first start)")

    model_building.initialize_model_parallel(layout, args.seed)
    try:
        placement = model_building.load_placement(args.llep_placement) if args.llep_placement else None
        built = f"the model of {resume_from}" if resuming else f"the model of {args.pretrained}" if args.pretrained \
            else args.recipe
        _progress(rank, f"building {built}: about {estimate.parameters / 1e6:,.1f} M parameters and "
                        f"{estimate.total_bytes / 2**30:,.2f} GiB with gradients and optimizer state per rank")
        recipe, model, optimizer, scheduler = build(args, layout, device, tokenizer.vocab_size, placement, hf_config,
                                                    import_hf=None if resuming else args.hf_checkpoint,
                                                    import_pretrained=None if resuming else args.pretrained)
    except ConfigError as err:
        _fail(err, rank)
    config = recipe.config
    layers = moe_layers(model)

    run_info = run_info_for(args, layout, world, hf_config)
    progress = checkpointing.TrainingProgress()
    if resuming:
        _progress(rank, f"loading the checkpoint {resume_from}")
        try:
            with watchdog.long_phases():
                progress = checkpointing.load_checkpoint(resume_from, model, optimizer, scheduler, run_info,
                                                        RESUME_MUST_MATCH, placement)
        except checkpointing.CheckpointError as err:
            _fail(err, rank)
        if is_logger:
            print(f"[finetune] resumed from {args.load} at iteration {progress.iteration} "
                  f"({progress.consumed_samples} samples consumed)", flush=True)
        if progress.iteration >= args.train_iters and is_logger:  # after the line above, from the same rank
            print(f"[finetune] nothing left to do: the checkpoint is at iteration {progress.iteration} and "
                  f"--train-iters is {args.train_iters}; raise --train-iters to train further", flush=True)

    recorder = model_building.start_routing_trace(model, args, rank)
    flops_per_token = dashboard.model_flops_per_token(model, config, args.seq_length)
    load_meter = dashboard.MoELoadMeter(model)
    wandb_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else os.path.join("runs", "wandb"))
    wandb_board = dashboard.WandbDashboard(
        project=args.wandb_project, name=args.wandb_exp_name or f"finetune-{args.recipe}", directory=wandb_dir,
        mode=args.wandb_mode if args.wandb_project else "disabled", config=dict(vars(args), **run_info),
    )
    if is_logger:
        print(f"[finetune] {recipe.name} on {world} {device.type} ranks: TP={layout['tp']} PP={layout['pp']} "
              f"EP={layout['ep']} DP={layout['dp']}, {'LLEP' if args.llep else 'plain EP'}; {len(samples)} samples, "
              f"{dataset.num_windows} sequences of {args.seq_length}; global batch {layout['global_batch']} = "
              f"{layout['num_microbatches']} micro-batch(es) x {args.micro_batch_size} x DP {layout['dp']}", flush=True)
        if args.force_routing:
            print(f"[finetune] forcing routing: {args.force_routing[0]:.0%} of tokens into "
                  f"{args.force_routing[1]} hot expert(s)", flush=True)
        if valid_set is not None:
            requested = args.eval_iters or DEFAULT_EVAL_ITERS
            capped = f"; --eval-iters {requested} capped to the {eval_batches} it holds" \
                if eval_batches < requested else ""
            every = f"every {args.eval_interval} iterations and " if args.eval_interval else ""
            print(f"[finetune] validation: {eval_batches} global batch(es) of {args.valid_data} "
                  f"({eval_batches * layout['global_batch']} of its {valid_set.num_windows} sequences) "
                  f"{every}after iteration {args.train_iters}{capped}", flush=True)

    forward_backward = get_forward_backward_func()
    step_state = {"microbatch": 0}  # forced-routing seeds: a function of (iteration, micro-batch), resumable
    train_step = partial(forward_step, device, layers, args, config, step_state)
    eval_state = {"microbatch": 0}
    eval_step = partial(forward_step, device, layers, args, config, eval_state)
    stop = _StopRequest()
    tokens_per_step = layout["global_batch"] * args.seq_length
    last_loss = math.nan
    last_valid_loss = None  # after the first evaluation: its loss (nan off the last pipeline stage)
    last_saved = None
    first_iteration, loop_start = progress.iteration, time.perf_counter()
    signalled = 0  # the signal that stopped the run
    while progress.iteration < args.train_iters:
        watchdog.progress(f"step {progress.iteration + 1}")
        iterator = sft_data.micro_batches(dataset, progress.consumed_samples, args.micro_batch_size,
                                          parallel_state.get_data_parallel_rank(), layout["dp"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step_state["microbatch"] = progress.iteration * layout["num_microbatches"]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reported = forward_backward(
            forward_step_func=train_step, data_iterator=iterator, model=[model],
            num_microbatches=layout["num_microbatches"], seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        progress.iteration += 1
        progress.consumed_samples += layout["global_batch"]

        if parallel_state.is_pipeline_last_stage():
            last_loss, loss_tokens = global_loss(reported)
            if loss_tokens == 0 and is_logger:
                print(f"[finetune] step {progress.iteration}: the global batch has no loss tokens (every label is "
                      "masked, e.g. prompts longer than --seq-length): its loss is undefined (nan)", flush=True)
        if progress.iteration % args.log_interval == 0 or progress.iteration == args.train_iters:
            peak = torch.tensor([float(dashboard.peak_memory_bytes())], device=device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            moe_metrics, heatmap, heat_layers = dashboard.gather_moe_metrics(load_meter)
            metrics = {
                "train/loss": last_loss,
                "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "train/lr": optimizer.param_groups[0]["lr"],
                "time/step_s": elapsed,
                "throughput/tokens_per_sec": tokens_per_step / elapsed,
                "throughput/tokens_per_sec_per_gpu": tokens_per_step / elapsed / world,
                "throughput/tflops_per_gpu": flops_per_token * tokens_per_step / elapsed / world / 1e12,
                "memory/peak_gib": peak.item() / 2**30,
                **moe_metrics,
            }
            show_heatmap = progress.iteration % args.heatmap_interval == 0 or progress.iteration == args.train_iters
            wandb_board.log(progress.iteration, metrics, heatmap if show_heatmap else None, heat_layers)
            if is_logger:
                print(f"[finetune] step {progress.iteration}/{args.train_iters} | loss {last_loss:.4f} | "
                      f"grad norm {metrics['train/grad_norm']:.3f} | lr {metrics['train/lr']:.2e} | "
                      f"{metrics['throughput/tokens_per_sec']:,.0f} tokens/s "
                      f"({metrics['throughput/tokens_per_sec_per_gpu']:,.0f}/GPU, "
                      f"{metrics['throughput/tflops_per_gpu']:.3f} TFLOP/s/GPU) | step {elapsed:.3f} s | "
                      f"peak {metrics['memory/peak_gib']:.2f} GiB | {dashboard.llep_summary(metrics)}", flush=True)
        if valid_set is not None and (progress.iteration == args.train_iters or bool(
                args.eval_interval and progress.iteration % args.eval_interval == 0)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            eval_start = time.perf_counter()
            last_valid_loss, valid_tokens, valid_moe = evaluate(model, forward_backward, eval_step, eval_state,
                                                                valid_set, eval_batches, args, layout,
                                                                progress.iteration, load_meter)
            if device.type == "cuda":
                torch.cuda.synchronize()
            eval_seconds = time.perf_counter() - eval_start
            ppl = float(torch.tensor(last_valid_loss, dtype=torch.float64).exp())  # inf, not an error, past e^709
            wandb_board.log(progress.iteration, {"valid/loss": last_valid_loss, "valid/ppl": ppl,
                                                 "valid/tokens": valid_tokens})
            if is_logger:
                print(f"[finetune] validation at step {progress.iteration} | loss {last_valid_loss:.4f} | "
                      f"ppl {ppl:.2f} | {valid_tokens:,} tokens | {eval_seconds:.3f} s | {dashboard.llep_summary(valid_moe)}",
                      flush=True)
        signalled = stop.agreed(device)
        stopping = bool(signalled or (args.exit_interval and progress.iteration % args.exit_interval == 0))
        if args.save and (stopping or (args.save_interval and progress.iteration % args.save_interval == 0)):
            last_saved = _save(args, model, optimizer, scheduler, progress, run_info, placement, is_logger)
        if stopping:
            if is_logger and progress.iteration < args.train_iters and not signalled:  # main() reports a signal
                print(f"[finetune] stopping at iteration {progress.iteration} of {args.train_iters}", flush=True)
            break
    watchdog.progress("the end of the run")
    if args.save and progress.iteration != checkpointing.latest_iteration(args.save):
        last_saved = _save(args, model, optimizer, scheduler, progress, run_info, placement, is_logger)
    model_building.save_routing_trace(recorder, args, rank, layout["ep"], ENTRY)
    wandb_board.finish()
    if is_logger:
        steps = progress.iteration - first_iteration
        saved = f"saved in {last_saved}" if last_saved else f"nothing new saved in {args.save}" if args.save else \
            "not saved (no --save)"
        print(f"[finetune] done: {steps} step(s) this run, now at iteration {progress.iteration}/{args.train_iters}, "
              f"{steps * tokens_per_step:,} tokens in {time.perf_counter() - loop_start:.1f} s "
              f"({time.perf_counter() - started:.1f} s with start-up), final loss {last_loss:.4f}, "
              f"{'' if last_valid_loss is None else f'validation loss {last_valid_loss:.4f}, '}{saved}", flush=True)
    summary = dict(iteration=progress.iteration, loss=last_loss, valid_loss=last_valid_loss, checkpoint=last_saved,
                   wandb_dir=wandb_board.run_dir, stopped_by=signalled)
    ENTRY.finish()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Fine-tune; a run a signal stopped exits with 128 + the signal after saving, a rank that died
    ends the others in one line (:class:`recipes.entry_point.EntryPoint`)."""
    args = parse_args(argv)
    with ENTRY.ending_cleanly():
        summary = train(args)
    if summary["stopped_by"]:
        ENTRY.stopped_by(summary["stopped_by"], summary["iteration"], summary["checkpoint"], args.save, args.load)


if __name__ == "__main__":
    main()
