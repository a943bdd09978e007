"""The evaluation and generation entry points (recipes/evaluate.py, recipes/generate.py) under torchrun
on 2 CPU gloo ranks (EP = 2), from a fine-tuning checkpoint saved in a CAP placement (--load): with LLEP
spilling under forced imbalance they give plain EP's tokens, log-probs and loss; generation equals an
independent full-recompute oracle (tests/workers/inference_worker.py); a changed prompt or a perturbed weight
is detected; the fine-tuning run's validation loss is reproduced at any placement; CAP routing pruning
(--prune-p) changes nothing at p = 0 and drops devices and pairs at p = 0.5; bad arguments are one line
with exit status 2 (what is found once the process group is up, a missing checkpoint or a placement for
another model: tests/entry_points/test_outputs.py)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVALUATE = os.path.join(ROOT, "recipes", "evaluate.py")
FINETUNE = os.path.join(ROOT, "recipes", "finetune.py")
GENERATE = os.path.join(ROOT, "recipes", "generate.py")
WORKER = os.path.join(ROOT, "tests", "workers", "inference_worker.py")
DATA = os.path.join(ROOT, "recipes", "data", "tiny_sft.jsonl")
# 90% of the tokens into the 4 experts of EP rank 0 (physical slots), every chunk worth spilling
IMBALANCE = ["--force-routing", "0.9:4", "--llep-min-chunk-tokens", "1"]
EVAL = ["--seq-length", "32", "--micro-batch-size", "2", "--eval-iters", "2"]
VALID = ["--data", DATA, "--seq-length", "32", "--micro-batch-size", "2", "--eval-iters", "1"]  # finetune's validation
PROMPTS = [{"prompt": "Hello world"}, {"prompt": "Hello worle"},  # one character apart: the negative control
           {"messages": [{"role": "user", "content": "The quick brown fox"}]}]
# the fine-tuning run's CAP placement, and another one the worker moves the experts to
PLACEMENT = {1: [7, 0, 5, 2, 6, 1, 4, 3], 2: [3, 4, 5, 6, 7, 0, 1, 2]}
OTHER_PLACEMENT = {1: [1, 0, 3, 2, 5, 4, 7, 6], 2: [4, 5, 6, 7, 0, 1, 2, 3]}


def _torchrun(script, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc, prefix):
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-4000:])
    return [line for line in proc.stdout.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A one-step fine-tune saved in a CAP placement (its validation loss printed), then from that
    checkpoint generate.py with LLEP and with plain EP, evaluate.py with LLEP, and the worker's checks
    at plain EP (tests/workers/inference_worker.py): same model, prompts, data and forced routing."""
    from megatron_llep.placement import ExpertPlacement

    tmp = tmp_path_factory.mktemp("inference")
    for name, layers in (("placement", PLACEMENT), ("other_placement", OTHER_PLACEMENT)):
        ExpertPlacement(8, 2, layers).save(str(tmp / f"{name}.json"))
    lines = _ok(_torchrun(FINETUNE, "--train-iters", "1", "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-2",
                          "--valid-data", DATA, "--eval-iters", "1", "--llep-placement", str(tmp / "placement.json"),
                          "--save", str(tmp / "ckpt")), "[finetune] validation")
    model = ["--load", str(tmp / "ckpt"), *IMBALANCE]
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    generate_args = [*model, "--prompts", str(prompts), "--max-new-tokens", "10"]
    out = {"tmp": tmp, "generate_args": generate_args, "evaluate_args": [*model, *EVAL],
           "finetune_valid_loss": float(lines[-1].split("| loss ")[1].split(" ")[0])}
    for mode, flags in (("llep", []), ("plain", ["--no-llep"])):
        out[f"generate_{mode}"] = _ok(_torchrun(GENERATE, *generate_args, *flags, "--output", str(tmp / f"{mode}.jsonl")),
                                      "[generate]")
        out[f"generate_{mode}_records"] = [json.loads(line) for line in (tmp / f"{mode}.jsonl").read_text().splitlines()]
    # evaluate.py with LLEP here; at plain EP in the worker (tests/workers/inference_worker.py), which shares the model
    # --prune-p 0 (routing pruning on, dropping nothing) must leave the loss alone
    out["evaluate_llep"] = _ok(_torchrun(EVALUATE, *model, *EVAL, "--prune-p", "0", "--output", str(tmp / "llep.json"),
                                         "--wandb-project", "t", "--wandb-save-dir", str(tmp / "wandb")), "[evaluate]")
    out["evaluate_llep_result"] = json.loads((tmp / "llep.json").read_text())
    # CAP pruning at p = 0.5 without LLEP (the LLEP layer dispatching as plain EP), one GPU per node, on the
    # fine-tuning run's validation windows (the worker's valid_args: natural routing, which spans both devices)
    out["evaluate_pruned"] = _ok(_torchrun(EVALUATE, "--load", str(tmp / "ckpt"), *VALID, "--prune-p", "0.5", "--no-llep",
                                           "--llep-ranks-per-node", "1", "--output", str(tmp / "pruned.json")), "[evaluate]")
    out["evaluate_pruned_result"] = json.loads((tmp / "pruned.json").read_text())
    spec = {"generate_args": generate_args, "generations": str(tmp / "llep.jsonl"), "evaluate_args": [*model, *EVAL],
            "scratch": str(tmp), "other_placement": str(tmp / "other_placement.json"),
            "valid_args": ["--load", str(tmp / "ckpt"), *VALID]}
    line, = _ok(_torchrun(WORKER, json.dumps(spec)), "REPORT ")
    out["worker"] = json.loads(line[len("REPORT "):])
    return out


def _spilled(lines):
    summary = lines[-1] if "tokens spilled" in lines[-1] else next(line for line in lines if "tokens spilled" in line)
    return float(summary.split(" tokens spilled")[0].rsplit(" ", 1)[1])


def test_generation_with_llep_equals_plain_ep(runs):
    llep, plain = runs["generate_llep_records"], runs["generate_plain_records"]
    assert "LLEP 2/2 layers spilled" in "\n".join(runs["generate_llep"]) and _spilled(runs["generate_llep"]) > 0
    assert any("plain EP" in line for line in runs["generate_plain"])
    assert len(llep) == len(plain) == 3
    for a, b in zip(llep, plain):
        assert a["prompt"] == b["prompt"] and a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["generated_token_ids"] == b["generated_token_ids"] and a["generated_text"] == b["generated_text"]
        assert len(a["log_probs"]) == len(a["generated_token_ids"]) > 0
        assert a["log_probs"] == pytest.approx(b["log_probs"], abs=1e-6)
    # negative control: prompts one character apart give outputs the comparison tells apart
    assert llep[0]["prompt_token_ids"] != llep[1]["prompt_token_ids"]
    assert llep[0]["log_probs"] != pytest.approx(llep[1]["log_probs"], abs=1e-6)
    assert llep[2]["prompt_token_ids"][-11:] == list(b"assistant: ")  # messages without a chat template
    # one line per generation on rank 0, then the throughput line
    assert sum(line.startswith("[generate] #") for line in runs["generate_llep"]) == 3
    assert "prefill" in runs["generate_llep"][-2] and "decode" in runs["generate_llep"][-2]


def test_evaluation_with_llep_equals_plain_ep(runs):
    llep, plain_loss = runs["evaluate_llep_result"], runs["worker"]["eval_loss"]
    assert llep["moe"]["moe/layer_1/spilled_tokens"] > 0 and llep["moe"]["moe/layer_2/spilled_tokens"] > 0
    assert "LLEP 2/2 layers spilled" in runs["evaluate_llep"][-2]
    assert llep["loss"] == pytest.approx(plain_loss, rel=1e-6)  # evaluate.py's windows and loss at plain EP
    assert llep["loss_tokens"] > 0 and llep["sequences"] == 8  # 2 global batches of 2 x DP 2
    assert llep["loss"] < runs["finetune_valid_loss"] + 1  # the fine-tuned model, not a random one
    assert llep["ppl"] == pytest.approx(2.718281828459045 ** llep["loss"], rel=1e-9)
    assert llep["prefill_tokens_per_sec"] > 0 and llep["tokens_processed"] == 8 * 32
    from megatron_llep.testing.wandb_offline import read_history

    run_dir = next((runs["tmp"] / "wandb" / "wandb").glob("offline-run-*"))
    row = read_history(str(run_dir))[-1]
    assert row["eval/loss"] == pytest.approx(llep["loss"]) and row["moe/layer_1/spilled_tokens"] > 0


def test_generation_equals_full_recompute_oracle_and_perturbations_are_detected(runs):
    report = runs["worker"]
    assert report["tokens_equal"] == [True, True, True] and min(report["generated"]) > 0
    assert report["max_log_prob_diff"] < 1e-5
    assert report["indexed_format"] == "indexed" and 4.0 < report["indexed_loss"] < 7.5  # byte text, 512 ids
    # negative control: a perturbed expert weight shows in both comparisons
    assert report["perturbed_max_log_prob_diff"] > 1e-4
    assert abs(report["perturbed_eval_loss"] - report["eval_loss"]) > 1e-5
    # --load moved to another placement evaluates the fine-tuning run's validation windows to its loss
    # (printed with 4 decimals), as does the model that kept the checkpoint's placement
    assert report["other_placement_valid_loss"] == pytest.approx(runs["finetune_valid_loss"], abs=6e-5)
    assert report["kept_placement_valid_loss"] == pytest.approx(runs["finetune_valid_loss"], abs=6e-5)


def test_routing_pruning_in_evaluation(runs):
    """--prune-p 0 prunes nothing (plain EP's loss); --prune-p 0.5 drops pairs and devices, changes the
    loss, and says so in the result line and the JSON (settings and prune/* figures)."""
    unpruned, pruned = runs["evaluate_llep_result"], runs["evaluate_pruned_result"]
    assert unpruned["loss"] == pytest.approx(runs["worker"]["eval_loss"], abs=1e-6)
    assert unpruned["pruning"] == {"p": 0.0, "method": "devices", "cross_node_cost": 4.0, "ranks_per_node": None}
    moe = unpruned["moe"]
    assert moe["prune/dropped_pairs"] == 0 and moe["prune/tokens"] > 0
    assert moe["prune/devices_per_token"] == moe["prune/devices_per_token_unpruned"]
    assert "pruning p=0 (devices): devices/token" in runs["evaluate_llep"][-2]
    assert pruned["pruning"] == {"p": 0.5, "method": "devices", "cross_node_cost": 4.0, "ranks_per_node": 1}
    # the same windows unpruned (the worker, at plain EP)
    assert not pruned["llep"] and abs(pruned["loss"] - runs["worker"]["kept_placement_valid_loss"]) > 1e-4
    moe = pruned["moe"]
    assert moe["prune/dropped_pairs"] > 0 and 0 < moe["prune/dropped_pair_fraction"] < 1
    assert moe["prune/devices_per_token"] < moe["prune/devices_per_token_unpruned"]
    assert moe["prune/alltoall_bytes"] < moe["prune/alltoall_bytes_unpruned"]
    line = runs["evaluate_pruned"][-2]
    assert "plain EP | pruning p=0.5 (devices): devices/token " in line and "other-node devices/token" in line
    assert "pairs dropped" in line and "all-to-all " in line


def test_load_rebuilds_the_fine_tuned_model_in_its_placement(runs):
    lines = runs["evaluate_llep"]
    assert any("the experts stay in the CAP placement the checkpoint was saved in" in line for line in lines)
    assert any("gpt-oss-tiny" in line and "byte_tokenizer.json" in line for line in lines)  # the run's tokenizer
    assert runs["evaluate_llep_result"]["model"].endswith("iter_0000001 (iteration 1)")


# Bad input ------------------------------------------------------------------------------------


def _usage_error(capsys, parse, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    ([], "no model given: pass --load DIR"),
    (["--random-init", "--pretrained", "/"], "--pretrained and --random-init each give the model; choose one"),
    (["--hf-checkpoint", "/tmp"], "--hf-checkpoint needs --recipe"),
    (["--load", "/nonexistent/ckpt"], "--load: /nonexistent/ckpt is not a directory"),
    (["--random-init", "--data", "/nonexistent.jsonl"], "--data: /nonexistent.jsonl does not exist"),
    (["--random-init", "--seq-length", "0"], "--seq-length must be positive, got 0"),
    (["--random-init", "--max-tokens", "10"], "--max-tokens 10 is less than one window of --seq-length 64"),
    (["--random-init", "--llep-alpha", "nan"], "--llep-alpha"),
    (["--random-init", "--force-routing", "0.9"], "--force-routing expects F:H"),
    (["--random-init", "--output", "/proc/result.json"], "--output: "),
    (["--random-init", "--prune-p", "1.0"], "--prune-p (the score mass a token may drop) must be within [0, 1)"),
    (["--random-init", "--prune-p", "-0.1"], "--prune-p (the score mass a token may drop) must be within [0, 1)"),
    (["--random-init", "--prune-p", "0.2", "--prune-method", "tokens"], "argument --prune-method: invalid choice"),
    (["--random-init", "--prune-p", "0.2", "--cross-node-cost", "0.5"], "--cross-node-cost must be a finite number >= 1"),
    (["--random-init", "--cross-node-cost", "0.5"], "--cross-node-cost must be a finite number >= 1"),
    (["--random-init", "--prune-method", "experts"], "--prune-method refines routing pruning, which is off without "
                                                     "--prune-p"),
])
def test_evaluate_usage_errors_are_one_line(capsys, argv, message):
    from recipes import evaluate

    assert message in _usage_error(capsys, evaluate.parse_args, argv)


@pytest.mark.parametrize("argv, message", [
    (["--random-init"], "no prompt given: pass --prompt TEXT"),
    (["--prompt", "x"], "no model given"),
    (["--random-init", "--prompts", "/nonexistent.jsonl"], "--prompts: /nonexistent.jsonl does not exist"),
    (["--random-init", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be positive, got 0"),
    (["--random-init", "--prompt", "x", "--temperature", "-1"], "--temperature must be positive"),
    (["--random-init", "--prompt", "x", "--top-p", "1.5"], "--top-p must be at most 1, got 1.5"),
    (["--random-init", "--prompt", "x", "--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p exclude each other"),
    (["--pretrained", "/", "--recipe", "gpt-oss-tiny", "--prompt", "x"], "--recipe is not used with --pretrained"),
])
def test_generate_usage_errors_are_one_line(capsys, argv, message):
    from recipes import generate

    assert message in _usage_error(capsys, generate.parse_args, argv)


def test_generate_offers_pruning_and_finetune_does_not(capsys):
    """Pruning is refused in training: finetune.py has no such flags (argparse: unknown argument)."""
    from recipes import finetune, generate

    args = generate.parse_args(["--random-init", "--prompt", "x", "--prune-p", "0.3", "--prune-method", "experts"])
    assert (args.prune_p, args.prune_method) == (0.3, "experts")
    assert "--cross-node-cost" in _usage_error(capsys, generate.parse_args, ["--random-init", "--prompt", "x",
                                                                             "--cross-node-cost", "2"])
    assert "unrecognized arguments: --prune-p 0.5" in _usage_error(capsys, finetune.parse_args, ["--prune-p", "0.5"])
    with pytest.raises(SystemExit):
        finetune.parse_args(["--help"])
    assert "prune" not in capsys.readouterr().out.lower()


def test_bad_prompt_records_name_the_line(tmp_path):
    from recipes.runtime import sft_data
    from recipes import generate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    args = generate.parse_args(["--random-init", "--prompts", str(prompts)])
    with pytest.raises(sft_data.DataError, match=rf"^{prompts}:2: a prompt record needs either 'prompt'"):
        generate.read_prompts(args, sft_data.load_tokenizer(sft_data.DEFAULT_TOKENIZER))


@pytest.mark.parametrize("which", ["harmony", "deepseek-v3"])
def test_chat_prompts_are_transformers_generation_prompts(tmp_path, which):
    """A prompt or conversation rendered with the tokenizer's chat template and its generation prompt
    gives transformers' apply_chat_template(..., add_generation_prompt=True) ids (gpt-oss's and
    DeepSeek-V3's templates as tests/entry_points/test_sft_data.py models them); --no-chat-template gives BOS + text."""
    transformers = pytest.importorskip("transformers")
    from test_sft_data import _deepseek_dir, _harmony_dir

    from recipes.runtime import sft_data

    directory = {"harmony": _harmony_dir, "deepseek-v3": _deepseek_dir}[which](tmp_path)
    tokenizer = sft_data.load_tokenizer(str(directory))
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    question = [{"role": "user", "content": "What is 2+2?"}]
    expected = list(hf.apply_chat_template(question, tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"])
    assert sft_data.prompt_token_ids({"messages": question}, tokenizer, "x") == expected
    assert sft_data.prompt_token_ids({"prompt": "What is 2+2?"}, tokenizer, "x") == expected
    assert tokenizer.decode(expected) == hf.decode(expected)  # special tokens kept
    raw = sft_data.prompt_token_ids({"prompt": "What is 2+2?"}, tokenizer, "x", chat_template=False)
    assert raw == [tokenizer.bos_id] + tokenizer.encode("What is 2+2?")
