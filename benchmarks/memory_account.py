"""Per-tensor accounting of one MoE layer step's memory: plain EP, LLEP and the balanced ideal.

    python benchmarks/memory_account.py [--hot 1 4 16] [--out results/memory_account.json]
    python benchmarks/memory_account.py --hot 1 --budget-margin 0.05     # LLEP under the row budget
    python benchmarks/memory_account.py --ep 8 --shape gpt-oss-120b deepseek-v3 kimi-k2 --quiet --top 8 \\
        --out results/memory_grid_p8.json                                # the paper's grid at P = 8
    python benchmarks/memory_account.py --max-kept-weight-bytes 0       # borrowed copies not kept for the step

On ``--ep`` gloo ranks (default 2; shapes of benchmarks/layer_cpu.py: the published layers with widths
/ 8, tokens / 16 and N = the paper's experts per rank x P; forced routing, 95 % of tokens into h
experts, the hot experts on rank 0), each rank runs one forward+backward of each layer inside
:class:`megatron_llep.testing.memory.LiveTensors`, which records every tensor storage an operator
allocates (size, dtype, shape, creation site) and when it is freed. Reported per rank and layer:
the peak of the live tensor bytes (forward, backward, overall), and at LLEP's peak the bytes per
creation site next to those at the balanced run's peak. Deterministic (no allocator, no RSS), so
it can be compared between commits to the byte. Per shape and scenario a summary row gives the
largest peak over ranks of each layer (the per-rank peak the paper plots) and EP / LLEP of those.

The target: LLEP's peak <= 1.10 x (balanced peak + borrowed weights + their gradients),
on every rank. The plan uses ``CostModel.cpu()`` (layer_cpu.py calibrates on the machine; at 95 %
both spill to max/mean 1.00). ``--budget-margin F`` also sets ``LLEPConfig.max_tokens_per_rank``
to the balanced run's rows per rank x (1 + F), so LLEP spills even where max/mean stays below lambda.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional

from common import FULL_SHAPES, LayerShape, Scenario, print_table, write_results

import layer_cpu

PAPER_EP_OVER_LLEP_PEAK = "up to ~4-5x (8x H200, the LLEP paper: EP's peak grows with imbalance, LLEP's stays flat)"


def cpu_shape(name: str, ep: int, tokens: int = 0, hidden: int = 0) -> LayerShape:
    """The published layer ``name`` at layer_cpu.py's scale, with the paper's experts per rank at ``ep`` ranks."""
    from dataclasses import replace

    full = next(s for s in FULL_SHAPES if s.name == name)
    shape = full.scaled(experts=full.num_experts // 8 * ep, width_divisor=8, token_divisor=16)
    if tokens:
        shape = replace(shape, tokens_per_gpu=tokens)
    if hidden:
        shape = replace(shape, hidden=hidden, ffn=hidden)
    return shape


def row_budget(shape: LayerShape, margin: Optional[float]) -> Optional[int]:
    """The rows a rank computes in the balanced run (tokens per rank x K) plus ``margin``, or None."""
    return None if margin is None else math.ceil(shape.tokens_per_gpu * shape.topk * (1 + margin))


def _layers(shape: LayerShape, ep: int, budget: Optional[int], rank: int, max_kept: Optional[int]):
    """Stock EP, LLEP (same weights) and the balanced ideal (stock EP on balanced routing)."""
    import torch

    from megatron_llep.config import LLEPConfig
    from megatron_llep.planning.cost_model import CostModel
    from megatron_llep.runtime.forced_routing import force_routing
    from megatron_llep.planning.scenarios import imbalanced_topk
    from megatron_llep.testing.moe import build_moe_layer, moe_config

    cfg = moe_config(shape.num_experts, shape.hidden, shape.ffn, shape.topk, ep, gpt_oss_experts=shape.bias)
    min_chunk = layer_cpu.MIN_CHUNK * shape.tokens_per_gpu // layer_cpu.CPU_SHAPES[0].tokens_per_gpu
    llep_cfg = LLEPConfig(min_chunk_tokens=max(4, min_chunk), cost_model=CostModel.cpu(), max_tokens_per_rank=budget,
                          max_kept_weight_bytes=max_kept)
    torch.manual_seed(0)
    stock, llep, ideal = (build_moe_layer(cfg, c, seed=3, weight_scale=0.05) for c in (None, llep_cfg, None))
    force_routing(ideal.router, imbalanced_topk(shape.tokens_per_gpu, shape.num_experts, shape.topk, 0.0, 0, seed=17 + rank))
    return stock, llep, ideal


def _account(rank: int, world: int, shape_names: list, hot: list, tokens: int, hidden: int,
             budget_margin: Optional[float], max_kept: Optional[int], stacks: bool, rss: int, top: int) -> list[dict]:
    import torch

    from megatron_llep.runtime.forced_routing import force_routing
    from megatron_llep.planning.scenarios import imbalanced_topk
    from megatron_llep.testing.memory import by_site, step_live_bytes
    from megatron_llep.testing.moe import init_expert_parallel

    init_expert_parallel(world)
    rows = []
    for shape_name in shape_names:
        shape = cpu_shape(shape_name, world, tokens, hidden)
        budget = row_budget(shape, budget_margin)
        stock, llep, ideal = _layers(shape, world, budget, rank, max_kept)
        x = torch.randn(shape.tokens_per_gpu, 1, shape.hidden, generator=torch.Generator().manual_seed(rank))
        for h in hot:
            scenario = Scenario(0.95, h)
            ids = imbalanced_topk(shape.tokens_per_gpu, shape.num_experts, shape.topk, 0.95, h, seed=17 + rank)
            for layer in (stock, llep):
                force_routing(layer.router, ids)
            row = {"shape": shape.name, "scenario": scenario.label, "rank": rank, "ep": world,
                   "tokens_per_rank": shape.tokens_per_gpu, "hidden": shape.hidden, "ffn": shape.ffn,
                   "experts": shape.num_experts, "topk": shape.topk, "max_tokens_per_rank": budget,
                   "max_kept_weight_bytes": max_kept}
            trackers = {}
            for name, layer in (("ep", stock), ("llep", llep), ("balanced", ideal)):
                layer.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                tracker = step_live_bytes(lambda: layer(xi)[0], lambda out: out.sum().backward(), stacks=stacks)
                trackers[name] = tracker
                row[f"{name}_peak_mb"] = tracker.peak.bytes / 1e6
                row[f"{name}_forward_peak_mb"] = tracker.phase_peak("forward") / 1e6
                row[f"{name}_backward_peak_mb"] = tracker.phase_peak("backward") / 1e6
                row[f"{name}_peak_phase"] = tracker.peak.phase
                row[f"{name}_peak_op"] = tracker.peak.op
            if rss:
                row.update(_rss_peaks(rss, x, (("ep", stock), ("llep", llep), ("balanced", ideal))))
            stats = llep.token_dispatcher.last_stats
            plan = llep.token_dispatcher.rank_plan
            received = len(plan.weights_to_receive) if plan is not None else 0
            row["mode"] = stats.mode
            row["max_mean_before"] = stats.max_mean_before
            row["max_mean_after"] = stats.max_mean_after
            row["borrowed_experts"] = received
            row["borrowed_weights_mb"] = received * expert_bytes(llep) / 1e6
            row["target_mb"] = row["balanced_peak_mb"] + 2 * row["borrowed_weights_mb"]
            row["llep_over_target"] = row["llep_peak_mb"] / row["target_mb"]
            row["ep_over_llep"] = row["ep_peak_mb"] / row["llep_peak_mb"]
            for name in ("llep", "balanced"):
                row[f"{name}_peak_sites"] = {k: v / 1e6 for k, v in list(by_site(trackers[name].peak.live).items())[:top]}
            row["llep_peak_tensors"] = [a.as_dict() for a in sorted(trackers["llep"].peak.live, key=lambda a: -a.nbytes)[:top]]
            rows.append(row)
        del stock, llep, ideal
    return rows


def _rss_peaks(runs: int, x, layers) -> dict:
    """The resident-set peak rise of each layer's step (benchmarks/cpu_memory.py), minimum of ``runs``
    alternating runs."""
    import torch.distributed as dist

    from cpu_memory import malloc_for, peak_rss_rise

    malloc_for(timing=True)
    samples = {name: [] for name, _ in layers}
    for _ in range(runs):
        for name, layer in layers:
            layer.zero_grad(set_to_none=True)

            def step():
                xi = x.clone().requires_grad_()
                out, _ = layer(xi)
                out.sum().backward()

            samples[name].append(peak_rss_rise(step))
    dist.barrier()
    out = {}
    for name, values in samples.items():
        out[f"{name}_rss_peak_mb"] = min(values) / 1e6
        out[f"{name}_rss_samples_mb"] = [v / 1e6 for v in values]
    return out


def expert_bytes(layer) -> int:
    """One expert's bytes (all its tensors)."""
    adapter = layer.expert_adapter
    return sum(t.numel() * t.element_size() for t in adapter.expert_tensors(0))


def summarize(rows: list[dict]) -> list[dict]:
    """Per shape and scenario: each layer's largest peak over ranks, EP / LLEP of those, and the
    largest LLEP / (balanced + 2 x borrowed) over ranks."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["scenario"]), []).append(r)
    summary = []
    for (shape, scenario), group in groups.items():
        s = {"shape": shape, "scenario": scenario, "ep": group[0]["ep"], "mode": group[0]["mode"],
             "max_mean_before": group[0]["max_mean_before"], "max_mean_after": group[0]["max_mean_after"],
             "max_tokens_per_rank": group[0]["max_tokens_per_rank"],
             "max_kept_weight_bytes": group[0]["max_kept_weight_bytes"], "routing": "forced"}
        for name in ("ep", "llep", "balanced"):
            s[f"{name}_peak_mb_per_rank"] = [r[f"{name}_peak_mb"] for r in group]
            s[f"{name}_peak_max_mb"] = max(s[f"{name}_peak_mb_per_rank"])
        s["borrowed_weights_mb_per_rank"] = [r["borrowed_weights_mb"] for r in group]
        s["ep_over_llep_max_rank"] = s["ep_peak_max_mb"] / s["llep_peak_max_mb"]
        s["llep_over_balanced_max_rank"] = s["llep_peak_max_mb"] / s["balanced_peak_max_mb"]
        s["llep_over_target_max"] = max(r["llep_over_target"] for r in group)
        s["paper_ep_over_llep_peak"] = PAPER_EP_OVER_LLEP_PEAK
        summary.append(s)
    return summary


def account(hot: list, tokens: int = 0, hidden: int = 0, stacks: bool = True, rss: int = 0, ep: int = layer_cpu.EP_SIZE,
            shapes: tuple = ("gpt-oss-120b",), budget_margin: Optional[float] = None, max_kept: Optional[int] = None,
            top: int = 40) -> list[dict]:
    """Per rank, shape and scenario rows (every rank's)."""
    from megatron_llep.testing.distributed import run_distributed

    results = run_distributed(_account, ep, list(shapes), hot, tokens, hidden, budget_margin, max_kept, stacks, rss, top,
                              timeout_s=3600)
    return [row for rank_rows in results for row in rank_rows]


def _print_rank_row(r: dict) -> None:
    print(f"\n== {r['shape']} P={r['ep']} 95% into {r['scenario']} rank {r['rank']}: mode {r['mode']} max/mean "
          f"{r['max_mean_before']:.2f} -> {r['max_mean_after']:.2f}, borrowed {r['borrowed_experts']} experts = "
          f"{r['borrowed_weights_mb']:.2f} MB")
    for name in ("ep", "llep", "balanced"):
        print(f"  {name:9s} peak {r[name + '_peak_mb']:7.2f} MB (forward {r[name + '_forward_peak_mb']:7.2f}, "
              f"backward {r[name + '_backward_peak_mb']:7.2f}) at {r[name + '_peak_phase']} {r[name + '_peak_op']}")
    if "llep_rss_peak_mb" in r:
        print("  RSS peak rise (min of alternating runs): " + ", ".join(
            f"{n} {r[n + '_rss_peak_mb']:.1f} MB" for n in ("ep", "llep", "balanced")))
    print(f"  LLEP / (balanced + 2 x borrowed) = {r['llep_peak_mb']:.2f} / {r['target_mb']:.2f} = {r['llep_over_target']:.3f};"
          f"  EP / LLEP = {r['ep_over_llep']:.2f}")
    print("  at LLEP's peak (MB per site):")
    for k, v in list(r["llep_peak_sites"].items())[:14]:
        print(f"    {v:7.2f}  {k}")
    print("  at balanced's peak (MB per site):")
    for k, v in list(r["balanced_peak_sites"].items())[:10]:
        print(f"    {v:7.2f}  {k}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hot", type=int, nargs="+", default=[1, 4, 16], help="95 %% into this many experts")
    parser.add_argument("--ep", type=int, default=layer_cpu.EP_SIZE, help="gloo ranks (P)")
    parser.add_argument("--shape", nargs="+", default=["gpt-oss-120b"], choices=[s.name for s in FULL_SHAPES])
    parser.add_argument("--tokens", type=int, default=0, help="tokens per rank (default: the layer_cpu shape's)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden = ffn width (default: the layer_cpu shape's)")
    parser.add_argument("--budget-margin", type=float, default=None, help="set LLEPConfig.max_tokens_per_rank to the "
                        "balanced run's rows per rank x (1 + this)")
    parser.add_argument("--max-kept-weight-bytes", type=int, default=None, help="LLEPConfig.max_kept_weight_bytes "
                        "(default None: every borrowed expert kept for the step; 0: none kept)")
    parser.add_argument("--rss", type=int, default=0, help="also the peak resident-set rise of each step (benchmarks/"
                        "cpu_memory.py), minimum of this many alternating runs")
    parser.add_argument("--quiet", action="store_true", help="print only the summary table")
    parser.add_argument("--top", type=int, default=40, help="creation sites and tensors kept per row (largest first)")
    parser.add_argument("--out", default="results/memory_account.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = account(args.hot, args.tokens, args.hidden, rss=args.rss, ep=args.ep, shapes=tuple(args.shape),
                   budget_margin=args.budget_margin, max_kept=args.max_kept_weight_bytes, top=args.top)
    if not args.quiet:
        for r in rows:
            _print_rank_row(r)
    summary = summarize(rows)
    print("\nrouting: forced (95 % into h experts, hot experts on rank 0); live tensor bytes, largest over ranks")
    print_table(summary, [
        ("shape", "shape", ""), ("scenario", "95% into", ""), ("mode", "plan", ""), ("max_mean_before", "max/mean EP", ".2f"),
        ("max_mean_after", "LLEP", ".2f"), ("ep_peak_max_mb", "EP MB", ".1f"), ("llep_peak_max_mb", "LLEP MB", ".1f"),
        ("balanced_peak_max_mb", "balanced MB", ".1f"), ("ep_over_llep_max_rank", "EP/LLEP", ".2f"),
        ("llep_over_target_max", "LLEP/(bal+2xborrowed) max", ".3f"),
    ])
    write_results(args.out, "memory_account", rows, {
        "ep_size": args.ep, "shapes": args.shape, "hot": args.hot, "routing": "forced", "tokens": args.tokens,
        "hidden": args.hidden, "budget_margin": args.budget_margin,
        "max_kept_weight_bytes": args.max_kept_weight_bytes, "rss_runs": args.rss, "top": args.top, "summary": summary})


if __name__ == "__main__":
    main()
