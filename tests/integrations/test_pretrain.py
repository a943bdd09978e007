"""Pretraining through Megatron-LM's own loop (recipes/pretrain_gpt.py = Megatron-LM's pretrain_gpt
plus the megatron_llep.integrations.megatron_lm plugin) on CPU, gloo, 2 ranks, a tiny GPT MoE and a tiny blended
indexed dataset built here: LLEP and plain EP give the same losses and grad norms under forced
imbalance while LLEP really spills (statistics read back from Megatron-LM's writers, wandb
included); a broken LLEP mapping fails that comparison; resuming from a checkpoint continues
exactly, dropout included. Needs megatron.training (megatron-core >= 0.17); the 0.16 wheels have
none: there the entry point must refuse in one line."""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from megatron_llep.testing.wandb_offline import read_history

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
ENTRY = os.path.join(ROOT, "recipes", "pretrain_gpt.py")
BYTE_TOKENIZER = os.path.join(ROOT, "recipes", "data", "byte_tokenizer.json")
HAVE_MEGATRON_TRAINING = importlib.util.find_spec("megatron.training") is not None
needs_megatron_training = pytest.mark.skipif(
    not HAVE_MEGATRON_TRAINING,
    reason="megatron.training (Megatron-LM's loop) is not in this megatron-core wheel (0.17+ ship it)")

ITERS = 4
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--num-experts", "8", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2",
         "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
         "--moe-router-load-balancing-type", "none", "--swiglu", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0",
         # experts that matter at initialisation, so one computed with wrong weights shows in the loss
         "--init-method-std", "0.2"]
TRAINING = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--adam-eps", "1e-4", "--clip-grad", "1.0",
            "--seed", "1234", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "1000",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "258", "--split", "90,5,5"]
DROPOUT = [*MODEL[:MODEL.index("--hidden-dropout")], "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
           *MODEL[MODEL.index("--attention-dropout") + 2:]]
FORCED = ["--force-routing", "0.9:1"]  # 90% of the tokens take expert 0 (EP rank 0) as one of their two experts
LLEP = ["--llep", "--llep-min-chunk-tokens", "1", "--no-llep-cost-aware"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    env.pop("WANDB_MODE", None)  # pretrain_gpt.py's own default (offline) is what the wandb run is read back from
    return env


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One torchrun launch (see pretrain_worker.py). It builds two indexed datasets (the shipped SFT
    records; a text file of made-up documents), blended 70/30, then runs, all under forced
    imbalance: plain EP, LLEP (checkpoint at iteration 2, wandb offline), LLEP sending a wrong
    expert's weights, LLEP resumed from iteration 2, LLEP with every expert moved by a placement,
    and that placement with the router rows left behind; then, with dropout and without forced
    routing, plain EP (checkpoint at iteration 2) and three runs resumed from it: as is, with
    --no-load-rng, and with the data loaders drawing from dropout's generator."""
    from megatron_llep.placement import ExpertPlacement

    out = tmp_path_factory.mktemp("pretrain")
    notes = out / "notes.txt"
    notes.write_text("\n\n".join(f"Note {i}: the {i % 7}-th expert hears about item {i * 13 % 97}." for i in range(120)))
    datasets = [[os.path.join(ROOT, "recipes", "data", "tiny_sft.jsonl"), str(out / "sft")], [str(notes), str(out / "notes")]]
    data = ["--data-path", "0.7", str(out / "sft_text_document"), "0.3", str(out / "notes_text_document"),
            "--data-cache-path", str(out / "cache")]
    common = [*MODEL, *TRAINING, *data, "--tensorboard-dir", str(out / "tb")]
    dropout = [*DROPOUT, *common[len(MODEL):], "--train-iters", str(ITERS)]
    dropout_ckpt = str(out / "dropout_ckpt")
    dropout_resumed = [*dropout, "--load", dropout_ckpt, "--ckpt-step", "2"]
    forced = [*common, *FORCED]
    ckpt = str(out / "ckpt")
    # every expert moves: the two ranks swap halves, and each half is reversed
    swapped = np.array([7, 6, 5, 4, 3, 2, 1, 0])
    ExpertPlacement(num_experts=8, ep_size=2, layers={1: swapped, 2: np.roll(swapped, 4)}).save(str(out / "placement.json"))
    placed = [*forced, *LLEP, "--llep-placement", str(out / "placement.json")]
    runs = [
        {"name": "plain", "argv": [*forced, "--train-iters", str(ITERS)]},
        {"name": "llep", "argv": [*forced, *LLEP, "--train-iters", str(ITERS), "--save", ckpt, "--save-interval", "2",
                                  "--wandb-project", "llep-test", "--wandb-exp-name", "pretrain",
                                  "--wandb-save-dir", str(out / "wandb")]},
        {"name": "llep_overlap", "argv": [*forced, *LLEP, "--overlap-grad-reduce", "--train-iters", str(ITERS)]},
        {"name": "broken", "argv": [*forced, *LLEP, "--train-iters", "2"], "broken": "wrong_expert_sent"},
        {"name": "resumed", "argv": [*forced, *LLEP, "--train-iters", str(ITERS), "--load", ckpt, "--ckpt-step", "2"]},
        {"name": "placed", "argv": [*placed, "--train-iters", "2"]},
        {"name": "placed_broken", "argv": [*placed, "--train-iters", "2"], "broken": "router_rows_stay"},
        {"name": "dropout", "argv": [*dropout, "--save", dropout_ckpt, "--save-interval", "2"]},
        {"name": "dropout_resumed", "argv": dropout_resumed},
        {"name": "dropout_no_load_rng", "argv": [*dropout_resumed, "--no-load-rng"]},
        {"name": "dropout_loader_rng", "argv": dropout_resumed, "broken": "loader_on_the_dropout_generator"},
    ]
    (out / "spec.json").write_text(json.dumps({"datasets": datasets, "runs": runs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
           os.path.join(ROOT, "tests", "workers", "pretrain_worker.py"), str(out), str(out / "spec.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    if (out / "skip.txt").exists():
        pytest.skip((out / "skip.txt").read_text())
    results = {run["name"]: json.loads((out / f"{run['name']}.json").read_text()) for run in runs}
    returns = {run["name"]: json.loads((out / f"{run['name']}.returns.json").read_text()) for run in runs}
    return {"scalars": results, "returns": returns, "stdout": proc.stdout, "wandb": out / "wandb", "ckpt": ckpt,
            "datasets": json.loads((out / "datasets.json").read_text()), "out": out}


def _series(scalars: dict, key: str) -> list:
    return [value for _, value in sorted((int(step), value) for step, value in scalars[key].items())]


@needs_megatron_training
def test_indexed_datasets_are_built_from_text_and_jsonl(runs):
    """Read back with Megatron's IndexedDataset: one document per JSONL record or text paragraph,
    UTF-8 bytes ended by the byte tokenizer's end-of-document id 257."""
    sft, notes = runs["datasets"]
    with open(os.path.join(ROOT, "recipes", "data", "tiny_sft.jsonl")) as f:
        first = json.loads(f.readline())
    assert (sft["documents"], sft["sequences"], notes["documents"], notes["sequences"]) == (240, 240, 120, 120)
    assert sft["first"] == [*f"{first['prompt']}\n{first['response']}".encode(), 257]
    assert sft["last_ids"] == notes["last_ids"] == [257]
    assert notes["first"] == [*b"Note 0: the 0-th expert hears about item 0.", 257]
    from recipes.runtime.indexed_data import megatron_tokenizer_flags

    assert megatron_tokenizer_flags(BYTE_TOKENIZER) == "--tokenizer-type NullTokenizer --vocab-size 258"


@needs_megatron_training
def test_llep_trains_like_plain_ep_and_spills(runs):
    plain, llep = runs["scalars"]["plain"], runs["scalars"]["llep"]
    for key in ("lm loss", "grad-norm"):
        assert len(_series(llep, key)) == ITERS
        assert _series(llep, key) == pytest.approx(_series(plain, key), rel=1e-5, abs=1e-6), key
    assert len(set(_series(plain, "lm loss"))) == ITERS  # the model really trained
    # LLEP really spilled, in every step and layer; plain EP logged no LLEP statistics
    for layer in (1, 2):
        spilled = _series(llep, f"moe/layer_{layer}/spilled_tokens")
        assert len(spilled) == ITERS and min(spilled) > 0
        before, after = _series(llep, f"moe/layer_{layer}/max_mean_before"), _series(llep, f"moe/layer_{layer}/max_mean_after")
        assert min(before) > 1.3 and all(a < b for a, b in zip(after, before))
        assert min(_series(llep, f"moe/layer_{layer}/weight_bytes")) > 0
    assert not any(key.startswith("moe/layer_") for key in plain)
    assert "LLEP: 2/2 layers spilled" in runs["stdout"]
    # borrowed experts kept for the step: without --overlap-grad-reduce the plugin's no_sync_func marks the
    # first of the 2 micro-batches, so each step's return begins in its last backward (once per layer and
    # step) and the second layer's moves on behind the first layer's backward
    returns = runs["returns"]["llep"]
    assert returns["returns"] == 2 * ITERS and returns["behind"] > 0, returns


@needs_megatron_training
def test_llep_with_overlapped_grad_reduce_trains_like_plain_ep(runs):
    """--overlap-grad-reduce: Megatron-LM's no_sync_func is DDP's own, the kept gradients still return
    behind the backward, and the expert buckets wait for them (kept_weights.DeferredGradReady)."""
    plain, overlap = runs["scalars"]["plain"], runs["scalars"]["llep_overlap"]
    for key in ("lm loss", "grad-norm"):
        assert _series(overlap, key) == pytest.approx(_series(plain, key), rel=1e-5, abs=1e-6), key
    returns = runs["returns"]["llep_overlap"]
    assert returns["returns"] == 2 * ITERS and returns["behind"] > 0, returns


@needs_megatron_training
def test_statistics_reach_megatrons_wandb_writer(runs):
    run_dirs = glob.glob(os.path.join(runs["wandb"], "wandb", "offline-run-*"))
    assert len(run_dirs) == 1, run_dirs
    history = {row["_step"]: row for row in read_history(run_dirs[0])}
    llep = runs["scalars"]["llep"]
    for step in range(1, ITERS + 1):
        for key in ("moe/layer_1/spilled_tokens", "moe/layer_2/max_mean_after", "moe/layer_2/plan_time_ms"):
            assert history[step][key] == pytest.approx(llep[key][str(step)]), (step, key)
        assert history[step]["lm loss"] == pytest.approx(llep["lm loss"][str(step)])


@needs_megatron_training
def test_a_broken_mapping_fails_the_comparison(runs):
    plain, broken = runs["scalars"]["plain"], runs["scalars"]["broken"]
    assert min(_series(broken, "moe/layer_1/spilled_tokens")) > 0  # the broken path was exercised
    for key in ("lm loss", "grad-norm"):
        assert _series(broken, key) != pytest.approx(_series(plain, key)[:2], rel=1e-5, abs=1e-6), key


@needs_megatron_training
def test_placed_experts_train_the_same_model(runs):
    """--llep-placement moves every expert (weights and router rows) to another slot: the same
    model, so LLEP on it trains like plain EP on the unplaced one (the forced hot expert now lives
    on the other rank)."""
    plain, placed = runs["scalars"]["plain"], runs["scalars"]["placed"]
    for key in ("lm loss", "grad-norm"):
        assert _series(placed, key) == pytest.approx(_series(plain, key)[:2], rel=1e-5, abs=1e-6), key
    assert min(_series(placed, "moe/layer_1/spilled_tokens")) > 0
    assert "applied the expert placement" in runs["stdout"]
    # negative control: experts moved without their router rows are another model
    broken = runs["scalars"]["placed_broken"]
    assert _series(broken, "lm loss") != pytest.approx(_series(plain, "lm loss")[:2], rel=1e-5, abs=1e-6)


@needs_megatron_training
def test_resume_continues_exactly(runs):
    llep, resumed = runs["scalars"]["llep"], runs["scalars"]["resumed"]
    assert {"iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"} <= set(os.listdir(runs["ckpt"]))
    assert sorted(int(step) for step in resumed["lm loss"]) == [3, 4]
    for key in ("lm loss", "grad-norm", "moe/layer_1/spilled_tokens"):
        for step in ("3", "4"):
            assert resumed[key][step] == llep[key][step], (key, step)


@needs_megatron_training
def test_resume_with_dropout_continues_exactly(runs):
    """Megatron-LM's checkpoint carries the RNG states dropout draws from; on CPU the data loaders
    must not draw from the same generator after they were restored."""
    scalars = runs["scalars"]
    full, resumed = scalars["dropout"], scalars["dropout_resumed"]
    assert sorted(int(step) for step in resumed["lm loss"]) == [3, 4]
    for key in ("lm loss", "grad-norm"):
        assert [resumed[key][step] for step in ("3", "4")] == [full[key][step] for step in ("3", "4")], key
    # negative controls: other dropout masks give other losses
    for name in ("dropout_no_load_rng", "dropout_loader_rng"):
        assert scalars[name]["lm loss"]["3"] != full["lm loss"]["3"], name


@pytest.mark.skipif(HAVE_MEGATRON_TRAINING, reason="megatron.training is installed (the refusal is for 0.16 wheels)")
def test_entry_point_refuses_in_one_line_without_megatron_training():
    proc = subprocess.run([sys.executable, ENTRY, "--llep"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "megatron.training" in lines[0] and "megatron-core >= 0.17" in lines[0], proc.stderr


def _llep_flags(*argv: str) -> argparse.Namespace:
    """The plugin's flags parsed beside the Megatron-LM flags they are checked against."""
    from megatron_llep.integrations.megatron_lm import add_llep_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--moe-token-dispatcher-type", default="alltoall")
    parser.add_argument("--expert-model-parallel-size", type=int, default=2)
    parser.add_argument("--load", default=None)
    parser.add_argument("--save", default=None)
    return add_llep_args(parser).parse_args(argv)


def test_llep_flags_map_onto_llep_config():
    from megatron_llep.config import LLEPConfig
    from megatron_llep.planning.cost_model import CostModel
    from megatron_llep.integrations.flags import llep_config_from_flags
    from megatron_llep.integrations.megatron_lm import note_when_idle

    args = _llep_flags("--llep", "--llep-alpha", "1.5", "--llep-min-chunk-tokens", "7", "--llep-imbalance-threshold", "2",
                       "--llep-ranks-per-node", "4", "--no-llep-cost-aware", "--llep-cost-model", "h200",
                       "--no-llep-enabled", "--no-llep-record-stats", "--llep-max-tokens-per-rank", "4096")
    assert llep_config_from_flags(args) == LLEPConfig(alpha=1.5, min_chunk_tokens=7, imbalance_threshold=2.0,
                                                      ranks_per_node=4, cost_aware=False, cost_model=CostModel(),
                                                      enabled=False, record_stats=False, max_tokens_per_rank=4096)
    # CPU defaults, as recipes/finetune.py's: m = 16 and the CPU cost model
    assert llep_config_from_flags(_llep_flags("--llep")) == LLEPConfig(min_chunk_tokens=16, cost_model=CostModel.cpu())
    for given, kept in (("auto", "auto"), ("none", None), ("0", 0), ("4096", 4096)):
        assert llep_config_from_flags(_llep_flags("--llep-max-kept-weight-bytes", given)).max_kept_weight_bytes == kept
    assert note_when_idle(_llep_flags("--llep")) is None
    assert "no work" in note_when_idle(_llep_flags("--llep", "--expert-model-parallel-size", "1"))
    # knobs without --llep do nothing, and say so (the placement is plain EP's too)
    assert note_when_idle(_llep_flags()) is None and note_when_idle(_llep_flags("--llep-placement", "p.json")) is None
    assert note_when_idle(_llep_flags("--llep-alpha", "2", "--no-llep-cost-aware")) == (
        "--llep-alpha, --no-llep-cost-aware tune LLEP, which is off without --llep: they do nothing in this plain-EP run")


@pytest.mark.parametrize("argv, message", [
    (["--llep-alpha", "0"], "--llep-alpha must be a finite number > 0 (capacity factor), got 0.0"),
    (["--llep-min-chunk-tokens", "-1"], "--llep-min-chunk-tokens (m) must be an integer >= 0, got -1"),
    (["--llep-imbalance-threshold", "0.5"], "--llep-imbalance-threshold (lambda) must be >= 1.0"),
    (["--llep-ranks-per-node", "0"], "--llep-ranks-per-node must be a positive integer"),
    (["--llep-max-tokens-per-rank", "0"], "--llep-max-tokens-per-rank (the token-expert rows an EP rank may receive "
                                          "per layer step) must be a positive integer, or None for no budget, got 0"),
    (["--moe-token-dispatcher-type", "allgather"], "use --moe-token-dispatcher-type alltoall (got allgather)"),
    (["--llep-placement", "/nonexistent/placement.json"], "--llep-placement /nonexistent/placement.json: "),
])
def test_bad_llep_flags_are_refused_in_one_line(argv, message):
    from megatron_llep.integrations.megatron_lm import check_llep_args

    with pytest.raises(ValueError) as err:
        check_llep_args(_llep_flags("--llep", *argv))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_placement_for_another_model_is_refused(tmp_path):
    from megatron_llep.integrations.megatron_lm import check_llep_args
    from megatron_llep.placement import ExpertPlacement

    ExpertPlacement.identity(16, 2, [1, 2]).save(str(tmp_path / "placement.json"))
    with pytest.raises(ValueError, match="placement is for 16 experts, the model has --num-experts 8"):
        check_llep_args(_llep_flags("--llep-placement", str(tmp_path / "placement.json")))


def test_launcher_starts_pretrain_gpt_and_a_usage_error_is_one_line():
    """LLEP_ENTRY=pretrain_gpt launch/torchrun.sh on 2 ranks: a bad LLEP flag is reported once, by
    rank 0, with exit status 2, before Megatron-LM is imported."""
    env = dict(_env(), LLEP_ENTRY="pretrain_gpt", PYTHON=sys.executable, NPROC_PER_NODE="2", MASTER_PORT=_free_port())
    proc = subprocess.run([os.path.join(ROOT, "launch", "torchrun.sh"), *MODEL, *TRAINING, "--train-iters", "2",
                           "--llep", "--llep-alpha", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[pretrain_gpt] error:")]
    assert len(errors) == 1 and "--llep-alpha must be a finite number > 0" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@needs_megatron_training
def test_a_usage_error_found_after_megatron_parses_is_one_line(tmp_path):
    """A flag only Megatron-LM's parsed arguments can check (a data prefix without its files) is
    refused in one line, exit status 2, no traceback, before the process group starts."""
    missing = str(tmp_path / "missing_text_document")
    proc = subprocess.run([sys.executable, ENTRY, *MODEL, *TRAINING, "--expert-model-parallel-size", "1",
                           "--train-iters", "2", "--data-path", missing], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[pretrain_gpt] error:")]
    assert errors == [f"[pretrain_gpt] error: data prefix {missing}: {missing}.bin does not exist "
                      "(build one with recipes/make_indexed_dataset.py)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_cpu_runs_get_the_flags_megatron_lm_needs_there():
    from megatron_llep.testing.megatron_training_cpu import cpu_argv

    argv = cpu_argv(["--llep", "--spec", "local", "--no-rope-fusion"])
    assert argv[:4] == ["--llep", "--spec", "local", "--no-rope-fusion"]
    assert argv[4:] == ["--distributed-backend", "gloo", "--attention-backend", "local", "--no-persist-layer-norm",
                        "--no-gradient-accumulation-fusion"]
    with pytest.raises(ValueError, match="--distributed-backend nccl cannot run on CPU: use --distributed-backend gloo"):
        cpu_argv(["--distributed-backend", "nccl"])


def test_checkpoints_in_another_expert_order_are_refused(tmp_path):
    """Megatron-LM loads into the model after the placement moved its experts: a checkpoint saved in
    another order would load every moved expert into the wrong slot, silently."""
    from megatron_llep.integrations.megatron_lm import check_llep_args, record_checkpoint_placement
    from megatron_llep.placement import ExpertPlacement

    swapped = np.array([7, 6, 5, 4, 3, 2, 1, 0])
    for name, order in (("p.json", swapped), ("q.json", np.roll(swapped, 4))):
        ExpertPlacement(num_experts=8, ep_size=2, layers={1: order}).save(str(tmp_path / name))
    p, q = str(tmp_path / "p.json"), str(tmp_path / "q.json")
    plain = tmp_path / "plain"  # saved without a placement
    plain.mkdir()
    (plain / "latest_checkpointed_iteration.txt").write_text("2")
    check_llep_args(_llep_flags("--load", str(plain)))
    with pytest.raises(ValueError) as err:
        check_llep_args(_llep_flags("--load", str(plain), "--llep-placement", p))
    assert str(err.value) == (f"--load {plain}: its checkpoints hold the experts in original order, this run uses "
                              f"--llep-placement {p}; pass the placement they were saved with, or another --load "
                              "directory")

    placed = tmp_path / "placed"
    record_checkpoint_placement(_llep_flags("--save", str(placed), "--llep-placement", p))
    assert (placed / "expert_placement.json").is_file()
    (placed / "iter_0000002").mkdir()  # Megatron-LM saved here
    check_llep_args(_llep_flags("--load", str(placed), "--save", str(placed), "--llep-placement", p))
    for argv in (["--llep-placement", q], []):
        with pytest.raises(ValueError, match=f"--load {placed}: its checkpoints hold the experts in the placement in "):
            check_llep_args(_llep_flags("--load", str(placed), *argv))
    with pytest.raises(ValueError, match=f"--save {placed}: .* this run uses original order"):
        check_llep_args(_llep_flags("--save", str(placed)))

    # a note left where nothing was saved does not outlive a run without a placement
    empty = tmp_path / "empty"
    record_checkpoint_placement(_llep_flags("--save", str(empty), "--llep-placement", p))
    record_checkpoint_placement(_llep_flags("--save", str(empty)))
    assert not (empty / "expert_placement.json").exists()


@pytest.mark.skipif(HAVE_MEGATRON_TRAINING, reason="only a megatron-core without megatron.training refuses")
def test_without_megatron_training_the_refusal_says_how_to_install_it_here():
    proc = subprocess.run([sys.executable, ENTRY, "--llep"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[pretrain_gpt] error:")]
    assert len(lines) == 1 and "bash .ci/install_megatron_core.sh" in lines[0] and "Python 3.12" in lines[0], proc.stderr


@pytest.mark.parametrize("flags, unfused", [
    (dict(swiglu=False, quick_geglu=False, bias_gelu_fusion=True, num_experts=8), True),  # docs/pretrain.md's model
    (dict(swiglu=True, quick_geglu=False, bias_gelu_fusion=True, num_experts=8), False),
    (dict(swiglu=False, quick_geglu=True, bias_gelu_fusion=True, num_experts=8), False),
    (dict(swiglu=False, quick_geglu=False, bias_gelu_fusion=False, num_experts=8), False),
    (dict(swiglu=False, quick_geglu=False, bias_gelu_fusion=True, num_experts=None), False),  # dense: fusion kept
])
def test_gelu_experts_run_unfused_where_megatron_cannot_fuse_them(flags, unfused):
    """Megatron-Core's expert MLP raises in the first step for a fused gelu with router probabilities
    (tests/docs/test_docs_commands.py runs docs/pretrain.md's gelu model end to end)."""
    from recipes.pretrain_gpt import unfuse_expert_activation

    args = argparse.Namespace(**flags)
    note = unfuse_expert_activation(args)
    assert (note is not None) == unfused and args.bias_gelu_fusion == (flags["bias_gelu_fusion"] and not unfused)
