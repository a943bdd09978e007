"""Inference on the model trained on real text (docs/real_routing.md), CPU ranks over gloo: what CAP's
routing pruning costs in perplexity, and prefill / generation speed of plain EP, LLEP, CAP placement
and pruning, side by side in one run.

    # perplexity against p: CAP device pruning and naive expert pruning, 8 ranks (EP = 8, two
    # emulated nodes of 4: --llep-ranks-per-node 4 --cross-node-cost 4), sequential and CAP placement
    python launch/torchrun.py --nproc_per_node 8 benchmarks/inference_cpu.py accuracy \\
        --pretrained ~/.cache/megatron_llep/runs/pretrain --corpus ~/.cache/megatron_llep/corpus \\
        --llep-ranks-per-node 4 --cross-node-cost 4
    # prefill and generation tokens/s, 2 ranks, modes in rotating rounds
    python launch/torchrun.py --nproc_per_node 2 benchmarks/inference_cpu.py speed \\
        --pretrained ~/.cache/megatron_llep/runs/pretrain --corpus ~/.cache/megatron_llep/corpus

``accuracy``: per domain, the first ``--max-tokens`` tokens of its held-out split (``--split``, the
indexed dataset of recipes/corpus.py) in ``--seq-length`` windows, evaluated by evaluate.py's own
code (exact token-weighted loss) once without pruning and once per (placement, method, p); each row
records perplexity and the ``prune/*`` statistics (devices per token, dropped token-expert pairs,
all-to-all bytes). The CAP placement is planned (lambda 0.5) from the shipped routing trace of the
same model and domain (recipes/data/routing_traces, recorded on the valid and test splits).
"Matched" rows put each CAP point beside the naive pruning at the same devices per token
(linear interpolation along naive's p grid). Routing: the model's own (real).

``speed``: ``--repeats`` rounds over the modes in rotating order; each mode runs ``--prefill-batches``
evaluation batches (prefill tokens/s, forward only) and generates ``--new-tokens`` greedy tokens
for ``--prompts`` held-out prompts through generate.py's engine (decode tokens/s); medians over
rounds, slowest rank. Routing: the model's own (real).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Optional

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")  # Megatron's engine draws a progress bar per rank and batch

from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402

quiet_known_cpu_warnings()

from common import print_table, write_results  # noqa: E402

NAIVE, CAP = "experts", "devices"


def _parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["accuracy", "speed"])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pretrained", help="Megatron-LM checkpoint (recipes/pretrain_gpt.py --save)")
    source.add_argument("--load", help="fine-tuning checkpoint (recipes/finetune.py --save)")
    parser.add_argument("--corpus", required=True, help="recipes/corpus.py output directory")
    parser.add_argument("--label", default=None, help="the model's name in rows and trace files (default: "
                                                       "pretrained / finetuned by source)")
    parser.add_argument("--domains", nargs="+", default=["legal", "prose", "code"])
    parser.add_argument("--split", default="valid", choices=["valid", "test"])
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16384, help="held-out tokens per domain (accuracy)")
    parser.add_argument("--p", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3, 0.4, 0.5])
    parser.add_argument("--llep-ranks-per-node", type=int, default=None)
    parser.add_argument("--cross-node-cost", type=float, default=4.0)
    parser.add_argument("--trace-dir", default=None, help="default: recipes/data/routing_traces")
    parser.add_argument("--repeats", type=int, default=3, help="speed: rounds over the modes")
    parser.add_argument("--prefill-batches", type=int, default=4, help="speed: evaluation batches per mode and round")
    parser.add_argument("--prompts", type=int, default=4, help="speed: prompts generated per mode and round")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="speed: tokens of each prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="speed: greedy tokens generated per prompt")
    parser.add_argument("--speed-p", type=float, default=0.2, help="speed: p of the pruned modes")
    parser.add_argument("--out", default=None, help="default: results/inference_cpu_<part>_<label>.json")
    bench = parser.parse_args(argv)
    bench.label = bench.label or ("pretrained" if bench.pretrained else "finetuned")
    return bench


class Harness:
    """The model built by evaluate.py's own code, and one evaluation of a domain's held-out text."""

    def __init__(self, bench: argparse.Namespace) -> None:
        import torch.distributed as dist

        from recipes import evaluate
        from recipes.runtime import model_building, model_sources

        self.bench = bench
        first = os.path.join(bench.corpus, "indexed", f"{bench.domains[0]}_{bench.split}_text_document")
        argv = ["--data", first, "--seq-length", str(bench.seq_length), "--micro-batch-size",
                str(bench.micro_batch_size), "--watchdog-timeout", "0",
                "--tokenizer", os.path.join(bench.corpus, "tokenizer", "tokenizer.json")]
        argv += ["--pretrained", bench.pretrained] if bench.pretrained else ["--load", bench.load]
        if bench.llep_ranks_per_node:
            argv += ["--llep-ranks-per-node", str(bench.llep_ranks_per_node)]
        self.args = args = evaluate.parse_args(argv)
        self.rank, self.world, self.device = evaluate.ENTRY.start(args.watchdog_timeout)
        source = model_sources.open_source(args, evaluate.ENTRY, self.rank)
        self.tokenizer = model_sources.load_tokenizer(args, evaluate.ENTRY, self.rank)
        self.recipe, self.model, self.layout = model_sources.build(args, source, evaluate.ENTRY, self.rank,
                                                                   self.world, self.device, self.tokenizer.vocab_size)
        self.layers = model_building.moe_layers(self.model)
        self.dist = dist

    def set_layers(self, enabled: bool, pruning) -> None:
        """LLEP on or off and the routing pruning of every MoE layer."""
        for layer in self.layers:
            config = dataclasses.replace(layer.llep_config, enabled=enabled, pruning=pruning)
            layer.llep_config = layer.token_dispatcher.llep_config = config

    def windows(self, domain: str, max_tokens: int):
        from recipes.runtime import evaluation

        prefix = os.path.join(self.bench.corpus, "indexed", f"{domain}_{self.bench.split}_text_document")
        documents = evaluation.read_indexed_documents(prefix, max_tokens + 1)
        dataset = evaluation.pack_windows(documents, self.bench.seq_length)
        count, batches = evaluation.window_count(dataset, max_tokens // self.bench.seq_length, self.layout["global_batch"])
        return evaluation.EvaluatedWindows(dataset, count), batches

    def evaluate(self, windows, batches: int) -> tuple[float, dict, float]:
        """Loss, MoE/pruning metrics and seconds of one evaluation (every rank)."""
        from functools import partial

        from megatron.core.pipeline_parallel import get_forward_backward_func

        from recipes.runtime import dashboard, finetuning

        state = {"microbatch": 0}
        step = partial(finetuning.forward_step, self.device, self.layers, self.args, self.recipe.config, state)
        self.dist.barrier()
        start = time.perf_counter()
        loss, _, metrics = finetuning.evaluate(self.model, get_forward_backward_func(), step, state, windows, batches,
                                             self.args, self.layout, 0, dashboard.MoELoadMeter(self.model))
        seconds = time.perf_counter() - start
        shared = [loss]
        self.dist.broadcast_object_list(shared, src=self.world - 1)
        return shared[0], metrics, seconds

    def cap_placement(self, domain: str):
        """CAP's placement at this EP size from the shipped trace of this model and domain (lambda 0.5)."""
        from megatron_llep.placement import Topology, plan_trace
        from recipes.runtime import routing_traces

        trace = routing_traces.load(self.bench.label, domain, self.bench.trace_dir or routing_traces.TRACE_DIR)
        topology = Topology(self.layout["ep"], self.bench.llep_ranks_per_node or self.layout["ep"], self.bench.cross_node_cost)
        placement, _ = plan_trace(trace, topology)
        return placement

    def finish(self) -> None:
        from megatron.core import parallel_state

        self.dist.barrier()
        parallel_state.destroy_model_parallel()
        self.dist.destroy_process_group()


def _matched(rows: list[dict], key: str) -> list[dict]:
    """Each CAP point beside naive pruning at the same ``key`` (devices per token, or those in other
    nodes), interpolated along naive's p grid (None outside it)."""
    matched = []
    for cap in (r for r in rows if r["method"] == CAP and r["p"] > 0):
        naive = sorted(((r[key], r["ppl"], r["p"]) for r in rows if r["method"] == NAIVE and
                        r["domain"] == cap["domain"] and r["placement"] == cap["placement"]), key=lambda x: x[0])
        if not naive:
            continue
        reached, ppl, p = (np.array(column) for column in zip(*naive))
        target = cap[key]
        inside = reached.min() <= target <= reached.max()
        matched.append(dict(
            matched_on=key, domain=cap["domain"], placement=cap["placement"], cap_p=cap["p"], target=target,
            cap_ppl=cap["ppl"], naive_p=float(np.interp(target, reached, p)) if inside else None,
            naive_ppl=float(np.interp(target, reached, ppl)) if inside else None,
            unpruned_ppl=cap["unpruned_ppl"]))
    return matched


def accuracy(bench: argparse.Namespace) -> None:
    from megatron_llep import RoutingPruning
    from megatron_llep.integrations.placement import apply_placement, restore_original_order

    harness = Harness(bench)
    rows = []
    for domain in bench.domains:
        windows, batches = harness.windows(domain, bench.max_tokens)
        placements = [("sequential", None), ("CAP", harness.cap_placement(domain))]
        for placement_name, placement in placements:
            if placement is not None:
                apply_placement(harness.model, placement)
            harness.set_layers(True, None)
            base_loss, _, _ = harness.evaluate(windows, batches)
            # p = 0 rows: every destination kept; the statistics of the unpruned routing
            grid = [(method, p) for method in (CAP, NAIVE) for p in [0.0, *bench.p]]
            for method, p in grid:
                harness.set_layers(True, RoutingPruning(p=p, method=method, cross_node_cost=bench.cross_node_cost))
                loss, metrics, seconds = harness.evaluate(windows, batches)
                row = dict(domain=domain, placement=placement_name, method=method, p=p, loss=loss,
                           ppl=float(np.exp(loss)), unpruned_ppl=float(np.exp(base_loss)),
                           devices_per_token=metrics["prune/devices_per_token"],
                           devices_per_token_unpruned=metrics["prune/devices_per_token_unpruned"],
                           remote_devices_per_token=metrics["prune/remote_devices_per_token"],
                           cross_node_devices_per_token=metrics["prune/cross_node_devices_per_token"],
                           dropped_pair_fraction=metrics["prune/dropped_pair_fraction"],
                           alltoall_bytes_ratio=metrics["prune/alltoall_bytes"] / max(metrics["prune/alltoall_bytes_unpruned"], 1.0),
                           tokens=metrics["prune/tokens"] / len(harness.layers), seconds=seconds)
                rows.append(row)
                if harness.rank == 0:
                    print(f"[inference_cpu] {domain} {placement_name} {method} p={p:g}: ppl {row['ppl']:.3f} "
                          f"(unpruned {row['unpruned_ppl']:.3f}), devices/token {row['devices_per_token']:.3f} "
                          f"(unpruned {row['devices_per_token_unpruned']:.3f}), dropped pairs "
                          f"{row['dropped_pair_fraction']:.1%}, all-to-all bytes x{row['alltoall_bytes_ratio']:.3f}",
                          flush=True)
            harness.set_layers(True, None)
            if placement is not None:
                restore_original_order(harness.model, placement)
    keys = ["devices_per_token"] + (["cross_node_devices_per_token"] if bench.llep_ranks_per_node else [])
    matched = [row for key in keys for row in _matched(rows, key)]
    if harness.rank == 0:
        print_table(rows, [("domain", "domain", ""), ("placement", "placement", ""), ("method", "pruning", ""),
                           ("p", "p", "g"), ("ppl", "ppl", ".3f"), ("devices_per_token", "dev/tok", ".3f"),
                           ("remote_devices_per_token", "remote dev/tok", ".3f"),
                           ("cross_node_devices_per_token", "other-node dev/tok", ".3f"),
                           ("dropped_pair_fraction", "dropped pairs", ".3f"), ("alltoall_bytes_ratio", "a2a bytes", ".3f")])
        print_table(matched, [("matched_on", "matched on", ""), ("domain", "domain", ""), ("placement", "placement", ""),
                              ("cap_p", "CAP p", "g"), ("target", "per token", ".3f"), ("cap_ppl", "CAP ppl", ".3f"),
                              ("naive_p", "naive p there", ".3f"), ("naive_ppl", "naive ppl", ".3f"),
                              ("unpruned_ppl", "unpruned ppl", ".3f")])
        write_results(bench.out or f"results/inference_cpu_accuracy_{bench.label}.json", "inference_cpu_accuracy",
                      rows, dict(vars(bench), ep=harness.layout["ep"], matched=matched, routing="real"))
    harness.finish()


SPEED_MODES = ("EP", "LLEP", "LLEP+CAP", "LLEP+CAP+pruning")


def speed(bench: argparse.Namespace) -> None:
    import statistics

    import torch

    from megatron_llep import RoutingPruning
    from megatron_llep.compat import inference as mcore_inference
    from megatron_llep.integrations.placement import apply_placement, restore_original_order
    from recipes import generate

    harness = Harness(bench)
    tokenizer = generate.MegatronTokenizer(harness.tokenizer)
    wrapper_class, controller_class = generate.generation_classes()
    engine = mcore_inference.static_inference_engine(harness.model, tokenizer, bench.prompts,
                                                     bench.prompt_tokens + bench.new_tokens, 1234, wrapper_class,
                                                     controller_class)
    wrapper = engine.controller.inference_wrapped_model
    params = mcore_inference.sampling_params(bench.new_tokens, top_k=1, log_probs=False)
    pruning = RoutingPruning(p=bench.speed_p, method=CAP, cross_node_cost=bench.cross_node_cost)
    rows = []
    for domain in bench.domains:
        windows, batches = harness.windows(domain, bench.prefill_batches * harness.layout["global_batch"] * bench.seq_length)
        prompts = [windows.dataset.window(i)["tokens"][:bench.prompt_tokens].tolist() for i in range(bench.prompts)]
        placement = harness.cap_placement(domain)
        prefill = {mode: [] for mode in SPEED_MODES}
        decode = {mode: [] for mode in SPEED_MODES}
        for round_ in range(bench.repeats):
            for mode in SPEED_MODES[round_ % 4:] + SPEED_MODES[:round_ % 4]:
                placed = "CAP" in mode
                if placed:
                    apply_placement(harness.model, placement)
                harness.set_layers(mode != "EP", pruning if "pruning" in mode else None)
                harness.evaluate(windows, 1)  # warm-up
                _, _, seconds = harness.evaluate(windows, batches)
                elapsed = torch.tensor([seconds])
                harness.dist.all_reduce(elapsed, op=harness.dist.ReduceOp.MAX)
                prefill[mode].append(batches * harness.layout["global_batch"] * bench.seq_length / float(elapsed))
                wrapper.timings = []
                requests = [mcore_inference.inference_request(i, "", ids, params) for i, ids in enumerate(prompts)]
                harness.dist.barrier()
                finished = mcore_inference.generate(engine, requests)
                generated = sum(len(mcore_inference.generated(r)[0]) for r in finished)
                decode_s = torch.tensor([sum(s for is_decode, _, s in wrapper.timings if is_decode)])
                harness.dist.all_reduce(decode_s, op=harness.dist.ReduceOp.MAX)
                decode[mode].append(generated / max(float(decode_s), 1e-9))
                harness.set_layers(True, None)
                if placed:
                    restore_original_order(harness.model, placement)
        row = dict(domain=domain, routing="real", ep=harness.layout["ep"], pruning_p=bench.speed_p)
        for mode in SPEED_MODES:
            row[f"{mode}_prefill_tokens_per_s"] = statistics.median(prefill[mode])
            row[f"{mode}_decode_tokens_per_s"] = statistics.median(decode[mode])
            row[f"{mode}_prefill_rounds"] = prefill[mode]
            row[f"{mode}_decode_rounds"] = decode[mode]
        rows.append(row)
        if harness.rank == 0:
            print(f"[inference_cpu] {domain}: " + "; ".join(
                f"{mode} prefill {row[f'{mode}_prefill_tokens_per_s']:,.0f} decode {row[f'{mode}_decode_tokens_per_s']:,.1f} tokens/s"
                for mode in SPEED_MODES), flush=True)
    if harness.rank == 0:
        columns = [("domain", "domain", "")]
        for kind in ("prefill", "decode"):
            columns += [(f"{mode}_{kind}_tokens_per_s", f"{kind} {mode}", ",.1f") for mode in SPEED_MODES]
        print_table(rows, columns)
        write_results(bench.out or f"results/inference_cpu_speed_{bench.label}.json", "inference_cpu_speed", rows,
                      dict(vars(bench), ep=harness.layout["ep"], routing="real"))
    harness.finish()


def main() -> None:
    bench = _parse()
    if bench.part == "accuracy":
        accuracy(bench)
    else:
        speed(bench)


if __name__ == "__main__":
    main()
