"""The step model of benchmarks/plan_model.py (--steps) and its real-trace replay
(benchmarks/real_routing.py --steps): the bound on kept copies it states, the count exchange and
planner time it prices, the overlapped baseline. Speed is never asserted."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_llep.config import LLEPConfig
from megatron_llep.planning.cost_model import CostModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import plan_model  # noqa: E402
from common import FULL_SHAPES, SCENARIOS  # noqa: E402

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release


def test_count_exchange_by_hand():
    model = CostModel()
    # P - 1 ring steps of one rank's int64 row, inside a node up to 8 ranks, across nodes beyond
    assert plan_model.count_exchange_s(8, 128, model) == pytest.approx(7 * (15e-6 + 8 * 128 / 400e9))
    assert plan_model.count_exchange_s(64, 384, model) == pytest.approx(63 * (15e-6 + 8 * 384 / 45e9))
    assert plan_model.count_exchange_s(1, 128, model) == 0.0


def test_overlapped_layer_is_the_longer_of_all_to_alls_and_compute():
    assert plan_model.overlapped({"dispatch_s": 1.0, "combine_s": 1.0, "compute_s": 3.0}) == 3.0
    assert plan_model.overlapped({"dispatch_s": 2.0, "combine_s": 2.0, "compute_s": 3.0}) == 4.0


def test_steps_keep_one_copy_per_rank_by_default_and_price_the_host():
    layer, ep = FULL_SHAPES[1], 16
    config = plan_model.ep_config(LLEPConfig(), CostModel(training=True), ep)
    rows = plan_model.step_rows(layer, ep, SCENARIOS[-1], config, seed=0, repeats=1)
    after = [r for r in rows if r["weights"] == "after"]
    assert all(r["kept_bound_copies"] == 1 and r["max_kept_per_rank"] <= 1 for r in after)
    assert all(r["planner_ms"] > 0 and r["count_exchange_ms"] > 0 for r in rows)
    assert all(r["cross_node_rows_vs_ep"] <= 1 for r in rows)
    unbounded = plan_model.step_rows(layer, ep, SCENARIOS[-1], config, seed=0, repeats=1, kept_copies=None)
    assert max(r["max_kept_per_rank"] for r in unbounded if r["weights"] == "after") > 1
    overlapped = plan_model.step_rows(layer, ep, SCENARIOS[-1], config, seed=0, repeats=1, overlap=True)
    by = {(r["weights"], r["micro_batches"]): r for r in rows}
    for r in overlapped:  # hiding the all-to-alls shortens the ideal's step, so the ratios change
        assert r["overlapped_baseline"] and r["ideal_ms"] < by[r["weights"], r["micro_batches"]]["ideal_ms"]


def test_kept_copies_flag():
    assert plan_model.kept_copies_arg("none") is None and plan_model.kept_copies_arg("2") == 2
    with pytest.raises(Exception):
        plan_model.kept_copies_arg("-1")


def test_real_routing_steps_smoke(tmp_path):
    out = str(tmp_path / "steps.json")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "real_routing.py"), "--steps", "--smoke",
                           "--planner-repeats", "1", "--out", out], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert {r["kind"] for r in rows} == {"step"} and {r["routing"] for r in rows} == {"stand-in"}
    assert {r["micro_batches"] for r in rows} == set(plan_model.MICRO_BATCHES)
    assert all(r["max_kept_per_rank"] <= 1 for r in rows if r["weights"] == "after")
    assert np.isfinite([r["llep_vs_ideal_behind"] for r in rows]).all()
