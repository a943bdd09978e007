"""The benchmarks run with one command, print a table and write JSON (tiny settings here; the
numbers themselves live in docs/benchmarks.md, speed is never asserted in tests)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(script, *args, tmp_path):
    out = os.path.join(tmp_path, "result.json")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args, "--out", out],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        data = json.load(f)
    assert data["rows"] and data["machine"] and data["command"]
    return data, proc.stdout


def test_plan_model(tmp_path):
    data, stdout = _bench("plan_model.py", "--ep", "8", "--planner-repeats", "1", tmp_path=str(tmp_path))
    assert "LLEP/ideal" in stdout
    rows = {(r["model"], r["scenario"]): r for r in data["rows"]}
    assert len(rows) == 3 * 13
    for (model, scenario), r in rows.items():
        assert r["llep_max_mean"] <= r["ep_max_mean"] + 1e-9
        if scenario == "balanced":
            assert r["mode"] == "fallback"
    assert rows["gpt-oss-120b", "0.95:4"]["mode"] == "llep"


def test_layer_cpu_smoke(tmp_path):
    data, stdout = _bench("layer_cpu.py", "--smoke", "--repeats", "1", tmp_path=str(tmp_path))
    assert "EP/LLEP" in stdout
    balanced, hot = data["rows"]
    assert balanced["mode"] == "fallback"
    # the cost model is calibrated on this CPU; at smoke-test sizes it may judge a spill not worth it
    assert hot["mode"] in ("llep", "plain") and hot["max_mean_before"] > 1.5
    assert hot["max_mean_after"] <= hot["max_mean_before"]
    for key in ("ep_ms", "llep_ms", "ideal_ms", "ep_peak_mb", "llep_peak_mb", "ep_fwd_bwd_ms", "llep_fwd_bwd_ms",
                "ideal_fwd_bwd_ms", "ep_live_peak_mb", "llep_live_peak_mb", "ideal_live_peak_mb"):
        assert hot[key] > 0
    assert hot["llep_vs_ideal"] == pytest.approx(hot["llep_ms"] / hot["ideal_ms"])


def test_gpu_script_dry_run(tmp_path):
    """Every row of the H200 script at tiny shapes on CPU; what needs Transformer Engine is skipped
    with its reason, and so, with --without-megatron, is what needs megatron-core."""
    dry = ("--dry-run", "--cpu", "--repeats", "1", "--ep", "4")
    data, stdout = _bench("gpu_h200.py", *dry, tmp_path=str(tmp_path))
    rows = data["rows"]
    # the JSON is rewritten after every row (once at the start, once per row, once at the end)
    assert data["status"] == "complete" and data["writes"] == len(rows) + 2
    assert sum(line.startswith("[") for line in stdout.splitlines()) == len(rows)  # a progress line per row
    assert set(data["sections"]) == {"grid", "correctness", "pipeline"}
    assert not [r["name"] for r in rows if r["status"] == "error"], [r.get("traceback") for r in rows if r["status"] == "error"]
    assert all(r["reason"] for r in rows if r["status"] == "skipped")
    models = {"gpt-oss-120b", "deepseek-v3", "kimi-k2"}

    grid = {(r["model"], r["scenario"]): r for r in rows if r["section"] == "grid"}
    assert set(grid) == {(m, s) for m in models for s in ("ideal", "balanced", "0.95:1", "0.95:4", "0.95:16")}
    for (model, scenario), r in grid.items():
        assert r["status"] == "ok"
        if scenario != "ideal":
            assert [link["gbps"] for link in r["links"]] == [200, 300, 400]
            assert all(link["ep_fwd_bwd_ms"] > link["ep_fwd_ms"] > 0 and link["llep_fwd_bwd_ms"] > 0 for link in r["links"])
            assert r["ep_ms"] > 0 and r["llep_ms"] > 0 and r["ep_peak_gb"] >= 0

    pipeline = {(r["model"], r["piece"]): r for r in rows if r["section"] == "pipeline"}
    host_pieces = ("plan", "rank_view", "permutations", "send_columns", "recv_gather", "combine_gather", "comm")
    expert_pieces = ("build", "native", "borrowed", "borrowed_as_native", "ep_hot_rank", "total")
    for model in models:
        assert pipeline[model, "plan"]["mode"] == "llep" and pipeline[model, "plan"]["borrowed_experts"]
        for piece in host_pieces + tuple(f"SequentialMLP {p}" for p in expert_pieces):
            assert pipeline[model, piece]["status"] == "ok" and pipeline[model, piece]["ms"] > 0, (model, piece)
        for piece in expert_pieces:
            assert pipeline[model, f"TEGroupedMLP {piece}"]["status"] == "skipped"
        assert "Transformer Engine" in pipeline[model, "TEGroupedMLP build"]["reason"]

    correctness = {r["name"]: r for r in rows if r["section"] == "correctness"}
    for model in ("gpt-oss-120b", "deepseek-v3"):  # borrowed slot == native expert, bit for bit on CPU
        entry = correctness[f"bf16 SequentialMLP {model}"]
        assert entry["status"] == "pass" and entry["bitwise"] and {"output", "input_grad"} <= set(entry["tensors"])
        assert correctness[f"bf16 TEGroupedMLP {model}"]["status"] == "skipped"
    fp8 = [r for r in correctness.values() if r["dtype"] == "fp8"]
    assert len(fp8) == 3 and all(r["status"] == "skipped" and "Transformer Engine" in r["reason"] for r in fp8)

    # without megatron-core: the pure parts still run, Megatron's parts are skipped with the reason
    data, _ = _bench("gpu_h200.py", *dry, "--without-megatron", "--sections", "pipeline", "correctness", tmp_path=str(tmp_path))
    rows = {(r["section"], r["name"]): r for r in data["rows"]}
    assert data["status"] == "complete" and not [r for r in rows.values() if r["status"] == "error"]
    assert rows["pipeline", "kimi-k2 plan"]["status"] == "ok" and rows["pipeline", "kimi-k2 recv_gather"]["status"] == "ok"
    for key in (("pipeline", "kimi-k2 permutations"), ("pipeline", "kimi-k2 send_columns"), ("pipeline", "kimi-k2 SequentialMLP build"),
                ("correctness", "bf16 SequentialMLP deepseek-v3")):
        assert rows[key]["status"] == "skipped" and "megatron-core" in rows[key]["reason"], key

    # a spent time budget: every row left is recorded as skipped
    data, _ = _bench("gpu_h200.py", *dry, "--without-megatron", "--sections", "grid", "--time-budget", "0",
                     tmp_path=str(tmp_path))
    assert data["status"] == "budget_exhausted" and len(data["rows"]) == 15
    assert all(r["status"] == "skipped" and "time budget" in r["reason"] for r in data["rows"])


def test_host_overhead(tmp_path):
    data, stdout = _bench("host_overhead.py", "--repeats", "1", tmp_path=str(tmp_path))
    assert "extra host ms" in stdout
    rows = {r["scenario"]: r for r in data["rows"]}
    assert rows["balanced"]["mode"] == "plain" and rows["balanced"]["extra_rows"] == 0
    # the plan is folded into Megatron's permute: no row gathered beyond stock EP (16 experts per rank)
    assert rows["0.95:4"]["mode"] == "llep" and rows["0.95:4"]["extra_rows"] == 0 and rows["0.95:4"]["columns"] > 0
    # stock's chunk sorts, which LLEP's receive gathers replace, are timed and netted out
    assert "net host ms" in stdout and rows["0.95:4"]["stock_sorts_ms"] > 0 and rows["balanced"]["stock_sorts_ms"] == 0
    assert rows["0.95:4"]["net_host_ms"] == rows["0.95:4"]["extra_host_ms"] - rows["0.95:4"]["stock_sorts_ms"]
