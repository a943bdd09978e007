"""The spill planner's compiled core (megatron_llep/planning/_spill_core.cpp) against the Python
planner it was written from: the same plan, field for field, on the forced grid, Megatron-LM PR
#7488's workloads, the shipped real traces and random inputs with kept copies, budgets and relays.
The Python planner is the reference: its plans are the ones the rest of the suite checks against
brute force, plain EP and float64 layers."""

import dataclasses
import functools

import numpy as np
import pytest
from hypothesis import given, settings

from megatron_llep.config import LLEPConfig
from megatron_llep.planning import TOKEN_IMBALANCE_WORKLOADS, plan_llep
from megatron_llep.planning import planner

from common import FULL_SHAPES, SCENARIOS, sample_counts  # noqa: E402
from plan_model import expert_shape  # noqa: E402
from planner_copies import workload_counts  # noqa: E402
from test_planner_kept_copies import SHAPE, planning_inputs  # noqa: E402

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release

PLAN_FIELDS = ("fallback", "capacity", "rank_loads_after", "spilled_experts", "chunk_expert", "chunk_src", "chunk_dst",
               "chunk_count", "transfer_expert", "transfer_native", "transfer_helper", "transfer_wave",
               "transfer_source", "transfer_kept")

# node-aware, plain least-loaded, relayed, rank-order tokens, exact balance, not repacked, small chunks
CONFIGS = {
    "cost-aware": LLEPConfig(ranks_per_node=8),
    "least-loaded": LLEPConfig(ranks_per_node=8, cost_aware=False),
    "relayed": LLEPConfig(ranks_per_node=4, relay_within_node=True),
    "rank-order-tokens": LLEPConfig(ranks_per_node=8, node_aware_tokens=False),
    "exact": LLEPConfig(alpha=1.0, min_chunk_tokens=0, imbalance_threshold=1.0, cost_aware=False, ranks_per_node=8),
    "not-repacked": LLEPConfig(ranks_per_node=8, repack_copies=False),
    "one-node": LLEPConfig(min_chunk_tokens=64),
}


def plan_fields(plan) -> dict:
    return {name: np.asarray(getattr(plan, name)).tolist() for name in PLAN_FIELDS}


def python_plan(monkeypatch, *args, **kwargs):
    """The plan of the Python planner (the compiled core switched off for one call)."""
    with monkeypatch.context() as patch:
        patch.setattr(planner, "_spill_core", None)
        return plan_llep(*args, **kwargs)


def assert_same_plans(compiled, reference, label: str) -> None:
    got, want = plan_fields(compiled), plan_fields(reference)
    differ = [name for name in PLAN_FIELDS if got[name] != want[name]]
    assert not differ, f"{label}: the compiled planner's plan differs in {differ}"


def test_the_compiled_planner_is_built():
    assert planner.COMPILED_PLANNER, ("megatron_llep.planning._spill_core is not built: `pip install -e .` needs a "
                                      "C++17 compiler (g++) and pybind11; the Python planner plans meanwhile")


def kept_copies(counts: np.ndarray, seed: int):
    """A held matrix (a few experts kept on other ranks) and a keep room, as later micro-batches see."""
    ep, experts = counts.shape
    rng = np.random.default_rng(seed)
    held = np.zeros((experts, ep), bool)
    held[rng.integers(0, experts, 20), rng.integers(0, ep, 20)] = True
    held[np.arange(experts), np.arange(experts) // (experts // ep)] = False
    return held, rng.integers(0, 3, ep)


@functools.lru_cache(maxsize=None)
def grid_inputs(ep: int) -> list:
    """(shape, label, counts) on part of the forced grid and on PR #7488's workloads: every model at
    P = 16, Kimi-K2 (N = 384, the planner's largest) at P = 64."""
    inputs = []
    for shape in FULL_SHAPES if ep <= 16 else FULL_SHAPES[-1:]:
        inputs += [(shape, s.label, sample_counts(shape, ep, s, 0)) for s in SCENARIOS[::3]]
        inputs += [(shape, w, workload_counts(shape, ep, w, 0)) for w in TOKEN_IMBALANCE_WORKLOADS]
    return inputs


@pytest.mark.parametrize("config_name,ep", [(name, 16) for name in sorted(CONFIGS)]
                         + [("cost-aware", 64), ("relayed", 64)])
def test_same_plans_on_the_forced_grid_and_pr7488_workloads(config_name, ep, monkeypatch):
    config = CONFIGS[config_name]
    for shape, label, counts in grid_inputs(ep):
        for held, room in [(None, None), kept_copies(counts, ep)]:
            args = (counts, config, expert_shape(shape))
            kwargs = dict(held=held, keep_room=room)
            assert_same_plans(plan_llep(*args, **kwargs), python_plan(monkeypatch, *args, **kwargs),
                              f"{shape.name} P={ep} {label} held={held is not None}")


def test_same_plans_on_the_real_traces_across_nodes(monkeypatch):
    import real_routing
    from recipes.runtime import routing_traces

    config = LLEPConfig(ranks_per_node=8)
    shape = expert_shape(dataclasses.replace(real_routing.REPLAY_SHAPE, num_experts=64, tokens_per_gpu=32768))
    for (name, domain), trace in real_routing.load_all(routing_traces.TRACE_DIR).items():
        for number, layer in sorted(trace.layers.items()):
            for ep in (16, 64):
                draws = real_routing.sequence_draws(layer.num_sampled, ep, 32768, 0)
                counts = real_routing.replay_counts(layer.expert_ids, trace.num_experts, draws)
                assert_same_plans(plan_llep(counts, config, shape), python_plan(monkeypatch, counts, config, shape),
                                  f"{name}/{domain} layer {number} P={ep}")


def test_same_plans_under_a_row_budget(monkeypatch):
    counts = sample_counts(FULL_SHAPES[0], 16, SCENARIOS[-1], 0)
    per_rank = int(counts.sum()) // 16
    for slack in (1.0, 1.05, 1.3):
        config = LLEPConfig(ranks_per_node=8, max_tokens_per_rank=int(per_rank * slack) + 1)
        args = (counts, config, expert_shape(FULL_SHAPES[0]))
        assert_same_plans(plan_llep(*args), python_plan(monkeypatch, *args), f"budget x{slack}")


@settings(max_examples=200, deadline=None)
@given(planning_inputs())
def test_same_plans_on_random_inputs(inputs):
    counts, held, room, config = inputs
    compiled = plan_llep(counts, config, SHAPE, held=held, keep_room=room)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "_spill_core", None)
        reference = plan_llep(counts, config, SHAPE, held=held, keep_room=room)
    assert_same_plans(compiled, reference, "random input")


def test_the_comparison_fails_when_one_chunk_goes_elsewhere(monkeypatch):
    """Negative control: a plan with one token chunk sent to another destination is told apart."""
    counts = sample_counts(FULL_SHAPES[0], 16, SCENARIOS[-1], 0)
    args = (counts, CONFIGS["cost-aware"], expert_shape(FULL_SHAPES[0]))
    compiled = plan_llep(*args)
    moved = dataclasses.replace(compiled, chunk_dst=compiled.chunk_dst.copy())
    moved.chunk_dst[-1] = (moved.chunk_dst[-1] + 1) % 16
    with pytest.raises(AssertionError, match="chunk_dst"):
        assert_same_plans(moved, python_plan(monkeypatch, *args), "moved chunk")
