"""The benchmarks run with one command, print a table and write JSON (tiny settings here; the
numbers themselves live in docs/benchmarks.md, speed is never asserted in tests)."""

import json
import os
import subprocess
import sys

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
    for key in ("ep_ms", "llep_ms", "ep_peak_mb", "llep_peak_mb", "ep_fwd_bwd_ms", "llep_fwd_bwd_ms"):
        assert hot[key] > 0


def test_gpu_script_dry_run(tmp_path):
    data, _ = _bench("gpu_h200.py", "--dry-run", "--cpu", "--repeats", "1", "--ep", "4", tmp_path=str(tmp_path))
    assert {r["scenario"] for r in data["rows"]} == {"balanced", "0.95:1"}
    assert all(r["llep_ms"] > 0 and r["ep_ms"] > 0 for r in data["rows"])


def test_host_overhead(tmp_path):
    data, stdout = _bench("host_overhead.py", "--repeats", "1", tmp_path=str(tmp_path))
    assert "extra host ms" in stdout
    rows = {r["scenario"]: r for r in data["rows"]}
    assert rows["balanced"]["mode"] == "plain" and rows["balanced"]["extra_rows"] == 0
    assert rows["0.95:4"]["mode"] == "llep" and rows["0.95:4"]["extra_rows"] > 0
