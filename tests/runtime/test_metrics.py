"""Step statistics derived from a plan, and the bounded tracker loggers drain."""

import numpy as np

from megatron_llep.config import LLEPConfig
from megatron_llep.runtime.statistics import LLEPStatsTracker, LLEPStepStats
from megatron_llep.planning import plan_llep


def test_stats_from_a_spilling_plan():
    counts = np.zeros((2, 4), np.int64)
    counts[:, 0] = 50  # expert 0 on rank 0 gets all 100 tokens
    plan = plan_llep(counts, LLEPConfig(min_chunk_tokens=0, cost_aware=False))
    stats = LLEPStepStats.from_plan(plan, layer_number=3, expert_weight_bytes=1000, plan_time_s=1e-4)
    assert stats.mode == "llep" and stats.layer_number == 3
    assert stats.max_mean_before == 2.0 and stats.max_mean_after == 1.0
    assert stats.spilled_tokens == 50 and stats.weight_transfers == 1 and stats.weight_bytes == 1000
    assert stats.moved_tokens == 0  # rank 1 computes its own 50 tokens
    scalars = stats.scalars()
    assert scalars["llep_active"] == 1.0 and "expert_loads" not in scalars


def test_tracker_is_bounded_and_drains():
    tracker = LLEPStatsTracker(max_steps=3)
    plan = plan_llep(np.full((2, 4), 5, np.int64), LLEPConfig(cost_aware=False))
    for _ in range(5):
        tracker.record(LLEPStepStats.from_plan(plan, 1, 10, 0.0))
    assert tracker.summary()["max_mean_before"] == 1.0
    drained = tracker.drain()
    assert len(drained[1]) == 3 and drained[1][0].mode == "fallback"
    assert tracker.drain() == {}


def test_statistics_set_aside_are_dropped_and_earlier_ones_kept():
    tracker = LLEPStatsTracker()
    plan = plan_llep(np.full((2, 4), 5, np.int64), LLEPConfig(cost_aware=False))
    tracker.record(LLEPStepStats.from_plan(plan, 1, 10, 0.0))
    with tracker.set_aside():  # e.g. an evaluation's forwards
        tracker.record(LLEPStepStats.from_plan(plan, 1, 10, 0.0))
        tracker.record(LLEPStepStats.from_plan(plan, 2, 10, 0.0))
    tracker.record(LLEPStepStats.from_plan(plan, 1, 10, 0.0))
    drained = tracker.drain()
    assert sorted(drained) == [1] and len(drained[1]) == 2


def test_megatron_lm_evaluation_is_kept_out_of_the_training_statistics():
    import pytest

    from megatron_llep.compat.megatron_training import missing_reason

    if missing_reason():
        pytest.skip(missing_reason())
    from megatron.training import training

    from megatron_llep.integrations import megatron_lm
    from megatron_llep.runtime.state import STATS

    original = training.evaluate
    try:
        training.evaluate = lambda *a, **k: STATS.record(LLEPStepStats.from_plan(
            plan_llep(np.full((2, 4), 5, np.int64), LLEPConfig(cost_aware=False)), 1, 10, 0.0))
        megatron_lm.install_llep_logging()
        STATS.drain()
        training.evaluate()
        assert STATS.drain() == {}
    finally:
        training.evaluate, training.training_log = original, getattr(training.training_log, "__wrapped__",
                                                                    training.training_log)
