"""recipes/pretrain_gpt.py answers common mistakes in one line naming the flag or file (exit status 2,
printed once, by rank 0, no traceback), found before Megatron-LM starts the process group: a parallel
layout the processes cannot fill, experts EP cannot split, a sequence longer than the position
embeddings, truncated or corrupt .bin/.idx files, a --save (or --wandb-save-dir, ...) directory that
cannot be written or whose disk is too small, --save without --save-interval, a --load of a fine-tuning
checkpoint, token ids outside the vocabulary, and whatever else Megatron-LM's argument validation asserts.

The cases run the real entry point's ``main`` on 2 gloo ranks, all in one torchrun launch
(tests/workers/entry_cases_worker.py, Megatron-LM imported once); one also runs as its own job through
launch/torchrun.py. Needs megatron.training (megatron-core >= 0.17): skipped on 0.16."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from test_pretrain import ENTRY, MODEL, ROOT, _env, _free_port, needs_megatron_training  # noqa: E402

TRAINING = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "2",
            "--eval-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "258", "--split", "90,5,5"]
# one checkpoint of this model is terabytes: 2 layers of 4 h^2 attention weights at h = 2^18
HUGE = ["--hidden-size", str(2**18)]


def _immutable(path) -> bool:
    """Make ``path`` a directory nobody can write (chattr +i, else mode 0555); False where that cannot
    be done (root without chattr writes into 0555)."""
    path.mkdir()
    chattr = shutil.which("chattr")
    if chattr and subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode == 0:
        return True
    path.chmod(0o555)
    return os.geteuid() != 0


def _writable_again(path) -> None:
    chattr = shutil.which("chattr")
    if chattr:
        subprocess.run([chattr, "-i", str(path)], capture_output=True)
    path.chmod(0o755)


def _copy_dataset(prefix: str, to: str, cut_bin: int = 0, cut_idx: int = 0, idx_head: bytes = b"") -> str:
    for suffix, cut in ((".bin", cut_bin), (".idx", cut_idx)):
        shutil.copyfile(prefix + suffix, to + suffix)
        if cut:
            os.truncate(to + suffix, os.path.getsize(to + suffix) - cut)
    if idx_head:
        with open(to + ".idx", "r+b") as f:
            f.write(idx_head)
    return to


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    """One torchrun launch running every case; ``{name: (rank 0's result, rank 1's result)}``."""
    from recipes.runtime.checkpointing import LATEST_FILE, MANIFEST_FILE, MANIFEST_FORMAT
    from recipes.runtime.indexed_data import build_indexed_dataset

    out = tmp_path_factory.mktemp("pretrain_errors")
    data, _, _ = build_indexed_dataset(os.path.join(ROOT, "recipes", "data", "tiny_sft.jsonl"), str(out / "sft"))
    finetuned = out / "finetuned"  # what recipes/runtime/checkpointing.py writes
    (finetuned / "iter_0000002").mkdir(parents=True)
    (finetuned / "iter_0000002" / MANIFEST_FILE).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": {}}))
    (finetuned / LATEST_FILE).write_text("2")
    (out / "a_file").write_text("")
    read_only = _immutable(out / "read_only")
    good = [*MODEL, *TRAINING, "--data-cache-path", str(out / "cache")]
    cases = {
        "experts_not_split": [*good, "--data-path", data, "--num-experts", "7"],
        "ep_beyond_world": [*good, "--data-path", data, "--expert-model-parallel-size", "4"],
        "tp_pp_beyond_world": [*good, "--data-path", data, "--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2"],
        "seq_beyond_positions": [*good, "--data-path", data, "--seq-length", "64"],
        "bin_truncated": [*good, "--data-path", _copy_dataset(data, str(out / "cut_bin"), cut_bin=10)],
        "idx_truncated": [*good, "--data-path", _copy_dataset(data, str(out / "cut_idx"), cut_idx=20)],
        "idx_not_an_index": [*good, "--data-path", _copy_dataset(data, str(out / "bad_idx"), idx_head=b"NOTANIDX!")],
        "save_file": [*good, "--data-path", data, "--save", str(out / "a_file"), "--save-interval", "2"],
        "wandb_dir_file": [*good, "--data-path", data, "--wandb-save-dir", str(out / "a_file")],
        "save_disk_too_small": [*good, *HUGE, "--data-path", data, "--save", str(out / "huge"), "--save-interval", "2"],
        "save_without_interval": [*good, "--data-path", data, "--save", str(out / "ckpt")],
        "load_finetuned": [*good, "--data-path", data, "--load", str(finetuned)],
        "vocab_too_small": [*good, "--data-path", data, "--vocab-size", "100"],
        "megatron_bare_assertion": [*good, "--data-path", data, "--lr", "0.1", "--min-lr", "1"],
        "megatron_assertion": [*good, "--data-path", data, "--fp16-lm-cross-entropy"],
    }
    if read_only:
        cases["save_read_only"] = [*good, "--data-path", data, "--save", str(out / "read_only"), "--save-interval", "2"]
    spec = {"cases": {name: {"entry": "recipes.pretrain_gpt", "argv": argv} for name, argv in cases.items()}}
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
           os.path.join(ROOT, "tests", "workers", "entry_cases_worker.py"), str(out), str(out / "spec.json")]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    finally:
        _writable_again(out / "read_only")
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    if (out / "skip.txt").exists():
        pytest.skip((out / "skip.txt").read_text())
    results = {name: tuple(json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1))
               for name in cases}
    return {"results": results, "out": out, "data": data, "finetuned": str(finetuned)}


def _null_tokenizer_vocabulary(vocab_size: int) -> int:
    """The vocabulary of Megatron's NullTokenizer for ``--vocab-size`` (0.17 adds an end-of-document id)."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(vocab_size).vocab_size


def _one_line(refused: dict, case: str) -> str:
    """The case's error line, after checking: exit status 2, that line alone on rank 0's stderr and no
    traceback; rank 1 printed nothing and waited for rank 0's report (the launcher ends it then)."""
    if case not in refused["results"]:
        pytest.skip(f"{case}: not set up on this machine")
    rank0, rank1 = refused["results"][case]
    assert rank0["code"] == 2, (case, rank0)
    errors = [line for line in rank0["stderr"].splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("[pretrain_gpt] error: "), (case, rank0["stderr"][-3000:])
    for result in (rank0, rank1):
        assert "Traceback" not in result["stderr"], (case, result["stderr"][-3000:])
    assert rank1["ended_by_launcher"] and "error:" not in rank1["stderr"], (case, rank1)
    return errors[0][len("[pretrain_gpt] error: "):]


@needs_megatron_training
def test_a_layout_the_processes_cannot_fill_and_experts_ep_cannot_split_are_named(refused):
    assert _one_line(refused, "experts_not_split").startswith(
        "--num-experts 7 is not a multiple of --expert-model-parallel-size 2: ")
    assert _one_line(refused, "ep_beyond_world") == (
        "--expert-model-parallel-size 4 needs a multiple of 4 processes, but 2 were launched: launch a multiple of 4 "
        "processes or lower it")
    assert _one_line(refused, "tp_pp_beyond_world").startswith(
        "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 needs a multiple of 4 processes, but 2 "
        "were launched")


@needs_megatron_training
def test_a_sequence_longer_than_the_position_embeddings_is_named(refused):
    assert _one_line(refused, "seq_beyond_positions").startswith(
        "--seq-length 64 exceeds --max-position-embeddings 32, the longest sequence the model is built for: raise "
        "--max-position-embeddings to at least 64")


@needs_megatron_training
def test_truncated_or_corrupt_data_files_are_named(refused):
    out = refused["out"]
    size = os.path.getsize(refused["data"] + ".bin")
    assert _one_line(refused, "bin_truncated").startswith(
        f"data prefix {out}/cut_bin: {out}/cut_bin.bin has {size - 10:,} bytes, but {out}/cut_bin.idx indexes "
        f"{size:,}: the .bin is truncated")
    idx = os.path.getsize(refused["data"] + ".idx")
    assert _one_line(refused, "idx_truncated").startswith(
        f"{out}/cut_idx.idx has {idx - 20:,} bytes, but its header (240 sequences, 241 documents) needs {idx:,}: ")
    assert _one_line(refused, "idx_not_an_index").startswith(
        f"{out}/bad_idx.idx is not a Megatron indexed-dataset index (bad header)")


@needs_megatron_training
def test_a_save_directory_that_cannot_be_written_or_is_on_a_too_small_disk_is_refused(refused):
    out = refused["out"]
    assert _one_line(refused, "save_file") == (
        f"--save {out}/a_file: {out}/a_file is a file, not a directory; give a directory this run can write")
    assert _one_line(refused, "save_read_only").startswith(f"--save {out}/read_only: cannot write to {out}/read_only (")
    # parameters counted by hand: per layer 4 h^2 attention, 2 LayerNorms (4 h), router (8 h), 8 experts of
    # 3 x 24 x h (gated fc1, fc2); a vocabulary x h embedding (tied), 32 x h learned positions, a final LayerNorm
    h = 2**18
    parameters = 2 * (4 * h * h + 4 * h + 8 * h + 8 * 72 * h) + _null_tokenizer_vocabulary(258) * h + 32 * h + 2 * h
    needed = parameters * (4 + 8)  # fp32 weights and Adam's two moments
    if shutil.disk_usage(out).free >= needed:
        pytest.skip("this disk could hold the huge checkpoint")
    line = _one_line(refused, "save_disk_too_small")
    assert line.startswith(f"--save {out}/huge: "), line
    assert (f" GiB free on its disk, but one checkpoint of this model ({parameters:,} parameters) needs at least "
            f"{needed / 2**30:,.1f} GiB (weights and optimizer state") in line, line
    assert not os.path.exists(out / "huge" / "iter_0000002")


@needs_megatron_training
def test_an_output_directory_that_is_a_file_is_named(refused):
    out = refused["out"]
    assert _one_line(refused, "wandb_dir_file") == (
        f"--wandb-save-dir {out}/a_file: {out}/a_file is a file, not a directory; give a directory this run can write")


@needs_megatron_training
def test_save_without_save_interval_names_both_flags(refused):
    assert _one_line(refused, "save_without_interval") == (
        f"--save {refused['out']}/ckpt needs --save-interval N, the iterations between checkpoints (Megatron-LM also "
        "saves when training ends): e.g. --save-interval 1000")


@needs_megatron_training
def test_loading_a_finetuning_checkpoint_says_what_reads_it(refused):
    finetuned = refused["finetuned"]
    assert _one_line(refused, "load_finetuned") == (
        f"--load {finetuned}: {finetuned}/iter_0000002 is a checkpoint of recipes/finetune.py, which Megatron-LM's "
        f"loop cannot read: continue it with recipes/finetune.py --load {finetuned}, or evaluate it with "
        f"recipes/evaluate.py --load {finetuned}")


@needs_megatron_training
def test_token_ids_outside_the_vocabulary_are_named(refused):
    data = refused["data"]
    assert _one_line(refused, "vocab_too_small").startswith(  # 257: the byte tokenizer's end of document
        f"data prefix {data}: token id 257 in {data}.bin is outside the vocabulary of "
        f"{_null_tokenizer_vocabulary(100)} ids (--tokenizer-type NullTokenizer --vocab-size 100): ")


@needs_megatron_training
def test_other_megatron_lm_assertions_are_one_line(refused):
    bare = _one_line(refused, "megatron_bare_assertion")  # Megatron-LM asserts it without a message
    assert bare.startswith("Megatron-LM refused the arguments: assert args.min_lr <= args.lr (arguments.py:"), bare
    assert _one_line(refused, "megatron_assertion") == (
        "Megatron-LM refused the arguments: lm cross entropy in fp16 only support in fp16 mode.")


@needs_megatron_training
def test_a_refusal_ends_the_job_in_one_line_with_status_2(tmp_path):
    """End to end, through launch/torchrun.py: the job's status is rank 0's, one line, no traceback."""
    cmd = [sys.executable, os.path.join(ROOT, "launch", "torchrun.py"), "--nproc_per_node", "2", "--master_port",
           _free_port(), ENTRY, *MODEL, *TRAINING, "--mock-data", "--num-experts", "6",
           "--expert-model-parallel-size", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["[pretrain_gpt] error: --num-experts 6 is not a multiple of --expert-model-parallel-size 4: "
                      "every expert-parallel rank holds as many experts as the others; use a multiple of 4 experts "
                      "or an --expert-model-parallel-size that divides 6"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_index_check_finds_the_bin_size_and_the_token_scan_samples_large_files(tmp_path):
    """Megatron-Core's own builder writes the files; the largest id is found whole or in a sample that
    includes the first and last windows."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from recipes.runtime.pretrain_checks import max_token_id, read_index

    prefix = str(tmp_path / "ids")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in (np.arange(1000), np.full(3000, 7), np.array([5, 9000])):
        builder.add_document(document.astype(np.int64), [document.size])
    builder.finalize(prefix + ".idx")
    assert read_index(prefix) == (np.dtype(np.uint16), 2 * 4002)
    assert os.path.getsize(prefix + ".bin") == 2 * 4002
    assert max_token_id(prefix + ".bin", np.dtype(np.uint16), budget=2**20) == (9000, True)
    assert max_token_id(prefix + ".bin", np.dtype(np.uint16), budget=128) == (9000, False)  # the last window
