"""Nothing a run writes is lost, and bad input or a fault ends it in one line.

* The one writer (megatron_llep/writable.py) against a full disk, real (a filled tmpfs in a user and
  mount namespace) and injected (ENOSPC at write and fsync time): the previous file stays whole, no
  partial file is left, and the error is one line naming the file, the flag and the bytes needed;
  the negative control, a direct write under the same fault, loses the previous file.
* Every entry point's outputs on a full disk, and the bad inputs each entry point must name, through
  launch/torchrun.py on 2 gloo ranks in one launch (tests/workers/entry_cases_worker.py runs the entry points'
  ``main`` one case after another): --output of generate.py and evaluate.py, routing traces,
  cap_pipeline.py's placement and kept traces, the save lock, Hugging Face exports, corpora, indexed
  datasets, placement files, and a Megatron-LM checkpoint save (megatron-core >= 0.17), each ending
  in rank 0's one line with the previous files untouched; the save lock taken from ``--save=DIR``.
* Checkpoints Megatron-Core 0.16 cannot read (saved by 0.17+), and Megatron-LM checkpoints given to
  ``--load``, are named with the flag and release that read them.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch

from megatron_llep import writable
from megatron_llep.placement import ExpertPlacement
from megatron_llep.testing import full_disk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from test_pretrain import MODEL, TRAINING, _env, _free_port  # noqa: E402

LAUNCHER = os.path.join(ROOT, "launch", "torchrun.py")
WORKER = os.path.join(ROOT, "tests", "workers", "entry_cases_worker.py")
DATA = os.path.join(ROOT, "recipes", "data", "tiny_sft.jsonl")
NAMESPACES = full_disk.namespaces_available()
PREVIOUS = "the previous run's output\n"
SMALL = ["--seq-length", "32", "--eval-iters", "1"]


# The writer, in this process (injected) and in a namespace with a real full tmpfs -----------------


def _write_everything(directory: str, elsewhere: str) -> dict:
    """Under a full ``directory`` holding ``out.txt`` = PREVIOUS: each writer's error (None: it wrote),
    then a direct write of the same file (the negative control), and the files left; ``elsewhere``: a
    directory with space, where a file written together with one in ``directory`` goes."""
    from safetensors.torch import save_file
    import torch

    from megatron_llep.placement.trace import synthetic_trace

    errors = {}
    target = os.path.join(directory, "out.txt")

    def attempt(name, write):
        try:
            write()
            errors[name] = None
        except writable.OutputError as err:
            errors[name] = (str(err), err.errno)

    attempt("text", lambda: writable.write_text(target, "new " * 4000, "--output"))
    attempt("trace", lambda: synthetic_trace(4000, 16, 2, 4, 0.8, seed=1)[0].save(os.path.join(directory, "t.npz"),
                                                                                     "--record-routing-trace"))

    def safetensors() -> None:
        with writable.staged(os.path.join(directory, "m.safetensors"), "--out") as path:
            save_file({"w": torch.zeros(20000)}, path)

    attempt("safetensors", safetensors)

    def pair() -> None:  # the first file fits, the second does not: neither replaces anything
        with writable.StagedOutputs("--out") as outputs:
            with outputs.open(os.path.join(elsewhere, "first.txt")) as f:
                f.write("x")
            with outputs.open(target) as f:
                f.write("new " * 4000)

    attempt("pair", pair)
    kept = open(target).read()
    try:
        with open(target, "w") as f:  # the negative control: what the writer avoids
            f.write("new " * 4000)
    except OSError:
        pass
    return {"errors": errors, "kept": kept, "direct": open(target).read(), "files": sorted(os.listdir(directory)),
            "elsewhere": sorted(os.listdir(elsewhere))}


def _check_writer_on_a_full_disk(result: dict, directory: str) -> None:
    errors = result["errors"]
    text, code = errors["text"]
    assert code == errno.ENOSPC and "\n" not in text, text
    assert text.startswith(f"--output {directory}/out.txt: cannot write it (No space left on device; it needs "
                           "15.6 KiB, "), text
    assert text.endswith("the previous out.txt is untouched; free space there or give --output another path"), text
    assert errors["trace"][0].startswith(f"--record-routing-trace {directory}/t.npz: cannot write it (No space left")
    assert "no partial file is left" in errors["trace"][0]
    assert errors["safetensors"][0].startswith(f"--out {directory}/m.safetensors: cannot write it (No space left")
    assert errors["pair"][0].startswith(f"--out {directory}/out.txt: cannot write it (No space left")
    assert result["kept"] == PREVIOUS
    assert result["files"] == ["out.txt"] and result["elsewhere"] == []  # nothing partial, first.txt not alone
    assert result["direct"] != PREVIOUS  # the negative control lost the previous file


def test_the_writer_on_an_injected_full_disk(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "full" / "out.txt").write_text(PREVIOUS)
    with full_disk.injected(f"{tmp_path}/full/"):
        result = _write_everything(str(tmp_path / "full"), str(tmp_path / "elsewhere"))
    _check_writer_on_a_full_disk(result, str(tmp_path / "full"))


@pytest.mark.skipif(not NAMESPACES, reason="no user and mount namespaces here (unshare) to mount a tmpfs in")
def test_the_writer_on_a_filled_tmpfs(tmp_path):
    directory, elsewhere = tmp_path / "tmpfs", tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (f"import json, sys; sys.path[:0] = [{ROOT!r} + '/tests/entry_points', {ROOT!r} + '/tests/integrations']; "
              f"from megatron_llep.testing import full_disk; from test_outputs import _write_everything; full_disk.mount_tmpfs({str(directory)!r}, 2**18); "
              f"open({str(directory / 'out.txt')!r}, 'w').write({PREVIOUS!r}); "
              f"filler = full_disk.fill({str(directory)!r}); "
              f"result = _write_everything({str(directory)!r}, {str(elsewhere)!r}); "
              "import os; os.remove(filler); result['files'] = sorted(os.listdir(" + repr(str(directory)) + ")); "
              "print(json.dumps(result))")
    proc = subprocess.run(full_disk.namespace_command([sys.executable, "-c", script]), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_writer_on_a_full_disk(json.loads(proc.stdout.splitlines()[-1]), str(directory))


def test_the_writer_replaces_whole_keeps_modes_and_creates_exclusively(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    writable.write_text(str(target), "one")  # the directory is created
    os.chmod(target, 0o640)
    writable.write_text(str(target), "two")
    assert target.read_text() == "two" and (os.stat(target).st_mode & 0o777) == 0o640
    with pytest.raises(FileExistsError):
        writable.write_text(str(target), "three", exclusive=True)
    assert target.read_text() == "two"
    with pytest.raises(ValueError, match="not an output error"):  # any other error: re-raised, nothing left
        with writable.staged(str(tmp_path / "x.npz")) as path:
            np.save(open(path, "wb"), np.zeros(3))
            raise ValueError("not an output error")
    assert sorted(os.listdir(tmp_path)) == ["sub"] and os.listdir(tmp_path / "sub") == ["out.txt"]


def test_an_unwritable_directory_is_one_line_naming_the_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    (tmp_path / "out.txt").write_text(PREVIOUS)
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(writable.OutputError) as err:
            writable.write_text(str(tmp_path / "out.txt"), "new", "--output")
    finally:
        tmp_path.chmod(0o755)
    assert str(err.value).startswith(f"--output {tmp_path}/out.txt: cannot write it (Permission denied)")
    assert (tmp_path / "out.txt").read_text() == PREVIOUS


def test_ctrl_c_in_the_single_process_tools_is_one_line_and_leaves_the_previous_files(tmp_path, capsys, monkeypatch):
    from recipes import corpus, make_indexed_dataset
    from recipes.runtime import indexed_data

    (tmp_path / "sft_text_document.bin").write_text(PREVIOUS)

    def documents_then_ctrl_c(path, json_key=None):
        yield "a document"
        raise KeyboardInterrupt

    monkeypatch.setattr(indexed_data, "read_documents", documents_then_ctrl_c)
    with pytest.raises(SystemExit) as exit_info:
        make_indexed_dataset.main([DATA, "--output-prefix", str(tmp_path / "sft")])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == (f"make_indexed_dataset: stopped by SIGINT: nothing written to "
                                       f"{tmp_path}/sft_text_document.*\n")
    assert os.listdir(tmp_path) == ["sft_text_document.bin"] and (tmp_path / "sft_text_document.bin").read_text() == PREVIOUS
    monkeypatch.setattr(corpus, "collect", lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit) as exit_info:
        corpus.main(["--out", str(tmp_path / "corpus")])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == f"[corpus] stopped by SIGINT: nothing written to {tmp_path}/corpus\n"


# Checkpoints of other releases and loops ------------------------------------------------------------


def test_a_checkpoint_megatron_core_016_cannot_read_names_the_release(tmp_path, monkeypatch):
    """0.17+ keeps a checkpoint's common state inside the shards (no common.pt): 0.16 is told so, and
    a Megatron-LM checkpoint (no manifest) is told apart, naming --pretrained; 0.17+ reads the common
    state and tells a Megatron-LM checkpoint by its arguments."""
    from megatron_llep.compat import mcore
    from recipes.runtime import checkpointing, pretrained

    for name, manifest in (("finetuned", True), ("pretrained", False)):
        directory = tmp_path / name / "iter_0000002"
        directory.mkdir(parents=True)
        (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
        (directory / ".metadata").write_text("")
        if manifest:
            (directory / checkpointing.MANIFEST_FILE).write_text("{}")
        (tmp_path / name / checkpointing.LATEST_FILE).write_text("2")
    monkeypatch.setattr(mcore, "MCORE_VERSION", mcore.Version("0.16.1"))
    with pytest.raises(checkpointing.CheckpointError) as err:
        checkpointing.read_run_state(str(tmp_path / "finetuned" / "iter_0000002"))
    assert str(err.value) == (f"{tmp_path}/finetuned/iter_0000002 was saved by megatron-core >= 0.17 (its common state "
                              "is inside the shards, no common.pt), which megatron-core 0.16.1 cannot read: install "
                              "megatron-core >= 0.17 (docs/compat.md)")
    with pytest.raises(checkpointing.CheckpointError) as err:
        checkpointing.read_run_state(str(tmp_path / "pretrained" / "iter_0000002"))
    assert str(err.value).startswith(f"{tmp_path}/pretrained/iter_0000002 is a Megatron-LM checkpoint "
                                     "(recipes/pretrain_gpt.py; no checkpoint_manifest.json, its common state inside the "
                                     "shards): --pretrained reads it, with megatron-core >= 0.17; megatron-core 0.16.1 "
                                     "cannot")
    monkeypatch.undo()
    monkeypatch.setattr(checkpointing, "read_common_state", lambda directory: {"args": object(), "iteration": 2})
    with pytest.raises(checkpointing.CheckpointError, match=r"is a Megatron-LM checkpoint \(recipes/pretrain_gpt.py\): "
                                                            r"--pretrained reads it; --load reads checkpoints of"):
        checkpointing.read_run_state(str(tmp_path / "pretrained" / "iter_0000002"))
    from megatron_llep.compat import megatron_training

    monkeypatch.setattr(megatron_training, "missing_reason", lambda: "megatron-core 0.16.1 has no megatron.training")
    with pytest.raises(pretrained.PretrainedError) as err:
        pretrained.saved_arguments(str(tmp_path / "pretrained"))
    assert str(err.value) == (f"--pretrained {tmp_path}/pretrained: Megatron-LM checkpoints (recipes/pretrain_gpt.py), "
                              "which --pretrained reads, need megatron-core >= 0.17: megatron-core 0.16.1 has no "
                              "megatron.training; docs/compat.md shows how to install it on Python 3.11")


# Every entry point, in one launch of launch/torchrun.py ---------------------------------------------


def _hf_config_of_tiny(path, hidden_size_factor: int = 1) -> str:
    """gpt-oss-tiny's config.json written to ``path`` (its hidden size times ``hidden_size_factor``)."""
    from recipes.hf.rules import family_module
    from recipes.models import RECIPES

    config = family_module("gpt-oss-tiny").hf_config_from_recipe(RECIPES["gpt-oss-tiny"]())
    config["hidden_size"] *= hidden_size_factor
    path.write_text(json.dumps(config))
    return str(path)


def _hold(directory, content: str) -> str:
    directory.mkdir()
    (directory / ".megatron-llep.lock").write_text(content)
    return str(directory)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    """Every case of every entry point, run through launch/torchrun.py in one launch (in a user and mount
    namespace where one can be made: the full disks are then real, filled tmpfs); ``{name: (rank 0's
    result, rank 1's result or None)}``, ``out`` the directory they ran in."""
    from recipes.runtime.indexed_data import build_indexed_dataset
    from test_pretrain_errors import _copy_dataset

    out = tmp_path_factory.mktemp("outputs")
    prefix, _, _ = build_indexed_dataset(DATA, str(out / "sft"))
    cut_bin, cut_idx = _copy_dataset(prefix, str(out / "cut_bin"), cut_bin=10), \
        _copy_dataset(prefix, str(out / "cut_idx"), cut_idx=20)
    (out / "a_file").write_text("")
    (out / "not_json.json").write_text("not json\n")
    (out / "list.json").write_text("[1, 2]\n")
    (out / "some_dir").mkdir()
    (out / "empty_ckpt").mkdir()
    ExpertPlacement(8, 2, {n: list(range(8)) for n in (1, 2, 9)}).save(str(out / "layer_9.json"))  # tiny: MoE 1, 2
    (out / "bad.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "broken"\n')
    (out / "hf_tiny").mkdir()  # a Hugging Face directory whose config.json and file layout pass the first checks
    _hf_config_of_tiny(out / "hf_tiny" / "config.json")
    safetensors.torch.save_file({"unused": torch.zeros(1)}, str(out / "hf_tiny" / "model.safetensors"))
    held = _hold(out / "held", json.dumps({"host": os.uname().nodename, "pid": os.getpid(), "since": "now",
                                           "command": "another run"}))
    listed = _hold(out / "listed", "[1, 2]")
    ckpt = str(out / "ckpt")

    def full(name, previous=None, **more):
        return {"dir": str(out / f"full_{name}"), "previous": previous or {}, **more}

    def rank_0(entry, *argv, **more):
        return {"entry": entry, "argv": list(argv), "ranks": [0], **more}

    generate = ["--random-init", "--prompt", "hi", "--max-new-tokens", "2"]
    evaluate = ["--random-init", *SMALL]
    pretrain = [*MODEL, *TRAINING, "--data-path", prefix, "--data-cache-path", str(out / "cache"), "--train-iters", "2",
                "--eval-iters", "1"]
    spec = {"full_disk": "tmpfs" if NAMESPACES else "injected", "cases": {
        # full disks
        "generate_output": {"entry": "recipes.generate", "argv": [*generate, "--output", f"{out}/full_generate/out.jsonl"],
                            "full": full("generate", {"out.jsonl": PREVIOUS})},
        "evaluate_output": {"entry": "recipes.evaluate", "argv": [*evaluate, "--output", f"{out}/full_evaluate/r.json"],
                            "full": full("evaluate", {"r.json": PREVIOUS})},
        "evaluate_traces": {"entry": "recipes.evaluate", "argv": [*evaluate, "--record-routing-trace",
                                                                  f"{out}/full_traces"],
                            "full": full("traces", {"trace_rank0.npz": PREVIOUS})},
        "cap_keep_traces": {"entry": "recipes.cap_pipeline", "argv": [*evaluate, "--out", f"{out}/placement.json",
                                                                      "--keep-traces", f"{out}/full_kept"],
                            "full": full("kept")},
        "cap_out": {"entry": "recipes.cap_pipeline", "argv": [*evaluate, "--out", f"{out}/full_cap/placement.json"],
                    "full": full("cap", {"placement.json": PREVIOUS})},
        "finetune_lock": {"entry": "recipes.finetune", "argv": ["--train-iters", "1", "--save", f"{out}/full_lock/ckpt"],
                          "full": full("lock")},
        "corpus": rank_0("recipes.corpus", "--out", f"{out}/full_corpus", "--max-docs-per-split", "1",
                         full=full("corpus", {"manifest.json": PREVIOUS})),
        "indexed_dataset": rank_0("recipes.make_indexed_dataset", DATA, "--output-prefix", f"{out}/full_indexed/sft",
                                  full=full("indexed", {"sft_text_document.idx": PREVIOUS})),
        "placement_file": rank_0("megatron_llep.placement.cli", "synthetic", f"{out}/full_synthetic/s.npz", "--experts",
                                 "16", "--topk", "2", "--clusters", "4", full=full("synthetic", {"s.npz": PREVIOUS})),
        # a fine-tuning checkpoint for the cases after it, and its export on a full disk
        "finetune_saves": {"entry": "recipes.finetune", "argv": ["--train-iters", "1", "--seq-length", "32",
                                                                  "--save", ckpt]},
        "hf_export": {"entry": "recipes.hf.__main__", "argv": ["export", "--load", ckpt, "--out", f"{out}/full_hf/hf"],
                      "full": full("hf", {"hf/config.json": PREVIOUS})},
        # bad input
        "generate_top_k": {"entry": "recipes.generate", "argv": [*generate, "--top-k", "100000"]},
        "generate_non_utf8": {"entry": "recipes.generate", "argv": ["--random-init", "--prompt", "caf\udce9"]},
        "generate_too_long": {"entry": "recipes.generate", "argv": ["--random-init", "--prompt", "hi",
                                                                    "--max-new-tokens", "600"]},
        "generate_wandb_file": {"entry": "recipes.generate", "argv": [*generate, "--wandb-project", "p",
                                                                      "--wandb-save-dir", f"{out}/a_file"]},
        "finetune_wandb_file": {"entry": "recipes.finetune", "argv": ["--wandb-save-dir", f"{out}/a_file"]},
        "generate_no_llep_knobs": {"entry": "recipes.generate", "argv": [*generate, "--no-llep", "--llep-alpha", "2",
                                                                         "--no-llep-cost-aware"]},
        # layouts and data fine-tuning refuses once the process group is up
        **{f"finetune_{name}": {"entry": "recipes.finetune", "argv": ["--seq-length", "32", "--micro-batch-size", "2",
                                                                        "--train-iters", "1", *argv]}
           for name, argv, _ in finetune_refusals(out)},
        "finetune_load_and_pretrained": {"entry": "recipes.finetune", "argv": ["--load", ckpt, "--pretrained",
                                                                               f"{out}/some_dir", "--seq-length", "32",
                                                                               "--train-iters", "1"]},
        "finetune_lock_list": {"entry": "recipes.finetune", "argv": ["--train-iters", "1", "--save", listed]},
        # a valid config.json (checked first, before any process group), then the held --out
        "hf_import_lock_held": {"entry": "recipes.hf.__main__", "argv": ["import", "--hf", f"{out}/hf_tiny",
                                                                         "--recipe", "gpt-oss-tiny", "--out", held]},
        "evaluate_no_checkpoint": {"entry": "recipes.evaluate", "argv": [*SMALL, "--load", f"{out}/empty_ckpt"]},
        "evaluate_placement_layer": {"entry": "recipes.evaluate", "argv": [*evaluate, "--llep-placement",
                                                                           f"{out}/layer_9.json"]},
        "evaluate_bin_truncated": {"entry": "recipes.evaluate", "argv": [*evaluate, "--data", cut_bin]},
        "evaluate_idx_truncated": {"entry": "recipes.evaluate", "argv": [*evaluate, "--data", cut_idx]},
        "hf_export_nan": {"entry": "recipes.hf.__main__", "argv": ["export", "--load", ckpt, "--out", f"{out}/hf",
                                                                   "--max-shard-size-gib", "nan"]},
        "hf_export_other_family": {"entry": "recipes.hf.__main__", "argv": ["export", "--load", ckpt, "--out",
                                                                            f"{out}/hf", "--recipe", "deepseek-v3-tiny"]},
        "hf_export_other_sizes": {"entry": "recipes.hf.__main__", "argv": [
            "export", "--load", ckpt, "--out", f"{out}/hf", "--hf-config", _hf_config_of_tiny(out / "big.json", 2)]},
        "corpus_check_not_json": rank_0("recipes.corpus", "--out", f"{out}/corpus", "--check", f"{out}/not_json.json"),
        "corpus_check_list": rank_0("recipes.corpus", "--out", f"{out}/corpus", "--check", f"{out}/list.json"),
        "indexed_json_key": rank_0("recipes.make_indexed_dataset", DATA, "--output-prefix", f"{out}/k",
                                   "--json-key", "nosuch"),
        # Megatron-LM's loop (megatron-core >= 0.17), last: the lock from --save=DIR, a save on a full disk
        # (rank 0 alone takes the lock: the launcher ends the other ranks, which wait in the rendezvous)
        "pretrain_save_equals": rank_0("recipes.pretrain_gpt", *pretrain, f"--save={held}", "--save-interval", "2"),
        # room for the lock and for what the start-up check asks (the weights and Adam's state), not for the save
        "pretrain_save_full": {"entry": "recipes.pretrain_gpt", "argv": [*pretrain, f"--save={out}/full_pretrain/ckpt",
                                                                          "--save-interval", "2"],
                               "full": full("pretrain", size=2**22, leave=800 * 2**10, part="/iter_0000002")},
    }}
    (out / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, LAUNCHER, "--nproc_per_node", "2", "--master_port", _free_port(), WORKER, str(out),
               str(out / "spec.json")]
    proc = subprocess.run(full_disk.namespace_command(command) if NAMESPACES else command, cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    results = {}
    for name, case in spec["cases"].items():
        if case["entry"] == "recipes.pretrain_gpt" and (out / "skip.txt").exists():
            continue
        results[name] = tuple(json.loads((out / f"{name}.rank{r}.json").read_text()) if r in case.get("ranks", [0, 1])
                              else None for r in (0, 1))
    return {"results": results, "spec": spec["cases"], "out": str(out), "ckpt": ckpt, "held": held, "listed": listed,
            "skip": (out / "skip.txt").read_text() if (out / "skip.txt").exists() else None}


def _one_line(cases: dict, name: str, label: str, code: int) -> str:
    """The case's one error line, less its ``[label] error: `` (argparse's ``prog: error: ``), after
    checking: exit status ``code``, that line alone on rank 0's stderr, no traceback anywhere, and rank 1
    printing no error (it ended waiting for rank 0's report, or finished where rank 0 alone failed)."""
    if name not in cases["results"]:
        pytest.skip(cases["skip"])
    rank0, rank1 = cases["results"][name]
    errors = [line for line in rank0["stderr"].splitlines() if "error:" in line]
    assert rank0["code"] == code and len(errors) == 1, (name, rank0["code"], rank0["stderr"][-3000:])
    assert errors[0].startswith(f"{label} error: " if label.startswith("[") else f"{label}: error: "), errors
    for result in (rank0, rank1):
        if result is not None:
            assert "Traceback" not in result["stderr"] and "Exception ignored" not in result["stderr"], \
                (name, result["stderr"][-3000:])
    assert rank1 is None or "error:" not in rank1["stderr"], (name, rank1["stderr"][-3000:])
    return errors[0].split("error: ", 1)[1]


FULL_DISK_CASES = [
    # case, its line's label and exit status, what the line begins with (D: the case's full directory)
    ("generate_output", "[generate]", 1, "--output D/out.jsonl: cannot write it (No space left on device; it needs "),
    ("evaluate_output", "[evaluate]", 1, "--output D/r.json: cannot write it (No space left on device; it needs "),
    ("evaluate_traces", "[evaluate]", 1, "--record-routing-trace D/trace_rank0.npz: cannot write it (No space left"),
    ("cap_keep_traces", "[cap_pipeline]", 1, "--keep-traces D/trace_rank0.npz: cannot write it (No space left"),
    ("cap_out", "[cap_pipeline]", 1, "--out D/placement.json: cannot write it (No space left on device; it needs "),
    ("finetune_lock", "[finetune]", 1, "--save D/ckpt/.megatron-llep.lock: cannot write it (No space left on device"),
    ("corpus", "[corpus]", 1, "--out D/"),
    ("indexed_dataset", "make_indexed_dataset", 1, "--output-prefix D/sft_text_document."),
    ("placement_file", "python -m megatron_llep.placement", 1, "--out D/s.npz: cannot write it (No space left"),
    ("hf_export", "[recipes.hf]", 2, "--out D/hf/"),
]


@pytest.mark.parametrize("name, label, code, begins", FULL_DISK_CASES, ids=[c[0] for c in FULL_DISK_CASES])
def test_every_output_on_a_full_disk_leaves_the_previous_files_and_one_line(cases, name, label, code, begins):
    line = _one_line(cases, name, label, code)
    full = cases["spec"][name]["full"]
    assert line.startswith(begins.replace("D/", full["dir"] + "/")), line
    assert "No space left on device" in line and "; free space there or give " in line, line
    # the previous files whole, nothing partial beside them
    assert cases["results"][name][0]["files"] == full["previous"], cases["results"][name][0]["files"]


def finetune_refusals(out) -> list[tuple[str, list[str], str]]:
    """Fine-tuning's refusals of a layout or data, found once the process group is up: case name, flags,
    what the one line says."""
    return [
        ("ep_vs_world", ["--recipe", "gpt-oss-tiny", "--expert-model-parallel-size", "3"], "EP = 3 must divide"),
        ("global_batch", ["--global-batch-size", "6"], "not a multiple of micro batch x DP"),
        ("tp_without_te", ["--tensor-model-parallel-size", "2"], "Transformer Engine"),
        ("gpt_oss_bias_at_ep1", ["--pipeline-model-parallel-size", "2"], "need EP >= 2"),
        ("bad_jsonl_line", ["--data", f"{out}/bad.jsonl"], f"{out}/bad.jsonl:2: not valid JSON"),
    ]


@pytest.mark.parametrize("name", [name for name, _, _ in finetune_refusals("")])
def test_bad_layouts_and_data_in_fine_tuning_are_one_line(cases, name):
    said = {n: text for n, _, text in finetune_refusals(cases["out"])}[name]
    line = _one_line(cases, f"finetune_{name}", "[finetune]", 2)
    assert said in line, line


BAD_INPUT_CASES = [
    # case, its line's label and exit status, what the line says ({out}: the cases' directory)
    ("generate_top_k", "[generate]", 2, "--top-k 100000 exceeds the 258 tokens of the tokenizer {byte_tokenizer}: give "
                                       "at most 258"),
    ("generate_non_utf8", "usage: entry_cases_worker.py", 2, "argument --prompt: not valid UTF-8 (byte 0xe9 at "
                                                             "character 4): give the text in UTF-8"),
    ("generate_too_long", "[generate]", 2, "the longest prompt (3 tokens) plus --max-new-tokens 600 = 603 tokens exceeds "
                                          "gpt-oss-tiny's longest sequence, 512 tokens: shorten the prompt or lower "
                                          "--max-new-tokens"),
    ("generate_wandb_file", "usage: entry_cases_worker.py", 2, "--wandb-save-dir: {out}/a_file is a file, not a "
                                                               "directory; give a writable directory"),
    ("finetune_wandb_file", "usage: entry_cases_worker.py", 2, "--wandb-save-dir: {out}/a_file is a file, not a "
                                                               "directory; give a writable directory"),
    ("finetune_lock_list", "[finetune]", 2, "--save {out}/listed: {out}/listed/.megatron-llep.lock is not a lock of this "
                                           "project (an array), so whether a run uses the directory cannot be told: "
                                           "remove it if none does, then start again"),
    ("hf_import_lock_held", "[recipes.hf]", 2, "--out {out}/held is in use by another run (pid {pid} on this host"),
    ("evaluate_no_checkpoint", "[evaluate]", 2, "no checkpoint at '{out}/empty_ckpt' (neither "
                                               "latest_checkpointed_iteration.txt nor a dist_checkpointing directory)"),
    ("evaluate_placement_layer", "[evaluate]", 2, "--llep-placement {out}/layer_9.json: the model has no MoE layer 9 "
                                                 "(its MoE layers: 1, 2); is it this model's file?"),
    ("evaluate_bin_truncated", "[evaluate]", 2, "--data {out}/cut_bin: {out}/cut_bin.bin has {cut_bin:,} bytes, but "
                                               "{out}/cut_bin.idx indexes {bin:,}: the .bin is truncated"),
    ("evaluate_idx_truncated", "[evaluate]", 2, "--data {out}/cut_idx: {out}/cut_idx.idx has {cut_idx:,} bytes, but its "
                                               "header (240 sequences, 241 documents) needs {idx:,}"),
    ("hf_export_nan", "usage: python -m recipes.hf", 2, "--max-shard-size-gib must be positive, got nan"),
    ("hf_export_other_family", "[recipes.hf]", 2, "--recipe deepseek-v3-tiny is a deepseek-v3 model, but {ckpt}/"
                                                 "iter_0000001 was trained as gpt-oss-tiny (gpt-oss): drop --recipe"),
    ("hf_export_other_sizes", "[recipes.hf]", 2, "the model --hf-config {out}/big.json describes is not the one {ckpt}/"
                                                "iter_0000001 holds: embedding.word_embeddings.weight has shape (512, 64) "
                                                "in {ckpt}/iter_0000001, (512, 128) in the model built here"),
    ("corpus_check_not_json", "[corpus]", 2, "--check {out}/not_json.json:1: not valid JSON (Expecting value, column 1); "
                                            "give the manifest.json python -m recipes.corpus wrote"),
    ("corpus_check_list", "[corpus]", 2, "--check {out}/list.json: expected the corpus manifest as a JSON object, got an "
                                        "array; give the manifest.json python -m recipes.corpus wrote"),
    ("indexed_json_key", "make_indexed_dataset", 2, "{data}:1: no 'nosuch' field, which --json-key names; give the field "
                                                    "that holds the documents' text"),
]


@pytest.mark.parametrize("name, label, code, says", BAD_INPUT_CASES, ids=[c[0] for c in BAD_INPUT_CASES])
def test_bad_input_is_one_line_naming_the_flag_or_file(cases, name, label, code, says):
    out = cases["out"]
    sizes = {suffix: os.path.getsize(f"{out}/sft_text_document.{suffix}") for suffix in ("bin", "idx")}
    expected = says.format(out=out, ckpt=cases["ckpt"], pid=os.getpid(), data=DATA, bin=sizes["bin"],
                           idx=sizes["idx"], cut_bin=sizes["bin"] - 10, cut_idx=sizes["idx"] - 20,
                           byte_tokenizer=os.path.join(ROOT, "recipes", "data", "byte_tokenizer.json"))
    if label.startswith("usage: "):  # argparse: the usage, then "prog: error: ..."
        rank0 = cases["results"][name][0]
        assert rank0["code"] == 2 and rank0["stderr"].count("usage:") == 1, rank0["stderr"][-3000:]
        label = label[len("usage: "):]
    line = _one_line(cases, name, label, code)
    assert line.startswith(expected), line
    assert name != "generate_too_long" or "--seq-length" not in line


def test_knobs_a_run_ignores_and_a_pretrained_model_it_does_not_start_from_are_said(cases):
    """``--no-llep`` with LLEP knobs runs (an A/B run may keep them) and says they do nothing;
    ``--load X --pretrained Y`` resumes X and says Y is ignored."""
    for name, said in (("generate_no_llep_knobs", "[generate] note: --llep-alpha, --no-llep-cost-aware tune LLEP, which "
                                                  "--no-llep turns off: they do nothing in this plain-EP run"),
                       ("finetune_load_and_pretrained", f"[finetune] note: --pretrained {cases['out']}/some_dir is "
                                                        f"ignored: resuming from {cases['ckpt']}/iter_0000001")):
        rank0, rank1 = cases["results"][name]
        assert rank0["code"] == 0 and rank1["code"] == 0, rank0["stderr"][-3000:]
        assert [line for line in rank0["stdout"].splitlines() if line.startswith(said)], rank0["stdout"]
        assert said.split(" note:")[0] + " note:" not in rank1["stdout"]


def test_pretraining_takes_the_save_lock_from_save_equals_dir(cases):
    line = _one_line(cases, "pretrain_save_equals", "[pretrain_gpt]", 2)
    assert line.startswith(f"--save {cases['held']} is in use by another run (pid {os.getpid()} on this host"), line


def test_a_pretraining_save_on_a_full_disk_leaves_no_partial_checkpoint(cases):
    """Megatron-LM's dist_checkpointing save fails on every rank: rank 0 removes the partial iter_* directory
    before the "latest" file names it, and the run ends in one line with the space a save needs."""
    line = _one_line(cases, "pretrain_save_full", "[pretrain_gpt]", 1)
    save = cases["spec"]["pretrain_save_full"]["full"]["dir"] + "/ckpt"
    assert line.startswith(f"saving iteration 2 to {save} failed (rank "), line
    # the cause, from the rank that saw it; where every rank's writer only saw its effect, torch's short write
    assert "No space left on device" in line or "ENOSPC" in line or "a write was cut short" in line, line
    assert f"removed its partial {save}/iter_0000002, nothing was saved before; a save needs about " in line, line
    assert line.endswith(f"free space there or give --save another directory, then resume with --load {save}"), line
    left = cases["results"]["pretrain_save_full"][0]["files"]
    assert list(left) == ["ckpt/.megatron-llep.lock"], left  # no iter_*, no "latest" file (the lock: the run's own)
