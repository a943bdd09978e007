"""One GPU: LLEP against plain EP and the force-balanced ideal at the published MoE layer shapes, each
emulated EP rank's expert work run by the library's own machinery on Megatron's experts module.

    python benchmarks/gpu_layer.py --out results/gpu_layer.json                # one H100 or H200
    python benchmarks/gpu_layer.py --dry-run --cpu --out /tmp/gpu_layer.json   # tiny shapes on CPU, seconds

Needs megatron-core; Transformer Engine is optional (with it the grid runs TEGroupedMLP experts and
the correctness rows cover TEGroupedMLP as well as SequentialMLP).

* ``correctness``, bf16: one expert borrowed (``ExpertAdapter.forward_borrowed_part`` on a copy of
  its tensors) against the same expert run natively among its neighbours (``forward_native``),
  with gpt-oss-120b's expert math (biases, quick-GELU GLU, clamp) and DeepSeek-V3's (SwiGLU) at
  full width: output, input and probability gradients, every weight gradient; bit for bit, or
  within ``TOLERANCE``.
* ``layer`` grid: gpt-oss-120b, DeepSeek-V3, Kimi-K2 (benchmarks/common.py), balanced and 95 % into
  1 / 4 / 16 experts (forced routing), ``--ep`` emulated ranks. Measured (CUDA events): each rank's
  expert forward+backward, for plain EP, for ``plan_llep``'s plan (native slots in one call, then
  one call per weight wave, as LLEPMoELayer runs them; a borrowed expert is a copy of a native
  one's tensors; one experts module of N / P experts serves every rank) and for the ideal (every
  rank the mean load, spread evenly over its experts). Modelled (one GPU cannot measure NVLink):
  the dispatch and combine all-to-alls and the weight copies, by the library's LayerTimeModel at
  ``--link-gbps`` with its CostModel's GEMM rate fitted to this device. Layer time = dispatch +
  slowest rank's measured GEMMs + the model's wait for weight copies + combine; the no-overlap
  roofline counts the copies' whole link time instead of that wait.

The JSON is rewritten atomically after every row (``complete`` false until the end); each row
prints one progress line.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import traceback
from dataclasses import replace

import numpy as np

try:
    import megatron.core  # noqa: F401
except ImportError as exc:
    print(f"gpu_layer.py needs megatron-core (pip install megatron-core): {exc}", file=sys.stderr)
    sys.exit(2)
import torch

from common import BALANCED, DEEPSEEK_V3, FULL_SHAPES, GPT_OSS_120B, PAPER_SPEEDUP, Scenario, print_table, sample_counts, write_results
from megatron_llep.config import LLEPConfig
from megatron_llep.planning import CostModel, LayerTimeModel, LLEPPlan, plan_llep, rank_loads
from megatron_llep.runtime.experts import make_expert_adapter
from megatron_llep.testing.moe import build_moe_layer, init_expert_parallel, moe_config
from recipes.models import HAVE_TE

SCENARIOS = (BALANCED, Scenario(0.95, 1), Scenario(0.95, 4), Scenario(0.95, 16))
TOLERANCE = 1e-2  # per tensor: max |borrowed - native| <= TOLERANCE * max |native|
MEASURED = "each emulated rank's expert forward+backward (CUDA events, median of --repeats; wall clock on CPU)"
MODELLED = "dispatch, combine and weight copies: LayerTimeModel (training CostModel, GEMM rate fitted here) at link_gbps"


def build_experts(shape, num_experts: int, ep: int, te: bool, device: torch.device):
    """Megatron's experts module of ``num_experts`` bf16 experts of ``shape`` and its ExpertAdapter.
    The config says EP = ``ep``, so its linears leave communication to the dispatcher as on an EP
    rank; the one-process group makes every expert of the config local."""
    config = moe_config(num_experts, shape.hidden, shape.ffn, min(shape.topk, num_experts), ep, gpt_oss_experts=shape.bias,
                        params_dtype=torch.bfloat16, use_cpu_initialization=device.type == "cpu",
                        perform_initialization=False, bias_dropout_fusion=False, moe_grouped_gemm=te)
    layer = build_moe_layer(config, weight_scale=shape.hidden ** -0.5, te_grouped_gemm=te).to(device)
    return layer, make_expert_adapter(layer.experts, num_experts)


def timed(step, repeats: int) -> tuple[float, float]:
    """Median forward and forward+backward ms of ``step() -> (output, its gradient)`` after a warm-up."""
    fwd, both = [], []
    for i in range(repeats + 1):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        out, grad = step()
        events[1].record()
        out.backward(grad)
        events[2].record()
        del out
        torch.cuda.synchronize()
        if i:
            fwd.append(events[0].elapsed_time(events[1]))
            both.append(events[0].elapsed_time(events[2]))
    return statistics.median(fwd), statistics.median(both)


def run_rank(adapter, slot_counts, waves, width: int, device: torch.device, repeats: int) -> dict:
    """One emulated rank: its native slots through ``forward_native``, then its borrowed slots
    (copies of native experts' tensors), one ``forward_borrowed_part`` call per weight wave."""
    local = adapter.num_local_experts
    counts = [int(c) for c in slot_counts]
    bounds = np.cumsum([0, local] + [len(list(g)) for _, g in itertools.groupby(waves)]).tolist()
    sizes = [sum(counts[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    borrowed = [[t.detach().clone().requires_grad_() for t in adapter.expert_tensors(i % local)]
                for i in range(len(counts) - local)]
    x = torch.randn(sum(counts), width, device=device, dtype=torch.bfloat16)
    probs, grad = torch.rand(sum(counts), device=device), torch.randn_like(x)

    def step():
        adapter.experts.zero_grad(set_to_none=True)
        for tensor in itertools.chain(*borrowed):
            tensor.grad = None
        pieces, piece_probs = x.detach().requires_grad_().split(sizes), probs.detach().requires_grad_().split(sizes)
        outs = [adapter.forward_native(pieces[0], counts[:local], piece_probs[0])]
        for a, b, piece, piece_prob in zip(bounds[1:-1], bounds[2:], pieces[1:], piece_probs[1:]):
            outs += adapter.forward_borrowed_part(piece, counts[a:b], piece_prob, borrowed[a - local : b - local])
        return (torch.cat(outs) if len(outs) > 1 else outs[0]), grad

    fwd, both = timed(step, repeats)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if device.type == "cuda" else None
    return {"fwd_ms": fwd, "gemm_ms": both, "peak_gb": peak}


def plain(counts: np.ndarray, local: int) -> LLEPPlan:
    """Plain EP's plan: every token to its expert's native rank."""
    loads = rank_loads(counts, local)
    return LLEPPlan(counts, local, float(loads.mean()), loads, loads.copy(), fallback=True)


def priced(counts: np.ndarray, plan: LLEPPlan, measured: list[dict], model: CostModel, expert_shape) -> dict:
    """Layer forward+backward ms: the slowest rank's measured GEMMs and the modelled communication."""
    ep = plan.ep_size
    phases = LayerTimeModel(counts, plan.num_local_experts, expert_shape, model).phases(plan)
    model_gemm = max(sum(model.gemm_time(int(t), expert_shape) for t in plan.rank_view(p).tokens_per_slot) for p in range(ep))
    copies = max(np.bincount(plan.transfer_source, minlength=ep).max(initial=0),
                 np.bincount(plan.transfer_helper, minlength=ep).max(initial=0))  # on the busiest rank's link
    comm_ms = (phases["dispatch_s"] + phases["combine_s"]) * 1e3
    wait_ms = max(0.0, phases["compute_s"] - model_gemm) * 1e3  # borrowed GEMMs waiting for their weights
    copies_ms = model.link_time(copies * expert_shape.weight_bytes * 2, False) * 1e3  # weights there, gradients back
    gemm = max(r["gemm_ms"] for r in measured)
    peaks = [r["peak_gb"] for r in measured if r["peak_gb"] is not None]
    return {"gemm_ms": gemm, "fwd_gemm_ms": max(r["fwd_ms"] for r in measured), "dispatch_ms": phases["dispatch_s"] * 1e3,
            "combine_ms": phases["combine_s"] * 1e3, "weight_wait_ms": wait_ms, "weight_copies_ms": copies_ms,
            "layer_ms": comm_ms + gemm + wait_ms, "no_overlap_ms": comm_ms + gemm + copies_ms,
            "peak_gb": max(peaks) if peaks else None, "max_mean": float(plan.rank_loads_after.max() / plan.rank_loads_after.mean())}


def layer_rows(shape, args, device: torch.device, te: bool):
    """The grid rows of one layer shape, one per scenario and link bandwidth."""
    ep, local = args.ep, shape.num_experts // args.ep
    layer, adapter = build_experts(shape, local, ep, te, device)
    expert_shape = adapter.expert_shape(layer.config)
    run = lambda counts, waves=(): run_rank(adapter, counts, waves, shape.hidden, device, args.repeats)  # noqa: E731
    sizes = sorted({max(1, shape.tokens_per_gpu >> s) for s in (7, 5, 3, 1)})  # one expert's forward, to fit the GEMM rate
    samples = [(t, run([t] + [0] * (local - 1))["fwd_ms"] / 1e3) for t in sizes]
    model = CostModel.calibrate(samples, expert_shape, base=CostModel(training=True))
    for index, scenario in enumerate(SCENARIOS):
        counts = sample_counts(shape, ep, scenario, seed=index)
        loads = counts.sum(axis=0)
        ep_runs = [run(loads[p * local : (p + 1) * local]) for p in range(ep)]
        ideal_counts = np.full_like(counts, counts.sum() // counts.size)
        ideal_runs = [run(ideal_counts.sum(axis=0)[:local])]  # every rank alike
        hot = "uniform" if scenario is BALANCED else f"{scenario.hot_fraction:.0%} of tokens into experts 0..{scenario.num_hot - 1}"
        for gbps in args.link_gbps:
            link = replace(model, intra_node_gbps=gbps)
            config = LLEPConfig(cost_model=link, min_chunk_tokens=args.min_chunk, cost_aware=not args.dry_run)
            plan = plan_llep(counts, config, expert_shape)
            views = [plan.rank_view(p) for p in range(ep)]
            llep_runs = ep_runs if plan.is_plain_ep else [run(v.tokens_per_slot, v.receive_waves) for v in views]
            row = {"section": "layer", "status": "ok", "name": f"{shape.name} {scenario.label}", "model": shape.name,
                   "scenario": scenario.label, "routing": f"forced ({hot}; benchmarks/common.py sample_counts)",
                   "measured": MEASURED, "modelled": MODELLED, "link_gbps": gbps, "ep_size": ep, "experts": shape.num_experts,
                   "hidden": shape.hidden, "ffn": shape.ffn, "topk": shape.topk, "tokens_per_rank": shape.tokens_per_gpu,
                   "experts_module": type(layer.experts).__name__, "gemm_tflops_fitted": model.gemm_tflops,
                   "mode": "fallback" if plan.fallback else "plain" if plan.is_plain_ep else "llep",
                   "spilled_experts": int(plan.spilled_experts.size), "weight_copies": plan.num_weight_transfers}
            for name, mode_counts, mode_plan, runs in (("ep", counts, plain(counts, local), ep_runs), ("llep", counts, plan, llep_runs),
                                                       ("ideal", ideal_counts, plain(ideal_counts, local), ideal_runs)):
                row.update({f"{name}_{key}": value for key, value in priced(mode_counts, mode_plan, runs, link, expert_shape).items()})
            row.update(llep_vs_ideal=row["llep_layer_ms"] / row["ideal_layer_ms"], ep_vs_llep=row["ep_layer_ms"] / row["llep_layer_ms"],
                       ep_vs_llep_no_overlap=row["ep_no_overlap_ms"] / row["llep_no_overlap_ms"],
                       paper_fwd_speedup=PAPER_SPEEDUP.get(shape.name, {}).get(scenario.label))
            yield row


def correctness(shape, ep: int, te: bool, device: torch.device, tokens: int) -> dict:
    """Expert 2 of four, borrowed (a copy of its tensors, alone in slot 0) against native (among its
    neighbours): the same rows, probabilities and output gradient."""
    layer, adapter = build_experts(shape, 4, ep, te, device)
    counts, j = [tokens // 2, tokens // 4, tokens, tokens // 4], 2
    a, b = sum(counts[:j]), sum(counts[: j + 1])
    x = torch.randn(sum(counts), shape.hidden, device=device, dtype=torch.bfloat16)
    probs, grad = torch.rand(sum(counts), device=device), torch.randn_like(x)
    xn, pn = x.clone().requires_grad_(), probs.clone().requires_grad_()
    native = adapter.forward_native(xn, counts, pn)
    native.backward(grad)
    copy = [t.detach().clone().requires_grad_() for t in adapter.expert_tensors(j)]
    xb, pb = x[a:b].clone().requires_grad_(), probs[a:b].clone().requires_grad_()
    (borrowed,) = adapter.forward_borrowed_part(xb, [counts[j]], pb, [copy])
    borrowed.backward(grad[a:b])
    pairs = {"output": (native[a:b], borrowed), "input_grad": (xn.grad[a:b], xb.grad), "probs_grad": (pn.grad[a:b], pb.grad)}
    pairs.update({f"weight_grad_{i} {tuple(t.shape)}": (t.grad, c.grad) for i, (t, c) in enumerate(zip(adapter.expert_tensors(j), copy))})
    tensors = {name: {"bitwise": bool(torch.equal(want, got)), "max_abs_diff": float((want.float() - got.float()).abs().max()),
                      "max_abs": float(want.float().abs().max())} for name, (want, got) in pairs.items()}
    ok = all(t["max_abs_diff"] <= TOLERANCE * t["max_abs"] for t in tensors.values())
    return {"status": "pass" if ok else "fail", "bitwise": all(t["bitwise"] for t in tensors.values()),
            "tolerance": TOLERANCE, "tokens": counts[j], "hidden": shape.hidden, "ffn": shape.ffn, "tensors": tensors}


def progress(row: dict) -> str:
    if row["status"] in ("error", "skipped"):
        return f"[{row['section']}] {row['name']}: {row['status']}: {row['reason']}"
    if row["section"] == "correctness":
        return f"[correctness] {row['name']}: {row['status']}{' (bit for bit)' if row['bitwise'] else ''}"
    return (f"[layer] {row['name']} @ {row['link_gbps']:g} GB/s, {row['mode']}: EP {row['ep_layer_ms']:.2f} ms, "
            f"LLEP {row['llep_layer_ms']:.2f} ms, ideal {row['ideal_layer_ms']:.2f} ms; LLEP/ideal {row['llep_vs_ideal']:.2f}, "
            f"EP/LLEP {row['ep_vs_llep']:.2f} (no overlap: {row['ep_vs_llep_no_overlap']:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=8, help="emulated EP ranks (default 8)")
    parser.add_argument("--link-gbps", type=float, nargs="+", default=[400.0],
                        help="modelled link bandwidth per direction, GB/s (default 400: NVLink 4 as achieved)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after a warm-up (median)")
    parser.add_argument("--shape", action="append", choices=[s.name for s in FULL_SHAPES], help="only these layer shapes")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (checks the script)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (Megatron through megatron_llep.testing.cpu_gloo)")
    parser.add_argument("--out", default="results/gpu_layer.json")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_layer.py: no CUDA device; run it on a GPU, or check it with --dry-run --cpu", file=sys.stderr)
        sys.exit(2)
    import torch.distributed as dist

    if args.cpu:
        from megatron_llep.testing import cpu_gloo

        cpu_gloo.enable()
    else:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if args.cpu else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    init_expert_parallel(1)  # one process: each experts module is one emulated rank's
    device = torch.device("cpu" if args.cpu else "cuda")
    te = HAVE_TE and not args.cpu
    size = (lambda s: replace(s, num_experts=8 * args.ep, hidden=64, ffn=32, tokens_per_gpu=64)) if args.dry_run else (lambda s: s)
    args.min_chunk = 4 if args.dry_run else LLEPConfig().min_chunk_tokens  # dry run: least-loaded plans, not cost-aware
    settings = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "dtype": "bf16", "ep": args.ep,
                "link_gbps": args.link_gbps, "repeats": args.repeats, "dry_run": args.dry_run, "min_chunk_tokens": args.min_chunk,
                "cost_aware": not args.dry_run, "routing": "forced", "measured": MEASURED, "modelled": MODELLED,
                "tolerance": TOLERANCE, "transformer_engine": HAVE_TE}
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(progress(row), flush=True)
        write_results(args.out, "gpu_layer", rows, settings, complete=False)

    for shape in (size(GPT_OSS_120B), size(DEEPSEEK_V3)):
        for module in ("SequentialMLP", "TEGroupedMLP"):
            row = {"section": "correctness", "name": f"bf16 {module} {shape.name}", "model": shape.name, "experts_module": module,
                   "dtype": "bf16", "routing": "none: the expert's rows are given", "modelled": "nothing"}
            if module == "TEGroupedMLP" and not te:
                emit({**row, "status": "skipped", "reason": "needs CUDA" if args.cpu else "Transformer Engine is not installed"})
                continue
            try:
                row.update(correctness(shape, args.ep, module == "TEGroupedMLP", device, 8 if args.dry_run else 4096))
            except Exception:  # noqa: BLE001  (recorded; the other rows still run)
                row.update(status="error", reason=traceback.format_exc(limit=-3))
            emit(row)
    for shape in [size(s) for s in FULL_SHAPES if not args.shape or s.name in args.shape]:
        try:
            for row in layer_rows(shape, args, device, te):
                emit(row)
        except Exception:  # noqa: BLE001
            emit({"section": "layer", "name": shape.name, "model": shape.name, "status": "error", "routing": "forced",
                  "modelled": MODELLED, "reason": traceback.format_exc(limit=-3)})
    print_table([r for r in rows if r["section"] == "layer" and r["status"] == "ok"], [
        ("name", "layer", ""), ("link_gbps", "GB/s", "g"), ("mode", "plan", ""), ("ep_max_mean", "EP max/mean", ".2f"),
        ("ep_layer_ms", "EP ms", ".2f"), ("llep_layer_ms", "LLEP ms", ".2f"), ("ideal_layer_ms", "ideal ms", ".2f"),
        ("llep_vs_ideal", "LLEP/ideal", ".2f"), ("ep_vs_llep", "EP/LLEP", ".2f"), ("ep_vs_llep_no_overlap", "no overlap", ".2f"),
        ("ep_peak_gb", "EP peak GB", ".2f"), ("llep_peak_gb", "LLEP peak GB", ".2f")])
    write_results(args.out, "gpu_layer", rows, settings)


if __name__ == "__main__":
    main()
