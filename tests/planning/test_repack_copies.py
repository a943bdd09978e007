"""Fewer weight copies at the same balance (``LLEPConfig.repack_copies``): each home rank's spilled
tokens refilled largest expert into largest quota (MoonEP's planning rule), with no process group."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_llep.config import LLEPConfig
from megatron_llep.planning import plan_llep

import planner_copies  # noqa: E402
from common import FULL_SHAPES, SCENARIOS, sample_counts  # noqa: E402

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release


@st.composite
def inputs(draw):
    per_node = draw(st.sampled_from([None, 1, 2, 4]))
    ep = draw(st.sampled_from([2, 4, 8]))
    local = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    counts = rng.integers(0, 20, size=(ep, ep * local))
    for e in rng.choice(ep * local, size=min(ep * local, draw(st.integers(1, 8))), replace=False):
        counts[:, e] += rng.integers(0, 300, size=ep)
    held = None
    if draw(st.booleans()):
        held = rng.random((ep * local, ep)) < 0.2
        held[np.arange(ep * local), np.arange(ep * local) // local] = False
    config = LLEPConfig(min_chunk_tokens=draw(st.sampled_from([0, 4, 32])), alpha=draw(st.sampled_from([1.0, 1.2])),
                        imbalance_threshold=1.0, cost_aware=False,
                        ranks_per_node=per_node if per_node is None or per_node < ep else None)
    return counts.astype(np.int64), held, config


def _new_copies(plan):
    return plan.num_weight_transfers


@settings(max_examples=400, deadline=None)
@given(inputs())
def test_repacking_keeps_every_load_and_never_adds_a_copy(case):
    counts, held, config = case
    plan = plan_llep(counts, config, held=held)
    before = plan_llep(counts, dataclasses.replace(config, repack_copies=False), held=held)
    np.testing.assert_array_equal(plan.rank_loads_after, before.rank_loads_after)
    assert _new_copies(plan) <= _new_copies(before)
    # every routed token is computed exactly once, by its expert's native rank or a helper
    delivered = np.zeros_like(counts)
    np.add.at(delivered, (plan.chunk_src, plan.chunk_expert), plan.chunk_count)
    np.testing.assert_array_equal(delivered[:, plan.spilled_experts], counts[:, plan.spilled_experts])


@pytest.mark.parametrize("ep", [8, 64])
@pytest.mark.parametrize("layer", FULL_SHAPES, ids=lambda layer: layer.name)
def test_never_more_copies_than_the_moonep_rule_at_exact_balance(layer, ep):
    for scenario in SCENARIOS[1:]:
        counts = sample_counts(layer, ep, scenario, seed=0)
        row = planner_copies.copy_row(counts, {"point": scenario.label})
        assert row["llep_max_mean"] <= row["moonep_max_mean"] + 1e-4, row
        assert row["llep_copies"] <= row["moonep_copies"], row


def test_the_moonep_rule_by_hand():
    """One hot rank of 4 equal experts (100 tokens each), three empty ranks: target 100 each, so the
    home fills each of the three with one whole expert: 3 copies."""
    counts = np.zeros((4, 16), np.int64)
    counts[0, :4] = 100
    assert planner_copies.moonep_rule_copies(counts, 4) == (3, 1.0)
    plan = plan_llep(counts, planner_copies.exact_config(4))
    assert plan.num_weight_transfers == 3
