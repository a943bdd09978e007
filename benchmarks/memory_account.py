"""Per-tensor accounting of one MoE layer step's memory: plain EP, LLEP and the balanced ideal.

    python benchmarks/memory_account.py [--hot 1 4 16] [--out results/memory_account.json]

On 2 gloo ranks (the shape of benchmarks/layer_cpu.py: gpt-oss-120b/cpu, forced routing, 95 % of
tokens into h experts), each rank runs one forward+backward of each layer inside
:class:`megatron_llep.testing.memory.LiveTensors`, which records every tensor storage an operator
allocates (size, dtype, shape, creation site) and when it is freed. Reported per rank and layer:
the peak of the live tensor bytes (forward, backward, overall), and at LLEP's peak the bytes per
creation site next to those at the balanced run's peak. Deterministic (no allocator, no RSS), so
it can be compared between commits to the byte.

The target of issue 26: LLEP's peak <= 1.10 x (balanced peak + borrowed weights + their gradients).
The plan uses ``CostModel.cpu()`` (layer_cpu.py calibrates on the machine; at 95 % both spill to
max/mean 1.00).
"""

from __future__ import annotations

import argparse
import os

from common import Scenario, write_results

import layer_cpu


def _account(rank: int, world: int, hot: list, tokens: int, hidden: int, stacks: bool, rss: int) -> list[dict]:
    import torch

    from dataclasses import replace

    from megatron_llep.cost_model import CostModel
    from megatron_llep.scenarios import force_routing, imbalanced_topk
    from megatron_llep.testing.memory import by_site, step_live_bytes
    from megatron_llep.testing.moe import init_expert_parallel

    init_expert_parallel(world)
    shape = layer_cpu.CPU_SHAPES[0]
    if tokens:
        shape = replace(shape, tokens_per_gpu=tokens)
    if hidden:
        shape = replace(shape, hidden=hidden, ffn=hidden)
    rows = []
    for h in hot:
        scenario = Scenario(0.95, h)
        point = layer_cpu.Point(shape, scenario, min_chunk_tokens=layer_cpu.MIN_CHUNK if not tokens else max(4, tokens // 32))
        stock, llep, ideal = layer_cpu._layers(shape, point, CostModel.cpu(), rank)
        ids = imbalanced_topk(shape.tokens_per_gpu, shape.num_experts, shape.topk, 0.95, h, seed=17 + rank)
        for layer in (stock, llep):
            force_routing(layer.router, ids)
        x = torch.randn(shape.tokens_per_gpu, 1, shape.hidden, generator=torch.Generator().manual_seed(rank))
        row = {"scenario": scenario.label, "rank": rank, "tokens_per_rank": shape.tokens_per_gpu,
               "hidden": shape.hidden, "ffn": shape.ffn, "experts": shape.num_experts}
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
        if rss:  # the benchmark's resident-set measure of the same steps, alternating, minimum
            import torch.distributed as dist

            from cpu_memory import malloc_for, peak_rss_rise

            malloc_for(timing=True)
            samples = {name: [] for name in ("ep", "llep", "balanced")}
            for _ in range(rss):
                for name, layer in (("ep", stock), ("llep", llep), ("balanced", ideal)):
                    layer.zero_grad(set_to_none=True)

                    def step():
                        xi = x.clone().requires_grad_()
                        out, _ = layer(xi)
                        out.sum().backward()

                    samples[name].append(peak_rss_rise(step))
            for name, values in samples.items():
                row[f"{name}_rss_peak_mb"] = min(values) / 1e6
                row[f"{name}_rss_samples_mb"] = [v / 1e6 for v in values]
            dist.barrier()
        stats = llep.token_dispatcher.last_stats
        plan = llep.token_dispatcher.rank_plan
        received = len(plan.weights_to_receive) if plan is not None else 0
        row["mode"] = stats.mode
        row["max_mean_after"] = stats.max_mean_after
        row["borrowed_experts"] = received
        row["borrowed_weights_mb"] = received * stats_weight_bytes(llep) / 1e6
        row["target_mb"] = row["balanced_peak_mb"] + 2 * row["borrowed_weights_mb"]
        row["llep_over_target"] = row["llep_peak_mb"] / row["target_mb"]
        row["ep_over_llep"] = row["ep_peak_mb"] / row["llep_peak_mb"]
        row["llep_peak_sites"] = {k: v / 1e6 for k, v in by_site(trackers["llep"].peak.live).items()}
        row["balanced_peak_sites"] = {k: v / 1e6 for k, v in by_site(trackers["balanced"].peak.live).items()}
        row["llep_peak_tensors"] = [a.as_dict() for a in sorted(trackers["llep"].peak.live, key=lambda a: -a.nbytes)[:40]]
        rows.append(row)
    return rows


def stats_weight_bytes(layer) -> int:
    """One expert's bytes (all its tensors)."""
    adapter = layer.expert_adapter
    return sum(t.numel() * t.element_size() for t in adapter.expert_tensors(0))


def account(hot: list, tokens: int = 0, hidden: int = 0, stacks: bool = True, rss: int = 0) -> list[dict]:
    """Per rank and scenario rows (both ranks)."""
    from megatron_llep.testing.distributed import run_distributed

    results = run_distributed(_account, layer_cpu.EP_SIZE, hot, tokens, hidden, stacks, rss, timeout_s=1800)
    return [row for rank_rows in results for row in rank_rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hot", type=int, nargs="+", default=[1, 4, 16], help="95 %% into this many experts")
    parser.add_argument("--tokens", type=int, default=0, help="tokens per rank (default: the layer_cpu shape's)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden = ffn width (default: the layer_cpu shape's)")
    parser.add_argument("--rss", type=int, default=0, help="also the peak resident-set rise of each step (benchmarks/"
                        "cpu_memory.py), minimum of this many alternating runs")
    parser.add_argument("--out", default="results/memory_account.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = account(args.hot, args.tokens, args.hidden, rss=args.rss)
    for r in rows:
        print(f"\n== 95% into {r['scenario']} rank {r['rank']}: mode {r['mode']} max/mean {r['max_mean_after']:.2f}, "
              f"borrowed {r['borrowed_experts']} experts = {r['borrowed_weights_mb']:.2f} MB")
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
    write_results(args.out, "memory_account", rows, {"ep_size": layer_cpu.EP_SIZE, "hot": args.hot, "routing": "forced",
                                                      "tokens": args.tokens, "hidden": args.hidden, "rss_runs": args.rss})


if __name__ == "__main__":
    main()
