"""One run per save directory (recipes/runtime/save_lock.py): a live holder refuses a second run in one line
naming it (fine-tuning under torchrun, pretraining; ``--save=DIR`` as well, and pretraining's
``--save=DIR`` in tests/entry_points/test_outputs.py), a dead holder's lock (gone, or its pid reused) is taken
over, a file in its place that is no lock is refused naming it, and the lock goes when the run ends."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from recipes.runtime import save_lock  # noqa: E402
from test_pretrain import needs_megatron_training  # noqa: E402


def _hold(directory, pid, pid_start=None, host=None):
    directory.mkdir(exist_ok=True)
    holder = {"host": host or socket.gethostname(), "pid": pid, "since": "2026-12-06 00:00:00", "command": "other run",
              "pid_start": pid_start if pid_start is not None else save_lock._start_time(pid)}
    (directory / save_lock.LOCK_FILE).write_text(json.dumps(holder))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_refuses_and_a_dead_one_is_taken_over(tmp_path):
    said = []
    _hold(tmp_path / "live", os.getpid())
    with pytest.raises(save_lock.SaveDirectoryInUse, match=rf"is in use by another run \(pid {os.getpid()} on this host"):
        save_lock.acquire(str(tmp_path / "live"), said.append)
    _hold(tmp_path / "remote", os.getpid(), host="gpu-node-17")
    with pytest.raises(save_lock.SaveDirectoryInUse, match="on host gpu-node-17.*remove .*lock if that run is gone"):
        save_lock.acquire(str(tmp_path / "remote"), said.append)
    for name, pid, start in (("dead", _dead_pid(), None), ("reused", os.getpid(), "0")):  # start "0": another process
        _hold(tmp_path / name, pid, start)
        path = save_lock.acquire(str(tmp_path / name), said.append)
        assert json.load(open(path))["pid"] == os.getpid()
        save_lock.release(path, json.load(open(path)))
        assert not os.path.exists(path)
    assert len(said) == 2 and all("taking over the lock of a run that is gone" in line for line in said)


@pytest.mark.parametrize("content, found", [("[1, 2]", "an array"), ("", "an empty file"), ("{", "not JSON"),
                                            ('{"pid": 1}', "an object without host and pid")])
def test_a_file_that_is_no_lock_is_refused_naming_it(tmp_path, content, found):
    """Locks are written whole (a temporary file hard-linked into place), so anything else in the lock's
    place was not written by a run of this project: whether a run uses the directory cannot be told."""
    (tmp_path / save_lock.LOCK_FILE).write_text(content)
    with pytest.raises(save_lock.SaveDirectoryInUse) as err:
        save_lock.acquire(str(tmp_path), flag="--out")
    assert str(err.value) == (f"--out {tmp_path}: {tmp_path}/{save_lock.LOCK_FILE} is not a lock of this project "
                              f"({found}), so whether a run uses the directory cannot be told: remove it if none "
                              "does, then start again")
    save_lock.release(str(tmp_path / save_lock.LOCK_FILE))  # not a lock of this process's: left alone
    assert (tmp_path / save_lock.LOCK_FILE).read_text() == content


def test_finetune_refuses_a_save_directory_another_run_holds(tmp_path):
    """The lock comes from the parsed arguments: ``--save=DIR`` too."""
    _hold(tmp_path / "ckpt", os.getpid())
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           os.path.join(ROOT, "recipes", "finetune.py"), "--train-iters", "1",
                           f"--save={tmp_path / 'ckpt'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("[finetune] error:")]
    assert len(errors) == 1 and f"is in use by another run (pid {os.getpid()} on this host" in errors[0], proc.stderr[-2000:]
    assert not list((tmp_path / "ckpt").glob("iter_*"))  # nothing written beside the other run


@needs_megatron_training
def test_pretraining_refuses_a_save_directory_another_run_holds(tmp_path):
    _hold(tmp_path / "ckpt", os.getpid())
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "pretrain_gpt.py"), "--save",
                           str(tmp_path / "ckpt")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[pretrain_gpt] error:")]
    assert len(errors) == 1 and "is in use by another run" in errors[0], proc.stderr[-2000:]
