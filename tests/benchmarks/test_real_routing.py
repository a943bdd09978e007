"""Real routing: the shipped-trace loader, the computations of benchmarks/real_routing.py checked by
hand on tiny traces, its --smoke run (stand-in traces it writes itself), and the shape of the real
traces in recipes/data/routing_traces/ once they exist."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_llep.placement.trace import RoutingTrace
from recipes.runtime import routing_traces

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import real_routing  # noqa: E402  (the benchmark: its imbalance and replay functions)
from common import SCENARIOS  # noqa: E402

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release


def _trace(num_experts: int, tokens: int, seed: int) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    ids = {n: np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :4] for n in (1, 2)}
    return RoutingTrace.from_expert_ids(num_experts, ids)


def test_loader_round_trip_and_errors(tmp_path):
    directory = str(tmp_path)
    assert routing_traces.available(directory) == [] and routing_traces.available(str(tmp_path / "absent")) == []
    written = {("pretrained", "code"): _trace(16, 40, 0), ("finetuned", "legal"): _trace(16, 24, 1)}
    for (model, domain), trace in written.items():
        trace.save(routing_traces.trace_path(model, domain, directory))
    (tmp_path / "notes.txt").write_text("not a trace")
    (tmp_path / "nounderscore.npz").write_bytes(b"")
    assert routing_traces.available(directory) == [("finetuned", "legal"), ("pretrained", "code")]
    for (model, domain), trace in written.items():
        loaded = routing_traces.load(model, domain, directory)
        assert (loaded.num_experts, loaded.topk, sorted(loaded.layers)) == (16, 4, [1, 2])
        for n in (1, 2):
            np.testing.assert_array_equal(loaded.layer(n).expert_ids, trace.layer(n).expert_ids)
            np.testing.assert_array_equal(loaded.layer(n).expert_counts, trace.layer(n).expert_counts)

    with pytest.raises(ValueError) as err:
        routing_traces.load("finetuned", "code", directory)
    message = str(err.value)
    assert "\n" not in message and os.path.join(directory, "finetuned_code.npz") in message
    assert "available: finetuned/legal, pretrained/code" in message
    with pytest.raises(ValueError, match=r"available: none"):
        routing_traces.load("pretrained", "code", str(tmp_path / "absent"))

    with pytest.raises(ValueError, match="no routing-trace manifest"):
        routing_traces.manifest(directory)
    manifest = tmp_path / routing_traces.MANIFEST_FILE
    manifest.write_text('{"checkpoints": {"pretrained": "ckpt/iter_1000"}}')
    assert routing_traces.manifest(directory) == {"checkpoints": {"pretrained": "ckpt/iter_1000"}}
    for bad, reason in (("{not json", "not a readable JSON manifest"), ("[1, 2]", "must be a JSON object")):
        manifest.write_text(bad)
        with pytest.raises(ValueError, match=reason):
            routing_traces.manifest(directory)


def test_imbalance_by_hand():
    """8 experts, top-2; sequential placement puts experts 0-3 on rank 0 and 4-7 on rank 1 at P = 2."""
    ids = np.array([[0, 1], [0, 2], [4, 5], [0, 3]])
    # whole trace: rank 0 gets 2 + 2 + 0 + 2 = 6 assignments, rank 1 gets 2: max/mean = 6 / 4
    assert real_routing.batch_imbalance(ids, 8, 2) == pytest.approx([1.5])
    # batches of 2 tokens: (4, 0) -> 2.0 and (2, 2) -> 1.0; of 3: (4, 2) -> 4/3, the 4th token dropped
    assert real_routing.batch_imbalance(ids, 8, 2, 2) == pytest.approx([2.0, 1.0])
    assert real_routing.batch_imbalance(ids, 8, 2, 3) == pytest.approx([4 / 3])
    assert real_routing.batch_imbalance(ids, 8, 2, 5).size == 0
    # P = 8, one expert per rank: expert 0 has 3 of the 8 assignments, the mean is 1
    assert real_routing.batch_imbalance(ids, 8, 8) == pytest.approx([3.0])
    # dropped assignments (-1) are not load: rank 0 gets 1, rank 1 gets 2
    assert real_routing.batch_imbalance(np.array([[0, -1], [4, 5]]), 8, 2) == pytest.approx([4 / 3])
    # the placement convention matters: round robin (e % P) would give rank 0 five of 8 (1.25)
    assert real_routing.sequential_devices(8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="does not divide"):
        real_routing.sequential_devices(8, 3)

    rows = real_routing.imbalance_rows({"source": "hand"}, ids, 8, (2,), (2, 8))
    assert rows == [{"kind": "imbalance", "source": "hand", "ep": 2, "tokens": 4, "whole": pytest.approx(1.5),
                     "b2_batches": 2, "b2_mean": pytest.approx(1.5), "b2_max": pytest.approx(2.0),
                     "b8_batches": 0, "b8_mean": None, "b8_max": None}]
    # expert counts 3, 1, 1, 1, 1, 1, 0, 0: the top expert has 3 of 8, the top 4 have 6
    assert real_routing.top_shares(ids, 8, (1, 4)) == {"top1": pytest.approx(3 / 8), "top4": pytest.approx(6 / 8)}

    # negative control: every token splits evenly over the two ranks, so nothing is imbalanced
    even = np.array([[0, 4], [1, 5], [2, 6], [3, 7]])
    assert real_routing.batch_imbalance(even, 8, 2, 1) == pytest.approx([1.0] * 4)
    assert real_routing.batch_imbalance(even, 8, 8) == pytest.approx([1.0])


def test_replay_uses_whole_sequences():
    """Sequence s routes all its 256 tokens to experts 4s .. 4s+3; a 100-token partial sequence at
    the end routes to experts 32-35, which no replayed token may reach."""
    sequences, seq = 8, real_routing.SEQUENCE_TOKENS
    ids = np.concatenate([np.repeat(4 * np.arange(sequences)[:, None] + np.arange(4), seq, axis=0),
                          np.tile(np.arange(32, 36), (100, 1))])
    ep, tokens_per_gpu, k = 4, 4 * seq, 4
    draws = real_routing.sequence_draws(len(ids), ep, tokens_per_gpu, seed=3)
    assert draws.shape == (ep, 4) and draws.min() >= 0 and draws.max() < sequences
    np.testing.assert_array_equal(draws, real_routing.sequence_draws(len(ids), ep, tokens_per_gpu, seed=3))
    counts = real_routing.replay_counts(ids, 36, draws)
    assert counts.shape == (ep, 36) and counts.sum() == ep * tokens_per_gpu * k
    assert (counts.sum(axis=1) == tokens_per_gpu * k).all()
    assert (counts[:, 32:] == 0).all()
    for rank in range(ep):  # every expert of a drawn sequence got exactly that sequence's tokens
        expected = np.repeat(np.bincount(draws[rank], minlength=sequences) * seq, 4)
        np.testing.assert_array_equal(counts[rank, :32], expected)
    with pytest.raises(ValueError, match="multiple of the sequence length"):
        real_routing.sequence_draws(len(ids), ep, 1000, seed=0)
    with pytest.raises(ValueError, match="no whole 256-token sequence"):
        real_routing.sequence_draws(255, ep, tokens_per_gpu, seed=0)


def test_no_traces_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        real_routing.main(["--traces", str(tmp_path), "--out", str(tmp_path / "r.json"), "--plot", ""])
    assert "no routing traces" in str(exit_info.value) and "--smoke" in str(exit_info.value)


def test_smoke_run(tmp_path):
    before = routing_traces.available()
    out, png = str(tmp_path / "real_routing.json"), str(tmp_path / "real_routing.png")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "real_routing.py"), "--smoke",
                           "--out", out, "--plot", png], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert routing_traces.available() == before  # stand-ins live in a temporary directory
    with open(out) as f:
        data = json.load(f)
    rows = data["rows"]
    labels = {(r["kind"], r["routing"]) for r in rows}
    assert labels == {("imbalance", "stand-in"), ("imbalance", "forced"), ("top_share", "stand-in"),
                      ("top_share", "forced"), ("replay", "stand-in"), ("transfer", "stand-in"),
                      ("stability", "stand-in")}
    assert {r["scenario"] for r in rows if r["routing"] == "forced"} == {s.label for s in SCENARIOS}
    assert data["settings"]["manifest"]["stand_in"] is True
    assert {r["source"] for r in rows if r["kind"] == "replay"} == {f"{m}/{d}" for m in ("pretrained", "finetuned")
                                                                    for d in ("code", "prose", "legal")}

    imbalance = [r for r in rows if r["kind"] == "imbalance"]
    assert {r["ep"] for r in imbalance} == set(real_routing.IMBALANCE_EP)
    for r in imbalance:
        assert r["whole"] >= 1.0 and r["b256_max"] >= r["b256_mean"] >= 1.0
    replay = [r for r in rows if r["kind"] == "replay"]
    assert {r["ep"] for r in replay} == set(real_routing.SMOKE_REPLAY_EP)
    for r in replay:  # cost-aware LLEP is never predicted slower than plain EP
        assert r["llep_ms"] <= r["ep_ms"] * (1 + 1e-9) and r["llep_vs_ideal"] > 0 and r["llep_max_mean"] <= r["ep_max_mean"] + 1e-9
    transfer = [r for r in rows if r["kind"] == "transfer"]
    fits = {(r["model"], r["layer"], r["fit"]) for r in transfer}
    assert len(fits) == 2 * len(real_routing.SMOKE_LAYERS) * 3
    assert all(sum(r["own"] and r["method"] == "sequential" for r in transfer if (r["model"], r["layer"], r["fit"]) == f) == 1
               for f in fits)
    assert {r["method"].split(" (")[0].split("=")[0] for r in transfer} >= {"sequential", "EPLB", "CAP comm-optimal", "CAP lambda"}
    assert all(r["eval"] != r["fit"] for r in rows if r["kind"] == "stability")
    assert os.path.getsize(png) > 0 and "LLEP/ideal" in proc.stdout and "top-16 share" in proc.stdout


@pytest.mark.skipif(not routing_traces.available(), reason="no real routing traces in recipes/data/routing_traces yet")
def test_shipped_traces():
    """The traces recorded from the model trained here: 64 experts, top-4, MoE layers 1-4, every
    token kept in its original order (nothing sampled away), whole 256-token sequences."""
    for model, domain in routing_traces.available():
        trace = routing_traces.load(model, domain)
        assert (trace.num_experts, trace.topk, sorted(trace.layers)) == (64, 4, [1, 2, 3, 4]), (model, domain)
        for number, layer in trace.layers.items():
            assert layer.num_sampled == layer.tokens_seen, (model, domain, number)
            assert layer.num_sampled >= real_routing.SEQUENCE_TOKENS and layer.num_sampled % real_routing.SEQUENCE_TOKENS == 0
            assert layer.expert_ids.min() >= 0 and layer.expert_ids.max() < 64
    assert isinstance(routing_traces.manifest(), dict)
