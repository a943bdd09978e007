"""The real-routing pipeline of docs/real_routing.md, smoke-sized, on 2 CPU ranks: a corpus from this
interpreter's files -> a gpt-oss-shaped MoE pretrained through Megatron-LM's loop with LLEP ->
fine-tuned from that checkpoint on the narrow domain with validation -> routing traces and the
model benchmark (plain EP, LLEP, the force-balanced ideal) on its own routing -> the trace replay.
Needs megatron.training (megatron-core >= 0.17)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from megatron_llep.placement.trace import RoutingTrace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from recipes import corpus  # noqa: E402
from test_pretrain import _free_port, needs_megatron_training  # noqa: E402

# the docs' gpt-oss-shaped model (docs/real_routing.md), at smoke size
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "32", "--moe-ffn-hidden-size", "32",
         "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8",
         "--seq-length", "64", "--max-position-embeddings", "64", "--normalization", "RMSNorm",
         "--untie-embeddings-and-output-weights", "--quick-geglu", "--glu-linear-offset", "1.0",
         "--activation-func-clamp-value", "7.0", "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion",
         "--softmax-type", "learnable", "--window-size", "31,0", "--window-attn-skip-freq", "2",
         "--position-embedding-type", "rope", "--rotary-base", "150000",
         "--num-experts", "8", "--moe-router-topk", "4", "--moe-router-score-function", "softmax",
         "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
         "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def _torchrun(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           _free_port(), *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "rror" in line and "warn" not in line.lower()]
    assert proc.returncode == 0, (errors[-10:], proc.stderr[-2000:])
    return proc


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    out = tmp_path_factory.mktemp("real")
    built = corpus.build(str(out / "corpus"), vocab_size=320, max_docs_per_split=8, log=lambda _: None)
    idx = out / "corpus" / "indexed"
    data = ["--train-data-path", "0.8", str(idx / "code_train_text_document"), "0.2", str(idx / "prose_train_text_document"),
            "--valid-data-path", str(idx / "code_valid_text_document"), "--test-data-path", str(idx / "code_test_text_document"),
            *built["null_tokenizer_flags"].split()]
    train = ["--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "5e-3", "--min-lr", "5e-4",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "0", "--seed", "1234", "--log-interval", "10",
             "--eval-iters", "1", "--eval-interval", "1000"]
    script = os.path.join(ROOT, "recipes", "pretrain_gpt.py")
    _torchrun(script, "--llep", *MODEL, *data, *train, "--train-iters", "1", "--save", str(out / "untrained"),
              "--save-interval", "1")
    pretrain = _torchrun(script, "--llep", *MODEL, *data, *train, "--train-iters", "40", "--save", str(out / "pretrained"),
                         "--save-interval", "40")
    return out, pretrain.stdout


def _finetune(out, pretrained: str, *extra: str) -> str:
    corpus_dir = out / "corpus"
    return _torchrun(os.path.join(ROOT, "recipes", "finetune.py"), "--pretrained", pretrained,
                     "--tokenizer", str(corpus_dir / "tokenizer"), "--data", str(corpus_dir / "code_train.jsonl"),
                     "--seq-length", "64", "--micro-batch-size", "4", "--lr", "1e-4", *extra).stdout


def _first_loss(stdout: str) -> float:
    line = next(line for line in stdout.splitlines() if line.startswith("[finetune] step 1/"))
    return float(line.split("| loss ")[1].split()[0])


@needs_megatron_training
def test_pretraining_drops_the_loss_and_finetuning_starts_from_it(pipeline):
    out, log = pipeline
    losses = [float(part.split("lm loss:")[1].split("|")[0]) for part in log.splitlines() if " lm loss:" in part
              and "iteration" in part]
    assert losses[-1] < losses[0] - 1.0, losses
    uniform = math.log(320)
    # the first fine-tuning step is computed with the loaded weights: near the pretraining loss on the same
    # domain, far below a model that has learned nothing; the checkpoint of iteration 1 is such a model
    trained = _first_loss(_finetune(out, str(out / "pretrained"), "--train-iters", "1"))
    untrained = _first_loss(_finetune(out, str(out / "untrained"), "--train-iters", "1"))
    assert trained < losses[-1] + 0.6 and trained < uniform - 1.0, (trained, losses[-1])
    assert untrained > uniform - 0.3, untrained


@needs_megatron_training
def test_finetuned_model_is_traced_and_benchmarked_on_its_own_routing(pipeline, tmp_path):
    out, _ = pipeline
    corpus_dir = out / "corpus"
    ft = str(out / "finetuned")
    log = _finetune(out, str(out / "pretrained"), "--data", str(corpus_dir / "legal_train.jsonl"),
                    "--valid-data", str(corpus_dir / "legal_valid.jsonl"), "--eval-iters", "1", "--train-iters", "2",
                    "--save", ft)
    assert "validation" in log
    bench = os.path.join(ROOT, "benchmarks", "model_cpu.py")
    _torchrun(bench, "--load", ft, "--corpus", str(corpus_dir), "--label", "finetuned", "--domains", "legal",
              "--seq-length", "64", "--micro-batch-size", "2", "--steps", "1", "--repeats", "1", "--trace-tokens", "256",
              "--trace-dir", str(tmp_path), "--out", str(tmp_path / "model.json"))
    trace = RoutingTrace.load(str(tmp_path / "finetuned_legal.npz"))
    assert (trace.num_experts, trace.topk, sorted(trace.layers)) == (8, 4, [1, 2])
    assert all(layer.expert_ids.shape == (256, 4) for layer in trace.layers.values())
    rows = json.load(open(tmp_path / "model.json"))["rows"]
    assert [r["domain"] for r in rows] == ["legal"]
    for mode in ("EP", "LLEP", "ideal"):
        assert rows[0][f"{mode}_train_tokens_per_s"] > 0 and rows[0][f"{mode}_eval_tokens_per_s"] > 0
        assert len(rows[0][f"{mode}_peak_mb_per_rank"]) == 2
    # inference on the same model and routing: pruning accuracy (CAP placement from the trace above) and speed
    bench = os.path.join(ROOT, "benchmarks", "inference_cpu.py")
    common = ["--load", ft, "--corpus", str(corpus_dir), "--label", "finetuned", "--domains", "legal",
              "--seq-length", "64", "--micro-batch-size", "2", "--trace-dir", str(tmp_path), "--llep-ranks-per-node", "1"]
    _torchrun(bench, "accuracy", *common, "--max-tokens", "256", "--p", "0.3", "--out", str(tmp_path / "accuracy.json"))
    rows = json.load(open(tmp_path / "accuracy.json"))["rows"]
    assert {(r["placement"], r["method"], r["p"]) for r in rows} == {
        (placement, method, p) for placement in ("sequential", "CAP") for method in ("devices", "experts") for p in (0, 0.3)}
    for row in rows:
        pruned = row["p"] > 0
        assert (row["devices_per_token"] < row["devices_per_token_unpruned"]) == pruned
        assert (abs(row["ppl"] / row["unpruned_ppl"] - 1) < 1e-6) == (not pruned)
    _torchrun(bench, "speed", *common, "--repeats", "1", "--prefill-batches", "1", "--prompts", "2",
              "--prompt-tokens", "16", "--new-tokens", "4", "--out", str(tmp_path / "speed.json"))
    row = json.load(open(tmp_path / "speed.json"))["rows"][0]
    for mode in ("EP", "LLEP", "LLEP+CAP", "LLEP+CAP+pruning"):
        assert row[f"{mode}_prefill_tokens_per_s"] > 0 and row[f"{mode}_decode_tokens_per_s"] > 0
