"""Real multi-process MoE layer benchmark on CPU: Megatron's stock alltoall dispatcher (plain EP) and
LLEP side by side in the same gloo run, P = 2, the published layer shapes scaled to fit two cores.

    python benchmarks/layer_cpu.py [--quick] [--shape deepseek-v3] [--out results/layer_cpu.json]

Per layer shape and scenario it reports the forward wall-clock time of both (fastest of the
repeats, slowest rank; the minimum filters the CPU steal of a shared VM), the EP/LLEP ratio, LLEP
against the force-balanced ideal (stock EP on balanced routing, a third layer with the same
weights), forward+backward time, and per-rank peak memory of a forward+backward step, and the weight bytes LLEP copies in an optimizer
step of four forward+backward micro-batches with its copies kept for the step (the default) and
without (``max_kept_weight_bytes=0``). EP, LLEP and
the ideal run alternately at every point, so every ratio compares timings of the same minutes.

Peak memory, two measures. Live tensor bytes (``*_live_peak_mb``, EP, LLEP and the ideal): the
peak over one forward+backward of the bytes of tensor storages alive
(:class:`megatron_llep.testing.memory.LiveTensors`), the same on every run; it agrees with
torch.profiler's allocation events within the input's copy. And the resident set (``*_peak_mb``):
the rise of the process's peak resident set (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) above its resident set just before the step. For that step glibc's mmap
threshold is set to 64 KiB (``mallopt``), so every tensor buffer is its own mapping and returns to
the OS when freed: the high-water mark then follows the live tensor bytes. Timed runs behave like
a GPU's caching allocator instead: buffers up to 32 MiB (glibc's largest mmap threshold) come from
the heap, 1 GiB of heap is faulted in before timing, and freed heap memory is kept (trim threshold
2 GiB), so a buffer freed by one layer call is reused by the next without page faults. With glibc's
default 128 KiB trim threshold (which setting the mmap threshold freezes), every free at the top of
the heap went back to the OS and the next allocation faulted its pages in again: 29 MB gathers took
12 ms instead of 2 ms; without the pre-faulted heap, a layer whose buffers fragment the heap grew it
into fresh pages now and then (LLEP's 11.8 MB combine gather: 25-43 ms instead of 1 ms).
The resident set overstates the live set and moves with the process's history, most likely
because buffers of the timed runs still alive pin the heap, so the step's large allocations are
served from the heap's free chunks (glibc maps fresh memory only when no free chunk fits), whose
pages stay resident when freed. A probe on 2026-12-06 saw the hot rank's RSS peak at 209 MB late in backward while 54 MB of
tensors were alive (live peak 154 MB), and the same plain-EP code measured 225-275 MB in
successive runs.

The LLEP cost model is calibrated on this machine first (expert GEMM timings, gloo send/recv
bandwidth between the two ranks), so cost-aware spilling judges CPU, not H200, numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Optional


from cpu_memory import malloc_for, peak_rss_rise
from common import BALANCED, DEEPSEEK_V3, GPT_OSS_120B, KIMI_K2, SCENARIOS, LayerShape, Scenario, print_table, write_results

EP_SIZE = 2
# N scaled so that each rank keeps the paper's 8-GPU experts per rank; widths / 8; tokens / 16.
CPU_SHAPES = (
    GPT_OSS_120B.scaled(experts=128 // 8 * EP_SIZE, width_divisor=8, token_divisor=16),
    DEEPSEEK_V3.scaled(experts=256 // 8 * EP_SIZE, width_divisor=8, token_divisor=16),
    KIMI_K2.scaled(experts=384 // 8 * EP_SIZE, width_divisor=8, token_divisor=16),
)
MIN_CHUNK = 64  # the paper's m = 1024 at 32K tokens/GPU, scaled with the tokens


@dataclass(frozen=True)
class Point:
    shape: LayerShape
    scenario: Scenario
    alpha: float = 1.0
    imbalance_threshold: float = 1.3
    min_chunk_tokens: int = MIN_CHUNK
    ablation: str = ""
    value: str = ""
    memory: bool = True


def _calibrate(shape: LayerShape, rank: int):
    """A CostModel fitted to this CPU: one expert's forward at a few sizes, gloo P2P bandwidth."""
    import torch
    import torch.distributed as dist

    from megatron_llep.planning.cost_model import CostModel, ExpertShape

    es = ExpertShape(shape.hidden, shape.ffn, gated=True, bias=shape.bias, dtype_bytes=4)
    w1 = torch.randn(2 * shape.ffn, shape.hidden)
    w2 = torch.randn(shape.hidden, shape.ffn)
    samples = []
    for tokens in (16, 64, 256, 1024):
        x = torch.randn(tokens, shape.hidden)
        start = time.perf_counter()
        for _ in range(3):
            h = x @ w1.t()
            (torch.nn.functional.silu(h[:, : shape.ffn]) * h[:, shape.ffn :]) @ w2.t()
        samples.append((tokens, (time.perf_counter() - start) / 3))
    links = []
    for num_bytes in (1 << 18, 1 << 21, 1 << 23):  # one way = half the fastest of three round trips
        buf = torch.empty(num_bytes // 4)
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            best = min(best, (time.perf_counter() - start) / 2)
        links.append((num_bytes, best))
    # every rank must plan identically: rank 0 fits, everyone uses its numbers
    params = torch.zeros(5, dtype=torch.float64)
    if rank == 0:
        try:
            model = CostModel.calibrate(samples, es, link_samples=links, base=CostModel(inter_node_gbps=1.0))
        except ValueError as err:  # a noisy VM: keep the library's CPU link figures
            print(f"  link calibration failed ({err}); using CostModel.cpu()'s link figures", flush=True)
            model = CostModel.calibrate(samples, es, base=CostModel.cpu())
        params = torch.tensor([model.gemm_tflops, model.gemm_half_efficiency_tokens, model.gemm_launch_s,
                               model.intra_node_gbps, model.link_latency_s], dtype=torch.float64)
    dist.broadcast(params, 0)
    p = params.tolist()
    return replace(CostModel(inter_node_gbps=1.0), gemm_tflops=p[0], gemm_half_efficiency_tokens=p[1], gemm_launch_s=p[2],
                   intra_node_gbps=p[3], link_latency_s=p[4])


def _layers(shape: LayerShape, point: Point, cost_model, rank: int):
    """Stock EP, LLEP (same weights) and the force-balanced ideal: stock EP on balanced routing."""
    import torch

    from megatron_llep.config import LLEPConfig
    from megatron_llep.runtime.forced_routing import force_routing
    from megatron_llep.planning.scenarios import imbalanced_topk
    from megatron_llep.testing.moe import build_moe_layer, moe_config

    cfg = moe_config(shape.num_experts, shape.hidden, shape.ffn, shape.topk, EP_SIZE, gpt_oss_experts=shape.bias)
    llep_cfg = LLEPConfig(alpha=point.alpha, min_chunk_tokens=point.min_chunk_tokens,
                          imbalance_threshold=point.imbalance_threshold, cost_model=cost_model)
    torch.manual_seed(0)
    stock, llep, ideal = (build_moe_layer(cfg, c, seed=3, weight_scale=0.05) for c in (None, llep_cfg, None))
    force_routing(ideal.router, imbalanced_topk(shape.tokens_per_gpu, shape.num_experts, shape.topk, 0.0, 0, seed=17 + rank))
    return stock, llep, ideal


def _timed(fn, group_max) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return group_max(time.perf_counter() - start)


def run_points(rank: int, world: int, points: list, repeats: int, partial_path: str = "") -> list[dict]:
    """Rank-side benchmark loop (spawned by :func:`megatron_llep.testing.distributed.run_distributed`)."""
    import torch
    import torch.distributed as dist

    from megatron_llep.runtime.state import drop_kept_experts
    from megatron_llep.runtime.forced_routing import force_routing
    from megatron_llep.planning.scenarios import imbalanced_topk
    from megatron_llep.testing.memory import step_live_bytes
    from megatron_llep.testing.moe import init_expert_parallel

    init_expert_parallel(world)
    malloc_for(timing=True)

    def group_max(value: float) -> float:
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    rows = []
    calibrated = {}
    pairs = {}
    for point in points:
        shape = point.shape
        if shape not in calibrated:
            calibrated[shape] = _calibrate(shape, rank)
        key = (shape, point.alpha, point.imbalance_threshold, point.min_chunk_tokens)
        if key not in pairs:
            pairs.clear()  # keep at most one set of layers alive
            pairs[key] = _layers(shape, point, calibrated[shape], rank)
        stock, llep, ideal = pairs[key]
        tokens = shape.tokens_per_gpu
        ids = imbalanced_topk(tokens, shape.num_experts, shape.topk, point.scenario.hot_fraction,
                              point.scenario.num_hot, seed=17 + rank)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, 1, shape.hidden, generator=gen)
        for layer in (stock, llep):
            force_routing(layer.router, ids)

        def forward(layer):
            if layer is llep:
                drop_kept_experts("timing a first micro-batch")  # every timed forward copies afresh
            with torch.no_grad():
                layer(x)

        def step(layer):
            xi = x.clone().requires_grad_()
            out, _ = layer(xi)
            out.sum().backward()

        layers = {"ep": stock, "llep": llep, "ideal": ideal}
        for layer in layers.values():  # warm-up
            forward(layer)
        times = {name: [] for name in layers}
        for _ in range(repeats):  # alternating, so that the ratios see the same machine
            for name, layer in layers.items():
                times[name].append(_timed(lambda: forward(layer), group_max))
        stats = llep.token_dispatcher.last_stats
        row = {
            "model": shape.name, "scenario": point.scenario.label, "ablation": point.ablation, "value": point.value,
            "tokens_per_rank": tokens, "experts": shape.num_experts, "hidden": shape.hidden, "ffn": shape.ffn,
            "ep_ms": min(times["ep"]) * 1e3, "llep_ms": min(times["llep"]) * 1e3, "ideal_ms": min(times["ideal"]) * 1e3,
            "ep_median_ms": statistics.median(times["ep"]) * 1e3, "llep_median_ms": statistics.median(times["llep"]) * 1e3,
            "ideal_median_ms": statistics.median(times["ideal"]) * 1e3,
            "speedup": min(times["ep"]) / min(times["llep"]), "llep_vs_ideal": min(times["llep"]) / min(times["ideal"]),
            "mode": stats.mode, "max_mean_before": stats.max_mean_before, "max_mean_after": stats.max_mean_after,
            "spilled_tokens": stats.spilled_tokens, "weight_mb": stats.weight_bytes / 1e6,
            "moved_tokens": stats.moved_tokens, "plan_ms": stats.plan_time_s * 1e3,
        }
        row.update(_weight_bytes_per_step(llep, step, STEP_MICROBATCHES))
        if point.memory:
            for name, layer in (("ep", stock), ("llep", llep)):
                layer.zero_grad(set_to_none=True)
                mem = peak_rss_rise(lambda: step(layer))
                mem_all = torch.tensor([float(mem)])
                dist.all_reduce(mem_all, op=dist.ReduceOp.MAX)
                row[f"{name}_peak_mb"] = float(mem_all) / 1e6
            for name, layer in layers.items():  # live tensor bytes: deterministic, after the RSS probe
                layer.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                live = step_live_bytes(lambda: layer(xi)[0], lambda out: out.sum().backward(), stacks=False)
                row[f"{name}_live_peak_mb"] = group_max(float(live.peak.bytes)) / 1e6
            fwd_bwd = {name: [] for name in layers}
            for _ in range(max(1, repeats // 2)):
                for name, layer in layers.items():
                    fwd_bwd[name].append(_timed(lambda: step(layer), group_max))
            for name in fwd_bwd:
                row[f"{name}_fwd_bwd_ms"] = min(fwd_bwd[name]) * 1e3
            row["llep_vs_ideal_fwd_bwd"] = row["llep_fwd_bwd_ms"] / row["ideal_fwd_bwd_ms"]
        rows.append(row)
        if rank == 0 and partial_path:
            with open(partial_path, "a") as f:  # nothing is lost if a later point fails
                f.write(json.dumps(row) + "\n")
        if rank == 0:
            print(f"  {shape.name:16s} {point.scenario.label:9s} {point.ablation}={point.value} "
                  f"EP {row['ep_ms']:.1f} ms  LLEP {row['llep_ms']:.1f} ms  ({row['mode']})", flush=True)
    return rows


STEP_MICROBATCHES = 4


def _weight_bytes_per_step(llep, step, microbatches: int) -> dict:
    """Weight bytes LLEP copies in one optimizer step of ``microbatches`` forward+backward passes
    (the same routing each time: the worst case for reuse is a different routing per micro-batch,
    see plan_model.py --steps), with the copies kept for the step (the default) and without."""
    from dataclasses import replace as with_fields

    from megatron_llep.runtime.state import accumulating_gradients, drop_kept_experts, finish_borrowed_gradients
    from megatron_llep.runtime.state import STATS

    result = {}
    config = llep.llep_config
    for label, bound in (("kept", config.max_kept_weight_bytes), ("unkept", 0)):
        llep.llep_config = llep.token_dispatcher.llep_config = with_fields(config, max_kept_weight_bytes=bound)
        drop_kept_experts("a new optimizer step")  # copies the timed forwards left
        STATS.drain()
        with accumulating_gradients():
            for _ in range(microbatches):
                step(llep)
        finish_borrowed_gradients(llep)
        stats = [s for entries in STATS.drain().values() for s in entries]
        result[f"weight_mb_step_{label}"] = sum(s.weight_bytes for s in stats) / 1e6
    llep.llep_config = llep.token_dispatcher.llep_config = config
    llep.zero_grad(set_to_none=True)
    return result


def grid(quick: bool, smoke: bool = False, shape_names: Optional[list[str]] = None) -> list[Point]:
    """The run's points; ``shape_names`` keeps only those layer shapes (their names without ``/cpu``)."""
    if smoke:  # seconds, for the test suite: tiny widths, two scenarios
        tiny = replace(CPU_SHAPES[0], hidden=32, ffn=32, tokens_per_gpu=128)
        return [Point(tiny, BALANCED, min_chunk_tokens=4), Point(tiny, Scenario(0.95, 16), min_chunk_tokens=4)]
    if shape_names:
        shapes = tuple(s for s in CPU_SHAPES if s.name.removesuffix("/cpu") in shape_names)
    else:
        shapes = CPU_SHAPES[:1] if quick else CPU_SHAPES
    scenarios = (BALANCED, Scenario(0.95, 1), Scenario(0.95, 16)) if quick else SCENARIOS
    points = [Point(s, sc) for s in shapes for sc in scenarios]
    if quick or shape_names:
        return points
    # 95% into the 16 experts of one rank: clearly imbalanced at P = 2 (max/mean ~1.9)
    base, hot = CPU_SHAPES[0], Scenario(0.95, 16)
    ablate = []
    for tokens in (512, 1024, 4096):
        ablate.append(Point(replace(base, tokens_per_gpu=tokens), hot, ablation="tokens", value=str(tokens), memory=False))
    for alpha in (1.1, 1.25, 1.5):
        ablate.append(Point(base, hot, alpha=alpha, ablation="alpha", value=str(alpha), memory=False))
    for lam in (1.0, 1.3, 1.6, 2.0):
        ablate.append(Point(base, Scenario(0.8, 16), imbalance_threshold=lam, ablation="lambda", value=str(lam), memory=False))
    for m in (0, 256, 1024):
        ablate.append(Point(base, hot, min_chunk_tokens=m, ablation="m", value=str(m), memory=False))
    for hidden, ffn in ((720, 180), (180, 720)):
        ablate.append(Point(replace(base, hidden=hidden, ffn=ffn), hot, ablation="D/H", value=f"{hidden}/{ffn}", memory=False))
    for experts in (16, 64):  # hot = all experts of rank 0, as in the base point
        ablate.append(Point(replace(base, num_experts=experts), Scenario(0.95, experts // EP_SIZE), ablation="N",
                            value=str(experts), memory=False))
    return points + ablate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, three scenarios, no ablations")
    parser.add_argument("--shape", action="append", choices=[s.name.removesuffix("/cpu") for s in CPU_SHAPES],
                        help="only this layer shape, no ablations (repeat for several; with --quick, three scenarios)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, two scenarios (checks the script)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", default="results/layer_cpu.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_llep.testing.distributed import run_distributed

    points = grid(args.quick, args.smoke, args.shape)
    print(f"{len(points)} points on {EP_SIZE} gloo ranks, {args.repeats} repeats each")
    partial = args.out + ".partial.jsonl"
    if os.path.exists(partial):
        os.remove(partial)
    rows = run_distributed(run_points, EP_SIZE, points, args.repeats, partial, timeout_s=3600)[0]
    os.remove(partial)
    columns = [
        ("model", "model", ""), ("scenario", "scenario", ""), ("ablation", "ablation", ""), ("value", "value", ""),
        ("mode", "plan", ""), ("max_mean_before", "EP max/mean", ".2f"), ("max_mean_after", "LLEP max/mean", ".2f"),
        ("ep_ms", "EP fwd ms", ".1f"), ("llep_ms", "LLEP fwd ms", ".1f"), ("ideal_ms", "ideal fwd ms", ".1f"),
        ("speedup", "EP/LLEP", ".2f"), ("llep_vs_ideal", "LLEP/ideal", ".2f"), ("ep_fwd_bwd_ms", "EP f+b ms", ".1f"),
        ("llep_fwd_bwd_ms", "LLEP f+b ms", ".1f"), ("llep_vs_ideal_fwd_bwd", "LLEP/ideal f+b", ".2f"),
        ("ep_peak_mb", "EP peak MB", ".1f"), ("llep_peak_mb", "LLEP peak MB", ".1f"),
        ("ep_live_peak_mb", "EP live MB", ".1f"), ("llep_live_peak_mb", "LLEP live MB", ".1f"),
        ("ideal_live_peak_mb", "ideal live MB", ".1f"), ("weight_mb", "weights MB", ".1f"),
        ("weight_mb_step_unkept", f"weights MB/step of {STEP_MICROBATCHES} unkept", ".1f"),
        ("weight_mb_step_kept", "kept", ".1f"),
        ("plan_ms", "plan ms", ".2f"),
    ]
    print_table(rows, columns)
    write_results(args.out, "layer_cpu", rows, {"ep_size": EP_SIZE, "repeats": args.repeats, "quick": args.quick, "smoke": args.smoke,
                                                 "only_shapes": args.shape, "min_chunk_tokens": MIN_CHUNK, "shapes": CPU_SHAPES})


if __name__ == "__main__":
    main()
