"""The whole model on its own routing, 2 CPU ranks: routing traces per domain, and training-step and
evaluation (forward-only) tokens/s of plain EP, LLEP and the force-balanced ideal, side by side.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/model_cpu.py \\
        --pretrained ~/.cache/megatron_llep/runs/pretrain --corpus ~/.cache/megatron_llep/corpus \\
        --label pretrained [--trace-dir recipes/data/routing_traces] [--out results/model_cpu_pretrained.json]
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/model_cpu.py \\
        --load ~/.cache/megatron_llep/runs/finetune_legal --corpus ... --label finetuned

The model comes from a Megatron-LM checkpoint (``--pretrained``, recipes/pretrain_gpt.py) or a
fine-tuning checkpoint (``--load``, recipes/finetune.py), built and loaded by the fine-tuning entry
point's own code. Each domain's held-out text (``<domain>_valid.jsonl`` + ``<domain>_test.jsonl`` of
recipes/corpus.py) is packed into sequences of ``--seq-length``.

* Traces (``--trace-dir``): ``--trace-tokens`` tokens per domain, forward-only, one sequence per
  micro-batch (so a trace's rows are whole sequences back to back), both ranks' tokens merged into
  ``<label>_<domain>.npz`` (megatron_llep.placement.trace format).
* Timing: per domain, ``--repeats`` rounds; each round runs plain EP (the LLEP layer with
  ``enabled=False``: Megatron's alltoall code), LLEP, and the ideal (plain EP with every router
  forced to a balanced top-K through Megatron's router replay: the same compute with perfectly
  balanced loads) one after the other in a rotating order, ``--steps`` timed steps each after one
  warm-up step: a training step (forward, backward and an optimizer step at a negligible learning
  rate, so the routing does not drift between modes) and an evaluation step (forward only, eval
  mode). The median over rounds of each mode's mean step time, slowest rank. Routing: the model's
  own (``real``), the ideal's forced balanced.
* Peak memory per rank: the rise of the resident set during one training step of each mode
  (benchmarks/cpu_memory.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from typing import Callable, Optional

import numpy as np

from common import print_table, write_results
from megatron_llep.writable import write_text
from cpu_memory import malloc_for, peak_rss_rise

MODES = ("EP", "LLEP", "ideal")


def _parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pretrained", help="Megatron-LM checkpoint (recipes/pretrain_gpt.py --save)")
    source.add_argument("--load", help="fine-tuning checkpoint (recipes/finetune.py --save)")
    parser.add_argument("--corpus", required=True, help="recipes/corpus.py output directory")
    parser.add_argument("--label", required=True, help="names the model in the rows and trace files")
    parser.add_argument("--domains", nargs="+", default=["code", "prose", "legal"])
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode and round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of EP / LLEP / ideal")
    parser.add_argument("--trace-dir", default=None, help="write <label>_<domain>.npz routing traces here")
    parser.add_argument("--trace-tokens", type=int, default=32768, help="tokens per domain in a trace (both ranks)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=None, help="default: results/model_cpu_<label>.json")
    return parser.parse_args(argv)


def _set_mode(layers: list, mode: str, balanced_ids: Callable[[], np.ndarray]) -> None:
    """LLEP on or off in every MoE layer, and the routers forced to balanced top-K for the ideal."""
    from megatron_llep.runtime.forced_routing import force_routing

    for layer in layers:
        config = dataclasses.replace(layer.llep_config, enabled=mode == "LLEP")
        layer.llep_config = layer.token_dispatcher.llep_config = config
        force_routing(layer.router, balanced_ids() if mode == "ideal" else None)


def _note_trace(bench: argparse.Namespace, path: str, domain: str, sequences: int, ep: int) -> None:
    """Record where a trace came from in the trace directory's manifest.json (recipes/runtime/routing_traces.py)."""
    manifest_path = os.path.join(bench.trace_dir, "manifest.json")
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {"traces": {}}
    corpus_manifest = os.path.join(bench.corpus, "manifest.json")
    manifest["traces"][os.path.basename(path)] = dict(
        model=bench.label, domain=domain, checkpoint=bench.pretrained or bench.load,
        data=f"{domain}_valid.jsonl + {domain}_test.jsonl of recipes/corpus.py (held-out text)",
        corpus_versions=json.load(open(corpus_manifest)).get("versions") if os.path.exists(corpus_manifest) else None,
        sequences=sequences, seq_length=bench.seq_length, tokens=sequences * bench.seq_length, micro_batch_size=1,
        token_order="whole sequences back to back, in corpus order", expert_parallel_size=ep, mode="forward-only",
        date=time.strftime("%Y-%m-%d"))
    write_text(manifest_path, json.dumps(manifest, indent=1, sort_keys=True))


def main() -> None:
    bench = _parse()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_llep.integrations.routing_traces import RoutingTraceRecorder
    from megatron_llep.runtime.state import STATS
    from megatron_llep.placement.trace import merge_traces
    from megatron_llep.planning.scenarios import imbalanced_topk
    from recipes.runtime import checkpointing, finetuning, model_building, sft_data

    tokenizer_path = os.path.join(bench.corpus, "tokenizer", "tokenizer.json")
    common = ["--tokenizer", tokenizer_path, "--data", os.path.join(bench.corpus, f"{bench.domains[0]}_valid.jsonl"),
              "--seq-length", str(bench.seq_length), "--micro-batch-size", str(bench.micro_batch_size),
              "--lr", "1e-12", "--min-lr", "0", "--lr-warmup-iters", "0", "--weight-decay", "0",
              "--train-iters", "1000000", "--watchdog-timeout", "0"]
    args = finetuning.parse_args(common + (["--pretrained", bench.pretrained] if bench.pretrained else []))
    rank, world, device = finetuning.ENTRY.init_distributed()
    resume = checkpointing.find_checkpoint(bench.load) if bench.load else None
    args.megatron_lm_args = model_building.megatron_lm_arguments_for(args, resume)
    if args.megatron_lm_args is None:
        raise SystemExit("model_cpu.py: --load must be a fine-tuning run started from --pretrained")
    layout = model_building.parallel_layout(args, world, args.megatron_lm_args.num_experts)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=layout["ep"], expert_tensor_parallel_size=1)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    tokenizer = sft_data.load_tokenizer(tokenizer_path)
    recipe, model, optimizer, scheduler = finetuning.build(args, layout, device, tokenizer.vocab_size,
                                                         import_pretrained=bench.pretrained)
    if resume:
        checkpointing.load_model_weights(resume, model)
    config = recipe.config
    layers = model_building.moe_layers(model)
    forward_backward = get_forward_backward_func()
    rng = np.random.default_rng(1234 + rank)
    tokens_per_micro = bench.micro_batch_size * bench.seq_length

    def balanced() -> np.ndarray:
        return imbalanced_topk(tokens_per_micro, config.num_moe_experts, config.moe_router_topk, 0.0, 0,
                               seed=int(rng.integers(2**31)))

    def run_steps(dataset, first: int, count: int, forward_only: bool, micro_batch: int = bench.micro_batch_size) -> float:
        """``count`` global batches from window ``first`` on; returns the slowest rank's mean step time."""
        model.train(not forward_only)
        iterator = sft_data.micro_batches(dataset, first, micro_batch, parallel_state.get_data_parallel_rank(), layout["dp"])
        forward_step = functools.partial(finetuning.forward_step, device, layers, args, config, {"microbatch": 0})
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            if forward_only:
                with torch.no_grad():
                    forward_backward(forward_step_func=forward_step, data_iterator=iterator, model=[model],
                                     num_microbatches=1, seq_length=bench.seq_length, micro_batch_size=micro_batch,
                                     forward_only=True)
            else:
                model.zero_grad_buffer()
                optimizer.zero_grad()
                forward_backward(forward_step_func=forward_step, data_iterator=iterator, model=[model],
                                 num_microbatches=1, seq_length=bench.seq_length, micro_batch_size=micro_batch,
                                 forward_only=False)
                optimizer.step()
        elapsed = torch.tensor([(time.perf_counter() - start) / count])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        model.train()
        return float(elapsed)

    rows = []
    malloc_for(timing=True)
    for domain in bench.domains:
        samples = []
        for split in ("valid", "test"):
            path = os.path.join(bench.corpus, f"{domain}_{split}.jsonl")
            if os.path.exists(path):
                samples += sft_data.read_sft_jsonl(path, tokenizer)
        dataset = sft_data.PackedSFTDataset(samples, bench.seq_length, seed=0)
        held_out_tokens = dataset.num_windows * bench.seq_length
        if bench.trace_dir:
            _set_mode(layers, "EP", balanced)
            sequences = max(1, min(bench.trace_tokens, held_out_tokens) // bench.seq_length // layout["dp"])
            recorder = RoutingTraceRecorder(model, max_tokens_per_layer=None).start()
            run_steps(dataset, 0, sequences, forward_only=True, micro_batch=1)
            recorder.stop()
            traces = [None] * world
            dist.all_gather_object(traces, recorder.trace())
            if rank == 0:
                # rank r read sequences r, r + dp, ...: interleave them back into corpus order
                merged = merge_traces(traces)
                for number, layer in merged.layers.items():
                    per_rank = [t.layers[number].expert_ids.reshape(sequences, bench.seq_length, -1) for t in traces]
                    layer.expert_ids = np.stack(per_rank, axis=1).reshape(-1, per_rank[0].shape[-1])
                merged.sources = [f"{bench.label} model ({bench.pretrained or bench.load}), {domain} held-out text "
                                  f"(valid+test), {sequences * world} sequences of {bench.seq_length} tokens, "
                                  f"EP={layout['ep']}, forward-only"]
                path = os.path.join(bench.trace_dir, f"{bench.label}_{domain}.npz")
                merged.save(path)
                _note_trace(bench, path, domain, sequences * world, layout["ep"])
                print(f"[model_cpu] {domain}: trace of {sequences * world * bench.seq_length} tokens in {path}", flush=True)
        step_times = {(mode, kind): [] for mode in MODES for kind in ("train", "eval")}
        stats_before, stats_after = [], []
        for round_ in range(bench.repeats):
            for mode in MODES[round_ % 3:] + MODES[: round_ % 3]:
                _set_mode(layers, mode, balanced)
                first = int(rng.integers(dataset.num_windows)) if rank == 0 else 0
                first_t = torch.tensor([first])
                dist.broadcast(first_t, 0)
                for kind in ("train", "eval"):
                    run_steps(dataset, int(first_t), 1, kind == "eval")  # warm-up
                    step_times[(mode, kind)].append(run_steps(dataset, int(first_t), bench.steps, kind == "eval"))
                if mode == "LLEP":
                    for stats in STATS.drain().values():
                        stats_before += [stat.max_mean_before for stat in stats]
                        stats_after += [stat.max_mean_after for stat in stats]
        row = {"model": bench.label, "domain": domain, "routing": "real (ideal: forced balanced)",
               "held_out_tokens": held_out_tokens, "tokens_per_step": tokens_per_micro * layout["dp"],
               "llep_max_mean_before": float(np.mean(stats_before)) if stats_before else None,
               "llep_max_mean_after": float(np.mean(stats_after)) if stats_after else None}
        for (mode, kind), times in step_times.items():
            median = statistics.median(times)
            row[f"{mode}_{kind}_s"] = median
            row[f"{mode}_{kind}_tokens_per_s"] = row["tokens_per_step"] / median
        for kind in ("train", "eval"):
            row[f"ep_over_llep_{kind}"] = row[f"EP_{kind}_s"] / row[f"LLEP_{kind}_s"]
            row[f"llep_over_ideal_{kind}"] = row[f"LLEP_{kind}_s"] / row[f"ideal_{kind}_s"]
        if bench.memory:
            for mode in MODES:
                _set_mode(layers, mode, balanced)
                peak = torch.tensor([float(peak_rss_rise(lambda: run_steps(dataset, 0, 1, False)))])
                peaks = [torch.zeros(1) for _ in range(world)]
                dist.all_gather(peaks, peak)
                row[f"{mode}_peak_mb_per_rank"] = [float(p) / 1e6 for p in peaks]
        rows.append(row)
        if rank == 0:
            print(f"[model_cpu] {bench.label}/{domain}: train tokens/s EP {row['EP_train_tokens_per_s']:,.0f} LLEP "
                  f"{row['LLEP_train_tokens_per_s']:,.0f} ideal {row['ideal_train_tokens_per_s']:,.0f}; eval tokens/s EP "
                  f"{row['EP_eval_tokens_per_s']:,.0f} LLEP {row['LLEP_eval_tokens_per_s']:,.0f} ideal "
                  f"{row['ideal_eval_tokens_per_s']:,.0f}", flush=True)
    if rank == 0:
        print_table(rows, [
            ("model", "model", ""), ("domain", "domain", ""),
            ("llep_max_mean_before", "max/mean EP", ".2f"), ("llep_max_mean_after", "max/mean LLEP", ".2f"),
            ("EP_train_tokens_per_s", "train EP tok/s", ",.0f"), ("LLEP_train_tokens_per_s", "train LLEP tok/s", ",.0f"),
            ("ideal_train_tokens_per_s", "train ideal tok/s", ",.0f"), ("ep_over_llep_train", "EP/LLEP train", ".2f"),
            ("llep_over_ideal_train", "LLEP/ideal train", ".2f"),
            ("EP_eval_tokens_per_s", "eval EP tok/s", ",.0f"), ("LLEP_eval_tokens_per_s", "eval LLEP tok/s", ",.0f"),
            ("ideal_eval_tokens_per_s", "eval ideal tok/s", ",.0f"), ("ep_over_llep_eval", "EP/LLEP eval", ".2f"),
            ("llep_over_ideal_eval", "LLEP/ideal eval", ".2f"),
        ])
        write_results(bench.out or f"results/model_cpu_{bench.label}.json", "model_cpu", rows,
                      dict(vars(bench), ep=layout["ep"], recipe=recipe.name))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
