"""CAP placement report: sequential vs DeepSeek-EPLB-style replication vs CAP (comm-optimal and
lambda-selected) vs CAP + LLEP, on held-out routing-trace tokens.

    python benchmarks/placement_report.py [--tokens 16384] [--out results/placement_report.json]
        [--plot docs/img/placement_report.png] [--smoke]

Traces are synthetic (:func:`megatron_llep.placement.trace.synthetic_trace`): experts in planted
co-activation clusters (a pick lies in the token's cluster with probability q) with load skew, at
published layer shapes. Every method is fit on the first half of the tokens and evaluated on the other
half: average distinct devices per token, C(pi) (on the held-out co-activation), max/mean GPU load.
EPLB gets one extra expert slot per GPU (``--redundant``); a token uses a replica on a device it
already visits, else the least-loaded one. "+LLEP" runs :func:`megatron_llep.planning.planner.plan_llep` on
the held-out per-rank loads of that placement (tokens split evenly over the EP ranks as sources).
A second table shows how the statistics settle with the number of trace tokens.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from common import print_table, write_results

from megatron_llep.config import LLEPConfig
from megatron_llep.placement.cap import plan_cap
from megatron_llep.placement.metrics import (
    Topology, coactivation, comm_cost, devices_per_token, distinct_per_row, load_imbalance, max_over_mean,
)
from megatron_llep.placement.replication import eplb_placement, route_with_replicas
from megatron_llep.placement.trace import expert_counts, synthetic_trace
from megatron_llep.planning import plan_llep


@dataclass(frozen=True)
class TraceScenario:
    name: str
    num_experts: int
    topk: int
    ep_size: int
    gpus_per_node: int
    num_clusters: int
    affinity: float
    load_skew: float


SCENARIOS = (
    TraceScenario("gpt-oss-120b", 128, 4, 8, 8, 8, 0.7, 0.6),
    TraceScenario("deepseek-v3", 256, 8, 16, 8, 16, 0.7, 0.6),
    TraceScenario("deepseek-v3 q=0", 256, 8, 16, 8, 16, 0.0, 0.6),
)
SMOKE = (TraceScenario("smoke", 32, 4, 4, 2, 4, 0.8, 0.6),)
# statistic stability: the strong-structure layer and a weakly structured one (q = 0.3)
STABILITY_SCENARIOS = (SCENARIOS[1], TraceScenario("deepseek-v3 q=0.3", 256, 8, 16, 8, 16, 0.3, 0.6))
STABILITY_TOKENS = (512, 1024, 2048, 4096, 8192, 16384)


def _llep_max_mean(eval_ids: np.ndarray, device_of_expert: np.ndarray, ep_size: int, config: LLEPConfig) -> float:
    """Max/mean rank load after LLEP on the placed layout (source rank = token position block)."""
    slot_of_expert = np.argsort(np.argsort(device_of_expert, kind="stable"))
    source = np.repeat(np.arange(ep_size), int(np.ceil(len(eval_ids) / ep_size)))[: len(eval_ids)]
    counts = np.zeros((ep_size, device_of_expert.size), np.int64)
    np.add.at(counts, (np.repeat(source, eval_ids.shape[1]), slot_of_expert[eval_ids.ravel()]), 1)
    return max_over_mean(plan_llep(counts, config).rank_loads_after)


def compare_placements(
    fit_ids: np.ndarray,
    eval_sets: dict[str, np.ndarray],
    num_experts: int,
    topo: Topology,
    lam: float,
    redundant: int,
    llep: LLEPConfig,
) -> tuple[list[dict], dict]:
    """Sequential, sequential+LLEP, EPLB (``redundant`` extra slots per GPU), CAP comm-optimal,
    CAP by ``lam`` and CAP comm-optimal+LLEP, all fit on ``fit_ids`` (``[T, K]`` expert ids) and
    scored on each of ``eval_sets`` (rows labelled ``eval``): the one computation behind the
    synthetic report and the real-trace transfer table. Also returns the fit's CAP spectrum."""
    n, ep = num_experts, topo.ep_size
    fit_loads = expert_counts(fit_ids, n)
    start = time.perf_counter()
    cap = plan_cap(coactivation(fit_ids, n), fit_loads, topo, lam=lam)
    plan_s = time.perf_counter() - start
    sequential = np.arange(n) // (n // ep)
    replicated = eplb_placement(fit_loads, ep, redundant)
    rows = []
    for name, eval_ids in eval_sets.items():
        eval_loads, eval_coact = expert_counts(eval_ids, n), coactivation(eval_ids, n)

        def row(method: str, device: np.ndarray, with_llep: bool = False) -> dict:
            r = {"method": method, "eval": name, "devices_per_token": devices_per_token(eval_ids, device).mean(),
                 "nodes_per_token": devices_per_token(eval_ids, topo.node_of(device)).mean(),
                 "comm_cost": comm_cost(eval_coact, device, topo), "max_mean": load_imbalance(eval_loads, device, ep)}
            if with_llep:
                r["llep_max_mean"] = _llep_max_mean(eval_ids, device, ep, llep)
            return r

        served, eplb_loads = route_with_replicas(eval_ids, replicated)
        rows += [
            row("sequential", sequential),
            row("sequential+LLEP", sequential, with_llep=True),
            {"method": f"EPLB (+{redundant} slot/GPU)", "eval": name,
             "devices_per_token": distinct_per_row(served).mean(),
             "nodes_per_token": distinct_per_row(np.where(served >= 0, topo.node_of(served), -1)).mean(),
             "max_mean": max_over_mean(eplb_loads)},
            row("CAP comm-optimal", cap.comm_optimal.device_of_expert),
            row(f"CAP {cap.selection} (step {cap.chosen})", cap.chosen_point.device_of_expert),
            row("CAP comm-optimal+LLEP", cap.comm_optimal.device_of_expert, with_llep=True),
        ]
    spectrum = {"plan_s": plan_s, "chosen": cap.chosen,
                "comm_cost_sequential": comm_cost(coactivation(fit_ids, n), sequential, topo),
                "comm_cost": [p.comm_cost for p in cap.spectrum], "imbalance": [p.imbalance for p in cap.spectrum]}
    return rows, spectrum


def evaluate(scenario: TraceScenario, tokens: int, lam: float, redundant: int, llep: LLEPConfig, seed: int) -> tuple[list[dict], dict]:
    trace, _ = synthetic_trace(2 * tokens, scenario.num_experts, scenario.topk, scenario.num_clusters,
                               scenario.affinity, scenario.load_skew, seed=seed)
    fit, held_out = trace.split(0.5)
    eval_ids = held_out.layer(1).expert_ids
    topo = Topology(scenario.ep_size, scenario.gpus_per_node)
    rows, spectrum = compare_placements(fit.layer(1).expert_ids, {"held out": eval_ids}, scenario.num_experts, topo,
                                        lam, redundant, llep)
    rows = [{"scenario": scenario.name, **r, "num_experts": scenario.num_experts, "topk": scenario.topk,
             "ep": scenario.ep_size, "gpus_per_node": scenario.gpus_per_node, "affinity": scenario.affinity,
             "load_skew": scenario.load_skew, "eval_tokens": len(eval_ids)} for r in rows]
    return rows, {"scenario": scenario.name, **spectrum}


def stability_rows(
    fit_ids: np.ndarray, eval_sets: dict[str, np.ndarray], num_experts: int, topo: Topology, token_counts: tuple
) -> list[dict]:
    """CAP (comm-optimal) fit on the first T of ``fit_ids`` for each T of ``token_counts``, scored
    on each of ``eval_sets`` (rows labelled ``eval``); the co-activation error is relative to the
    largest fit."""
    n = num_experts
    reference = coactivation(fit_ids[:max(token_counts)], n)
    eval_coacts = {name: coactivation(ids, n) for name, ids in eval_sets.items()}
    rows = []
    for count in token_counts:
        coact = coactivation(fit_ids[:count], n)
        device = plan_cap(coact, expert_counts(fit_ids[:count], n), topo).comm_optimal.device_of_expert
        error = float(np.linalg.norm(coact - reference) / np.linalg.norm(reference))
        rows += [{"fit_tokens": count, "eval": name, "coact_rel_error": error,
                  "devices_per_token": devices_per_token(ids, device).mean(),
                  "comm_cost": comm_cost(eval_coacts[name], device, topo)} for name, ids in eval_sets.items()]
    return rows


def stability(scenario: TraceScenario, token_counts: tuple, seed: int) -> list[dict]:
    """CAP fit on the first T tokens, evaluated on a fixed held-out set of the largest size."""
    largest = max(token_counts)
    trace, _ = synthetic_trace(2 * largest, scenario.num_experts, scenario.topk, scenario.num_clusters,
                               scenario.affinity, scenario.load_skew, seed=seed + 1)
    ids = trace.layer(1).expert_ids
    topo = Topology(scenario.ep_size, scenario.gpus_per_node)
    return [{"scenario": scenario.name, **r}
            for r in stability_rows(ids[:largest], {"held out": ids[largest:]}, scenario.num_experts, topo, token_counts)]


def plot(path: str, rows: list[dict], spectra: list[dict], stable: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    methods = list(dict.fromkeys(r["method"].split(" (")[0] for r in rows if "LLEP" not in r["method"]))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next(r["devices_per_token"] for r in rows if r["scenario"] == s and r["method"].split(" (")[0] == method)
                  for s in scenarios]
        axes[0].bar(np.arange(len(scenarios)) + i * width, values, width, label=method)
    axes[0].set_xticks(np.arange(len(scenarios)) + 0.4 - width / 2, scenarios)
    axes[0].set_ylabel("distinct devices per token (held out)")
    axes[0].legend(fontsize=8)
    for s in spectra:
        relative = np.array(s["comm_cost"]) / s["comm_cost_sequential"]
        axes[1].plot(relative, s["imbalance"], ".-", label=s["scenario"])
        axes[1].plot(relative[s["chosen"]], s["imbalance"][s["chosen"]], "k*", markersize=10)
    axes[1].set_xlabel("C(pi) / C(sequential) (fit tokens)")
    axes[1].set_ylabel("B(pi) = max/mean GPU load")
    axes[1].set_title("trade-off spectrum (* = lambda choice)")
    axes[1].legend(fontsize=8)
    error_axis = axes[2].twinx()
    for name in dict.fromkeys(r["scenario"] for r in stable):
        sub = [r for r in stable if r["scenario"] == name]
        tokens = [r["fit_tokens"] for r in sub]
        line, = axes[2].semilogx(tokens, [r["devices_per_token"] for r in sub], "o-", label=f"{name}: devices/token")
        error_axis.semilogx(tokens[:-1], [r["coact_rel_error"] for r in sub[:-1]], "x--", color=line.get_color(),
                            label=f"{name}: p_ij error")
    axes[2].set_xlabel("trace tokens used to fit")
    axes[2].set_ylabel("devices per token (held out), solid")
    error_axis.set_ylabel("p_ij relative error vs largest fit, dashed")
    axes[2].set_title("statistic stability")
    axes[2].legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags :func:`compare_placements` takes (also real_routing.py's): ``lam``, ``redundant``
    and ``min_chunk_tokens``."""
    parser.add_argument("--lambda", dest="lam", type=float, default=0.5, help="CAP's C/B trade-off")
    parser.add_argument("--redundant", type=int, default=1, help="EPLB extra expert slots per GPU")
    parser.add_argument("--min-chunk-tokens", type=int, default=64, help="LLEP m for the +LLEP rows")


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="fit tokens (as many again are held out)")
    add_placement_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="one tiny scenario (tests)")
    parser.add_argument("--out", default="results/placement_report.json")
    parser.add_argument("--plot", default="docs/img/placement_report.png", help="PNG to write ('' for none)")
    args = parser.parse_args(argv)
    scenarios = SMOKE if args.smoke else SCENARIOS
    tokens = 1024 if args.smoke else args.tokens
    token_counts = (256, 512, 1024) if args.smoke else STABILITY_TOKENS
    llep = LLEPConfig(cost_aware=False, min_chunk_tokens=args.min_chunk_tokens)
    rows, spectra = [], []
    for scenario in scenarios:
        scenario_rows, spectrum = evaluate(scenario, tokens, args.lam, args.redundant, llep, args.seed)
        rows += scenario_rows
        spectra.append(spectrum)
        print(f"{scenario.name}: planned in {spectrum['plan_s']:.2f} s, {len(spectrum['comm_cost'])} spectrum points", flush=True)
    print()
    print_table(rows, [("scenario", "scenario", ""), ("method", "method", ""), ("devices_per_token", "dev/token", ".2f"),
                       ("nodes_per_token", "nodes/token", ".2f"), ("comm_cost", "C", ".1f"),
                       ("max_mean", "max/mean", ".3f"), ("llep_max_mean", "after LLEP", ".3f")])
    stable = [r for s in (SMOKE if args.smoke else STABILITY_SCENARIOS) for r in stability(s, token_counts, args.seed)]
    print()
    print_table(stable, [("scenario", "scenario", ""), ("fit_tokens", "fit tokens", "d"),
                         ("coact_rel_error", "p_ij rel. error", ".3f"), ("devices_per_token", "dev/token", ".3f"),
                         ("comm_cost", "C", ".1f")])
    write_results(args.out, "placement_report", rows, {**vars(args), "spectra": spectra, "stability": stable,
                                                       "scenarios": [s.__dict__ for s in scenarios]})
    if args.plot:
        plot(args.plot, rows, spectra, stable)


if __name__ == "__main__":
    main()
