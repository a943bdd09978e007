"""Real routing beside forced routing: imbalance, LLEP replay and CAP transfer from routing traces.

    python benchmarks/real_routing.py [--traces DIR] [--out results/real_routing.json]
        [--plot docs/img/real_routing.png] [--smoke]
    python benchmarks/real_routing.py --steps [--max-kept-copies 1] [--overlapped-baseline]

Every other figure in docs/ rests on forced "f into h" routing, which overstates skew (
section 2). This benchmark reads the routing traces of the model trained here
(``recipes/runtime/routing_traces.py``: ``<model>_<domain>.npz``, tokens in their original order,
sequences of 256 tokens back to back) and computes, without a GPU or a process group:

a. imbalance: per (model, domain, layer) the max/mean rank load under sequential placement
   (expert e on rank e // (N/P)) for P = 2, 8, 64, per micro-batch of B consecutive tokens (mean
   and max over the batches) and over the whole trace; beside them the forced scenarios
   (``common.SCENARIOS`` drawn by ``megatron_llep.planning.scenarios.imbalanced_topk`` at the traces' N, K
   and token count), and the share of assignments taken by the top-1/4/16 experts;
b. plan-model replay at H200 scale: each of P = 8, 16, 64 source ranks holds ``--tokens-per-gpu``
   tokens of whole 256-token sequences drawn from the trace (seeded, with replacement), in a layer
   of the traces' N and K at gpt-oss-120b's widths; ``plan_model.compare_plans`` prices plain EP,
   LLEP and the balanced ideal exactly as ``plan_model.py`` does;
c. CAP transfer at P = 8 (one node of 8 GPUs): placements fit on the first half of one domain's
   trace, scored on the second half of every domain's (its own: held out), against sequential
   placement and EPLB (``placement_report.compare_placements``); and the stability of a fit on the
   first T tokens of one domain, scored on the others.

Rows are labelled ``routing``: ``real`` (a recorded trace), ``forced`` (a synthetic scenario) or
``stand-in`` (a synthetic trace in the trace format: ``--smoke`` generates those itself, so tests
need no shipped files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from typing import Optional

import numpy as np

from common import SCENARIOS, LayerShape, print_table, write_results
from placement_report import add_placement_arguments, compare_placements, stability_rows
from plan_model import (DEFAULT_KEPT_COPIES, MICRO_BATCHES, RANKS_PER_NODE, compare_plans, ep_config, ideal_prediction,
                        kept_copies_arg, step_replay, step_summary)

from megatron_llep.config import LLEPConfig
from megatron_llep.planning.cost_model import CostModel
from megatron_llep.placement.metrics import Topology, load_imbalance
from megatron_llep.placement.trace import RoutingTrace, clustered_topk, expert_counts, planted_clusters
from megatron_llep.planning.scenarios import imbalanced_topk
from megatron_llep.writable import write_text
from recipes.runtime import routing_traces

SEQUENCE_TOKENS = 256  # the traced model's sequence length: replay draws whole sequences
IMBALANCE_EP = (2, 8, 64)
BATCH_TOKENS = (256, 2048, 16384)
TOP_EXPERTS = (1, 4, 16)
REPLAY_EP = (8, 16, 64)
# The traced model's N and K at gpt-oss-120b's widths and the paper's 32K tokens per GPU.
REPLAY_SHAPE = LayerShape("real-64e@gpt-oss-width", 64, 2880, 2880, 4, 32768, bias=True)
TRANSFER_EP = 8
TRANSFER_GPUS_PER_NODE = 8
STABILITY_TOKENS = (512, 1024, 2048, 4096, 8192, 16384)
# --smoke: stand-in traces and settings small enough for a test
SMOKE_LAYERS = (1, 2)
SMOKE_TOKENS = 2048
SMOKE_BATCH_TOKENS = (256, 1024)
SMOKE_REPLAY_EP = (8, 64)
SMOKE_TOKENS_PER_GPU = 2048
SMOKE_STABILITY_TOKENS = (256, 1024)


def routing_label(trace: RoutingTrace) -> str:
    """``real`` for a recorded trace, ``stand-in`` for a synthetic one written in the trace format."""
    return "stand-in" if trace.sampling == "synthetic" else "real"


def write_stand_ins(directory: str, num_tokens: int, layers: tuple[int, ...], seed: int = 0) -> None:
    """Synthetic traces named like the shipped ones (pretrained/finetuned x code/prose/legal, 64
    experts, top-4) and a manifest saying so: co-activation clusters shared by every domain, hot
    experts per domain, the fine-tuned model more skewed on ``legal``."""
    for model in ("pretrained", "finetuned"):
        for d, domain in enumerate(("code", "prose", "legal")):
            skew = 1.2 if (model, domain) == ("finetuned", "legal") else 0.6
            ids = {n: clustered_topk(num_tokens, planted_clusters(64, 8, seed + n), 4, 0.6, skew, seed + 100 * d + n)
                   for n in layers}
            trace = RoutingTrace.from_expert_ids(64, ids, sampling="synthetic")
            trace.save(routing_traces.trace_path(model, domain, directory))
    write_text(os.path.join(directory, routing_traces.MANIFEST_FILE),
               json.dumps({"stand_in": True, "writer": "benchmarks/real_routing.py --smoke"}))


def load_all(directory: str) -> dict[tuple[str, str], RoutingTrace]:
    """Every trace of ``directory`` by (model, domain); exits with one line when there is none or
    when their expert counts or top-K differ (the forced scenarios are drawn at one N and K)."""
    pairs = routing_traces.available(directory)
    if not pairs:
        raise SystemExit(f"real_routing.py: no routing traces (<model>_<domain>.npz) in {directory}; "
                         "--smoke runs on generated stand-ins")
    traces = {pair: routing_traces.load(*pair, directory=directory) for pair in pairs}
    shapes = {(t.num_experts, t.topk) for t in traces.values()}
    if len(shapes) != 1:
        raise SystemExit(f"real_routing.py: the traces in {directory} mix experts/top-K {sorted(shapes)}")
    for (model, domain), trace in traces.items():
        sampled = [n for n, layer in trace.layers.items() if layer.tokens_seen > layer.num_sampled]
        if sampled:
            print(f"warning: {model}/{domain} layers {sampled} hold a sample of the tokens seen, not the tokens in "
                  "order: per-batch and replay figures mix unrelated tokens", file=sys.stderr)
    return traces


# a. imbalance under sequential placement

def sequential_devices(num_experts: int, ep_size: int) -> np.ndarray:
    """Megatron's default layout: expert e on rank e // (N / P)."""
    if num_experts % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide {num_experts} experts")
    return np.arange(num_experts) // (num_experts // ep_size)


def batch_imbalance(expert_ids: np.ndarray, num_experts: int, ep_size: int, batch_tokens: Optional[int] = None) -> np.ndarray:
    """Max/mean rank load under sequential placement of every batch of ``batch_tokens`` consecutive
    tokens (a trailing partial batch is dropped; ``None``: the whole trace as one batch)."""
    ids = np.asarray(expert_ids)
    size = len(ids) if batch_tokens is None else batch_tokens
    device = sequential_devices(num_experts, ep_size)
    return np.array([load_imbalance(expert_counts(ids[start:start + size], num_experts), device, ep_size)
                     for start in range(0, len(ids) - size + 1, size)])


def top_shares(expert_ids: np.ndarray, num_experts: int, tops: tuple[int, ...] = TOP_EXPERTS) -> dict[str, float]:
    """Share of all assignments that go to the ``k`` most loaded experts, for each ``k`` of ``tops``
    ("f into h" puts about ``f * min(h, K) / K`` on its ``h`` hot experts)."""
    cumulative = np.cumsum(np.sort(expert_counts(expert_ids, num_experts))[::-1])
    return {f"top{k}": float(cumulative[k - 1] / cumulative[-1]) for k in tops}


def imbalance_rows(label: dict, ids: np.ndarray, num_experts: int, eps: tuple[int, ...], batches: tuple[int, ...]) -> list[dict]:
    """One row per EP size: whole-trace max/mean and the mean and max over each batch size."""
    rows = []
    for ep in eps:
        row = {"kind": "imbalance", **label, "ep": ep, "tokens": len(ids),
               "whole": float(batch_imbalance(ids, num_experts, ep)[0])}
        for size in batches:
            per_batch = batch_imbalance(ids, num_experts, ep, size)
            row[f"b{size}_batches"] = per_batch.size
            row[f"b{size}_mean"] = float(per_batch.mean()) if per_batch.size else None
            row[f"b{size}_max"] = float(per_batch.max()) if per_batch.size else None
        rows.append(row)
    return rows


def skew_rows(traces: dict[tuple[str, str], RoutingTrace], eps: tuple[int, ...], batches: tuple[int, ...], seed: int) -> list[dict]:
    """Section a for every trace layer and every forced scenario at the traces' N, K, token count."""
    rows = []
    first = next(iter(traces.values()))
    n, k = first.num_experts, first.topk
    eps = tuple(ep for ep in eps if n % ep == 0)
    for (model, domain), trace in traces.items():
        shares = []
        for number, layer in sorted(trace.layers.items()):
            label = {"routing": routing_label(trace), "source": f"{model}/{domain}", "model": model, "domain": domain,
                     "layer": number}
            rows += imbalance_rows(label, layer.expert_ids, n, eps, batches)
            shares.append(top_shares(layer.expert_ids, n))
            rows.append({"kind": "top_share", **label, "tokens": layer.num_sampled, **shares[-1]})
        rows.append({"kind": "top_share", **label, "layer": "mean",
                     **{key: float(np.mean([s[key] for s in shares])) for key in shares[0]}})
    tokens = max(layer.num_sampled for t in traces.values() for layer in t.layers.values())
    for scenario in SCENARIOS:
        ids = imbalanced_topk(tokens, n, k, scenario.hot_fraction, scenario.num_hot, seed)
        label = {"routing": "forced", "source": f"forced {scenario.label}", "scenario": scenario.label, "layer": "-"}
        rows += imbalance_rows(label, ids, n, eps, batches)
        rows.append({"kind": "top_share", **label, "tokens": tokens, **top_shares(ids, n)})
    return rows


# b. plan-model replay

def sequence_draws(num_tokens: int, ep_size: int, tokens_per_gpu: int, seed: int,
                   sequence_tokens: int = SEQUENCE_TOKENS) -> np.ndarray:
    """``[P, tokens_per_gpu / S]`` indices of the whole ``S``-token sequences of a trace that each
    source rank holds, drawn with replacement (a long trace is not needed). Seeded by ``seed`` and
    ``P`` only, so every layer and every trace of that length replays the same token positions."""
    if tokens_per_gpu <= 0 or tokens_per_gpu % sequence_tokens:
        raise ValueError(f"tokens per GPU ({tokens_per_gpu}) must be a positive multiple of the sequence length {sequence_tokens}")
    num_sequences = num_tokens // sequence_tokens
    if not num_sequences:
        raise ValueError(f"a trace of {num_tokens} tokens holds no whole {sequence_tokens}-token sequence")
    return np.random.default_rng([seed, ep_size]).integers(0, num_sequences, (ep_size, tokens_per_gpu // sequence_tokens))


def replay_counts(expert_ids: np.ndarray, num_experts: int, draws: np.ndarray, sequence_tokens: int = SEQUENCE_TOKENS) -> np.ndarray:
    """``C[src, e]``: tokens source rank ``src`` routes to expert ``e`` when it holds the sequences
    ``draws[src]`` (from :func:`sequence_draws`); a trailing partial sequence is never used."""
    ids = np.asarray(expert_ids)
    num_sequences = len(ids) // sequence_tokens
    flat = ids[:num_sequences * sequence_tokens].ravel()
    sequence = np.repeat(np.arange(num_sequences), sequence_tokens * ids.shape[1])
    keep = flat >= 0
    per_sequence = np.bincount(sequence[keep] * num_experts + flat[keep], minlength=num_sequences * num_experts)
    return per_sequence.reshape(num_sequences, num_experts)[draws].sum(axis=1)


def replay_rows(traces: dict[tuple[str, str], RoutingTrace], eps: tuple[int, ...], tokens_per_gpu: int, seed: int,
                repeats: int, config: LLEPConfig, model: CostModel) -> list[dict]:
    """Section b: plain EP, LLEP and the ideal per (model, domain, layer, P), as plan_model prices them."""
    first = next(iter(traces.values()))
    shape = replace(REPLAY_SHAPE, name=f"real-{first.num_experts}e@gpt-oss-width", num_experts=first.num_experts,
                    topk=first.topk, tokens_per_gpu=tokens_per_gpu)
    rows = []
    for ep in eps:
        if shape.num_experts % ep:
            continue
        configured = ep_config(config, model, ep)
        ideal = ideal_prediction(shape, ep, configured)
        for (name, domain), trace in traces.items():
            for number, layer in sorted(trace.layers.items()):
                draws = sequence_draws(layer.num_sampled, ep, tokens_per_gpu, seed)
                counts = replay_counts(layer.expert_ids, shape.num_experts, draws)
                rows.append({"kind": "replay", "routing": routing_label(trace), "source": f"{name}/{domain}",
                             "model": name, "domain": domain, "layer": number, "ep": ep, "shape": shape.name,
                             **compare_plans(counts, shape, configured, ideal, repeats)})
    return rows


def step_replay_rows(traces: dict[tuple[str, str], RoutingTrace], eps: tuple[int, ...], tokens_per_gpu: int, seed: int,
                     repeats: int, config: LLEPConfig, kept_copies: Optional[int], overlap: bool) -> list[dict]:
    """Section b over an optimizer step: per (model, domain, layer, P), ``max(MICRO_BATCHES)``
    micro-batches of freshly drawn sequences, planned in order with copies kept across them
    (``plan_model.step_replay``: training cost model, the return behind the backward, the
    planner's time and the count exchange priced, the no-overlap roofline beside)."""
    first = next(iter(traces.values()))
    shape = replace(REPLAY_SHAPE, name=f"real-{first.num_experts}e@gpt-oss-width", num_experts=first.num_experts,
                    topk=first.topk, tokens_per_gpu=tokens_per_gpu)
    model = CostModel(training=True)
    rows = []
    for ep in eps:
        if shape.num_experts % ep:
            continue
        configured = ep_config(config, model, ep)
        for (name, domain), trace in traces.items():
            for number, layer in sorted(trace.layers.items()):
                counts = [replay_counts(layer.expert_ids, shape.num_experts,
                                        sequence_draws(layer.num_sampled, ep, tokens_per_gpu, seed * 1009 + k))
                          for k in range(max(MICRO_BATCHES))]
                label = {"kind": "step", "routing": routing_label(trace), "source": f"{name}/{domain}", "layer": number,
                         "point": f"{name}/{domain} layer {number}"}
                rows += step_replay(shape, ep, counts, label, configured, repeats, kept_copies, overlap)
    return rows


def run_steps(args: argparse.Namespace) -> None:
    """``--steps``: section b over a step of K micro-batches (plan_model.py --steps on the traces)."""
    traces = load_all(args.traces) if not args.smoke else None
    if args.smoke:
        with tempfile.TemporaryDirectory() as directory:
            write_stand_ins(directory, SMOKE_TOKENS, SMOKE_LAYERS, args.seed)
            traces = load_all(directory)
    eps = SMOKE_REPLAY_EP if args.smoke else REPLAY_EP
    tokens_per_gpu = SMOKE_TOKENS_PER_GPU if args.smoke else args.tokens_per_gpu
    rows = step_replay_rows(traces, eps, tokens_per_gpu, args.seed, args.planner_repeats, LLEPConfig(),
                            args.max_kept_copies, args.overlapped_baseline)
    print_table(rows, [
        ("routing", "routing", ""), ("point", "trace layer", ""), ("ep", "P", "d"), ("micro_batches", "K", "d"),
        ("weights", "weights", ""), ("ep_vs_ideal", "EP/ideal", ".3f"), ("llep_vs_ideal", "LLEP/ideal", ".3f"),
        ("llep_vs_ideal_behind", "behind: LLEP/ideal", ".3f"), ("llep_vs_ideal_no_overlap", "no overlap: LLEP/ideal", ".3f"),
        ("planner_ms", "planner ms", ".3f"), ("count_exchange_ms", "count exchange ms", ".3f"),
        ("max_kept_per_rank", "kept/rank", "d"), ("cross_node_rows_vs_ep", "x-node rows / EP", ".2f"),
    ])
    print()
    print(step_summary(rows, "point"))
    write_results(args.out, "real_routing_steps", rows, {
        **vars(args), "replay_ep": eps, "replay_tokens_per_gpu": tokens_per_gpu, "replay_shape": REPLAY_SHAPE,
        "ranks_per_node": RANKS_PER_NODE, "llep": LLEPConfig(), "micro_batches": MICRO_BATCHES})


# c. CAP transfer across domains

def transfer_rows(traces: dict[tuple[str, str], RoutingTrace], lam: float, redundant: int, llep: LLEPConfig,
                  token_counts: tuple[int, ...]) -> tuple[list[dict], list[dict], list[dict]]:
    """Section c per (model, layer, fit domain): placement rows on every domain's held-out half,
    stability rows on the other domains' halves, and the fit's CAP spectrum."""
    topo = Topology(TRANSFER_EP, TRANSFER_GPUS_PER_NODE)
    rows, stable, spectra = [], [], []
    for name in dict.fromkeys(m for m, _ in traces):
        domains = [d for m, d in traces if m == name]
        trace = traces[name, domains[0]]
        halves = {d: traces[name, d].split(0.5) for d in domains}
        for number in sorted(trace.layers):
            held_out = {d: halves[d][1].layer(number).expert_ids for d in domains}
            for fit in domains:
                fit_ids = halves[fit][0].layer(number).expert_ids
                label = {"routing": routing_label(traces[name, fit]), "model": name, "layer": number, "fit": fit,
                         "fit_tokens": len(fit_ids)}
                placed, spectrum = compare_placements(fit_ids, held_out, trace.num_experts, topo, lam, redundant, llep)
                rows += [{"kind": "transfer", **label, **r, "own": r["eval"] == fit, "eval_tokens": len(held_out[r["eval"]])}
                         for r in placed]
                spectra.append({**label, **spectrum})
                others = {d: ids for d, ids in held_out.items() if d != fit}
                counts = tuple(t for t in token_counts if t <= len(fit_ids))
                if others and counts:
                    stable += [{"kind": "stability", **label, **r}
                               for r in stability_rows(fit_ids, others, trace.num_experts, topo, counts)]
    return rows, stable, spectra


def transfer_table(rows: list[dict]) -> list[dict]:
    """One printed line per (model, layer, fit, eval): devices per token and max/mean by method."""
    methods = {"sequential": "seq", "EPLB": "eplb", "CAP comm-optimal": "cap", "CAP lambda": "cap_lam"}
    lines: dict[tuple, dict] = {}
    for r in rows:
        method = methods.get(r["method"].split(" (")[0].split("=")[0])  # "CAP lambda=0.5 (step 3)" -> "CAP lambda"
        if method is None:
            continue
        line = lines.setdefault((r["model"], r["layer"], r["fit"], r["eval"]),
                                {k: r[k] for k in ("model", "layer", "fit")} | {"eval": r["eval"] + (" (own)" if r["own"] else "")})
        line[f"{method}_dev"], line[f"{method}_mm"] = r["devices_per_token"], r["max_mean"]
    return list(lines.values())


def plot(path: str, rows: list[dict], eps: tuple[int, ...], batch: int) -> None:
    """Per-layer max/mean per domain and model (micro-batches of ``batch`` tokens) against the
    forced scenarios, one panel per EP size; and LLEP/ideal of the replay by P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    imbalance = [r for r in rows if r["kind"] == "imbalance"]
    replay = [r for r in rows if r["kind"] == "replay"]
    fig, axes = plt.subplots(1, len(eps) + 1, figsize=(5 * (len(eps) + 1), 4.5))
    traced = [r for r in imbalance if r["routing"] != "forced"]
    models = list(dict.fromkeys(r["model"] for r in traced))
    domains = list(dict.fromkeys(r["domain"] for r in traced))
    colours = {d: f"C{i}" for i, d in enumerate(domains)}
    key = f"b{batch}_mean"
    for ax, ep in zip(axes, eps):
        for i, name in enumerate(models):
            for domain in domains:
                sub = [r for r in traced if r["ep"] == ep and r["model"] == name and r["domain"] == domain]
                if sub:
                    ax.plot([r["layer"] for r in sub], [r[key] for r in sub], "o" + ("-", "--", ":")[i % 3],
                            color=colours[domain], label=f"{name}/{domain}")
        for r in imbalance:
            if r["routing"] == "forced" and r["ep"] == ep and r["scenario"] in ("balanced", "0.5:4", "0.8:16", "0.95:4", "0.95:1"):
                ax.axhline(r[key], color="grey", linestyle=":", linewidth=0.8)
                ax.annotate(f"forced {r['scenario']}", (1.0, r[key]), xycoords=("axes fraction", "data"),
                            fontsize=7, color="grey", ha="right", va="bottom")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("MoE layer")
        ax.set_title(f"sequential placement, P = {ep}")
    axes[0].set_ylabel(f"max/mean rank load, mean over {batch}-token batches")
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    sources = list(dict.fromkeys(r["source"] for r in replay))
    replay_eps = sorted({r["ep"] for r in replay})
    for i, source in enumerate(sources):
        sub = [r for r in replay if r["source"] == source]
        values = [np.array([r["llep_vs_ideal"] for r in sub if r["ep"] == ep]) for ep in replay_eps]
        x = np.arange(len(replay_eps)) + (i - (len(sources) - 1) / 2) * 0.8 / max(len(sources), 1)
        mean = np.array([v.mean() for v in values])
        spread = np.array([[m - v.min(), v.max() - m] for v, m in zip(values, mean)]).T
        name, domain = source.split("/")
        ax.errorbar(x, mean, yerr=spread, fmt="o" if models.index(name) == 0 else "s", color=colours.get(domain),
                    label=source, capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(np.arange(len(replay_eps)), [f"P = {ep}" for ep in replay_eps])
    ax.set_ylabel("LLEP / force-balanced ideal (plan model)")
    ax.set_title("replayed routing, mean and range over layers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default=routing_traces.TRACE_DIR, help="directory of <model>_<domain>.npz traces")
    parser.add_argument("--tokens-per-gpu", type=int, default=REPLAY_SHAPE.tokens_per_gpu, help="replay tokens per source rank")
    parser.add_argument("--planner-repeats", type=int, default=5, help="timed planner calls per replay row")
    add_placement_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny run on stand-in traces it generates (tests)")
    parser.add_argument("--out", default="results/real_routing.json")
    parser.add_argument("--plot", default="docs/img/real_routing.png", help="PNG to write ('' for none)")
    parser.add_argument("--steps", action="store_true",
                        help="only the replay, over optimizer steps of 1, 4 and 8 micro-batches (training cost model, "
                             "copies kept across micro-batches, the return behind the backward, planner time and "
                             "count exchange priced); --out defaults to results/real_routing_steps.json")
    parser.add_argument("--max-kept-copies", type=kept_copies_arg, default=DEFAULT_KEPT_COPIES,
                        help=f"with --steps: kept copies per rank and layer (default {DEFAULT_KEPT_COPIES}; 'none': no bound)")
    parser.add_argument("--overlapped-baseline", action="store_true",
                        help="with --steps: plain EP, the ideal and LLEP hide their token all-to-alls behind computation")
    args = parser.parse_args(argv)
    if args.steps:
        if args.out == "results/real_routing.json":
            args.out = "results/real_routing_steps.json"
        run_steps(args)
        return
    batches = SMOKE_BATCH_TOKENS if args.smoke else BATCH_TOKENS
    replay_eps = SMOKE_REPLAY_EP if args.smoke else REPLAY_EP
    tokens_per_gpu = SMOKE_TOKENS_PER_GPU if args.smoke else args.tokens_per_gpu
    token_counts = SMOKE_STABILITY_TOKENS if args.smoke else STABILITY_TOKENS
    if args.smoke:
        with tempfile.TemporaryDirectory() as directory:
            write_stand_ins(directory, SMOKE_TOKENS, SMOKE_LAYERS, args.seed)
            traces, manifest = load_all(directory), routing_traces.manifest(directory)
    else:
        traces = load_all(args.traces)
        try:
            manifest = routing_traces.manifest(args.traces)
        except ValueError as err:
            print(f"warning: {err}: provenance unknown", file=sys.stderr)
            manifest = None
    llep_plan = LLEPConfig()  # plan_model.py's defaults: alpha 1, m 1024, lambda 1.3
    cost_model = CostModel()
    timings = {}

    start = time.perf_counter()
    skew = skew_rows(traces, IMBALANCE_EP, batches, args.seed)
    timings["imbalance_s"] = time.perf_counter() - start
    print(f"imbalance: {len(traces)} traces and {len(SCENARIOS)} forced scenarios in {timings['imbalance_s']:.1f} s\n", flush=True)
    batch_columns = [(f"b{b}_{s}", f"B={b} {s}", ".2f") for b in batches for s in ("mean", "max")]
    print_table([r for r in skew if r["kind"] == "imbalance"],
                [("routing", "routing", ""), ("source", "source", ""), ("layer", "layer", ""), ("ep", "P", "d"),
                 ("whole", "whole trace", ".2f"), *batch_columns])
    print()
    print_table([r for r in skew if r["kind"] == "top_share"],
                [("routing", "routing", ""), ("source", "source", ""), ("layer", "layer", ""),
                 *[(f"top{k}", f"top-{k} share", ".3f") for k in TOP_EXPERTS]])

    start = time.perf_counter()
    replay = replay_rows(traces, replay_eps, tokens_per_gpu, args.seed, args.planner_repeats, llep_plan, cost_model)
    timings["replay_s"] = time.perf_counter() - start
    print(f"\nreplay at {tokens_per_gpu} tokens/GPU: {len(replay)} rows in {timings['replay_s']:.1f} s\n", flush=True)
    print_table(replay, [
        ("routing", "routing", ""), ("source", "source", ""), ("layer", "layer", ""), ("ep", "P", "d"), ("mode", "plan", ""),
        ("ep_max_mean", "EP max/mean", ".2f"), ("llep_max_mean", "LLEP max/mean", ".2f"),
        ("ep_ms", "EP ms", ".2f"), ("llep_ms", "LLEP ms", ".2f"), ("ideal_ms", "ideal ms", ".2f"),
        ("speedup", "speedup", ".2f"), ("llep_vs_ideal", "LLEP/ideal", ".3f"), ("weight_gb", "weights GB", ".3f"),
    ])

    start = time.perf_counter()
    llep_placed = LLEPConfig(cost_aware=False, min_chunk_tokens=args.min_chunk_tokens)
    transfer, stable, spectra = transfer_rows(traces, args.lam, args.redundant, llep_placed, token_counts)
    timings["transfer_s"] = time.perf_counter() - start
    print(f"\nCAP transfer at P = {TRANSFER_EP} ({TRANSFER_GPUS_PER_NODE} GPUs per node): {len(transfer)} rows in "
          f"{timings['transfer_s']:.1f} s\n", flush=True)
    print_table(transfer_table(transfer), [
        ("model", "model", ""), ("layer", "layer", ""), ("fit", "fit on", ""), ("eval", "scored on", ""),
        ("seq_dev", "seq dev/tok", ".2f"), ("eplb_dev", "EPLB dev/tok", ".2f"), ("cap_dev", "CAP dev/tok", ".2f"),
        ("cap_lam_dev", "CAP-lam dev/tok", ".2f"), ("seq_mm", "seq max/mean", ".3f"), ("eplb_mm", "EPLB max/mean", ".3f"),
        ("cap_mm", "CAP max/mean", ".3f"), ("cap_lam_mm", "CAP-lam max/mean", ".3f"),
    ])
    print()
    print_table(stable, [("model", "model", ""), ("layer", "layer", ""), ("fit", "fit on", ""), ("eval", "scored on", ""),
                         ("fit_tokens", "fit tokens", "d"), ("coact_rel_error", "p_ij rel. error", ".3f"),
                         ("devices_per_token", "dev/token", ".3f")])

    rows = skew + replay + transfer + stable
    traces_info = {f"{m}/{d}": {"routing": routing_label(t), "num_experts": t.num_experts, "topk": t.topk,
                                "layers": {n: {"tokens": layer.num_sampled, "tokens_seen": layer.tokens_seen}
                                           for n, layer in sorted(t.layers.items())},
                                "sampling": t.sampling, "sources": t.sources} for (m, d), t in traces.items()}
    write_results(args.out, "real_routing", rows, {
        **vars(args), "traces_dir": "stand-ins (--smoke)" if args.smoke else args.traces, "traces": traces_info,
        "manifest": manifest, "batch_tokens": batches, "imbalance_ep": IMBALANCE_EP, "replay_ep": replay_eps,
        "replay_tokens_per_gpu": tokens_per_gpu, "sequence_tokens": SEQUENCE_TOKENS, "replay_shape": REPLAY_SHAPE,
        "ranks_per_node": RANKS_PER_NODE, "llep": llep_plan, "transfer_ep": TRANSFER_EP,
        "transfer_gpus_per_node": TRANSFER_GPUS_PER_NODE, "stability_tokens": token_counts, "spectra": spectra,
        "timings": timings,
    })
    if args.plot:
        plot(args.plot, rows, IMBALANCE_EP, batches[len(batches) // 2])


if __name__ == "__main__":
    main()
