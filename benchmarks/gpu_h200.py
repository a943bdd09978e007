"""One-GPU (H200) layer benchmark at full SPEC shapes: every emulated EP rank's expert GEMMs timed
for the plain-EP and the LLEP plan, plus the plan's communication at a stated link bandwidth.

    python benchmarks/gpu_h200.py [--ep 8] [--out results/gpu_h200.json]
    python benchmarks/gpu_h200.py --dry-run      # tiny shapes on whatever device, to check the script

For each layer shape and scenario: routed-token counts for P emulated ranks are sampled, both plans
are made, and for each emulated rank its expert GEMMs (SwiGLU: x @ W1 -> act -> @ W2, bf16, one
distinct weight set per expert slot, tokens as the plan assigns them) run on the GPU, timed with
CUDA events (median of repeats). The layer time is dispatch + slowest rank's GEMMs + combine, the
communication phases priced by the cost model's link (NVLink 4 at ``--link-gbps`` per direction;
one GPU cannot measure NVLink). Peak memory per emulated rank is ``max_memory_allocated`` over its
token buffers, the activations kept for backward and its borrowed weights. The LLEP plan is
cost-aware with a cost model calibrated on this GPU's measured GEMM times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from common import FULL_SHAPES, PAPER_SPEEDUP, SCENARIOS, LayerShape, Scenario, print_table, sample_counts, write_results
from plan_model import balanced_counts, expert_shape, predict

from megatron_llep.config import LLEPConfig
from megatron_llep.cost_model import CostModel
from megatron_llep.planner import LLEPPlan, plan_llep


class _Timer:
    """CUDA events on GPU, perf_counter elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, repeats: int) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)


def _slot_tokens(plan: LLEPPlan, rank: int) -> list[int]:
    view = plan.rank_view(rank)
    return [int(t) for t in view.tokens_per_slot]


class RankEmulator:
    """Expert weights for up to ``slots`` experts and the GEMM loop of one emulated rank."""

    def __init__(self, shape: LayerShape, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        self.w1 = [torch.randn(2 * shape.ffn, shape.hidden, device=device, dtype=dtype) * 0.02 for _ in range(slots)]
        self.w2 = [torch.randn(shape.hidden, shape.ffn, device=device, dtype=dtype) * 0.02 for _ in range(slots)]

    def run(self, tokens_per_slot: list[int], x: torch.Tensor) -> torch.Tensor:
        out, offset = [], 0
        for slot, tokens in enumerate(tokens_per_slot):
            if tokens == 0:
                continue
            h = x[offset : offset + tokens] @ self.w1[slot].t()
            gate, up = h.chunk(2, dim=-1)
            out.append((F.silu(gate) * up) @ self.w2[slot].t())
            offset += tokens
        return torch.cat(out) if out else x[:0]


def calibrate_on_device(shape: LayerShape, device: torch.device, dtype: torch.dtype, timer: _Timer) -> CostModel:
    emulator = RankEmulator(shape, 1, device, dtype)
    samples = []
    for tokens in (128, 512, 2048, 8192):
        x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
        samples.append((tokens, timer(lambda: emulator.run([tokens], x), 5)))
    return CostModel.calibrate(samples, expert_shape(shape))


def measure_plan(plan: LLEPPlan, shape: LayerShape, emulator: RankEmulator, timer: _Timer, repeats: int) -> dict:
    compute, peaks = [], []
    act_bytes = (2 * shape.hidden + 3 * shape.ffn) * 2
    for rank in range(plan.ep_size):
        slots = _slot_tokens(plan, rank)
        total = sum(slots)
        x = torch.randn(max(total, 1), shape.hidden, device=emulator.device, dtype=emulator.dtype)
        compute.append(timer(lambda: emulator.run(slots, x), repeats))
        borrowed = len(slots) - plan.num_local_experts
        if emulator.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            kept = [torch.empty(total, shape.hidden + 2 * shape.ffn + shape.ffn + shape.hidden, device=emulator.device, dtype=emulator.dtype)]
            kept += [torch.empty(2 * shape.ffn * shape.hidden + shape.hidden * shape.ffn, device=emulator.device, dtype=emulator.dtype) for _ in range(borrowed)]
            emulator.run(slots, x)
            peaks.append(torch.cuda.max_memory_allocated() - base)
            del kept
        else:  # no allocator statistics: the same quantity, counted
            peaks.append(total * act_bytes + borrowed * expert_shape(shape).weight_bytes)
    return {"compute_s": max(compute), "rank_compute_s": compute, "peak_bytes": max(peaks)}


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = _Timer(device)
    link = CostModel(intra_node_gbps=args.link_gbps)
    shapes = FULL_SHAPES
    scenarios = SCENARIOS
    if args.dry_run:
        shapes = tuple(replace(s, hidden=64, ffn=64, tokens_per_gpu=256) for s in FULL_SHAPES[:1])
        scenarios = (SCENARIOS[0], Scenario(0.95, 1))
    rows = []
    for shape in shapes:
        model = replace(calibrate_on_device(shape, device, dtype, timer), intra_node_gbps=args.link_gbps)
        config = LLEPConfig(cost_model=model, ranks_per_node=args.ep)
        es = expert_shape(shape)
        slots = shape.num_experts // args.ep + 32  # natives plus what a helper borrows in any scenario
        emulator = RankEmulator(shape, slots, device, dtype)
        ideal_plan = plan_llep(balanced_counts(shape, args.ep), LLEPConfig(cost_aware=False, imbalance_threshold=1e9))
        ideal = measure_plan(ideal_plan, shape, emulator, timer, args.repeats)
        ideal_comm = predict(ideal_plan, shape, link)
        ideal_s = ideal_comm["dispatch_s"] + ideal["compute_s"] + ideal_comm["combine_s"]
        for scenario in scenarios:
            counts = sample_counts(shape, args.ep, scenario, args.seed)
            plans = {"ep": plan_llep(counts, LLEPConfig(cost_aware=False, imbalance_threshold=1e9)), "llep": plan_llep(counts, config, es)}
            row = {"model": shape.name, "scenario": scenario.label, "ep_size": args.ep, "device": str(device)}
            for name, plan in plans.items():
                needed = max(len(_slot_tokens(plan, r)) for r in range(args.ep))
                if needed > slots:
                    raise RuntimeError(f"a rank computes {needed} experts; the emulator holds {slots}")
                measured = measure_plan(plan, shape, emulator, timer, args.repeats)
                comm = predict(plan, shape, link)
                layer_s = comm["dispatch_s"] + measured["compute_s"] + comm["combine_s"]
                row.update({
                    f"{name}_ms": layer_s * 1e3, f"{name}_gemm_ms": measured["compute_s"] * 1e3,
                    f"{name}_comm_ms": (comm["dispatch_s"] + comm["combine_s"]) * 1e3,
                    f"{name}_peak_gb": measured["peak_bytes"] / 1e9, f"{name}_max_mean": comm["max_mean"],
                })
            row["ideal_ms"] = ideal_s * 1e3
            row["speedup"] = row["ep_ms"] / row["llep_ms"]
            row["llep_vs_ideal"] = row["llep_ms"] / row["ideal_ms"]
            row["mem_ratio"] = row["ep_peak_gb"] / row["llep_peak_gb"]
            row["weight_copies"] = plans["llep"].num_weight_transfers
            row["paper_speedup"] = PAPER_SPEEDUP.get(shape.name, {}).get(scenario.label)
            rows.append(row)
            print(f"  {shape.name:13s} {scenario.label:9s} EP {row['ep_ms']:8.2f} ms  LLEP {row['llep_ms']:8.2f} ms  "
                  f"x{row['speedup']:.2f}  ideal {row['ideal_ms']:.2f} ms", flush=True)
        del emulator
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=8, help="emulated EP ranks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-gbps", type=float, default=400.0, help="per-direction NVLink bandwidth assumed")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, two scenarios")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    parser.add_argument("--out", default="results/gpu_h200.json")
    args = parser.parse_args()
    rows = run(args)
    print_table(rows, [
        ("model", "model", ""), ("scenario", "scenario", ""), ("ep_max_mean", "EP max/mean", ".2f"),
        ("llep_max_mean", "LLEP max/mean", ".2f"), ("ep_ms", "EP ms", ".2f"), ("llep_ms", "LLEP ms", ".2f"),
        ("ideal_ms", "ideal ms", ".2f"), ("speedup", "speedup", ".2f"), ("paper_speedup", "paper", ""),
        ("llep_vs_ideal", "LLEP/ideal", ".3f"), ("ep_peak_gb", "EP peak GB", ".2f"), ("llep_peak_gb", "LLEP peak GB", ".2f"),
    ])
    write_results(args.out, "gpu_h200", rows, vars(args))


if __name__ == "__main__":
    main()
