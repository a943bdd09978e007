"""Damaged checkpoints, killed and stopped ranks (recipes/runtime/checkpointing.py, recipes/runtime/watchdog.py).

* the manifest (sizes, SHA-256) against hashlib, and find_checkpoint's fallback on 2 gloo ranks:
  a truncated, corrupted or deleted file, an interrupted save, a garbage or dangling "latest" file
  -> the newest complete checkpoint with one line per skipped one; nothing complete -> an error;
* forked checkpoint writers die with their rank (and, as a negative control, do not without);
* kill -9 of a rank during a save: no process of the job survives, and the resumed run (which also
  skips a damaged newest checkpoint) continues with the losses the killed run had (bitwise resume
  is tested in test_finetune.py);
* a full disk during a save (one rank's shard, or a file rank 0 writes alone): the run ends with
  one line and exit status 1, its partial directory removed, the previous checkpoint the latest;
  a retry resumes from it;
* SIGSTOP of a rank: the watchdog ends the job with one line naming the stopped rank.
"""

import contextlib
import glob
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron_llep.testing.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "recipes", "finetune.py")
SMALL = ["--seq-length", "32", "--micro-batch-size", "2"]
SHARD = 4096


# --- manifest and fallback, on a gloo group (files shaped like a dist_checkpointing save) ----------

def _fake_save(root: str, iteration: int, rank: int) -> None:
    """What a save leaves: rank 0's common files, one shard per rank, the manifest, the latest file."""
    import torch.distributed as dist

    from recipes.runtime import checkpointing

    directory = os.path.join(root, f"iter_{iteration:07d}")
    if rank == 0:
        os.makedirs(directory)
        for name in ("common.pt", "metadata.json", ".metadata"):
            with open(os.path.join(directory, name), "wb") as f:
                f.write(f"{name} of {iteration}".encode())
    dist.barrier()
    with open(os.path.join(directory, f"__{rank}_0.distcp"), "wb") as f:
        f.write(bytes((iteration * 31 + rank * 7 + i) % 251 for i in range(SHARD)))
    dist.barrier()
    checkpointing.write_manifest(directory)
    if rank == 0:
        with open(os.path.join(root, checkpointing.LATEST_FILE), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(100)


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(SHARD // 2)
        byte = f.read(1)
        f.seek(SHARD // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def _write(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)


def fallback_scenarios(rank: int, world: int, workdir: str) -> dict:
    """Each scenario damages a copy of a save root (iterations 1-3, latest 3), then asks
    find_checkpoint; returns, per scenario, what it chose (or its error) and what it printed."""
    import torch.distributed as dist

    from recipes.runtime import checkpointing

    pristine, root = os.path.join(workdir, "pristine"), os.path.join(workdir, "ckpt")
    for iteration in (1, 2, 3):
        _fake_save(pristine, iteration, rank)
    if rank == 0:  # a save killed before it finished: never a candidate
        os.makedirs(os.path.join(pristine, "iter_0000004.tmp"))
    it = lambda i: os.path.join(root, f"iter_{i:07d}")  # noqa: E731
    latest = os.path.join(root, checkpointing.LATEST_FILE)
    scenarios = {
        "intact": (None, {}),
        "truncated shard": (lambda: _truncate(os.path.join(it(3), "__1_0.distcp")), {}),
        "corrupted shard": (lambda: _flip_a_byte(os.path.join(it(3), "__0_0.distcp")), {}),
        "corrupted shard, sizes only": (lambda: _flip_a_byte(os.path.join(it(3), "__0_0.distcp")), {"verify": "size"}),
        "deleted file": (lambda: os.remove(os.path.join(it(3), "common.pt")), {}),
        "interrupted save": (lambda: [os.remove(os.path.join(it(3), name))
                                      for name in (checkpointing.MANIFEST_FILE, checkpointing.LEGACY_COMPLETE_MARK)], {}),
        "saved before manifests existed": (lambda: os.remove(os.path.join(it(3), checkpointing.MANIFEST_FILE)), {}),
        "garbage latest file": (lambda: _write(latest, b"\x00\xffjunk"), {}),
        "dangling latest file": (lambda: _write(latest, b"7\n"), {}),
        "garbage latest file, newest truncated": (
            lambda: (_write(latest, b"oops"), _truncate(os.path.join(it(3), "__1_0.distcp"))), {}),
        "rolled back latest file": (lambda: _write(latest, b"2"), {}),
        "nothing complete": (lambda: [os.remove(os.path.join(it(i), "__1_0.distcp")) for i in (1, 2, 3)], {}),
        "one damaged iter_ directory": (lambda: _truncate(os.path.join(it(3), "__1_0.distcp")), {"path": it(3)}),
        "one intact iter_ directory": (None, {"path": it(2)}),
        "nothing saved yet, first run": (lambda: shutil.rmtree(root), {"allow_none": True}),
        "nothing saved": (lambda: shutil.rmtree(root), {}),
    }
    results = {}
    for name, (damage, kwargs) in scenarios.items():
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(pristine, root)
            if damage:
                damage()
        dist.barrier()
        printed = io.StringIO()
        path = kwargs.pop("path", root)
        with contextlib.redirect_stderr(printed):
            try:
                chosen = checkpointing.find_checkpoint(path, **kwargs)
                chosen = None if chosen is None else os.path.relpath(chosen, root)
            except checkpointing.CheckpointError as err:
                chosen = f"error: {err}"
        results[name] = (chosen, printed.getvalue().splitlines())
        dist.barrier()
    return results


def test_manifest_matches_hashlib_and_damage_falls_back_with_a_line(tmp_path):
    results = run_distributed(fallback_scenarios, 2, str(tmp_path), timeout_s=300)
    assert results[0].keys() == results[1].keys()
    for name in results[0]:  # every rank decides alike; only rank 0 prints
        assert results[1][name][0] == results[0][name][0], name
        assert results[1][name][1] == [], name

    # the manifest: every file but itself, with sizes and SHA-256 computed here independently
    directory = tmp_path / "pristine" / "iter_0000003"
    manifest = json.loads((directory / "checkpoint_manifest.json").read_text())
    files = sorted(p.name for p in directory.iterdir() if p.name != "checkpoint_manifest.json")
    assert sorted(manifest["files"]) == files == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt",
                                                  "metadata.json"]
    for name in files:
        data = (directory / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    root = str(tmp_path / "ckpt")
    chosen = {name: result[0] for name, result in results[0].items()}
    lines = {name: result[1] for name, result in results[0].items()}
    skip3 = f"[checkpoint] skipping {root}/iter_0000003: "
    assert chosen["intact"] == "iter_0000003" and lines["intact"] == []
    assert chosen["truncated shard"] == "iter_0000002"
    assert lines["truncated shard"] == [skip3 + f"__1_0.distcp has 100 bytes, the manifest says {SHARD} (truncated or "
                                        "overwritten); falling back to an older checkpoint"]
    assert chosen["corrupted shard"] == "iter_0000002"
    assert lines["corrupted shard"] == [skip3 + "__0_0.distcp does not match its SHA-256 in the manifest (corrupted); "
                                        "falling back to an older checkpoint"]
    assert chosen["corrupted shard, sizes only"] == "iter_0000003"  # what --checkpoint-verify size gives up
    assert chosen["deleted file"] == "iter_0000002"
    assert lines["deleted file"] == [skip3 + "common.pt is missing; falling back to an older checkpoint"]
    assert chosen["interrupted save"] == "iter_0000002"
    assert len(lines["interrupted save"]) == 1 and "no checkpoint_manifest.json" in lines["interrupted save"][0]
    assert chosen["saved before manifests existed"] == "iter_0000003"
    assert lines["saved before manifests existed"] == [
        f"[checkpoint] {root}/iter_0000003 has no checkpoint_manifest.json (saved before checkpoints were verified): "
        "loading it unverified"]
    assert chosen["garbage latest file"] == "iter_0000003"
    assert lines["garbage latest file"] == [
        f"[checkpoint] {root}/latest_checkpointed_iteration.txt holds '\\x00�junk', not an iteration number: "
        "using the newest complete iter_* directory instead"]
    assert chosen["dangling latest file"] == "iter_0000003"
    assert lines["dangling latest file"] == [
        f"[checkpoint] {root}/latest_checkpointed_iteration.txt names iteration 7, but {root}/iter_0000007 is missing: "
        "using the newest complete iter_* directory instead"]
    assert chosen["garbage latest file, newest truncated"] == "iter_0000002"
    assert len(lines["garbage latest file, newest truncated"]) == 2
    assert chosen["rolled back latest file"] == "iter_0000002" and lines["rolled back latest file"] == []
    assert chosen["nothing complete"].startswith(f"error: no complete checkpoint under {root} (iter_0000003: "
                                                 "__1_0.distcp is missing; iter_0000002: ")
    assert chosen["nothing complete"].endswith("move the damaged checkpoints away or point --load at another directory")
    assert len(lines["nothing complete"]) == 2  # the last one is in the error
    assert chosen["one damaged iter_ directory"].startswith(f"error: {root}/iter_0000003 is not a complete checkpoint: "
                                                           "__1_0.distcp has 100 bytes")
    assert chosen["one intact iter_ directory"] == "iter_0000002"
    assert chosen["nothing saved yet, first run"] is None
    assert chosen["nothing saved"].startswith(f"error: no checkpoint at {root!r}")


# --- writer processes die with their rank ------------------------------------------------------------

FORKING_RANK = """
import multiprocessing, sys, time
sys.path.insert(0, sys.argv[1])
from recipes.runtime.checkpointing import writers_die_with_this_process
fork = multiprocessing.get_context("fork")
with writers_die_with_this_process():
    guarded = fork.Process(target=time.sleep, args=(600,))
    guarded.start()
unguarded = fork.Process(target=time.sleep, args=(600,))
unguarded.start()
print(guarded.pid, unguarded.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, deadline_s: float = 60.0) -> list:
    deadline = time.monotonic() + deadline_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def test_forked_writers_die_with_their_rank():
    rank = subprocess.Popen([sys.executable, "-c", FORKING_RANK, ROOT], stdout=subprocess.PIPE, text=True)
    guarded, unguarded = map(int, rank.stdout.readline().split())
    try:
        rank.kill()  # kill -9, as the OOM killer or a user would
        rank.wait()
        assert _wait_gone([guarded]) == []
        assert _alive(unguarded)  # negative control: a fork outside the block outlives its parent
    finally:
        for pid in (guarded, unguarded):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# --- kill -9 during a save, then resume ---------------------------------------------------------------

def _torchrun_cmd(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", SCRIPT, *args]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")


def _run(*args):
    proc = subprocess.run(_torchrun_cmd(*args), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def _children(pid: int) -> list:
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.split("/")[2]))
    return kids


def _descendants(pid: int) -> set:
    found, todo = set(), [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _rank_pid(agent: int, rank: int) -> int:
    for pid in _children(agent):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} under torchrun {agent}")


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()[:120]
    return "?"


def _steps(text: str) -> dict:
    """``{step: "loss ... | grad norm ... | lr ..."}`` from the progress lines."""
    lines = [line.split(" | ") for line in text.splitlines() if line.startswith("[finetune] step ")]
    return {int(parts[0].split()[2].split("/")[0]): " | ".join(parts[1:4]) for parts in lines}


def test_kill_9_during_a_save_leaves_nothing_running_and_resumes_exactly(tmp_path):
    """kill -9 rank 1 while the 4th checkpoint is being written (saves every step): nothing of the job
    survives; the resumed run skips the unfinished save and a damaged 3rd checkpoint and continues
    from the 2nd with the losses, gradient norms and LRs the killed run had printed for steps 3-4."""
    common = [*SMALL, "--train-iters", "6"]
    ckpt = tmp_path / "ckpt"
    out, err = open(tmp_path / "killed.out", "w"), open(tmp_path / "killed.err", "w")
    job = subprocess.Popen(_torchrun_cmd(*common, "--save", str(ckpt), "--save-interval", "1"), cwd=ROOT,
                           env=_env(), stdout=out, stderr=err)
    seen = set()  # every process of the job, the checkpoint writers forked during saves included
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "iter_0000004.tmp").exists():  # rank 0 opened the 4th save
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.err").read_text()[-3000:]
            seen |= _descendants(job.pid)
            time.sleep(0.02)
        victim = _rank_pid(job.pid, 1)
        seen |= _descendants(job.pid)
        os.kill(victim, signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
        out.close(), err.close()
    assert job.returncode != 0
    leftover = _wait_gone(seen)
    assert leftover == [], [f"{p}: {_cmdline(p)}" for p in leftover]
    uninterrupted = _steps((tmp_path / "killed.out").read_text())
    assert sorted(uninterrupted)[:4] == [1, 2, 3, 4]

    # the save in progress never became a checkpoint; damage the newest complete one as well
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3" and not (ckpt / "iter_0000004").exists()
    _truncate(ckpt / "iter_0000003" / "__1_0.distcp")
    resumed = _run(*common, "--save", str(ckpt), "--load", str(ckpt))
    assert f"[checkpoint] skipping {ckpt}/iter_0000003: __1_0.distcp has 100 bytes" in resumed.stderr
    assert f"resumed from {ckpt} at iteration 2" in resumed.stdout
    continued = _steps(resumed.stdout)
    assert sorted(continued) == [3, 4, 5, 6]
    assert continued[3] == uninterrupted[3] and continued[4] == uninterrupted[4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_no_complete_checkpoint_is_one_line_and_exit_2(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000002").mkdir(parents=True)  # a save that never finished: no manifest
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    proc = subprocess.run(_torchrun_cmd(*SMALL, "--train-iters", "3", "--load", str(ckpt)), cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and line.startswith("[")]
    assert errors == [f"[finetune] error: no complete checkpoint under {ckpt} (iter_0000002: no "
                      "checkpoint_manifest.json (a save that did not finish, or not written by "
                      "recipes/runtime/checkpointing.py)): move the damaged checkpoints away or point --load at another "
                      "directory"], proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr and "exitcode  : 2" in proc.stderr


# --- a full disk during a save --------------------------------------------------------------------------

def _full_disk_run(what: str, rank: int, iteration: int, *args) -> subprocess.CompletedProcess:
    """recipes/finetune.py on 2 ranks whose save of ``iteration`` hits a full disk (tests/workers/full_disk_worker.py)."""
    worker = os.path.join(ROOT, "tests", "workers", "full_disk_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", worker, what, str(rank),
           str(iteration), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _the_one_error(proc: subprocess.CompletedProcess) -> str:
    """The run failed (exit status 1, no traceback, no watchdog) with exactly one error line: returned."""
    assert proc.returncode != 0 and "exitcode  : 1 " in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line or "No space" in line]
    assert len(errors) == 1 and errors[0].startswith("[finetune] error: "), proc.stderr[-3000:]
    assert "]: Traceback" not in proc.stderr and "no progress" not in proc.stderr, proc.stderr[-3000:]  # a rank's
    return errors[0]


def _intact(directory) -> bool:
    """Every file the manifest lists, with its size and SHA-256."""
    manifest = json.loads((directory / "checkpoint_manifest.json").read_text())["files"]
    return bool(manifest) and all(
        (directory / name).stat().st_size == entry["size"]
        and hashlib.sha256((directory / name).read_bytes()).hexdigest() == entry["sha256"]
        for name, entry in manifest.items())


def test_a_full_disk_in_a_periodic_save_stops_the_run_in_one_line(tmp_path):
    """Rank 1's shard of the iteration-4 save hits a full disk: the run stops there (it would train
    what it cannot save) with one line naming the save, the error, the space a save needs and the
    space free; its partial directory is gone, as is the one a killed save had left, and the
    iteration-2 checkpoint is the latest, intact."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000001.tmp").mkdir(parents=True)  # a killed save's, holding space
    (ckpt / "iter_0000001.tmp" / "__0_0.distcp").write_bytes(b"\0" * 4096)
    proc = _full_disk_run("shard", 1, 4, *SMALL, "--train-iters", "6", "--save", str(ckpt), "--save-interval", "2")
    error = _the_one_error(proc)
    assert sorted(_steps(proc.stdout)) == [1, 2, 3, 4]
    previous = sum(p.stat().st_size for p in (ckpt / "iter_0000002").iterdir() if p.name != "checkpoint_manifest.json")
    assert error.startswith(
        f"[finetune] error: saving iteration 4 to {ckpt} failed (rank 1: [Errno 28] No space left on device); "
        f"removed its partial {ckpt}/iter_0000004.tmp, the latest checkpoint is still iteration 2; a save needs "
        f"about {previous / 2**20:.1f} MiB, {ckpt} has "), error
    assert error.endswith(" free: free space there or give --save another directory, then resume with --load "
                          f"{ckpt}"), error
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2" and _intact(ckpt / "iter_0000002")


def test_a_full_disk_in_the_final_save_on_rank_0_alone_then_a_retry_resumes(tmp_path):
    """The last save's metadata.json, which rank 0 writes alone while rank 1 waits in a barrier,
    hits a full disk: no rank hangs, one line, the partial directory is gone; the retry loads the
    iteration-2 checkpoint, repeats step 3 exactly and saves."""
    ckpt = tmp_path / "ckpt"
    args = [*SMALL, "--train-iters", "3", "--save", str(ckpt)]
    failed = _full_disk_run("metadata", 0, 3, *args, "--save-interval", "2")
    assert _the_one_error(failed).startswith(
        f"[finetune] error: saving iteration 3 to {ckpt} failed (rank 0: [Errno 28] No space left on device); "
        f"removed its partial {ckpt}/iter_0000003.tmp, the latest checkpoint is still iteration 2; ")
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    retried = _run(*args, "--load", str(ckpt))
    assert f"resumed from {ckpt} at iteration 2" in retried.stdout
    assert _steps(retried.stdout) == {3: _steps(failed.stdout)[3]}
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3" and _intact(ckpt / "iter_0000003")


# --- a stopped rank ------------------------------------------------------------------------------------

def test_watchdog_ends_a_job_whose_rank_is_stopped(tmp_path):
    """SIGSTOP rank 1 after step 2: rank 0's watchdog names it in one line and ends rank 0; torchrun
    then ends the job (it SIGKILLs the stopped rank after its fixed 30 s grace, done here at once)."""
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    launcher = [sys.executable, os.path.join(ROOT, "launch", "torchrun.py"), "--nproc_per_node", "2", SCRIPT]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        job = subprocess.Popen([*launcher, *SMALL, "--train-iters", "100000", "--watchdog-timeout", "10"], cwd=ROOT,
                               env=_env(), stdout=out, stderr=err)
    stopped = None
    try:
        deadline = time.monotonic() + 240
        while "[finetune] step 2/" not in out_path.read_text():
            assert job.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.05)
        rank0, stopped = _rank_pid(job.pid, 0), _rank_pid(job.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        assert _wait_gone([rank0], deadline_s=120) == [], err_path.read_text()[-3000:]  # rank 0 ended itself
        os.kill(stopped, signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
    stderr = err_path.read_text()
    messages = [line for line in stderr.splitlines() if line.startswith("[finetune] error:")]
    assert len(messages) == 1, stderr[-3000:]
    assert messages[0].startswith("[finetune] error: no progress for 1")  # 10-19 s
    assert "(--watchdog-timeout 10): rank 1 silent " in messages[0] and "(stopped, killed or cut off)" in messages[0]
    assert "rank 0 stuck in step" in messages[0] and messages[0].endswith("ending the job")
    assert "[torchrun] rank 0 (pid" in stderr and "exited with status 124" in stderr
    assert "Traceback" not in stderr
    assert job.returncode == 124
