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
import time
from functools import partial
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings

quiet_known_cpu_warnings()  # before the first Megatron-Core import, which warns at import time

from recipes.runtime import finetuning, model_building, sft_data  # noqa: E402
from recipes.runtime.finetuning import (  # noqa: E402
    DEFAULT_EVAL_ITERS,
    ENTRY,
    RESUME_MUST_MATCH,
    build,
    evaluate,
    forward_step,
    global_loss,
    run_info_for,
    validation_set,
)
from recipes.runtime.model_building import ConfigError, make_recipe, model_dtype, moe_layers  # noqa: E402

init_distributed = ENTRY.init_distributed
_fail = ENTRY.fail
_progress = ENTRY.progress


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """This entry point's flags (:func:`recipes.runtime.finetuning.parse_args`) with its usage text."""
    return finetuning.parse_args(argv, __doc__)


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
    from recipes.runtime import checkpointing, watchdog

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
    from recipes.runtime import memory

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

    from recipes.runtime import checkpointing, dashboard, watchdog

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
    ends the others in one line (:class:`recipes.runtime.entry_point.EntryPoint`)."""
    args = parse_args(argv)
    with ENTRY.ending_cleanly():
        summary = train(args)
    if summary["stopped_by"]:
        ENTRY.stopped_by(summary["stopped_by"], summary["iteration"], summary["checkpoint"], args.save, args.load)


if __name__ == "__main__":
    main()
