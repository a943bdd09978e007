"""The fine-tuning entry point (recipes/finetune.py) end to end under torchrun on 2 CPU ranks:
the README's main job, exact resume from a dist_checkpointing checkpoint, gradient accumulation,
LLEP == plain EP on the DeepSeek-V3 architecture in training and validation, pipeline
parallelism, the wandb dashboard read back from the offline run file, validation (--valid-data)
and clean errors for bad input."""

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_llep.testing.wandb_offline import read_history

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "recipes", "finetune.py")
SMALL = ["--seq-length", "32", "--micro-batch-size", "2"]


def _torchrun(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", SCRIPT, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc):
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return [line for line in proc.stdout.splitlines() if line.startswith("[finetune] step")]


def _history(wandb_dir):
    runs = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1, runs
    return {row["_step"]: row for row in read_history(runs[0])}, runs[0]


def test_resume_is_exact_and_wandb_logs_the_dashboard(tmp_path):
    """The README's main job (forced routing, LLEP on) reports throughput and LLEP's work, resumes
    bitwise from its checkpoint, and logs the dashboard to wandb's offline run."""
    common = [*SMALL, "--global-batch-size", "8", "--train-iters", "4", "--force-routing", "0.9:4",
              "--wandb-project", "llep-test", "--heatmap-interval", "2"]
    straight = _ok(_torchrun(*common, "--wandb-save-dir", str(tmp_path / "w_straight")))
    ckpt = str(tmp_path / "ckpt")
    # first half, stopped after iteration 2 (a save), then resumed by the same command line
    _ok(_torchrun(*common[:-4], "--exit-interval", "2", "--save", ckpt))
    resumed = _ok(_torchrun(*common, "--save", ckpt, "--load", ckpt, "--wandb-save-dir", str(tmp_path / "w_resumed")))
    assert len(straight) == 4 and len(resumed) == 2
    assert "tokens/s" in straight[-1] and "TFLOP/s/GPU" in straight[-1] and "LLEP 2/2 layers spilled" in straight[-1]

    reference, run_dir = _history(tmp_path / "w_straight")
    continued, _ = _history(tmp_path / "w_resumed")
    assert sorted(continued) == [3, 4]
    for step in (3, 4):  # bitwise: parameters, Adam moments, LR schedule and data position restored
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert continued[step][key] == reference[step][key], (step, key)
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]

    # the dashboard: throughput, memory, per-layer LLEP statistics and the load heatmap
    row = reference[4]
    for key in ("throughput/tokens_per_sec", "throughput/tokens_per_sec_per_gpu", "throughput/tflops_per_gpu",
                "time/step_s", "train/grad_norm", "memory/peak_gib"):
        assert row[key] > 0, key
    assert row["throughput/tokens_per_sec"] == pytest.approx(2 * row["throughput/tokens_per_sec_per_gpu"])
    for layer in (1, 2):
        assert row[f"moe/layer_{layer}/max_mean_before"] > 1.5  # 90% into 4 experts of rank 0
        assert row[f"moe/layer_{layer}/max_mean_after"] < row[f"moe/layer_{layer}/max_mean_before"]
        assert row[f"moe/layer_{layer}/spilled_tokens"] > 0 and row[f"moe/layer_{layer}/weight_bytes"] > 0
        assert row[f"moe/layer_{layer}/max_mean_load"] == pytest.approx(row[f"moe/layer_{layer}/max_mean_before"])
    assert "moe/expert_load_heatmap/path" in reference[2] and "moe/expert_load_heatmap/path" not in reference[3]
    image = os.path.join(run_dir, "files", row["moe/expert_load_heatmap/path"])
    assert os.path.getsize(image) > 0

    # resuming with another model is refused with a reason
    proc = _torchrun(*SMALL, "--recipe", "deepseek-v3-tiny", "--load", ckpt)
    assert proc.returncode != 0 and "incompatible run" in proc.stderr and "recipe" in proc.stderr


def test_gradient_accumulation_equals_one_large_micro_batch(tmp_path):
    """A global batch of 8 as 2 micro-batches of 2 per rank or as 1 micro-batch of 4 per rank:
    the same per-token loss and gradient (Megatron's per-token loss over micro-batches and DP)."""
    common = ["--seq-length", "32", "--global-batch-size", "8", "--train-iters", "2", "--wandb-project", "t"]
    _ok(_torchrun(*common, "--micro-batch-size", "2", "--wandb-save-dir", str(tmp_path / "accum")))
    _ok(_torchrun(*common, "--micro-batch-size", "4", "--wandb-save-dir", str(tmp_path / "single")))
    accum, _ = _history(tmp_path / "accum")
    single, _ = _history(tmp_path / "single")
    for step in (1, 2):
        assert accum[step]["train/loss"] == pytest.approx(single[step]["train/loss"], rel=1e-6)
        assert accum[step]["train/grad_norm"] == pytest.approx(single[step]["train/grad_norm"], rel=1e-5)


def test_pipeline_parallel_deepseek_v3_architecture():
    proc = _torchrun(*SMALL, "--recipe", "deepseek-v3-tiny", "--pipeline-model-parallel-size", "2",
                     "--train-iters", "2", "--valid-data", os.path.join(ROOT, "recipes", "data", "tiny_sft.jsonl"),
                     "--eval-iters", "1")
    lines = _ok(proc)
    assert len(lines) == 2
    losses = [float(line.split("loss ")[1].split(" ")[0]) for line in lines]
    valid, = _validation_lines(proc)  # from the last stage, which holds the loss
    losses.append(float(valid.split("loss ")[1].split(" ")[0]))
    assert all(math.isfinite(x) and 4.0 < x < 7.0 for x in losses)  # ~ln(258) at initialisation


def _parse_only(*args):
    """finetune.py without torchrun: usage errors end it before any process group exists."""
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, said", [(["--force-routing", "lots"], "F:H"),
                                         (["--data", "/nonexistent.jsonl"], "does not exist"),
                                         (["--save-interval", "2"], "needs --save")])
def test_bad_arguments_fail_before_starting(argv, said, capsys):
    from recipes import finetune

    with pytest.raises(SystemExit) as end:
        finetune.parse_args(argv)
    assert end.value.code == 2 and said in capsys.readouterr().err


def test_finetune_without_torchrun_says_how_to_launch_it():
    proc = _parse_only()
    assert proc.returncode != 0 and "torchrun" in (proc.stderr + proc.stdout)


def test_cap_placement_keeps_the_model_function(tmp_path):
    """Experts and router rows permuted across the EP ranks by a CAP placement file: the same
    losses and gradient norms as the unplaced model (LLEP runs on the placed layout), and the
    checkpoint records the placement."""
    from megatron_llep.placement import ExpertPlacement, read_checkpoint_placement

    placement = ExpertPlacement(8, 2, {1: [7, 0, 5, 2, 6, 1, 4, 3], 2: [3, 4, 5, 6, 7, 0, 1, 2]})
    path = str(tmp_path / "placement.json")
    placement.save(path)
    common = [*SMALL, "--train-iters", "2", "--wandb-project", "t"]
    traces = tmp_path / "traces"
    _ok(_torchrun(*common, "--wandb-save-dir", str(tmp_path / "plain"), "--record-routing-trace", str(traces),
                  "--trace-tokens-per-layer", "100"))
    # the recorded traces plan a placement with the CLI: the record -> plan -> apply workflow
    files = sorted(str(p) for p in traces.glob("trace_rank*.npz"))
    assert len(files) == 2
    planned = subprocess.run([sys.executable, "-m", "megatron_llep.placement", "plan", *files, "--ep-size", "2",
                              "--out", str(tmp_path / "planned.json")], cwd=ROOT, capture_output=True, text=True)
    assert planned.returncode == 0, planned.stderr
    assert sorted(ExpertPlacement.load(str(tmp_path / "planned.json")).layers) == [1, 2]
    _ok(_torchrun(*common, "--llep-placement", path, "--save", str(tmp_path / "ckpt"), "--wandb-save-dir", str(tmp_path / "placed")))
    unplaced, placed = _history(tmp_path / "plain")[0], _history(tmp_path / "placed")[0]
    for step in (1, 2):
        assert placed[step]["train/loss"] == pytest.approx(unplaced[step]["train/loss"], rel=1e-6)
        assert placed[step]["train/grad_norm"] == pytest.approx(unplaced[step]["train/grad_norm"], rel=1e-5)
    saved = read_checkpoint_placement(str(tmp_path / "ckpt" / "iter_0000002"))
    assert saved is not None and saved.to_json()["layers"] == placement.to_json()["layers"]
    proc = _torchrun(*SMALL, "--load", str(tmp_path / "ckpt"), "--train-iters", "3")  # without the placement
    assert proc.returncode != 0 and "placement" in proc.stderr


def test_sigterm_finishes_the_step_saves_and_resumes(tmp_path):
    """Preemption (slurm sends SIGTERM; torchrun forwards it): the ranks finish the step, agree,
    save a complete checkpoint and stop; the next run resumes from it."""
    import signal

    ckpt = str(tmp_path / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", SCRIPT, *SMALL,
           "--train-iters", "100000", "--save", ckpt]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("[finetune] step 2/"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    stopped = [line for line in err.splitlines() if line.startswith("[finetune] stopped by SIGTERM after iteration ")]
    assert len(stopped) == 1, err[-2000:]
    iteration = int(stopped[0].split("after iteration ")[1].split(":")[0])
    assert iteration >= 2
    assert stopped[0].endswith(f": saved in {ckpt}/iter_{iteration:07d}; resume with --load {ckpt}")
    assert sorted(os.listdir(ckpt)) == [f"iter_{iteration:07d}", "latest_checkpointed_iteration.txt"]
    resumed = _torchrun(*SMALL, "--train-iters", str(iteration + 1), "--load", ckpt)
    assert f"resumed from {ckpt} at iteration {iteration}" in resumed.stdout
    assert len(_ok(resumed)) == 1


def _validation_lines(proc):
    return [line for line in proc.stdout.splitlines() if line.startswith("[finetune] validation at step")]


def test_validation_loss_is_reported_at_the_eval_steps(tmp_path):
    """One text record of 144 tokens: 4 windows of 32, exactly one global batch (2 x DP 2), so every
    training step and every evaluation see the same 4 windows, all tokens trained. The validation
    loss after step S must then equal the training loss of step S + 1 (same parameters, same
    windows; train-mode forward, reduced by the loop) and count 4 x 32 tokens."""
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 3 + "abcdefg"}) + "\n")
    proc = _torchrun(*SMALL, "--data", str(data), "--valid-data", str(data), "--train-iters", "3",
                     "--eval-interval", "1", "--eval-iters", "3", "--lr-warmup-iters", "0", "--wandb-project", "t",
                     "--wandb-save-dir", str(tmp_path / "w"))
    steps = _ok(proc)
    assert len(steps) == 3
    assert proc.stdout.count("--eval-iters 3 capped to the 1 it holds") == 1
    lines = _validation_lines(proc)
    assert [line.split(" | ")[0] for line in lines] == [f"[finetune] validation at step {s}" for s in (1, 2, 3)]
    history, _ = _history(tmp_path / "w")
    for step in (1, 2, 3):
        row = history[step]
        assert row["valid/tokens"] == 128
        assert row["valid/ppl"] == pytest.approx(math.exp(row["valid/loss"]), rel=1e-9)
        assert f"| loss {row['valid/loss']:.4f} | ppl {row['valid/ppl']:.2f} | 128 tokens |" in lines[step - 1]
    for step in (1, 2):
        assert history[step]["valid/loss"] == pytest.approx(history[step + 1]["train/loss"], rel=1e-6)
    assert history[1]["valid/loss"] < history[1]["train/loss"] - 1e-3  # the evaluation saw the trained model
    done, = [line for line in proc.stdout.splitlines() if line.startswith("[finetune] done:")]
    assert f"validation loss {history[3]['valid/loss']:.4f}" in done


def test_llep_equals_plain_ep_on_deepseek_v3_architecture_in_training_and_validation(tmp_path):
    """DeepSeek-V3's architecture (MLA, shared expert, sigmoid routing with expert bias and an MTP
    layer), 90% of the tokens forced into 4 hot experts (evaluation forwards too): LLEP spills in
    every MoE layer, training and evaluating, and gives plain EP's losses and gradient norms.
    Evaluating in between log steps leaves the training metrics as without it; another validation
    file gives another loss (the comparison is sensitive)."""
    records = [{"prompt": "What is the capital of France?", "response": "Paris is the capital of France."},
               {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]},
               {"text": "Validation text about experts, routers and load balancing across ranks."}]
    valid, other = tmp_path / "valid.jsonl", tmp_path / "other.jsonl"
    valid.write_text("".join(json.dumps(r) + "\n" for r in records * 3))
    other.write_text("".join(json.dumps({"text": r["text"].upper()}) + "\n" for r in records[2:] * 6))
    common = [*SMALL, "--recipe", "deepseek-v3-tiny", "--train-iters", "2", "--log-interval", "2", "--force-routing",
              "0.9:4", "--eval-iters", "2", "--wandb-project", "t"]
    llep = _torchrun(*common, "--valid-data", str(valid), "--eval-interval", "1",
                     "--wandb-save-dir", str(tmp_path / "llep"))
    plain = _torchrun(*common, "--valid-data", str(valid), "--eval-interval", "1", "--no-llep",
                      "--wandb-save-dir", str(tmp_path / "plain"))
    elsewhere = _torchrun(*common, "--valid-data", str(other), "--wandb-save-dir", str(tmp_path / "other"))
    steps = _ok(llep)
    _ok(plain)
    _ok(elsewhere)
    assert "LLEP 4/4 layers spilled" in steps[-1]  # 3 decoder MoE layers and the MTP layer's
    evaluations = _validation_lines(llep)
    assert len(evaluations) == 2 and all("layers spilled" in line for line in evaluations), evaluations
    with_llep, without, control = (_history(tmp_path / name)[0] for name in ("llep", "plain", "other"))
    # step 2's logged loss and gradient norm follow from step 1's update (--log-interval 2: step 2 alone is logged)
    assert with_llep[2]["train/loss"] == pytest.approx(without[2]["train/loss"], rel=1e-6)
    assert with_llep[2]["train/grad_norm"] == pytest.approx(without[2]["train/grad_norm"], rel=1e-5)
    for step in (1, 2):
        assert with_llep[step]["valid/loss"] == pytest.approx(without[step]["valid/loss"], rel=1e-6)
        assert with_llep[step]["valid/tokens"] == without[step]["valid/tokens"] > 0
    assert abs(control[2]["valid/loss"] / with_llep[2]["valid/loss"] - 1) > 1e-3
    # the step-1 evaluation ran before the step-2 log, the control's only after it: the same training metrics
    moe_keys = sorted(key for key in with_llep[2] if key.startswith("moe/layer_") and key.endswith((
        "/spilled_tokens", "/max_mean_before", "/max_mean_load")))
    assert len(moe_keys) == 3 * 4, moe_keys
    for key in ("train/loss", "train/grad_norm", *moe_keys):
        assert with_llep[2][key] == control[2][key], key


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eval-iters", "0"], "--eval-iters must be positive, got 0"),
        (["--eval-interval", "2"], "--eval-interval needs --valid-data"),
        (["--valid-data", "/nonexistent/valid.jsonl"], "--valid-data: /nonexistent/valid.jsonl does not exist"),
    ],
    ids=["eval-iters-0", "interval-without-data", "missing-file"],
)
def test_bad_validation_arguments_are_usage_errors(args, message):
    proc = _parse_only(*args)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].endswith(message), proc.stderr
