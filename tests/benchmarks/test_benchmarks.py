"""The benchmarks run with one command, print a table and write JSON (tiny settings here; the
numbers themselves live in docs/benchmarks.md, speed is never asserted in tests)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_gpu_layer_dry_run(tmp_path):
    """The one-GPU script at tiny shapes on CPU: every row runs, labels its routing and what is
    modelled, and a borrowed slot matches the native expert bit for bit (TEGroupedMLP rows are
    skipped with the reason: Transformer Engine needs CUDA)."""
    data, stdout = _bench("gpu_layer.py", "--dry-run", "--cpu", "--repeats", "1", "--ep", "4", tmp_path=str(tmp_path))
    rows = data["rows"]
    assert data["complete"] and data["settings"]["routing"] == "forced" and "LayerTimeModel" in data["settings"]["modelled"]
    assert sum(line.startswith("[") for line in stdout.splitlines()) == len(rows)  # a progress line per row
    assert not [r for r in rows if r["status"] == "error"], [r["reason"] for r in rows if r["status"] == "error"]
    assert all(r["routing"] and r["modelled"] for r in rows)

    layer = {(r["model"], r["scenario"]): r for r in rows if r["section"] == "layer"}
    assert set(layer) == {(m, s) for m in ("gpt-oss-120b", "deepseek-v3", "kimi-k2")
                          for s in ("balanced", "0.95:1", "0.95:4", "0.95:16")}
    for (model, scenario), r in layer.items():
        assert r["routing"].startswith("forced") and "dispatch" in r["modelled"] and "forward+backward" in r["measured"]
        assert r["mode"] == ("fallback" if scenario == "balanced" else "llep"), (model, scenario, r["mode"])
        for mode in ("ep", "llep", "ideal"):
            comm = r[f"{mode}_dispatch_ms"] + r[f"{mode}_combine_ms"]  # modelled; the GEMMs measured
            assert comm > 0 and r[f"{mode}_gemm_ms"] > 0
            assert r[f"{mode}_layer_ms"] == pytest.approx(comm + r[f"{mode}_gemm_ms"] + r[f"{mode}_weight_wait_ms"])
            assert r[f"{mode}_no_overlap_ms"] == pytest.approx(comm + r[f"{mode}_gemm_ms"] + r[f"{mode}_weight_copies_ms"])
        assert r["llep_vs_ideal"] == pytest.approx(r["llep_layer_ms"] / r["ideal_layer_ms"])
        assert r["ep_vs_llep"] == pytest.approx(r["ep_layer_ms"] / r["llep_layer_ms"])
        if scenario != "balanced":
            assert r["weight_copies"] > 0 and r["llep_weight_copies_ms"] > 0 and r["llep_max_mean"] < r["ep_max_mean"]

    correctness = {r["name"]: r for r in rows if r["section"] == "correctness"}
    for model in ("gpt-oss-120b", "deepseek-v3"):  # borrowed slot == native expert, bit for bit on CPU
        entry = correctness[f"bf16 SequentialMLP {model}"]
        assert entry["status"] == "pass" and entry["bitwise"]
        assert {"output", "input_grad", "probs_grad"} < set(entry["tensors"])
        assert sum(name.startswith("weight_grad") for name in entry["tensors"]) == (4 if model == "gpt-oss-120b" else 2)
        assert correctness[f"bf16 TEGroupedMLP {model}"]["status"] == "skipped"


def test_gpu_layer_without_megatron_says_so():
    code = ("import runpy, sys; sys.modules['megatron'] = None; sys.argv = ['gpu_layer.py', '--dry-run', '--cpu']; "
            f"runpy.run_path({os.path.join(ROOT, 'benchmarks', 'gpu_layer.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "needs megatron-core" in proc.stderr


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
