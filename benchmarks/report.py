"""Turn benchmark JSON into docs: result tables (markdown) and the speedup / peak-memory plot.

    python benchmarks/report.py --layer-cpu results/layer_cpu.json --plan-model results/plan_model.json \
        [--gpu results/gpu_layer.json] --out-dir docs

Writes ``docs/benchmarks_results.md`` (included by docs/benchmarks.md) and ``docs/img/llep_speedup_memory.png``
and copies the JSON to ``docs/data/`` so every figure in the docs has its raw numbers next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from megatron_llep.writable import write_text


def _load(path):
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def _fmt(value, spec):
    if value is None:
        return "–"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def _table(rows, columns) -> str:
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(_fmt(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def layer_cpu_section(data) -> str:
    rows = [r for r in data["rows"] if not r["ablation"]]
    ablations = [r for r in data["rows"] if r["ablation"]]
    out = [f"### Real layer on CPU, gloo, P = 2; routing: forced (f into h; balanced rows forced uniform) ({data['date']})", "",
           f"Machine: {data['machine'].get('platform')}, {data['machine'].get('cpus')} cores, torch {data['machine'].get('torch')}. "
           f"Command: `{data['command']}`.", "",
           _table(rows, [("model", "layer", ""), ("scenario", "scenario", ""), ("mode", "plan", ""),
                         ("max_mean_before", "EP max/mean", ".2f"), ("max_mean_after", "LLEP max/mean", ".2f"),
                         ("ep_ms", "EP fwd ms", ".1f"), ("llep_ms", "LLEP fwd ms", ".1f"), ("ideal_ms", "ideal fwd ms", ".1f"),
                         ("speedup", "EP/LLEP", ".2f"), ("llep_vs_ideal", "LLEP/ideal", ".2f"),
                         ("ep_fwd_bwd_ms", "EP fwd+bwd ms", ".1f"), ("llep_fwd_bwd_ms", "LLEP fwd+bwd ms", ".1f"),
                         ("ideal_fwd_bwd_ms", "ideal fwd+bwd ms", ".1f"), ("llep_vs_ideal_fwd_bwd", "LLEP/ideal fwd+bwd", ".2f"),
                         ("ep_peak_mb", "EP peak MB", ".1f"),
                         ("llep_peak_mb", "LLEP peak MB", ".1f"), ("weight_mb", "weights moved MB", ".1f")])]
    if ablations:
        out += ["", "Ablations (gpt-oss-120b/cpu layer, forward):", "",
                _table(ablations, [("ablation", "knob", ""), ("value", "value", ""), ("scenario", "scenario", ""),
                                   ("mode", "plan", ""), ("max_mean_before", "EP max/mean", ".2f"),
                                   ("max_mean_after", "LLEP max/mean", ".2f"), ("ep_ms", "EP ms", ".1f"),
                                   ("llep_ms", "LLEP ms", ".1f"), ("ideal_ms", "ideal ms", ".1f"), ("speedup", "EP/LLEP", ".2f"),
                                   ("llep_vs_ideal", "LLEP/ideal", ".2f")])]
    return "\n".join(out)


def plan_model_section(data) -> str:
    rows = data["rows"]
    out = [f"### Plan-level model at full shapes; routing: forced (f into h, bursts; balanced rows forced uniform) ({data['date']})", "",
           f"Command: `{data['command']}`. Times are the cost model's predictions (docs/benchmarks.md), not measurements; "
           "\"no-overlap\" is the same plan with every weight copy, then the GEMMs, one after the other.", ""]
    for ep in sorted({r["ep"] for r in rows}):
        out += [f"P = {ep}:", "", _table([r for r in rows if r["ep"] == ep], [
            ("model", "layer", ""), ("scenario", "scenario", ""), ("mode", "plan", ""),
            ("ep_max_mean", "EP max/mean", ".2f"), ("llep_max_mean", "LLEP max/mean", ".2f"),
            ("speedup", "pred. speedup", ".2f"), ("paper_speedup", "paper (8xH200)", ".2f"),
            ("llep_vs_ideal", "LLEP/ideal", ".3f"), ("llep_no_overlap_vs_ideal", "no-overlap LLEP/ideal", ".3f"),
            ("ep_token_gb", "EP token GB", ".2f"),
            ("llep_token_gb", "LLEP token GB", ".2f"), ("weight_gb", "weight GB", ".2f"),
            ("ep_mem_vs_ideal", "EP act. mem / ideal", ".2f"), ("llep_mem_vs_ideal", "LLEP act. mem / ideal", ".2f"),
            ("plan_ms", "planner ms", ".3f")]), ""]
    return "\n".join(out)


def gpu_section(data) -> str:
    grid = [r for r in data["rows"] if r["section"] == "layer" and r["status"] == "ok"]
    checks = [r for r in data["rows"] if r["section"] == "correctness"]
    return "\n".join([f"### One GPU, emulated P = {grid[0]['ep_size']}; routing: forced (f into h; balanced rows forced uniform) ({data['date']})", "",
                      f"Machine: {data['machine']}. Command: `{data['command']}`. Measured: {data['settings']['measured']}. "
                      f"Modelled: {data['settings']['modelled']}.", "",
                      _table(grid, [("model", "layer", ""), ("scenario", "scenario", ""), ("link_gbps", "GB/s", "g"), ("mode", "plan", ""),
                                    ("ep_layer_ms", "EP ms", ".2f"), ("llep_layer_ms", "LLEP ms", ".2f"),
                                    ("ideal_layer_ms", "ideal ms", ".2f"), ("ep_vs_llep", "EP/LLEP", ".2f"),
                                    ("ep_vs_llep_no_overlap", "EP/LLEP no overlap", ".2f"), ("paper_fwd_speedup", "paper (fwd)", ".2f"),
                                    ("llep_vs_ideal", "LLEP/ideal", ".3f"), ("ep_peak_gb", "EP peak GB", ".2f"),
                                    ("llep_peak_gb", "LLEP peak GB", ".2f")]), "",
                      _table(checks, [("name", "borrowed vs native", ""), ("status", "status", ""), ("bitwise", "bit for bit", ""),
                                      ("reason", "reason", "")])])


def plot(layer_cpu, plan_model, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in plan_model["rows"] if r["ep"] == 8 and r["model"] == "gpt-oss-120b"]
    for hot in (1, 4, 16):
        sel = sorted([r for r in rows if r["scenario"].endswith(f":{hot}")], key=lambda r: float(r["scenario"].split(":")[0]))
        xs = [float(r["scenario"].split(":")[0]) for r in sel]
        axes[0].plot(xs, [r["speedup"] for r in sel], marker="o", label=f"model P=8, {hot} hot")
        axes[1].plot(xs, [r["ep_mem_vs_ideal"] for r in sel], marker="o", label=f"EP, {hot} hot")
        axes[1].plot(xs, [r["llep_mem_vs_ideal"] for r in sel], marker="x", linestyle="--", label=f"LLEP, {hot} hot")
    if layer_cpu:
        cpu = [r for r in layer_cpu["rows"] if not r["ablation"] and r["model"].startswith("gpt-oss")]
        for hot in (1, 4, 16):
            sel = sorted([r for r in cpu if r["scenario"].endswith(f":{hot}")], key=lambda r: float(r["scenario"].split(":")[0]))
            axes[0].plot([float(r["scenario"].split(":")[0]) for r in sel], [r["speedup"] for r in sel],
                         marker="s", linestyle=":", label=f"measured CPU P=2, {hot} hot")
    paper = {0.95: (5.19, 5.22, 6.11)}
    for f, values in paper.items():
        axes[0].scatter([f] * 3, values, marker="*", s=120, color="black", label="paper 8xH200 (16/4/1 hot)")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set(xlabel="fraction of tokens into the hot experts", ylabel="MoE layer speedup EP / LLEP", title="gpt-oss-120b layer")
    axes[1].set(xlabel="fraction of tokens into the hot experts", ylabel="peak activation memory / balanced", title="per-rank peak memory (model, P=8)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer-cpu")
    parser.add_argument("--plan-model", required=True)
    parser.add_argument("--gpu")
    parser.add_argument("--out-dir", default="docs")
    args = parser.parse_args()
    layer_cpu, plan_model, gpu = _load(args.layer_cpu), _load(args.plan_model), _load(args.gpu)
    sections = [s for s in (layer_cpu and layer_cpu_section(layer_cpu), plan_model_section(plan_model), gpu and gpu_section(gpu)) if s]
    write_text(os.path.join(args.out_dir, "benchmarks_results.md"),
               "<!-- generated by benchmarks/report.py; do not edit -->\n\n" + "\n\n".join(sections) + "\n")
    plot(layer_cpu, plan_model, os.path.join(args.out_dir, "img", "llep_speedup_memory.png"))
    data_dir = os.path.join(args.out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    for path in (args.layer_cpu, args.plan_model, args.gpu):
        target = os.path.join(data_dir, os.path.basename(path)) if path else None
        if path and not (os.path.exists(target) and os.path.samefile(path, target)):  # regenerating from docs/data
            shutil.copy(path, target)
    print(f"wrote {args.out_dir}/benchmarks_results.md and {args.out_dir}/img/llep_speedup_memory.png")


if __name__ == "__main__":
    main()
