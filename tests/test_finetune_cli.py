"""The README's main job: recipes/finetune.py under torchrun on 2 CPU processes."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "recipes", "finetune.py")


def _run(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_main_job_trains_and_reports_llep():
    proc = _run(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", SCRIPT,
                "--train-iters", "2", "--force-routing", "0.9:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("[finetune] step")]
    assert len(lines) == 2
    assert "tokens/s" in lines[-1] and "LLEP 2/2 layers spilled" in lines[-1]


def test_bad_arguments_fail_fast_with_a_message():
    proc = _run(sys.executable, SCRIPT, "--force-routing", "lots")
    assert proc.returncode == 2 and "F:H" in proc.stderr
    proc = _run(sys.executable, SCRIPT)
    assert proc.returncode != 0 and "torchrun" in (proc.stderr + proc.stdout)
