"""The placement command line end to end (synthetic trace -> placement file), its bad-input
messages, profiling selection through --profile, and the placement report in --smoke mode."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_llep.placement.cap import SpectrumPoint
from megatron_llep.placement.cli import main
from megatron_llep.placement.placement import ExpertPlacement
from megatron_llep.placement.trace import synthetic_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILED: list = []


def profile_step_time(layer: int, point: SpectrumPoint) -> float:
    """A deterministic stand-in for a measured step time, used through --profile."""
    score = point.imbalance + 0.001 * point.comm_cost
    PROFILED.append((layer, point.step, score))
    return score


def test_cli_writes_a_valid_placement_that_cuts_communication(tmp_path):
    trace_path, out = str(tmp_path / "trace.npz"), str(tmp_path / "placement.json")
    proc = subprocess.run(
        f"{sys.executable} -m megatron_llep.placement synthetic {trace_path} --experts 32 --topk 4 --tokens 3000 "
        f"--clusters 4 --affinity 0.9 --skew 0.5 --layers 1 3 && "
        f"{sys.executable} -m megatron_llep.placement plan {trace_path} --ep-size 4 --gpus-per-node 2 --lambda 1.0 -o {out}",
        shell=True, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[2/2] layer 3" in proc.stdout and "C seq" in proc.stdout
    placement = ExpertPlacement.load(out)
    assert placement.ep_size == 4 and sorted(placement.layers) == [1, 3]
    for number in (1, 3):
        summary = placement.metadata["layers"][str(number)]
        assert summary["comm_cost"] < 0.6 * summary["comm_cost_sequential"]
        assert summary["devices_per_token"] < summary["devices_per_token_sequential"]


def test_cli_selects_by_profiling_and_merges_rank_files(tmp_path, capsys):
    trace, _ = synthetic_trace(1500, 16, 2, 4, 0.8, 1.0, seed=2)
    paths = [str(tmp_path / f"rank{r}.npz") for r in range(2)]
    for path in paths:
        trace.save(path)
    out = str(tmp_path / "p.json")
    PROFILED.clear()
    main(["plan", *paths, "--ep-size", "4", "--profile", "test_placement_cli:profile_step_time", "-o", out])
    placement = ExpertPlacement.load(out)
    summary = placement.metadata["layers"]["1"]
    assert summary["tokens"] == 3000 and summary["selection"] == "profiling"
    assert {step for _, step, _ in PROFILED} == set(range(summary["spectrum_points"]))
    assert summary["spectrum_step"] == min(PROFILED, key=lambda entry: (entry[2], entry[1]))[1]
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["plan", "{bad}", "--ep-size", "4"], "not a routing trace file"),
    (["plan", "{trace}", "--ep-size", "3"], "not divisible by the expert-parallel size 3"),
    (["plan", "{trace}", "{other}", "--ep-size", "4"], "different shapes"),
    (["plan", "{trace}", "--ep-size", "4", "--layers", "7"], "no MoE layer 7"),
    (["plan", "{trace}", "--ep-size", "4", "--gpus-per-node", "3"], "gpus_per_node=3"),
    (["plan", "{trace}", "--ep-size", "4", "--profile", "nomodule"], "module:function"),
    (["plan", "{trace}", "--ep-size", "4", "--profile", "auto"], "run it through recipes/cap_pipeline.py"),
])
def test_cli_bad_input_gives_a_clear_error(tmp_path, capsys, args, message):
    trace, _ = synthetic_trace(200, 16, 2, 4, 0.8, seed=1)
    other, _ = synthetic_trace(200, 32, 2, 4, 0.8, seed=1)
    files = {"trace": str(tmp_path / "t.npz"), "other": str(tmp_path / "o.npz"), "bad": str(tmp_path / "bad.npz")}
    trace.save(files["trace"])
    other.save(files["other"])
    with open(files["bad"], "w") as f:
        f.write("{}")
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(**files) for a in args] + ["-o", str(tmp_path / "p.json")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_placement_report_smoke(tmp_path):
    out, png = str(tmp_path / "report.json"), str(tmp_path / "report.png")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "placement_report.py"), "--smoke",
                           "--out", out, "--plot", png], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        data = json.load(f)
    rows = {r["method"].split(" (")[0]: r for r in data["rows"]}
    assert rows["CAP comm-optimal"]["devices_per_token"] < rows["sequential"]["devices_per_token"]
    assert rows["EPLB"]["max_mean"] < rows["sequential"]["max_mean"]
    assert rows["CAP comm-optimal+LLEP"]["llep_max_mean"] <= rows["CAP comm-optimal"]["max_mean"] + 1e-9
    assert data["settings"]["stability"] and os.path.getsize(png) > 0
    assert "dev/token" in proc.stdout


def _megatron_router_trace(directory: str, ids_by_layer: dict, mtp_ids) -> str:
    """A router-trace file written by Megatron-Core's own tracer (0.19+), two steps."""
    router_trace = pytest.importorskip(
        "megatron.core.transformer.moe.router_trace", reason="Megatron-Core's router tracer arrived in 0.19"
    )
    import torch

    tracer = router_trace.RouterTracer(directory, max_steps=4, rank=0, training_mode=True)
    for step in range(2):
        tracer.record_indices([torch.as_tensor(ids_by_layer[n][step]) for n in sorted(ids_by_layer)],
                              layer_ids=[n - 1 for n in sorted(ids_by_layer)])
        tracer.record_indices([torch.as_tensor(mtp_ids)], block="mtp", mtp_idx=0)
        tracer.advance_step()
    return tracer.output_path


def test_megatron_router_traces_are_read_and_planned(tmp_path):
    rng = np.random.default_rng(0)
    ids = {n: [np.argsort(rng.random((40, 16)), axis=1)[:, :2] for _ in range(2)] for n in (1, 2)}
    path = _megatron_router_trace(str(tmp_path), ids, mtp_ids=np.zeros((40, 2), dtype=np.int64))
    from megatron_llep.placement.trace import load_traces

    trace = load_traces([path], num_experts=16)
    assert sorted(trace.layers) == [1, 2]  # MTP records skipped, decoder index 0 -> layer 1
    for n in (1, 2):
        assert np.array_equal(trace.layer(n).expert_ids, np.concatenate(ids[n]))
        assert trace.layer(n).tokens_seen == 80
    out = str(tmp_path / "placement.json")
    main(["plan", path, "--num-experts", "16", "--ep-size", "4", "-o", out])
    assert sorted(ExpertPlacement.load(out).layers) == [1, 2]


def test_megatron_router_traces_need_the_number_of_experts(tmp_path, capsys):
    path = tmp_path / "router_trace_rank0.jsonl"
    path.write_text(json.dumps({"block": "decoder", "layer": 0, "top_indices": [[0, 1]]}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(path), "--ep-size", "2", "-o", str(tmp_path / "p.json")])
    assert exit_info.value.code == 2 and "--num-experts" in capsys.readouterr().err
