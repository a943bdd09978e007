"""The planner beside MoonEP's planning rule: weight copies at equal (exact) balance, and the
planner's host time at N = 384, P = 64.

    python benchmarks/planner_copies.py [--repeats 30] [--out results/planner_copies.json]

Copies. Both planners balance exactly (every rank within one token of the mean, LLEP at alpha 1
with m = 0 and lambda 1, not cost-aware) on the forced grid (gpt-oss-120b, DeepSeek-V3, Kimi-K2 at
P = 8 and 64, every scenario of ``common.SCENARIOS``) and on the shipped real routing traces
(P = 8, 16, 64, 32K tokens per GPU) and on Megatron-LM PR #7488's token-imbalance workloads W0-W7
(routing "pr7488": the three shapes at P = 8 and 64, their tokens per GPU; W6 and W7 at step 3,
after the hotspot's first move and on the burst, the others at step 0); each row counts the weight copies each needs (one per expert
and helper). MoonEP's rule, as published (MoonshotAI's MoonEP planning kernel): the most
overloaded home group fills the roomiest destination completely (one home group per destination
while it has excess left), then inside each home group the largest expert takes the largest
remaining quota.

Time. :func:`plan_llep` with the library's defaults (cost-aware, m = 1024, lambda 1.3, 8 ranks a
node) at Kimi-K2's N = 384 and P = 64 on every forced scenario and every PR #7488 workload: the least
of ``--repeats`` calls in a row (on a quiet machine: the host's load average is recorded beside
it), from the compiled planner and then from the Python reference it was written from (the same
plans; ``python_plan_min_ms``).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import megatron_llep.planning.planner as planner
from common import FULL_SHAPES, KIMI_K2, SCENARIOS, print_table, sample_counts, write_results
from plan_model import RANKS_PER_NODE, expert_shape

from megatron_llep.config import LLEPConfig
from megatron_llep.planning import TOKEN_IMBALANCE_WORKLOADS, plan_llep, token_imbalance_counts

COPY_EPS = (8, 64)
TRACE_EPS = (8, 16, 64)
# the step each PR #7488 workload is planned at: W6 once its hotspot has moved, W7 on its burst
WORKLOAD_STEP = {"W6_rotating_hotspot": 3, "W7_burst": 3}


def workload_counts(shape, ep: int, workload: str, seed: int) -> np.ndarray:
    return token_imbalance_counts(workload, ep, shape.tokens_per_gpu, shape.num_experts, shape.topk, seed,
                                  WORKLOAD_STEP.get(workload, 0))


def moonep_rule_copies(counts: np.ndarray, local: int) -> tuple[int, float]:
    """Weight copies MoonEP's planning rule makes to balance ``counts`` ([P, N]) exactly, and the
    max/mean rank load it reaches. Targets: the mean load, the remainder one token each to the
    first ranks. Home groups are ranks' native experts."""
    loads = counts.sum(axis=0).astype(np.int64)
    ep = counts.shape[0]
    rank_loads = loads.reshape(ep, local).sum(axis=1)
    total = int(rank_loads.sum())
    target = np.full(ep, total // ep, np.int64)
    target[: total % ep] += 1
    excess = np.maximum(rank_loads - target, 0)
    room = np.maximum(target - rank_loads, 0)
    quotas: dict[int, list[int]] = {}  # home rank -> the quotas it sends, one per destination
    while excess.sum() > 0:
        home = int(np.argmax(excess))  # the most overloaded home group
        dst = int(np.argmax(room))  # fills the roomiest destination
        amount = int(min(excess[home], room[dst]))
        quotas.setdefault(home, []).append(amount)
        excess[home] -= amount
        room[dst] -= amount
    copies = 0
    for home, amounts in quotas.items():
        experts = sorted(loads[home * local:(home + 1) * local].tolist(), reverse=True)
        remaining = sorted(amounts, reverse=True)
        # the largest local expert takes the largest remaining quota, again and again
        while remaining and experts:
            remaining.sort(reverse=True)
            experts.sort(reverse=True)
            take = min(experts[0], remaining[0])
            if take <= 0:
                break
            copies += 1
            experts[0] -= take
            remaining[0] -= take
            remaining = [q for q in remaining if q > 0]
    return copies, float(target.max() / target.mean())  # every rank ends at its target


def exact_config(ep: int) -> LLEPConfig:
    return LLEPConfig(alpha=1.0, min_chunk_tokens=0, imbalance_threshold=1.0, cost_aware=False,
                      ranks_per_node=min(RANKS_PER_NODE, ep))


def copy_row(counts: np.ndarray, label: dict) -> dict:
    ep, n = counts.shape
    plan = plan_llep(counts, exact_config(ep))
    moon, moon_max_mean = moonep_rule_copies(counts, n // ep)
    after = plan.rank_loads_after
    return {**label, "ep": ep, "llep_copies": plan.num_weight_transfers, "moonep_copies": moon,
            "llep_max_mean": float(after.max() / after.mean()), "moonep_max_mean": moon_max_mean,
            "llep_minus_moonep": plan.num_weight_transfers - moon}


def forced_copy_rows(seed: int) -> list[dict]:
    rows = []
    for shape in FULL_SHAPES:
        for ep in COPY_EPS:
            for scenario in SCENARIOS[1:]:
                rows.append(copy_row(sample_counts(shape, ep, scenario, seed),
                                     {"routing": "forced", "point": f"{shape.name} {scenario.label}"}))
    return rows


def workload_copy_rows(seed: int) -> list[dict]:
    rows = []
    for shape in FULL_SHAPES:
        for ep in COPY_EPS:
            for workload in TOKEN_IMBALANCE_WORKLOADS:
                rows.append(copy_row(workload_counts(shape, ep, workload, seed),
                                     {"routing": "pr7488", "point": f"{shape.name} {workload}"}))
    return rows


def trace_copy_rows(seed: int) -> list[dict]:
    import real_routing
    from recipes.runtime import routing_traces

    rows = []
    traces = real_routing.load_all(routing_traces.TRACE_DIR)
    for ep in TRACE_EPS:
        for (name, domain), trace in traces.items():
            for number, layer in sorted(trace.layers.items()):
                draws = real_routing.sequence_draws(layer.num_sampled, ep, 32768, seed)
                counts = real_routing.replay_counts(layer.expert_ids, trace.num_experts, draws)
                rows.append(copy_row(counts, {"routing": "real", "point": f"{name}/{domain} layer {number}"}))
    return rows


def timing_rows(repeats: int, seed: int) -> list[dict]:
    shape, ep = KIMI_K2, 64
    config = LLEPConfig(ranks_per_node=RANKS_PER_NODE)
    rows = []
    points = [("forced", scenario.label, sample_counts(shape, ep, scenario, seed)) for scenario in SCENARIOS]
    points += [("pr7488", workload, workload_counts(shape, ep, workload, seed)) for workload in TOKEN_IMBALANCE_WORKLOADS]
    es = expert_shape(shape)
    compiled = planner._spill_core
    for routing, label, counts in points:
        plan_llep(counts, config, es)
        times, python_times = [], []
        for core, out in ((compiled, times), (None, python_times)):  # each planner's calls back to back
            planner._spill_core = core
            for _ in range(repeats):
                start = time.perf_counter()
                plan_llep(counts, config, es)
                out.append(time.perf_counter() - start)
        planner._spill_core = compiled
        plan = plan_llep(counts, config, es)
        rows.append({"routing": routing, "point": f"{shape.name} {label}", "ep": ep,
                     "num_experts": shape.num_experts, "compiled": compiled is not None,
                     "plan_min_ms": min(times) * 1e3, "plan_median_ms": float(np.median(times)) * 1e3,
                     "python_plan_min_ms": min(python_times) * 1e3, "spilled_experts": int(plan.spilled_experts.size),
                     "weight_copies": plan.num_weight_transfers})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/planner_copies.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    timing = timing_rows(args.repeats, args.seed)
    load_after = os.getloadavg()
    print_table(timing, [("routing", "routing", ""), ("point", "point", ""), ("ep", "P", "d"), ("num_experts", "N", "d"),
                         ("spilled_experts", "spilled", "d"), ("weight_copies", "copies", "d"),
                         ("plan_min_ms", "plan ms (min)", ".3f"), ("plan_median_ms", "plan ms (median)", ".3f"),
                         ("python_plan_min_ms", "Python planner ms (min)", ".3f")])
    print(f"load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f}\n")
    copies = forced_copy_rows(args.seed) + workload_copy_rows(args.seed) + trace_copy_rows(args.seed)
    print_table(copies, [("routing", "routing", ""), ("point", "point", ""), ("ep", "P", "d"),
                         ("llep_copies", "LLEP copies", "d"), ("moonep_copies", "MoonEP rule copies", "d"),
                         ("llep_max_mean", "LLEP max/mean", ".3f"), ("moonep_max_mean", "MoonEP max/mean", ".3f")])
    print()
    for routing in ("forced", "pr7488", "real"):
        for ep in sorted({r["ep"] for r in copies if r["routing"] == routing}):
            group = [r for r in copies if r["routing"] == routing and r["ep"] == ep]
            print(f"{routing} P = {ep}: mean copies LLEP {np.mean([r['llep_copies'] for r in group]):.1f}, MoonEP rule "
                  f"{np.mean([r['moonep_copies'] for r in group]):.1f}; LLEP makes more at "
                  f"{sum(r['llep_minus_moonep'] > 0 for r in group)} of {len(group)} points")
    which = "compiled" if planner.COMPILED_PLANNER else "Python (the compiled planner is not built)"
    print(f"planner ({which}) at N = 384, P = 64: slowest min-of-{args.repeats} "
          f"{max(r['plan_min_ms'] for r in timing):.3f} ms; the Python planner's "
          f"{max(r['python_plan_min_ms'] for r in timing):.3f} ms")
    write_results(args.out, "planner_copies", timing + copies,
                  {**vars(args), "load_average": [load_before, load_after], "ranks_per_node": RANKS_PER_NODE})


if __name__ == "__main__":
    main()
