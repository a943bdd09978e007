"""Fine-tune a Megatron-Core GPT MoE model (gpt-oss, DeepSeek-V3) with LLEP or plain EP.

CPU default (tiny gpt-oss, the shipped SFT data and byte tokenizer, gloo, 2 processes)::

    python -m torch.distributed.run --nproc_per_node 2 recipes/finetune.py

GPU, e.g. gpt-oss-20b on 8 GPUs with a local tokenizer and data::

    torchrun --nproc_per_node 8 recipes/finetune.py --recipe gpt-oss-20b --expert-model-parallel-size 8 \\
        --tokenizer /models/gpt-oss-20b --data sft.jsonl --seq-length 4096 --global-batch-size 64 \\
        --save ckpt --load ckpt --wandb-project llep

Megatron's own machinery does the work: GPTModel, DDP, the distributed optimizer, the
forward-backward schedules (gradient accumulation, pipeline parallelism), the LR scheduler and
dist_checkpointing. On CPU the gloo backend and megatron_llep.compat.cpu_gloo are used.
SIGTERM/SIGINT (e.g. slurm preemption) finish the current step, save (with --save) and exit.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402

quiet_known_cpu_warnings()  # before the first Megatron-Core import, which warns at import time

from megatron_llep.config import LLEPConfig, LLEPConfigError  # noqa: E402
from megatron_llep.cost_model import CostModel  # noqa: E402
from megatron_llep.writable import creation_problem  # noqa: E402
from recipes import data as sft_data  # noqa: E402
from recipes.models import RECIPES  # noqa: E402

if TYPE_CHECKING:
    from recipes import dashboard

# run_info entries a resumed run must share with the saved one
RESUME_MUST_MATCH = ("recipe", "seq_length", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size")


# the LLEPConfig field each LLEP flag sets (its validation messages name the flag)
LLEP_FLAGS = {"alpha": "--llep-alpha", "min_chunk_tokens": "--llep-min-chunk-tokens",
              "imbalance_threshold": "--llep-imbalance-threshold", "ranks_per_node": "--ranks-per-node"}
# numeric flags and their domains, checked before any process group or model exists
POSITIVE = ("train_iters", "micro_batch_size", "global_batch_size", "seq_length", "lr", "log_interval",
            "heatmap_interval", "trace_tokens_per_layer", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "expert_model_parallel_size", "save_interval", "exit_interval", "eval_interval", "eval_iters")
NON_NEGATIVE = ("min_lr", "lr_warmup_iters", "weight_decay", "clip_grad", "seed", "moe_aux_loss_coeff")
# validation global batches per evaluation without --eval-iters
DEFAULT_EVAL_ITERS = 10
# the sample order --valid-data is packed in: fixed, not --seed's, so that runs with other seeds are
# evaluated on the same windows
VALID_PACKING_SEED = 0
# seconds a rank other than 0 waits, after finding a usage error, for the launcher to end it once rank 0
# (which finds the same error) has reported it; then it reports the error itself
PEER_ERROR_GRACE_S = 30.0


def launch_rank() -> int:
    """This process's global rank before any process group exists (torchrun's RANK, srun's SLURM_PROCID)."""
    value = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return int(value) if value.isdigit() else 0


def wait_for_rank_zero_report() -> None:
    """On ranks other than 0: give rank 0 time to report an error every rank found, so the job prints it
    once (torchrun and ``srun --kill-on-bad-exit`` end this process when rank 0 exits)."""
    if launch_rank() != 0:
        time.sleep(PEER_ERROR_GRACE_S)


class RankZeroArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors (usage and one line, exit 2) are printed once per job, by rank 0."""

    def error(self, message: str) -> NoReturn:
        wait_for_rank_zero_report()
        super().error(message)


def _unwritable(directory: str) -> Optional[str]:
    """Why checkpoints or traces could not be written under ``directory`` (None: they can): tried
    with a real file, which also catches read-only mounts and immutable directories."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"{directory} is a file, not a directory"
    # the directory itself when it exists (a probe file goes into it), else where it will be created
    return creation_problem(os.path.join(directory, "probe") if os.path.isdir(directory) else directory)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = RankZeroArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--recipe", default="gpt-oss-tiny", choices=sorted(RECIPES))
    model.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    model.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                       help="the router's load-balancing loss coefficient while fine-tuning (default: the model's "
                            "own; 0 turns the loss off, as many post-training runs do)")
    model.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                       help="start from a Hugging Face checkpoint (config.json + *.safetensors, MXFP4/FP8 experts "
                            "dequantized): model sizes from its config.json, weights loaded right after the model is "
                            "built; --recipe picks the family (gpt-oss-20b/120b, deepseek-v3: config.json must match; "
                            "gpt-oss-tiny: any size). Ignored for the weights when resuming with --load")

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

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=None,
                          help="default: world size / (TP x PP)")

    ckpt = parser.add_argument_group("checkpointing")
    ckpt.add_argument("--save", default=None, help="directory to save checkpoints to (also on exit and on SIGTERM)")
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--exit-interval", type=int, default=None,
                      help="stop (and save, with --save) after an iteration divisible by this, e.g. a job time slice")
    ckpt.add_argument("--load", default=None, help="resume from this save directory (or one iter_* directory)")
    ckpt.add_argument("--pretrained", default=None, metavar="DIR",
                      help="start from the model weights of a Megatron-LM checkpoint (recipes/pretrain_gpt.py --save "
                           "DIR, or one iter_* directory): the model is rebuilt from the arguments it records "
                           "(--recipe is not used), the optimizer, schedule and iteration start fresh (Megatron-LM's "
                           "--finetune). Needs megatron-core >= 0.17. Ignored for the weights when resuming with --load")
    ckpt.add_argument("--checkpoint-verify", choices=["sha256", "size"], default="sha256",
                      help="what each checkpoint's manifest records and loading checks: every file's size and "
                           "SHA-256 (each rank hashes its own shards), or sizes only (no read-back, for huge "
                           "checkpoints); a damaged latest checkpoint falls back to the newest complete one")
    ckpt.add_argument("--watchdog-timeout", type=float, default=None, metavar="SECONDS",
                      help="end the job with a message when a rank makes no progress (a step, a save, a collective "
                           "waiting for a stopped or dead rank) for this long; collectives time out 30 s (or half "
                           "of it) later. Default 60 on CPU, 600 on GPU; 0 turns the watchdog off")

    log = parser.add_argument_group("logging")
    log.add_argument("--log-interval", type=int, default=1)
    log.add_argument("--wandb-project", default=None, help="enable wandb logging (offline unless --wandb-mode online)")
    log.add_argument("--wandb-exp-name", default=None, help="default: finetune-<recipe>")
    log.add_argument("--wandb-save-dir", default=None, help="default: <save>/wandb or ./runs/wandb")
    log.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], default=None,
                     help="default: $WANDB_MODE, else offline")
    log.add_argument("--heatmap-interval", type=int, default=10, help="log the expert-load heatmap every N steps")

    llep = parser.add_argument_group("LLEP")
    llep.add_argument("--no-llep", dest="llep", action="store_false", help="run plain expert parallelism")
    llep.add_argument("--llep-alpha", type=float, default=1.0)
    llep.add_argument("--llep-min-chunk-tokens", type=int, default=None, help="m (default 1024 on GPU, 16 on CPU)")
    llep.add_argument("--llep-imbalance-threshold", type=float, default=1.3, help="lambda")
    llep.add_argument("--llep-cost-aware", action=argparse.BooleanOptionalAction, default=True, help="plan by predicted layer time")
    llep.add_argument("--ranks-per-node", type=int, default=None, help="prefer helpers inside a node of this size")
    cap = parser.add_argument_group("CAP expert placement (docs/placement.md)")
    cap.add_argument("--placement", default=None, help="placement file (python -m megatron_llep.placement plan ...)")
    cap.add_argument("--record-routing-trace", default=None, metavar="DIR",
                     help="record every MoE router's choices; each rank writes DIR/trace_rank<r>.npz at the end")
    cap.add_argument("--trace-tokens-per-layer", type=int, default=16384,
                     help="bound on the recorded tokens per layer and rank (a uniform sample beyond it)")
    parser.add_argument(
        "--force-routing", default=None, metavar="F:H",
        help="demo/benchmark only: force a fraction F of tokens into H hot experts (Megatron router replay)",
    )
    args = parser.parse_args(argv)
    for names, holds, domain in ((POSITIVE, lambda v: v > 0, "positive"), (NON_NEGATIVE, lambda v: v >= 0, ">= 0")):
        for name in names:
            value = getattr(args, name)
            if value is not None and ((isinstance(value, float) and not math.isfinite(value)) or not holds(value)):
                parser.error(f"--{name.replace('_', '-')} must be {domain}, got {value}")
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} exceeds --lr {args.lr}; the schedule decays from --lr down to --min-lr")
    if args.seed >= 2**32:
        parser.error(f"--seed must be below 2**32, got {args.seed}")
    try:  # LLEPConfig's own rules, with the flag named
        LLEPConfig(alpha=args.llep_alpha, imbalance_threshold=args.llep_imbalance_threshold,
                   min_chunk_tokens=0 if args.llep_min_chunk_tokens is None else args.llep_min_chunk_tokens,
                   ranks_per_node=args.ranks_per_node)
    except LLEPConfigError as err:
        parser.error(err.for_flag(LLEP_FLAGS[err.knob]))
    if args.watchdog_timeout is not None and not (math.isfinite(args.watchdog_timeout) and args.watchdog_timeout >= 0):
        parser.error(f"--watchdog-timeout must be >= 0 seconds (0: off), got {args.watchdog_timeout}")
    if args.save_interval and not args.save:
        parser.error("--save-interval needs --save")
    for flag in ("eval_interval", "eval_iters"):
        if getattr(args, flag) is not None and args.valid_data is None:
            parser.error(f"--{flag.replace('_', '-')} needs --valid-data")
    if args.force_routing is not None:
        try:
            fraction, hot = args.force_routing.split(":")
            args.force_routing = (float(fraction), int(hot))
        except ValueError:
            parser.error(f"--force-routing expects F:H (e.g. 0.9:1), got {args.force_routing!r}")
        if not 0.0 <= args.force_routing[0] <= 1.0 or args.force_routing[1] < 1:
            parser.error(f"--force-routing F:H needs 0 <= F <= 1 and H >= 1, got {args.force_routing}")
        experts = None if args.hf_checkpoint or args.pretrained else RECIPES[args.recipe]().config.num_moe_experts  # else: build() checks
        if experts is not None and args.force_routing[1] > experts:
            parser.error(f"--force-routing F:H: H = {args.force_routing[1]} hot experts, but {args.recipe} has {experts}")
    for path, what in ((args.data, "--data"), (args.valid_data, "--valid-data"), (args.tokenizer, "--tokenizer"),
                       (args.placement, "--placement")):
        if path is not None and not os.path.exists(path):
            parser.error(f"{what}: {path} does not exist")
        if path is not None and what != "--tokenizer" and os.path.isdir(path):
            parser.error(f"{what}: {path} is a directory; give the file")
    for directory, what in ((args.save, "--save"), (args.record_routing_trace, "--record-routing-trace")):
        problem = directory and _unwritable(directory)
        if problem:
            parser.error(f"{what}: {problem}; give a writable directory")
    # --load == --save with nothing there yet: the first run of a resumable job (train() says so)
    load_is_save = args.load is not None and args.save is not None and \
        os.path.realpath(args.load) == os.path.realpath(args.save)
    if args.load is not None and not os.path.isdir(args.load) and not (load_is_save and not os.path.exists(args.load)):
        parser.error(f"--load: {args.load} is not a directory")
    if args.pretrained is not None:
        if not os.path.isdir(args.pretrained):
            parser.error(f"--pretrained: {args.pretrained} is not a directory")
        if args.hf_checkpoint is not None:
            parser.error("--pretrained and --hf-checkpoint both give the starting weights; choose one")
    if args.hf_checkpoint is not None:
        if not os.path.isdir(args.hf_checkpoint):
            parser.error(f"--hf-checkpoint: {args.hf_checkpoint} is not a directory")
        from recipes.hf.convert import ConversionError, family_key

        try:
            family_key(args.recipe)
        except ConversionError as err:
            parser.error(f"--hf-checkpoint with --recipe {args.recipe}: {err}")
    return args


def init_distributed(timeout: Optional[datetime.timedelta] = None) -> tuple[int, int, torch.device]:
    """Process group from torchrun's (or slurm's) environment: NCCL on GPUs, gloo + the CPU
    compatibility layer on CPU. ``timeout``: how long a collective may wait (None: torch's default)."""
    from recipes.launch_env import rendezvous_env_from_slurm

    try:
        rendezvous_env_from_slurm()
    except ValueError as err:  # inconsistent SLURM_* variables
        raise SystemExit(f"[finetune] error: {err}") from None
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun (python -m torch.distributed.run --nproc_per_node 2 recipes/finetune.py) "
                         "or srun (see launch/)")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout)
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)
    from megatron_llep.compat import cpu_gloo

    cpu_gloo.enable()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


class ConfigError(ValueError):
    """Parallel layout, batch or model settings that cannot work together."""


def hf_config_for(args: argparse.Namespace, checkpoint: Optional[str] = None) -> Optional[dict]:
    """The Hugging Face config.json the model's sizes come from: ``--hf-checkpoint``'s, else the one
    recorded in the ``checkpoint`` resumed from by a run that started from one (None: the recipe's sizes)."""
    if args.hf_checkpoint:
        from recipes.hf.checkpoint import HFCheckpoint, HFCheckpointError

        try:
            return HFCheckpoint(args.hf_checkpoint).config
        except HFCheckpointError as err:
            raise ConfigError(f"--hf-checkpoint: {err}") from None
    if checkpoint:
        return saved_run_info(checkpoint).get("hf_config")
    return None


def saved_run_info(directory: str) -> dict:
    """The ``run_info`` a fine-tuning checkpoint ``directory`` records (empty if none)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(directory).get("run_info", {})


def megatron_lm_arguments_for(args: argparse.Namespace, checkpoint: Optional[str] = None) -> Optional[argparse.Namespace]:
    """The Megatron-LM arguments the model is rebuilt from: ``--pretrained``'s checkpoint's, else the ones
    recorded in the ``checkpoint`` resumed from by a run that started from one (None: not such a model)."""
    from recipes import pretrained

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
    of a Megatron-LM checkpoint (``args.megatron_lm_args``, set by :func:`train` from ``--pretrained``)."""
    if getattr(args, "megatron_lm_args", None) is not None:
        from recipes import pretrained

        try:
            return pretrained.recipe_from_arguments(args.megatron_lm_args, source=args.pretrained, **kwargs)
        except pretrained.PretrainedError as err:
            raise ConfigError(str(err)) from None
    if hf_config is None:
        return RECIPES[args.recipe](**kwargs)
    from recipes.hf.convert import family_module

    family = family_module(args.recipe)
    fixed = getattr(family, "FIXED_SIZE_RECIPES", None)
    name = args.recipe if fixed is None or args.recipe in fixed else None
    try:
        return family.recipe_from_hf_config(hf_config, name, **kwargs)
    except ValueError as err:  # ConversionError: one line naming the config.json field
        source = args.hf_checkpoint or f"the config.json recorded in {args.load}"
        raise ConfigError(f"--hf-checkpoint {source}: {err}") from None


def parallel_layout(args: argparse.Namespace, world: int, num_experts: int) -> dict[str, int]:
    """TP/PP/EP/DP sizes and micro-batches per step, validated against the world and the model."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by TP x PP = {tp} x {pp}")
    dp = world // (tp * pp)
    ep = args.expert_model_parallel_size or dp * tp
    if (dp * tp) % ep:
        raise ConfigError(f"EP = {ep} must divide TP x DP = {tp * dp} (world {world} / PP {pp})")
    if num_experts % ep:
        raise ConfigError(f"{args.recipe} has {num_experts} experts, not divisible by EP = {ep}")
    global_batch = args.global_batch_size or args.micro_batch_size * dp
    if global_batch % (args.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {global_batch} is not a multiple of micro batch x DP = "
                          f"{args.micro_batch_size} x {dp}")
    return dict(tp=tp, pp=pp, ep=ep, dp=dp, global_batch=global_batch,
                num_microbatches=global_batch // (args.micro_batch_size * dp))


def llep_config(args: argparse.Namespace, on_gpu: bool) -> LLEPConfig:
    return LLEPConfig(
        alpha=args.llep_alpha,
        min_chunk_tokens=args.llep_min_chunk_tokens if args.llep_min_chunk_tokens is not None else (1024 if on_gpu else 16),
        imbalance_threshold=args.llep_imbalance_threshold,
        cost_aware=args.llep_cost_aware,
        # the tiny CPU recipes are priced against this CPU, not an H200 node
        cost_model=CostModel() if on_gpu else CostModel.cpu(),
        ranks_per_node=args.ranks_per_node,
    )


def _check_megatron_support(recipe, layout: dict[str, int]) -> None:
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


def build(args: argparse.Namespace, layout: dict[str, int], device: torch.device, vocab_needed: int, placement=None,
          hf_config: Optional[dict] = None, import_hf: Optional[str] = None, import_pretrained: Optional[str] = None):
    """GPTModel (LLEP or plain EP; experts in ``placement``'s order if given) wrapped in Megatron
    DDP, the distributed optimizer and the LR scheduler. ``hf_config``: model sizes from a Hugging
    Face config.json; ``import_hf`` / ``import_pretrained``: load that Hugging Face / Megatron-LM
    checkpoint's weights right after the model is built (before the placement, DDP and the optimizer)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_llep.layer import with_llep

    on_gpu = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if on_gpu else "fp32")]
    recipe = make_recipe(args, hf_config, ep_size=layout["ep"], tp_size=layout["tp"], pp_size=layout["pp"], dtype=dtype,
                         cpu=not on_gpu)
    if vocab_needed > recipe.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_needed} ids but {recipe.name}'s vocabulary is {recipe.vocab_size}")
    if args.seq_length > recipe.max_sequence_length:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds {recipe.name}'s {recipe.max_sequence_length}")
    if args.force_routing and not recipe.config.moe_enable_routing_replay:
        raise ConfigError("--force-routing needs Megatron's router replay (moe_enable_routing_replay), on in CPU recipes")
    if args.force_routing and args.force_routing[1] > recipe.config.num_moe_experts:
        raise ConfigError(f"--force-routing F:H: H = {args.force_routing[1]} hot experts, but the model has "
                          f"{recipe.config.num_moe_experts}")
    config = recipe.config
    _check_megatron_support(recipe, layout)
    config.calculate_per_token_loss = True  # exact per-token mean over micro-batches and DP ranks
    if args.moe_aux_loss_coeff is not None:
        set_aux_loss_coeff(config, args.moe_aux_loss_coeff, recipe.name)
    spec = recipe.layer_spec()
    if args.llep:
        spec = with_llep(spec, llep_config(args, on_gpu))
    model = GPTModel(
        config, spec, mtp_block_spec=recipe.mtp_spec(spec),
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        **recipe.gpt_model_kwargs(),
    )
    if on_gpu:
        model.cuda(device)
    if import_hf:
        _import_hf(import_hf, model, args.recipe)
    if import_pretrained:
        _import_pretrained(import_pretrained, model)
    if placement is not None:  # before DDP and the optimizer: they keep per-parameter buffers and state
        from megatron_llep.placement import apply_placement

        try:
            apply_placement(model, placement)
        except ValueError as err:
            raise ConfigError(f"--placement {args.placement}: {err}") from None
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


def set_aux_loss_coeff(config, coeff: float, model_name: str) -> None:
    """``--moe-aux-loss-coeff``: the coefficient of the router's one load-balancing loss (0: off)."""
    balancing = config.moe_router_load_balancing_type
    if not isinstance(balancing, str) or (balancing == "none" and coeff > 0):
        raise ConfigError(f"--moe-aux-loss-coeff {coeff}: {model_name}'s router has load-balancing loss {balancing!r}; "
                          "the flag sets the coefficient of a model's one balancing loss")
    config.moe_aux_loss_coeff = coeff


def run_info_for(args: argparse.Namespace, layout: dict[str, int], world: int, hf_config: Optional[dict] = None) -> dict:
    """What a checkpoint records about the run (RESUME_MUST_MATCH entries must match on resume)."""
    run_info = dict(recipe=args.recipe, seq_length=args.seq_length, world_size=world, llep=args.llep,
                    tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
                    expert_model_parallel_size=layout["ep"], data_parallel_size=layout["dp"],
                    global_batch_size=layout["global_batch"], micro_batch_size=args.micro_batch_size)
    if hf_config is not None:
        run_info["hf_config"] = hf_config  # the model's sizes, for resuming and exporting (python -m recipes.hf)
    if getattr(args, "megatron_lm_args", None) is not None:  # the model's arguments, for resuming
        run_info["megatron_lm_args"] = vars(args.megatron_lm_args)
    return run_info


def _import_hf(directory: str, model, recipe_name: str) -> None:
    from recipes.hf.convert import ConversionError, import_hf_checkpoint

    try:
        report = import_hf_checkpoint([model], directory, recipe_name)
    except ConversionError as err:
        raise ConfigError(f"--hf-checkpoint {directory}: {err}") from None
    if dist.get_rank() == 0:
        mib = 2**20
        print(f"[finetune] imported {directory} in {report.seconds:.1f} s: rank 0 read {report.bytes_read / mib:.1f} MiB "
              f"for its {report.param_bytes / mib:.1f} MiB of parameters, peak host memory "
              f"+{report.peak_overhead / mib:.1f} MiB during the import", flush=True)


def _import_pretrained(path: str, model) -> None:
    from recipes import pretrained

    start = time.perf_counter()
    try:
        directory = pretrained.load_weights(model, path)
    except pretrained.PretrainedError as err:
        raise ConfigError(str(err)) from None
    if dist.get_rank() == 0:
        print(f"[finetune] loaded the model weights of {directory} in {time.perf_counter() - start:.1f} s "
              "(optimizer, schedule and iteration start fresh)", flush=True)


def _moe_layers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


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


def _global_loss(reported: list[dict]) -> tuple[float, int]:
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
    loss, tokens = _global_loss(reported) if parallel_state.is_pipeline_last_stage() else (math.nan, 0)
    return loss, tokens, moe_metrics


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the masked per-token losses and the token count (Megatron's per-token-loss form)."""
    loss = (output_tensor.float() * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def _forward_step(device: torch.device, layers: list, args: argparse.Namespace, config, state: dict,
                  data_iterator, model):
    from megatron_llep.scenarios import force_routing, imbalanced_topk

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
    """SIGTERM/SIGINT set a flag; the loop agrees on it across ranks after each step."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._set)

    def _set(self, signum, _frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _llep_summary(metrics: dict[str, float]) -> str:
    active = [k for k in metrics if k.endswith("/llep_active")]
    if not active:
        return "plain EP"
    spilled = sum(metrics[k.replace("llep_active", "spilled_tokens")] for k in active)
    before = max(metrics[k.replace("llep_active", "max_mean_before")] for k in active)
    after = max(metrics[k.replace("llep_active", "max_mean_after")] for k in active)
    weight_kib = sum(metrics[k.replace("llep_active", "weight_bytes")] for k in active) / 1024
    plan_ms = sum(metrics[k.replace("llep_active", "plan_time_ms")] for k in active)
    spilling = sum(metrics[k] > 0 for k in active)
    return (f"LLEP {spilling}/{len(active)} layers spilled, max/mean {before:.2f} -> {after:.2f}, "
            f"{spilled:.0f} tokens spilled, {weight_kib:.0f} KiB weights, plan {plan_ms:.2f} ms")


def _save(args, model, optimizer, scheduler, progress, run_info: dict, placement, is_logger: bool) -> str:
    from recipes import checkpointing

    _progress(dist.get_rank(), f"saving iteration {progress.iteration} to {args.save}")
    start = time.perf_counter()
    directory = checkpointing.save_checkpoint(args.save, model, optimizer, scheduler, progress, run_info, placement,
                                              verify=args.checkpoint_verify)
    if is_logger:
        print(f"[finetune] saved {directory} in {time.perf_counter() - start:.1f} s", flush=True)
    return directory


def _load_placement(path: str):
    from megatron_llep.placement import ExpertPlacement

    try:
        return ExpertPlacement.load(path)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"--placement {path}: {err}") from None


def _fail(err: Exception, rank: int) -> NoReturn:
    """Bad input found on every rank alike: one message (rank 0's), exit status 2, no traceback."""
    wait_for_rank_zero_report()  # other ranks: the launcher ends them once rank 0 has printed and exited
    print(f"[finetune] error: {err}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    raise SystemExit(2)


def _progress(rank: int, message: str) -> None:
    """A line before a long phase (rank 0), so that a quiet minute is never a mystery; the phase is
    also the watchdog's (every rank)."""
    from recipes import watchdog

    watchdog.progress(message)
    if rank == 0:
        print(f"[finetune] {message}", flush=True)


def _check_memory(args: argparse.Namespace, layout: dict[str, int], device: torch.device, hf_config: Optional[dict]):
    """The parameter + gradient + optimizer memory per rank (estimated before building), refused with
    the numbers when it exceeds what the tightest rank has (``--no-memory-check``: only estimated)."""
    from recipes import memory

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
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
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from recipes import checkpointing, dashboard, watchdog

    started = time.perf_counter()
    timeout = args.watchdog_timeout
    if timeout is None:
        timeout = watchdog.default_timeout(torch.cuda.is_available())
    rank, world, device = init_distributed(watchdog.collective_timeout(timeout) if timeout else None)
    if timeout:
        watchdog.Watchdog(timeout, rank, world).start()
    is_logger = rank == world - 1  # holds the last pipeline stage (and its loss)
    try:
        resume_from = checkpointing.find_checkpoint(args.load, args.checkpoint_verify, allow_none=bool(
            args.save and os.path.realpath(args.load) == os.path.realpath(args.save))) if args.load else None
        _progress(rank, f"reading {args.data} (tokenizer {args.tokenizer})")
        tokenizer = sft_data.load_tokenizer(args.tokenizer)
        samples = sft_data.read_sft_jsonl(args.data, tokenizer)
        dataset = sft_data.PackedSFTDataset(samples, args.seq_length, seed=args.seed)
        hf_config = hf_config_for(args, resume_from)
        args.megatron_lm_args = megatron_lm_arguments_for(args, resume_from)
        num_experts = make_recipe(args, hf_config, cpu=device.type == "cpu").config.num_moe_experts
        layout = parallel_layout(args, world, num_experts)
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

    parallel_state.initialize_model_parallel(layout["tp"], layout["pp"], expert_model_parallel_size=layout["ep"],
                                             expert_tensor_parallel_size=1)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    try:
        placement = _load_placement(args.placement) if args.placement else None
        _progress(rank, f"building {f'the model of {args.pretrained}' if args.pretrained else args.recipe}: about {estimate.parameters / 1e6:,.1f} M parameters and "
                        f"{estimate.total_bytes / 2**30:,.2f} GiB with gradients and optimizer state per rank")
        recipe, model, optimizer, scheduler = build(args, layout, device, tokenizer.vocab_size, placement, hf_config,
                                                    import_hf=None if resuming else args.hf_checkpoint,
                                                    import_pretrained=None if resuming else args.pretrained)
    except ConfigError as err:
        _fail(err, rank)
    config = recipe.config
    layers = _moe_layers(model)
    if placement is not None:
        _progress(rank, f"applied the expert placement {args.placement} to MoE layer(s) "
                        f"{', '.join(map(str, sorted(placement.layers)))}")
    if args.llep and layout["ep"] == 1:
        _progress(rank, "LLEP has no work at EP=1 (every expert is on every rank): this runs as plain EP; "
                        "use 2+ expert-parallel ranks for LLEP to balance")

    run_info = run_info_for(args, layout, world, hf_config)
    progress = checkpointing.TrainingProgress()
    if resuming:
        _progress(rank, f"loading the checkpoint {resume_from}")
        try:
            progress = checkpointing.load_checkpoint(resume_from, model, optimizer, scheduler, run_info, RESUME_MUST_MATCH,
                                                    placement)
        except checkpointing.CheckpointError as err:
            _fail(err, rank)
        if is_logger:
            print(f"[finetune] resumed from {args.load} at iteration {progress.iteration} "
                  f"({progress.consumed_samples} samples consumed)", flush=True)
        if progress.iteration >= args.train_iters and is_logger:  # after the line above, from the same rank
            print(f"[finetune] nothing left to do: the checkpoint is at iteration {progress.iteration} and "
                  f"--train-iters is {args.train_iters}; raise --train-iters to train further", flush=True)

    recorder = None
    if args.record_routing_trace:
        from megatron_llep.placement import RoutingTraceRecorder

        recorder = RoutingTraceRecorder(model, max_tokens_per_layer=args.trace_tokens_per_layer, seed=args.seed + rank)
        recorder.start()
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
    forward_step = partial(_forward_step, device, layers, args, config, step_state)
    eval_state = {"microbatch": 0}
    eval_step = partial(_forward_step, device, layers, args, config, eval_state)
    stop = _StopRequest()
    tokens_per_step = layout["global_batch"] * args.seq_length
    last_loss = math.nan
    last_valid_loss = None  # after the first evaluation: its loss (nan off the last pipeline stage)
    last_saved = None
    first_iteration, loop_start = progress.iteration, time.perf_counter()
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
            forward_step_func=forward_step, data_iterator=iterator, model=[model],
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
            last_loss, loss_tokens = _global_loss(reported)
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
                      f"peak {metrics['memory/peak_gib']:.2f} GiB | {_llep_summary(metrics)}", flush=True)
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
                      f"ppl {ppl:.2f} | {valid_tokens:,} tokens | {eval_seconds:.3f} s | {_llep_summary(valid_moe)}",
                      flush=True)
        stopping = stop.agreed(device) or bool(args.exit_interval and progress.iteration % args.exit_interval == 0)
        if args.save and (stopping or (args.save_interval and progress.iteration % args.save_interval == 0)):
            last_saved = _save(args, model, optimizer, scheduler, progress, run_info, placement, is_logger)
        if stopping:
            if is_logger and progress.iteration < args.train_iters:
                print(f"[finetune] stopping at iteration {progress.iteration} of {args.train_iters}", flush=True)
            break
    watchdog.progress("the end of the run")
    if args.save and progress.iteration != checkpointing.latest_iteration(args.save):
        last_saved = _save(args, model, optimizer, scheduler, progress, run_info, placement, is_logger)
    if recorder is not None:
        recorder.stop()
        os.makedirs(args.record_routing_trace, exist_ok=True)
        recorder.trace().save(os.path.join(args.record_routing_trace, f"trace_rank{rank}.npz"))
        dist.barrier()
        if is_logger:
            print(f"[finetune] routing traces in {args.record_routing_trace}; plan a placement with: python -m "
                  f"megatron_llep.placement plan {args.record_routing_trace}/trace_rank*.npz --ep-size {layout['ep']} "
                  f"--out placement.json", flush=True)
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
                   wandb_dir=wandb_board.run_dir)
    watchdog.stop()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
