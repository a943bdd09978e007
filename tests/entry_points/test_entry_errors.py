"""The entry points fail cleanly: bad data, tokenizers, numeric flags, save targets, recipes too big for
the machine and placement CLI input give one line naming the file/line/field/flag (usage errors: exit 2,
printed once under torchrun, no rank traceback); and they say what they do (progress lines, nothing to
resume, nothing left to do, no loss tokens, placement applied, LLEP idle at EP=1, a closing summary)
without the CPU warning spam. Bad inputs are small files the tests write; expectations are written by
hand (published parameter counts, byte offsets, models Megatron builds)."""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch

from megatron_llep.config import LLEPConfig, LLEPConfigError
from megatron_llep.placement.cli import main as placement_main
from megatron_llep.placement.trace import synthetic_trace
from megatron_llep.testing.distributed import run_distributed
from recipes import finetune
from recipes.runtime import entry_point, model_building
from recipes.runtime.sft_data import ByteTokenizer, DataError, load_tokenizer, read_sft_jsonl
from recipes.runtime.memory import GIB, estimate_training_memory, memory_shortfall, stage_parameters
from recipes.models import RECIPES, deepseek_v3

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "recipes", "finetune.py")


def _one_line_error(call, *args, match: str) -> str:
    with pytest.raises(DataError) as err:
        call(*args)
    message = str(err.value)
    assert "\n" not in message and message.startswith(match), message
    return message


# Data ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content, kind", [(5, "a number (5)"), (None, "null"), (True, "a boolean")])
def test_non_string_message_content_names_file_line_and_field(tmp_path, content, kind):
    path = tmp_path / "sft.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    _one_line_error(read_sft_jsonl, str(path), ByteTokenizer(),
                    match=f"{path}:2: messages[1].content must be a string, got {kind}")


def test_non_utf8_bytes_are_named_by_line_and_column(tmp_path):
    path = tmp_path / "sft.jsonl"
    lines = [b'{"text": "fine"}', b"", b'{"text": "caf\xe9"}']  # latin-1 e-acute on line 3
    path.write_bytes(b"\n".join(lines) + b"\n")
    column = lines[2].index(b"\xe9") + 1
    message = _one_line_error(read_sft_jsonl, str(path), ByteTokenizer(), match=f"{path}:3: byte 0xe9 at column {column} ")
    assert "UTF-8" in message
    # a UTF-8 byte-order mark (Windows editors) is not an error
    path.write_bytes(b"\xef\xbb\xbf" + '{"text": "café"}\n'.encode())
    (ids, _), = read_sft_jsonl(str(path), ByteTokenizer())
    assert bytes(ids[1:-1].tolist()).decode() == "café"


def test_half_a_surrogate_pair_is_named_by_line(tmp_path):
    """JSON lets ``\\udcff`` through, but no tokenizer or output file takes half a UTF-16 pair; a whole pair is text."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "\\ud83d\\ude00 fine"}\n{"text": "caf\\udce9"}\n')
    _one_line_error(read_sft_jsonl, str(path), ByteTokenizer(),
                    match=f"{path}:2: \\udce9 is half of a UTF-16 surrogate pair, not a character; write the character")


def test_data_directory_is_called_a_directory(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    message = _one_line_error(read_sft_jsonl, str(tmp_path), ByteTokenizer(), match=f"data {tmp_path} is a directory")
    assert "not found" not in message and "train.jsonl" in message
    with pytest.raises(SystemExit) as exit_info:
        finetune.parse_args(["--data", str(tmp_path)])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", ": expected the tokenizer as a JSON object, got an array"),
        ('{"model": 5}', ": 'model' must be an object"),
        ('{"model": {"type": "BPE", "vocab": 3, "merges": []}}', ": not a valid Hugging Face tokenizer.json ("),
        ('{"model": {"type": "Nonsense"}}', ": not a valid Hugging Face tokenizer.json ("),
        ('{"type": "bytes", "special_tokens": {"bos": "x"}}', ": 'special_tokens.bos' must be an integer >= 256"),
        ('{"type": "bytes", "special_tokens": [256]}', ": 'special_tokens' must be an object"),
        ('{"type": "bytes", "vocab_size": 257}', ": BOS 256 and EOS 257 must be distinct ids below 'vocab_size' 257"),
        ('{"model": ', ":1: not valid JSON"),
    ],
)
def test_malformed_tokenizer_files_are_one_line_naming_the_file(tmp_path, text, message):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text(text)
    _one_line_error(load_tokenizer, str(path), match=f"{path}{message}")
    _one_line_error(load_tokenizer, str(tmp_path), match=f"{path}{message}")  # the directory form


def test_tokenizer_file_with_non_utf8_bytes_and_directory_without_one(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b'{"type": "bytes",\n "about": "\xff"}')
    _one_line_error(load_tokenizer, str(path), match=f"{path}:2: byte 0xff at column 12 ")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(load_tokenizer, str(empty), match=f"tokenizer not found: the directory {empty} has no tokenizer.json")


# Knobs -----------------------------------------------------------------------------------------


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        finetune.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.count("usage:") == 1 and len([line for line in err.splitlines() if "error:" in line]) == 1, err
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--llep-alpha", "0"], "--llep-alpha must be a finite number > 0 (capacity factor), got 0.0"),
        (["--llep-min-chunk-tokens", "-4"], "--llep-min-chunk-tokens (m) must be an integer >= 0, got -4"),
        (["--llep-imbalance-threshold", "0.5"], "--llep-imbalance-threshold (lambda) must be >= 1.0"),
        (["--llep-ranks-per-node", "0"], "--llep-ranks-per-node must be a positive integer"),
        (["--llep-max-tokens-per-rank", "0"], "--llep-max-tokens-per-rank (the token-expert rows an EP rank may "
                                              "receive per layer step) must be a positive integer"),
        (["--llep-max-kept-weight-bytes", "-1"], "--llep-max-kept-weight-bytes (the bytes of borrowed experts a rank "
                                                 "keeps for the step) must be an integer >= 0"),
        (["--force-routing", "0.9:99"], "--force-routing F:H: H = 99 hot experts, but gpt-oss-tiny has 8"),
        (["--recipe", "deepseek-v3-tiny", "--force-routing", "0.9:9"], "H = 9 hot experts, but deepseek-v3-tiny has 8"),
        (["--lr", "-1"], "--lr must be positive, got -1.0"),
        (["--lr", "nan"], "--lr must be positive, got nan"),
        (["--min-lr", "0.01"], "--min-lr 0.01 exceeds --lr 0.001"),
        (["--seed", str(2**32)], "--seed must be below 2**32"),
    ],
)
def test_bad_knobs_are_argparse_errors_naming_the_flag(capsys, argv, message):
    assert message in _usage_error(capsys, argv)


def _numeric_flags() -> list[tuple[str, type]]:
    """Every int/float flag finetune.py defines (recorded while its parser is built)."""
    recorded = []
    add_argument = argparse._ActionsContainer.add_argument

    def record(container, *names, **kwargs):
        if kwargs.get("type") in (int, float):
            recorded.append((names[0], kwargs["type"]))
        return add_argument(container, *names, **kwargs)

    with mock.patch.object(argparse._ActionsContainer, "add_argument", record):
        finetune.parse_args([])
    return recorded


def test_every_numeric_flag_has_a_domain(capsys):
    flags = _numeric_flags()
    assert len(flags) >= 20 and ("--lr", float) in flags and ("--llep-alpha", float) in flags
    for flag, kind in flags:
        for bad in ("-1", "nan") if kind is float else ("-1",):
            line = _usage_error(capsys, [flag, bad])
            assert flag in line, (flag, bad, line)


def test_llep_config_errors_name_the_knob_or_the_flag():
    with pytest.raises(LLEPConfigError) as err:
        LLEPConfig(imbalance_threshold=0.5)
    assert err.value.knob == "imbalance_threshold" and str(err.value).startswith("LLEPConfig.imbalance_threshold")
    assert err.value.for_flag("--llep-imbalance-threshold").startswith("--llep-imbalance-threshold (lambda) must be")

def test_every_entry_point_and_the_megatron_lm_plugin_offer_every_llep_knob_under_one_name():
    from megatron_llep.integrations.flags import flag
    from megatron_llep.integrations.megatron_lm import add_llep_args
    from recipes import cap_pipeline, evaluate, generate

    knobs = {flag(field.name) for field in dataclasses.fields(LLEPConfig) if field.name != "pruning"}
    plugin = add_llep_args(argparse.ArgumentParser())
    parsers = {"megatron-lm plugin": plugin}

    class Built(Exception):
        """The entry point's parser, caught where it would parse."""

    def catch(parser, *args, **kwargs):
        raise Built(parser)

    for module in (finetune, evaluate, generate, cap_pipeline):
        with mock.patch.object(argparse.ArgumentParser, "parse_args", catch), pytest.raises(Built) as built:
            module.parse_args([])
        parsers[module.__name__] = built.value.args[0]
    for name, parser in parsers.items():
        offered = {option for action in parser._actions for option in action.option_strings}
        assert knobs | {"--llep", "--no-llep", "--llep-placement"} <= offered, (name, knobs - offered)
        assert not {"--placement", "--ranks-per-node"} & offered, name
    # a placement applies with or without LLEP: not one of the knobs a plain-EP run says it ignores
    from megatron_llep.integrations.flags import tuning_flags_given

    args = plugin.parse_args(["--llep-placement", "p.json", "--llep-alpha", "2", "--no-llep-cost-aware"])
    assert tuning_flags_given(plugin, args) == ["--llep-alpha", "--no-llep-cost-aware"]


def test_the_row_budget_flag_reaches_the_llep_config():
    from recipes.runtime.model_building import llep_config

    assert llep_config(finetune.parse_args([]), on_gpu=False).max_tokens_per_rank is None
    args = finetune.parse_args(["--llep-max-tokens-per-rank", "512"])
    assert llep_config(args, on_gpu=False).max_tokens_per_rank == 512


def test_only_rank_zero_reports_a_usage_error_at_once(monkeypatch):
    waits = []
    monkeypatch.setattr(finetune.time, "sleep", waits.append)
    for rank, expected in (("0", []), ("1", [entry_point.PEER_ERROR_GRACE_S])):
        waits.clear()
        monkeypatch.setenv("RANK", rank)
        entry_point.wait_for_rank_zero_report()
        assert waits == expected
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_PROCID", "3")  # srun without torchrun
    assert entry_point.launch_rank() == 3


def _torchrun(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", SCRIPT, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_usage_error_under_torchrun_is_printed_once_without_rank_tracebacks():
    proc = _torchrun("--lr", "-1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("usage: finetune.py") == 1 and out.count("error: --lr must be positive, got -1.0") == 1, out[-3000:]
    assert f'File "{SCRIPT}"' not in proc.stderr  # no Python traceback from a rank (torchrun's own summary remains)
    assert "exitcode  : 2" in proc.stderr  # rank 0 is the root cause, with the usage exit status


def test_a_row_budget_no_plan_can_meet_ends_the_run_in_one_line():
    """Every EP rank raises the same InfeasibleBudgetError from the global counts: one line from rank 0
    naming the flag and the numbers, exit 2, no rank traceback (tests/planning/test_budget.py checks the planner)."""
    proc = _torchrun("--train-iters", "1", "--llep-max-tokens-per-rank", "8")
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.startswith("[finetune] error:")]
    assert len(lines) == 1 and "--llep-max-tokens-per-rank" in lines[0] and "row budget" in lines[0], out[-3000:]
    assert f'File "{SCRIPT}"' not in out and "[rank" not in out, out[-3000:]  # no rank traceback (torchrun's remains)
    assert "exitcode  : 2" in proc.stderr, out[-3000:]


# Save target -----------------------------------------------------------------------------------


def _unwritable_directory(path, how: str):
    """A directory writes to fail in: read-only (mode 0555; not for root) or immutable (chattr +i)."""
    path.mkdir()
    if how == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        path.chmod(0o555)
        return lambda: path.chmod(0o755)
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("cannot make an immutable directory here (chattr +i)")
    return lambda: subprocess.run([chattr, "-i", str(path)], check=True)


@pytest.mark.parametrize("how", ["read-only", "immutable"])
def test_unwritable_save_directory_is_refused_at_start_up(tmp_path, capsys, how):
    directory = tmp_path / "ckpt"
    restore = _unwritable_directory(directory, how)
    try:
        with open(directory / "probe", "w"):
            pass
        writable = True
    except OSError:
        writable = False
    try:
        assert not writable  # the fixture really is unwritable
        line = _usage_error(capsys, ["--save", str(directory)])
        assert f"--save: cannot write to {directory}" in line
        line = _usage_error(capsys, ["--save", str(directory / "new" / "deeper")])  # created later, but not here
        assert f"cannot write to {directory}" in line
        line = _usage_error(capsys, ["--record-routing-trace", str(directory)])
        assert "--record-routing-trace: cannot write" in line
    finally:
        restore()


def test_save_target_that_is_a_file_is_refused_and_first_resumable_run_parses(tmp_path, capsys):
    target = tmp_path / "ckpt"
    target.write_text("")
    assert f"--save: {target} is a file, not a directory" in _usage_error(capsys, ["--save", str(target)])
    assert f"is a file, so {target}/sub cannot be created" in _usage_error(capsys, ["--save", str(target / "sub")])
    fresh = str(tmp_path / "fresh")
    args = finetune.parse_args(["--save", fresh, "--load", fresh])  # nothing there yet: the first run
    assert args.load == args.save == fresh and not os.path.exists(fresh)
    assert "--load: " in _usage_error(capsys, ["--load", fresh])  # without --save there is nothing to start


# A recipe too big for the machine --------------------------------------------------------------


def _total(recipe) -> int:
    stage, = stage_parameters(recipe, tp=1, pp=1, ep=1)
    return stage.dense + stage.expert


def test_parameter_estimate_matches_published_model_sizes():
    # OpenAI's gpt-oss model card: 20.91 B and 116.83 B parameters; DeepSeek-V3 report: 671 B (main model)
    assert _total(RECIPES["gpt-oss-20b"](cpu=True)) / 1e9 == pytest.approx(20.91, abs=0.005)
    assert _total(RECIPES["gpt-oss-120b"](cpu=True)) / 1e9 == pytest.approx(116.83, abs=0.005)
    assert _total(deepseek_v3("671b", cpu=True, architecture={"mtp_num_layers": 0})) / 1e9 == pytest.approx(671.0, abs=0.5)


def _built_parameters(rank: int, world: int, layouts: list) -> list:
    """(recipe, PP, EP, pipeline stage, dense, expert) parameters of the GPTModel Megatron builds on this rank."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    counts = []
    for name, pp, ep in layouts:
        parallel_state.initialize_model_parallel(1, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        model_parallel_cuda_manual_seed(0)
        recipe = RECIPES[name](ep_size=ep, pp_size=pp, dtype=torch.float32, cpu=True)
        spec = recipe.layer_spec()
        model = GPTModel(recipe.config, spec, mtp_block_spec=recipe.mtp_spec(spec),
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage(), **recipe.gpt_model_kwargs())
        expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)  # routed, not shared
        dense = sum(p.numel() for p in model.parameters()) - expert
        counts.append((name, pp, ep, parallel_state.get_pipeline_model_parallel_rank(), dense, expert))
        parallel_state.destroy_model_parallel()
    return counts


def test_parameter_estimate_per_rank_matches_the_built_models():
    layouts = [("gpt-oss-tiny", 1, 2), ("deepseek-v3-tiny", 2, 1)]
    built = run_distributed(_built_parameters, 2, layouts, timeout_s=300)
    for rank_counts in built:
        for name, pp, ep, stage, dense, expert in rank_counts:
            estimate = stage_parameters(RECIPES[name](cpu=True), tp=1, pp=pp, ep=ep)[stage]
            assert (estimate.dense, estimate.expert) == (dense, expert), (name, pp, ep, stage)
    assert built[0][1][4:] != built[1][1][4:]  # PP stages differ (embedding first, output layer and MTP last)


def test_memory_estimate_counts_parameters_gradients_and_sharded_adam():
    recipe = RECIPES["gpt-oss-20b"](cpu=True, ep_size=2)
    fp32 = estimate_training_memory(recipe, tp=1, pp=1, ep=2, dp=2, dtype=torch.float32)
    stage, = stage_parameters(recipe, tp=1, pp=1, ep=2)
    assert fp32.parameters == stage.dense + stage.expert
    assert fp32.param_bytes == fp32.grad_bytes == 4 * fp32.parameters
    # Adam moments (8 bytes) of dense parameters sharded over DP 2; experts over expert-DP 2 * 1 / 2 = 1
    assert fp32.optimizer_bytes == stage.dense * 8 // 2 + stage.expert * 8
    bf16 = estimate_training_memory(recipe, tp=1, pp=1, ep=2, dp=2, dtype=torch.bfloat16)
    assert bf16.param_bytes == 2 * bf16.parameters and bf16.optimizer_bytes == stage.dense * 12 // 2 + stage.expert * 12
    message = memory_shortfall("gpt-oss-20b", fp32, 24 * GIB, 2, "available in host memory")
    assert message.startswith(f"gpt-oss-20b needs about {fp32.total_bytes / GIB:,.1f} GiB per rank")
    assert f"x 2 ranks on this node = {2 * fp32.total_bytes / GIB:,.1f} GiB, but 24.0 GiB is available" in message
    assert memory_shortfall("gpt-oss-20b", fp32, 2 * fp32.total_bytes, 2, "available") is None


def test_recipe_too_big_is_refused_before_building_with_the_numbers():
    proc = _torchrun("--recipe", "deepseek-v3")  # ~5 TiB per rank at EP=2: more than any host has
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[finetune] error:")]
    assert len(lines) == 1 and "deepseek-v3-671b needs about" in lines[0] and "--no-memory-check" in lines[0], proc.stderr[-3000:]
    assert "building" not in proc.stdout and f'File "{SCRIPT}"' not in proc.stderr


# Feedback --------------------------------------------------------------------------------------


def test_first_resumable_run_says_what_it_does_and_the_rerun_has_nothing_left(tmp_path):
    """A first ``--save X --load X`` run (X absent) starts from scratch and says so; the progress lines,
    the applied placement, LLEP idle at EP=1 and batches without loss tokens (a prompt longer than the
    sequence) are reported, the run ends with a summary and no warning spam; the same command again has
    nothing left to do."""
    from megatron_llep.placement import ExpertPlacement

    data = tmp_path / "long_prompt.jsonl"
    data.write_text(json.dumps({"prompt": "p" * 400, "response": "r"}) + "\n")
    placement = str(tmp_path / "placement.json")  # within each of the 2 routing groups of 4
    ExpertPlacement(8, 1, {n: [1, 0, 3, 2, 5, 4, 7, 6] for n in (2, 3, 4, 5)}).save(placement)
    ckpt = str(tmp_path / "ckpt")
    command = ["--recipe", "deepseek-v3-tiny", "--expert-model-parallel-size", "1", "--seq-length", "32",
               "--train-iters", "1", "--data", str(data), "--llep-placement", placement, "--save", ckpt, "--load", ckpt]
    first = _torchrun(*command)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    for expected in (f"[finetune] reading {data}", f"nothing to resume in {ckpt} yet: starting from scratch",
                     "[finetune] building deepseek-v3-tiny: about", f"applied the expert placement {placement} to MoE layer(s) 2, 3, 4, 5",
                     "LLEP has no work at EP=1", "step 1: the global batch has no loss tokens", f"saving iteration 1 to {ckpt}",
                     "[finetune] done: 1 step(s) this run, now at iteration 1/1, 128 tokens in"):
        assert out.count(expected) == 1, (expected, out)
    assert out.index("reading") < out.index("building") < out.index("step 1/1") < out.index("done:")
    assert "Warning" not in first.stderr and "warn" not in first.stderr, first.stderr[-3000:]

    again = _torchrun(*command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to do: the checkpoint is at iteration 1 and --train-iters is 1" in again.stdout
    assert "done: 0 step(s) this run" in again.stdout and f"nothing new saved in {ckpt}" in again.stdout
    assert "Warning" not in again.stderr, again.stderr[-3000:]


# Placement command line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "{trace}", "--ep-size", "0"], "argument --ep-size: must be >= 1, got 0"),
        (["plan", "{trace}", "--ep-size", "4", "--lambda", "nan"], "argument --lambda: must be a finite number within [0, 1]"),
        (["plan", "{trace}", "--ep-size", "4", "--cross-node-cost", "0.5"], "argument --cross-node-cost: must be a finite number >= 1"),
        (["plan", "{trace}", "--ep-size", "4", "--spectrum-steps", "-1"], "argument --spectrum-steps: must be >= 0"),
        (["plan", "{trace}", "--ep-size", "4", "--routing-groups", "0"], "argument --routing-groups: must be >= 1"),
        (["plan", "{trace}", "--ep-size", "4", "--max-evaluations", "0"], "argument --max-evaluations: must be >= 1"),
        (["plan", "{trace}", "--ep-size", "4", "--gpus-per-node", "x"], "argument --gpus-per-node: expected an integer, got 'x'"),
        (["plan", "{missing}", "--ep-size", "4"], "{missing}: no such file"),
        (["plan", "{dir}", "--ep-size", "4"], "{dir} is a directory; give the trace files"),
        (["plan", "{truncated}", "--ep-size", "4"], "{truncated}: not a routing trace file (not an .npz archive"),
        (["plan", "{trace}", "--ep-size", "4", "--layers", "7"], "the trace has no MoE layer 7"),
        (["plan", "{trace}", "--ep-size", "4", "-o", "{dir}"], "--out: {dir} is a directory; give a file name"),
        (["plan", "{trace}", "--ep-size", "4", "-o", "{trace}/p.json"], "{trace} is a file, so {trace}/p.json cannot be created"),
        (["synthetic", "{dir}/s.npz", "--experts", "16", "--topk", "20", "--clusters", "4"], "--topk 20 exceeds --experts 16"),
        (["synthetic", "{dir}/s.npz", "--experts", "16", "--topk", "2", "--clusters", "3"], "--clusters 3 must divide --experts 16"),
        (["synthetic", "{dir}/s.npz", "--experts", "16", "--topk", "2", "--clusters", "4", "--affinity", "2"],
         "argument --affinity: must be a finite number within [0, 1], got 2"),
        (["synthetic", "{dir}/s.npz", "--experts", "16", "--topk", "2", "--clusters", "4", "--tokens", "-5"],
         "argument --tokens: must be >= 1, got -5"),
    ],
)
def test_placement_cli_bad_numbers_and_files_are_one_line_usage_errors(tmp_path, capsys, args, message):
    trace, _ = synthetic_trace(200, 16, 2, 4, 0.8, seed=1)
    files = {"trace": str(tmp_path / "t.npz"), "missing": str(tmp_path / "none.npz"), "dir": str(tmp_path),
             "truncated": str(tmp_path / "cut.npz")}
    trace.save(files["trace"])
    with open(files["trace"], "rb") as f, open(files["truncated"], "wb") as cut:
        cut.write(f.read()[:100])
    argv = [a.format(**files) for a in args]
    if argv[0] == "plan" and "-o" not in argv:
        argv += ["-o", str(tmp_path / "p.json")]
    with pytest.raises(SystemExit) as exit_info:
        placement_main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert message.format(**files) in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    assert not os.path.exists(tmp_path / "p.json")


# --pretrained (a Megatron-LM checkpoint to fine-tune from) -------------------------------------


def test_pretrained_usage_errors_name_the_flag(tmp_path, capsys):
    assert "--pretrained: " in _usage_error(capsys, ["--pretrained", str(tmp_path / "missing")])
    (tmp_path / "hf").mkdir()
    assert "--pretrained and --hf-checkpoint both give the starting weights" in _usage_error(
        capsys, ["--pretrained", str(tmp_path), "--hf-checkpoint", str(tmp_path / "hf")])


def test_pretrained_directory_that_is_no_megatron_lm_checkpoint_is_one_line(tmp_path):
    from recipes.runtime import pretrained

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(pretrained.PretrainedError, match=r"holds 'release', not an iteration number$"):
        pretrained.checkpoint_directory(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(pretrained.PretrainedError) as err:
        pretrained.checkpoint_directory(str(tmp_path))
    assert "no Megatron-LM torch_dist checkpoint" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "iter_0000007").mkdir()
    (tmp_path / "iter_0000007" / "metadata.json").write_text("{}")
    assert pretrained.checkpoint_directory(str(tmp_path)) == str(tmp_path / "iter_0000007")


def test_aux_loss_coefficient_applies_to_a_model_with_one_balancing_loss():
    config = deepseek_v3("tiny", cpu=True, dtype=torch.float32).config  # seq_aux_loss
    model_building.set_aux_loss_coeff(config, 0.0, "deepseek-v3-tiny")
    assert config.moe_aux_loss_coeff == 0.0
    gpt_oss = RECIPES["gpt-oss-tiny"]().config  # no balancing loss: only 0 makes sense
    model_building.set_aux_loss_coeff(gpt_oss, 0.0, "gpt-oss-tiny")
    with pytest.raises(finetune.ConfigError, match=r"^--moe-aux-loss-coeff 0.01: gpt-oss-tiny's router has "
                                                    r"load-balancing loss 'none'"):
        model_building.set_aux_loss_coeff(gpt_oss, 0.01, "gpt-oss-tiny")


def test_make_indexed_dataset_refuses_a_directory_prefix_and_leaves_nothing_when_the_write_is_short(
        tmp_path, capsys, monkeypatch):
    """A directory as --output-prefix is one line; a write cut short (a full disk can truncate it without
    an error) is found by reading the dataset back: one line naming the file, and no .bin/.idx left."""
    from megatron.core.datasets import indexed_dataset

    from recipes import make_indexed_dataset

    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "hello world"}\n{"text": "a second document"}\n')
    with pytest.raises(SystemExit) as exit_info:
        make_indexed_dataset.main([str(data), "--output-prefix", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"--output-prefix {tmp_path} is a directory" in capsys.readouterr().err
    finalize = indexed_dataset.IndexedDatasetBuilder.finalize

    def finalize_then_lose_the_tail(self, idx_path):
        finalize(self, idx_path)
        bin_path = idx_path[:-4] + ".bin"
        os.truncate(bin_path, os.path.getsize(bin_path) - 3)

    monkeypatch.setattr(indexed_dataset.IndexedDatasetBuilder, "finalize", finalize_then_lose_the_tail)
    with pytest.raises(SystemExit) as exit_info:
        make_indexed_dataset.main([str(data), "--output-prefix", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out_text_document.bin: the written dataset is incomplete" in err[0], err
    assert not list(tmp_path.glob("out_text_document*"))
    monkeypatch.setattr(indexed_dataset.IndexedDatasetBuilder, "finalize", finalize)
    make_indexed_dataset.main([str(data), "--output-prefix", str(tmp_path / "out")])
    assert "2 documents" in capsys.readouterr().out
