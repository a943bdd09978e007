"""CAP's pipeline as one command (recipes/cap_pipeline.py) under torchrun on 2 CPU gloo ranks: traces
recorded with routing pruning on (tokens with dropped experts appear in them), a placement chosen by
timing the spectrum on this machine (the table printed, the choice recorded in the file), a placement
file evaluate.py takes and that leaves the model the same function; bad input is one line, exit 2."""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPELINE = os.path.join(ROOT, "recipes", "cap_pipeline.py")
EVALUATE = os.path.join(ROOT, "recipes", "evaluate.py")
SMALL = ["--random-init", "--seq-length", "32", "--micro-batch-size", "2", "--eval-iters", "2"]


def _torchrun(script, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-4000:])
    return proc.stdout


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cap_pipeline")
    out = _torchrun(PIPELINE, *SMALL, "--prune-p", "0.3", "--profile", "auto", "--candidates", "3",
                    "--profile-repeats", "1", "--profile-batches", "1", "--keep-traces", str(tmp / "traces"),
                    "--out", str(tmp / "placement.json"))
    return tmp, out


def test_traces_are_recorded_with_pruning_on(pipeline):
    from megatron_llep.placement import load_traces

    tmp, out = pipeline
    trace = load_traces([str(tmp / "traces" / f"trace_rank{r}.npz") for r in (0, 1)])
    ids = np.concatenate([layer.expert_ids for layer in trace.layers.values()])
    assert (ids < 0).any(axis=1).mean() > 0.05  # pruned tokens keep fewer than top-K experts
    assert (ids >= 0).any(axis=1).all()  # and always one device's
    assert "routing pruning p = 0.3 (devices)" in out and "pairs dropped" in out


def test_profile_auto_times_the_spectrum_and_records_its_choice(pipeline):
    from megatron_llep.placement import ExpertPlacement

    tmp, out = pipeline
    assert "position" in out and "chose position" in out
    placement = ExpertPlacement.load(str(tmp / "placement.json"))
    assert placement.metadata["selection"] == "profile auto"
    timed = placement.metadata["profile"]
    assert len(timed) >= 2 and all(row["seconds"] > 0 for row in timed)
    assert sorted(placement.layers) == [1, 2]
    for layer in placement.layers:
        assert sorted(placement.slot_to_expert(layer).tolist()) == list(range(8))


def test_the_placement_leaves_the_model_the_same_function(pipeline):
    """evaluate.py with and without the placement (no pruning): equal losses; a wrong placement file
    (the negative control: router rows moved, experts not) would change it, which apply's own tests cover."""
    tmp, _ = pipeline
    losses = []
    for extra in ([], ["--llep-placement", str(tmp / "placement.json")]):
        out = _torchrun(EVALUATE, *SMALL, *extra)
        losses.append(float(out.split("] loss ")[1].split(" ")[0]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--random-init", "--out", "p.json", "--llep-placement", __file__], "--llep-placement: this command makes the placement"),
    (["--random-init", "--out", "p.json", "--candidates", "1"], "--candidates must be >= 2, got 1"),
    (["--random-init", "--out", "p.json", "--lambda", "1.5"], "--lambda must be within [0, 1], got 1.5"),
    (["--random-init", "--out", "p.json", "--profile", "auto", "--lambda", "0.5"], "not allowed with argument"),
    (["--random-init", "--out", "/"], "--out: / is a directory"),
    (["--random-init"], "the following arguments are required: --out"),
])
def test_usage_errors_are_one_line(capsys, argv, message):
    from recipes import cap_pipeline

    with pytest.raises(SystemExit) as exit_info:
        cap_pipeline.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert message in err.splitlines()[-1]
