"""Pretrain a GPT (MoE) model with Megatron-LM's own training loop, LLEP one flag away.

This is Megatron-LM's ``pretrain_gpt.py`` (``megatron.training.pretrain``: its flags, data loaders,
schedules, checkpoints, TensorBoard/wandb logging) on Megatron's indexed datasets
(``GPTDataset`` built by ``BlendedMegatronDatasetBuilder`` from ``.bin``/``.idx`` prefixes, blended,
with train/valid/test splits), plus the plugin :mod:`megatron_llep.integrations.megatron_lm`: ``--llep`` and the
``--llep-*`` flags, ``--llep-placement``, and per-layer LLEP statistics at ``--log-interval``.
Needs megatron-core >= 0.17 (``megatron.training``). See docs/pretrain.md.

CPU (gloo, 2 ranks; the flags a CPU run needs are added)::

    python recipes/make_indexed_dataset.py recipes/data/tiny_sft.jsonl --output-prefix /tmp/tiny
    python -m torch.distributed.run --nproc_per_node 2 recipes/pretrain_gpt.py --llep \\
        --data-path /tmp/tiny_text_document --split 90,5,5 --tokenizer-type NullTokenizer --vocab-size 258 \\
        --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 \\
        --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall \\
        --micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 1e-3 --eval-iters 2 --log-interval 1 \\
        --force-routing 0.9:1

Supervised like the other entry points (recipes/runtime/entry_point.py): ``--watchdog-timeout`` (Megatron-LM's
``--distributed-timeout-minutes`` is set above it), one line when another rank died, the ranks stop
with a killed torchrun, no process of a rank outlives it when it is killed mid-save, and a run that
``--exit-signal-handler`` stopped exits with 128 + the signal after saving.
"""

from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from functools import partial  # noqa: E402
from typing import Iterator, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402

quiet_known_cpu_warnings()  # before the first Megatron-Core import, which warns at import time

from recipes.runtime import watchdog  # noqa: E402
from recipes.runtime.entry_point import EntryPoint  # noqa: E402

PREFIX = "[pretrain_gpt]"
ENTRY = EntryPoint("pretrain_gpt")


def _rank() -> int:
    """This process's global rank from the launcher's environment (torch.distributed is not up yet)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _fail(message: str) -> None:
    """A usage error: one line, exit status 2, no traceback. Every rank finds it: rank 0 reports it and
    the launcher ends the others, which wait for that first (and report it themselves only if rank 0
    did not find it), so the line is printed once."""
    from recipes.runtime import entry_point

    entry_point.wait_for_rank_zero_report()
    print(f"{PREFIX} error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _say(message: str) -> None:
    """A note from rank 0."""
    if _rank() == 0:
        print(f"{PREFIX} {message}", flush=True)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's flags plus LLEP's and this script's own."""
    from megatron_llep.integrations.megatron_lm import add_llep_args

    add_llep_args(parser)
    watchdog.add_argument(parser.add_argument_group("watchdog"))
    parser.add_argument_group("demo").add_argument(
        "--force-routing", default=None, metavar="F:H",
        help="demo/benchmark only: force a fraction F of tokens into H hot experts (Megatron's router replay)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """This script's checks (one-line ``ValueError``; recipes/runtime/pretrain_checks.py): forced routing,
    ``--load``, the directories Megatron-LM writes logs and caches into, ``--save`` and the data
    prefixes."""
    from megatron_llep.compat import megatron_training
    from recipes.runtime import pretrain_checks

    if args.force_routing is not None:
        try:
            fraction, hot = args.force_routing.split(":")
            args.force_routing = (float(fraction), int(hot))
        except ValueError:
            raise ValueError(f"--force-routing expects F:H (e.g. 0.9:1), got {args.force_routing!r}") from None
        if not 0.0 <= args.force_routing[0] <= 1.0 or not 1 <= args.force_routing[1] <= (args.num_experts or 0):
            raise ValueError(f"--force-routing F:H needs 0 <= F <= 1 and 1 <= H <= --num-experts, got {args.force_routing}")
        args.moe_enable_routing_replay = True  # becomes the TransformerConfig field the model is built with
    pretrain_checks.check_load(args)
    pretrain_checks.check_output_directories(args)
    prefixes = [] if args.mock_data else pretrain_checks.data_prefixes(args)
    if not args.mock_data and not prefixes:
        raise ValueError("no data: give --data-path PREFIX (.bin/.idx from recipes/make_indexed_dataset.py), "
                         "--train-data-path/--valid-data-path/--test-data-path, or --mock-data")
    if not args.save and not prefixes:
        return
    vocab_size = megatron_training.tokenizer_vocab_size(args)
    pretrain_checks.check_save(args, vocab_size)
    vocabulary = " ".join(f"--{name.replace('_', '-')} {getattr(args, name)}"
                          for name in ("tokenizer_type", "tokenizer_model", "vocab_size") if getattr(args, name))
    pretrain_checks.check_data(prefixes, vocab_size, vocabulary, _say)


def unfuse_expert_activation(args: argparse.Namespace) -> Optional[str]:
    """Turn off Megatron's bias-activation fusion where its expert MLP cannot run it, and say so.

    Megatron-Core's MLP scales an expert's activation by the router probabilities inside the fused
    kernel only for swiglu and quick-geglu; with the default gelu (``--bias-gelu-fusion`` is on unless
    ``--no-bias-gelu-fusion`` or ``--disable-bias-linear``) every MoE model fails in its first step
    ("Only support fusion of swiglu and quick_gelu with per_token_scale in MLP")."""
    fused_gated = args.swiglu or getattr(args, "quick_geglu", False)
    if not args.num_experts or fused_gated or not args.bias_gelu_fusion:
        return None
    args.bias_gelu_fusion = False
    return ("Megatron-Core's expert MLP fuses only swiglu and quick-geglu with the router probabilities: "
            "running the activation unfused (--no-bias-gelu-fusion; exact gelu instead of the fused tanh form)")


def is_dataset_built_on_rank(vp_stage: Optional[int] = None) -> bool:
    """Every rank of the first and last pipeline stages reads its own batches (tensor-parallel ranks
    of one data-parallel rank read the same samples), so no batch broadcast is needed."""
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage)


def dataset_config(args: argparse.Namespace):
    """Megatron's GPTDatasetConfig from its flags (as Megatron-LM's pretrain_gpt.py)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage: Optional[int] = None):
    """Blended GPT datasets with train/valid/test splits from the indexed ``.bin``/``.idx`` data."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset, train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage), dataset_config(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its own loader


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """This rank's micro-batch (nothing on middle pipeline stages), sliced for context parallelism."""
    from megatron.core import parallel_state

    from megatron_llep.compat.megatron_training import batch_on_this_cp_rank

    if not is_dataset_built_on_rank(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    batch = {key: batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None for key in keys}
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = batch_on_this_cp_rank(batch, parallel_state.get_context_parallel_group())
    return tuple(batch[key] for key in keys)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed masked per-token loss, its token count, and Megatron-LM's ``lm loss`` report."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


class _ForcedRouting:
    """``--force-routing``: every MoE router's choices for a micro-batch, seeded by (iteration,
    micro-batch, rank, layer) so that a resumed run forces the same routing; with
    ``--llep-placement`` the chosen experts are sent to the slots the placement moved them to."""

    def __init__(self) -> None:
        self.iteration: Optional[int] = None
        self.microbatch = 0
        self.placement = None

    def apply(self, model: torch.nn.Module, tokens: torch.Tensor, args: argparse.Namespace) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from megatron_llep.placement import ExpertPlacement
        from megatron_llep.runtime.forced_routing import force_routing
        from megatron_llep.planning.scenarios import imbalanced_topk

        if args.curr_iteration != self.iteration:
            self.iteration, self.microbatch = args.curr_iteration, 0
            self.placement = ExpertPlacement.load(args.llep_placement) if args.llep_placement else None
        self.microbatch += 1
        fraction, hot = args.force_routing
        for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
            seed = (args.seed + 1_000_003 * self.iteration + 10_007 * self.microbatch
                    + 1009 * torch.distributed.get_rank() + int(layer.layer_number))
            ids = imbalanced_topk(tokens.numel(), args.num_experts, args.moe_router_topk, fraction, hot, seed=seed)
            if self.placement is not None:  # the hot experts are the model's, wherever the placement put them
                ids = self.placement.expert_to_slot(int(layer.layer_number))[ids]
            force_routing(layer.router, ids)


_FORCED_ROUTING = _ForcedRouting()


def forward_step(data_iterator, model: torch.nn.Module):
    """One micro-batch forward (Megatron-LM's ``forward_step``)."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args, get_timers

    args = get_args()
    # the watchdog's phase: the step Megatron-LM runs (curr_iteration steps are done), or an evaluation after one
    watchdog.progress(f"{'step' if model.training else 'validation after step'} {args.curr_iteration + 1}")
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    if args.force_routing and tokens is not None:
        _FORCED_ROUTING.apply(model, tokens, args)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Check the installation and the flags, then run ``megatron.training.pretrain``."""
    from megatron_llep.integrations import megatron_lm
    from megatron_llep.compat import megatron_training
    from recipes.runtime.launch_env import rendezvous_env_from_slurm

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rendezvous_env_from_slurm()  # srun with one task per process: RANK, WORLD_SIZE, ... from SLURM_*
        megatron_lm.precheck_llep_flags(argv)
    except ValueError as err:
        _fail(str(err))
    reason = megatron_training.missing_reason()
    if reason is not None:
        _fail(f"{reason}; Megatron-LM's loop needs megatron-core >= 0.17, which pip installs on Python 3.12 only: "
              "on Python 3.11 run bash .ci/install_megatron_core.sh 0.19.2 in the environment (docs/compat.md)")
    if not torch.cuda.is_available():
        from megatron_llep.testing import megatron_training_cpu

        megatron_training_cpu.enable()
        try:
            cpu_argv = megatron_training_cpu.cpu_argv(argv)
        except ValueError as err:
            _fail(str(err))
        if len(cpu_argv) > len(argv) and _rank() == 0:
            print(f"{PREFIX} CPU run (gloo): added {' '.join(cpu_argv[len(argv):])}", flush=True)
        argv = cpu_argv
    try:
        watchdog_timeout, argv = watchdog.megatron_lm_timeouts(argv, torch.cuda.is_available())
    except ValueError as err:
        _fail(str(err))
    sys.argv = [sys.argv[0], *argv]
    if "--wandb-project" in argv and "WANDB_MODE" not in os.environ:
        # Megatron-LM's wandb.init goes online and fails without a key; the other entry points default to offline
        os.environ["WANDB_MODE"] = "offline"
        if _rank() == 0:
            print(f"{PREFIX} wandb runs offline (sync later with wandb sync; WANDB_MODE=online to log live)", flush=True)
    try:
        megatron_training.check_dataset_helpers()
    except RuntimeError as err:
        _fail(str(err))
    megatron_training.use_dataset_helpers()

    from megatron.training import set_startup_timestamps

    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    # Megatron-LM's pretrain_gpt.py defaults, and an evaluation interval where 0.19 has none
    args_defaults = {"tokenizer_type": "GPT2BPETokenizer", "eval_interval": 1000}
    megatron_lm.install_llep_logging()
    ENTRY.watch(watchdog_timeout, _rank(), int(os.environ.get("WORLD_SIZE", "1")))
    megatron_training.hook_checkpoint_saves(_checkpoint_saving)
    megatron_training.record_signal_stops()
    with ENTRY.ending_cleanly():
        try:
            megatron_training.run_pretrain(
                add_args, args_defaults, _precheck_parsed_args, _check_parsed_args,
                watchdog.during("building the datasets", train_valid_test_datasets_provider, long=True),
                watchdog.during("building the model", megatron_lm.model_provider, long=True), forward_step)
        except megatron_training.ArgumentsRefused as err:
            _fail(f"Megatron-LM refused the arguments: {err}")
        except SystemExit as end:  # Megatron-LM exits with 0 after a signal too
            if end.code not in (0, None) or megatron_training.signal_stop() is None:
                raise
    watchdog.stop()
    _report_signal_stop()


def _lock_save_directories(args: argparse.Namespace) -> None:
    """One run per save directory, as in fine-tuning: rank 0 takes the lock (recipes/runtime/save_lock.py) of
    every directory the parsed arguments will save into (any spelling of the flags), once it knows
    the directory is writable."""
    from recipes.runtime import pretrain_checks, save_lock

    if _rank() != 0:
        return
    try:
        for directory, flag in pretrain_checks.save_directories(args):
            pretrain_checks.check_writable(directory, flag)
            save_lock.acquire(directory, _say, flag)
    except (ValueError, OSError) as err:  # SaveDirectoryInUse is a ValueError, OutputError an OSError
        _fail(str(err))


def _precheck_parsed_args(args: argparse.Namespace) -> None:
    """The save directories' locks, then the flags Megatron-LM's validation would refuse with a bare
    assertion, named (a usage error ends the run)."""
    from recipes.runtime import pretrain_checks

    _lock_save_directories(args)
    try:
        pretrain_checks.precheck_args(args)
    except ValueError as err:
        _fail(str(err))


@contextlib.contextmanager
def _checkpoint_saving(iteration: int, async_save: bool) -> Iterator[None]:
    """Around each of Megatron-LM's checkpoint saves: a long watchdog phase, and no process of this rank
    left behind if it is killed meanwhile: Megatron-Core's result Manager (~300 MB, and the resource
    tracker it starts) is not made for a synchronous save, and forked writers die with the rank. An
    asynchronous save keeps the Manager (its writer process reports through it). A synchronous save
    that fails on any rank (a full disk) leaves no partial ``iter_*`` directory and the "latest" file
    as it was, and ends the run in one line from rank 0 (exit status 1)."""
    from megatron_llep.compat import mcore
    from recipes.runtime import checkpointing

    watchdog.progress(f"saving iteration {iteration}", long=True)
    if not async_save:
        mcore.collect_checkpoint_writes_in_process()
    try:
        with checkpointing.writers_die_with_this_process(), checkpointing.agreed_saves():
            yield
    except checkpointing.CheckpointSaveError as err:  # the run stops: going on would train what cannot be saved
        ENTRY.fail(err, _rank(), status=1)
    watchdog.progress(f"after saving iteration {iteration}")


def _report_signal_stop() -> None:
    """After ``--exit-signal-handler`` stopped the run (and saved, with ``--save``): its one line and exit
    status 128 + the signal; nothing otherwise."""
    from megatron.training import get_args

    from megatron_llep.compat import megatron_training

    stop = megatron_training.signal_stop()
    if stop is None:
        return
    signum, iteration = stop
    args = get_args()
    checkpoint = os.path.join(args.save, f"iter_{iteration:07d}") if args.save else None  # Megatron-LM's layout
    ENTRY.stopped_by(signum, iteration, checkpoint, args.save, args.load)


def _check_parsed_args(args: argparse.Namespace) -> None:
    """This script's and LLEP's checks on Megatron-LM's validated arguments (a usage error ends the
    run), and the note when ``--llep`` has nothing to do."""
    from megatron_llep.integrations import megatron_lm

    try:
        check_args(args)  # first: a --load of another entry point's checkpoint is named before its expert order
        megatron_lm.check_llep_args(args)
    except ValueError as err:
        _fail(str(err))
    fusion_note = unfuse_expert_activation(args)
    if fusion_note and _rank() == 0:
        print(f"{PREFIX} note: {fusion_note}", flush=True)
    if _rank() == 0:
        megatron_lm.record_checkpoint_placement(args)
    note = megatron_lm.note_when_idle(args)
    if note and _rank() == 0:
        print(f"{PREFIX} note: {note}", flush=True)


if __name__ == "__main__":
    main()
