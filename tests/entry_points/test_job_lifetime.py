"""How a job ends when one of its ranks, or its launcher, is killed, stopped or signalled, for the
fine-tuning loop and Megatron-LM's (recipes/runtime/entry_point.py, recipes/runtime/watchdog.py,
recipes/runtime/parent_death.py), on CPU with gloo and 2 ranks under launch/torchrun.py:

* kill -9 of a rank: the surviving rank says in one line which rank died; no traceback;
* kill -9 of a pretraining rank during a save: none of its processes survives it (Megatron-Core's
  result Manager and its resource tracker are never started), and the survivor's line names it;
* SIGSTOP of a pretraining rank: its watchdog names it (Megatron-LM's collective timeout is above it);
* kill -9 of torchrun: the ranks save and stop;
* SIGTERM to the ranks themselves: they save, say how to resume, and exit 143;
* Ctrl-C during generation: the launcher's one line, exit 130.

The pretraining tests need megatron.training (megatron-core >= 0.17) and skip without it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test_checkpoint_recovery import _alive, _cmdline, _descendants, _rank_pid, _wait_gone
from test_pretrain import MODEL, TRAINING, _env, _free_port, needs_megatron_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(ROOT, "launch", "torchrun.py")
FINETUNE = os.path.join(ROOT, "recipes", "finetune.py")
PRETRAIN = os.path.join(ROOT, "recipes", "pretrain_gpt.py")
GENERATE = os.path.join(ROOT, "recipes", "generate.py")
FINETUNE_ARGS = ["--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "100000"]
PRETRAIN_STEP_2 = " iteration        2/"  # Megatron-LM's progress line after the second step


class Job:
    """A 2-rank job under launch/torchrun.py with its output in files. Leaving the block ends every
    process of it still running: the launcher and whatever it started (tracked while waiting), each
    only while it is still the process that was seen."""

    def __init__(self, tmp_path, script: str, *args: str) -> None:
        self.out_path, self.err_path = tmp_path / "out", tmp_path / "err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, LAUNCHER, "--nproc_per_node", "2", "--master_port",
                                          _free_port(), script, *args], cwd=ROOT, env=_env(), stdout=out, stderr=err)
        self.seen: dict[int, str] = {}

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.track()
        for pid, cmdline in [(self.proc.pid, None), *self.seen.items()]:
            if _alive(pid) and (cmdline is None or _cmdline(pid) == cmdline):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def track(self) -> None:
        """Remember every process of the job running now."""
        for pid in _descendants(self.proc.pid) - set(self.seen):
            self.seen[pid] = _cmdline(pid)

    def wait_for(self, text: str, deadline_s: float = 240, path=None) -> None:
        """Until ``text`` is printed (to stdout unless ``path``)."""
        path = path or self.out_path
        deadline = time.monotonic() + deadline_s
        while text not in path.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()[-3000:]
            self.track()
            time.sleep(0.02)
        self.track()

    def rank(self, rank: int) -> int:
        return _rank_pid(self.proc.pid, rank)

    def wait(self) -> int:
        return self.proc.wait(timeout=180)

    def stderr(self) -> str:
        return self.err_path.read_text()

    def errors(self, label: str) -> list[str]:
        return [line for line in self.stderr().splitlines() if line.startswith(f"[{label}] error:")]


@pytest.fixture(scope="module")
def pretrain_data(tmp_path_factory) -> list[str]:
    """Megatron-LM's data flags for a tiny indexed dataset of the shipped SFT records."""
    from recipes.runtime.indexed_data import build_indexed_dataset

    out = tmp_path_factory.mktemp("lifetime_data")
    prefix, _, _ = build_indexed_dataset(os.path.join(ROOT, "recipes", "data", "tiny_sft.jsonl"), str(out / "sft"))
    return [*MODEL, *TRAINING, "--data-path", prefix, "--data-cache-path", str(out / "cache"), "--train-iters", "100000"]


def _stop_line(label: str, ckpt, iteration: int) -> str:
    return (f"[{label}] stopped by SIGTERM after iteration {iteration}: saved in {ckpt}/iter_{iteration:07d}; "
            f"resume with --load {ckpt}")


def test_a_killed_rank_is_named_in_one_line(tmp_path):
    """kill -9 rank 1 mid-run: rank 0's collective fails (gloo: connection reset); it prints one line naming
    rank 1, which its heartbeat's pid shows dead, and exits non-zero; no traceback anywhere."""
    with Job(tmp_path, FINETUNE, *FINETUNE_ARGS) as job:
        job.wait_for("[finetune] step 3/")
        victim = job.rank(1)
        os.kill(victim, signal.SIGKILL)
        assert job.wait() == 128 + signal.SIGKILL
    stderr = job.stderr()
    errors = job.errors("finetune")
    assert len(errors) == 1 and errors[0].startswith("[finetune] error: rank 1 died, last heard in "), stderr[-3000:]
    assert errors[0].endswith("; ending the job")
    # the launcher's line: rank 0 failed too (with the lost-peer status 75, not torchrun's SIGTERM: it ignores that)
    assert f"[torchrun] rank 1 (pid {victim}) was killed by SIGKILL (1 other rank(s) failed after it)" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]


@needs_megatron_training
def test_a_pretraining_rank_killed_during_a_save_leaves_nothing_running(tmp_path, pretrain_data):
    """kill -9 rank 1 as Megatron-LM starts writing the 3rd checkpoint (one per step; a save of this
    model takes a fraction of a second, so it may just have ended): no process of the job survives.
    Megatron-Core's results Manager (~300 MB, spawned at the first save) and its resource tracker,
    which would outlive the killed rank, are never started. Rank 0 (which, with --exit-signal-handler,
    finishes its step on torchrun's SIGTERM instead of dying at once) says which rank died."""
    ckpt = tmp_path / "ckpt"
    with Job(tmp_path, PRETRAIN, *pretrain_data, "--save", str(ckpt), "--save-interval", "1",
             "--exit-signal-handler") as job:
        job.wait_for(" iteration        1/")
        victim, deadline, tracked = job.rank(1), time.monotonic() + 240, 0.0
        while not (ckpt / "iter_0000003").exists():  # Megatron-LM writes into it directly
            assert job.proc.poll() is None and time.monotonic() < deadline, job.stderr()[-3000:]
            if time.monotonic() - tracked > 0.25:  # the Manager would live from the first save on
                job.track()
                tracked = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert job.wait() == 128 + signal.SIGKILL
        leftover = _wait_gone(list(job.seen), 60)
        assert leftover == [], [f"{pid}: {job.seen[pid]}" for pid in leftover]
    assert len(job.seen) > 2 and not [cmdline for cmdline in job.seen.values() if "multiprocessing" in cmdline]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() in ("2", "3")
    errors = job.errors("pretrain_gpt")
    assert len(errors) == 1 and errors[0].startswith("[pretrain_gpt] error: rank 1 died, last heard in "), \
        job.stderr()[-3000:]
    assert errors[0].endswith("; ending the job") and "Traceback" not in job.stderr(), job.stderr()[-3000:]


@needs_megatron_training
def test_the_pretraining_watchdog_names_a_stopped_rank(tmp_path, pretrain_data):
    """SIGSTOP rank 1 after step 2: rank 0's watchdog (--watchdog-timeout 10) names it in one line and ends
    rank 0 (exit 124); Megatron-LM's collectives time out only later (--distributed-timeout-minutes, set
    above the watchdog's longest allowance: 4 x 10 s + 30 s, 2 minutes)."""
    with Job(tmp_path, PRETRAIN, *pretrain_data, "--watchdog-timeout", "10") as job:
        job.wait_for(PRETRAIN_STEP_2)
        rank0, stopped = job.rank(0), job.rank(1)
        os.kill(stopped, signal.SIGSTOP)
        assert _wait_gone([rank0], 120) == [], job.stderr()[-3000:]
        os.kill(stopped, signal.SIGKILL)  # torchrun would after 30 s
        assert job.wait() == 124
    errors = job.errors("pretrain_gpt")
    assert len(errors) == 1, job.stderr()[-3000:]
    assert errors[0].startswith("[pretrain_gpt] error: no progress for 1")  # 10-19 s
    assert re.search(r"\(--watchdog-timeout 10\): rank 1 silent for 1\d s, last heard in step \d+ \(stopped, killed "
                     r"or cut off\); rank 0 stuck in step \d+; ending the job$", errors[0]), errors[0]
    assert "distributed_timeout_minutes ..................... 2\n" in job.out_path.read_text()
    assert "Traceback" not in job.stderr()


@pytest.mark.parametrize("entry", ["finetune", pytest.param("pretrain_gpt", marks=needs_megatron_training)])
def test_sigterm_to_the_ranks_saves_and_exits_143(entry, tmp_path, request):
    """SIGTERM sent to the ranks themselves (not to torchrun): they finish the step, save, say so in one
    line with how to resume, and exit 128 + 15 like a process SIGTERM ended, not 0 like a finished run.
    Megatron-LM saves on a signal only with its --exit-signal-handler."""
    ckpt = tmp_path / "ckpt"
    if entry == "finetune":
        script, args, step_2 = FINETUNE, FINETUNE_ARGS, "[finetune] step 2/"
    else:
        script, step_2 = PRETRAIN, PRETRAIN_STEP_2
        args = [*request.getfixturevalue("pretrain_data"), "--save-interval", "1000", "--exit-signal-handler"]
    with Job(tmp_path, script, *args, "--save", str(ckpt)) as job:
        job.wait_for(step_2)
        for rank in (0, 1):
            os.kill(job.rank(rank), signal.SIGTERM)
        assert job.wait() == 128 + signal.SIGTERM, job.stderr()[-3000:]
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 2
    stops = [line for line in job.stderr().splitlines() if "stopped by" in line and line.startswith(f"[{entry}]")]
    assert stops == [_stop_line(entry, ckpt, iteration)], job.stderr()[-3000:]
    assert "exited with status 143" in job.stderr().splitlines()[-1]
    assert "Traceback" not in job.stderr()


def test_the_ranks_of_a_killed_torchrun_save_and_stop(tmp_path):
    """kill -9 of torchrun (the ranks' parent, which held the rendezvous store): the kernel sends the
    ranks SIGTERM (PR_SET_PDEATHSIG), so they save and stop instead of going on unsupervised."""
    ckpt = tmp_path / "ckpt"
    with Job(tmp_path, FINETUNE, *FINETUNE_ARGS, "--save", str(ckpt)) as job:
        job.wait_for("[finetune] step 2/")
        ranks = [job.rank(0), job.rank(1)]
        os.kill(job.proc.pid, signal.SIGKILL)
        job.wait()
        assert _wait_gone(ranks, 120) == [], job.stderr()[-3000:]
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert (ckpt / f"iter_{iteration:07d}" / "checkpoint_manifest.json").is_file()
    stops = [line for line in job.stderr().splitlines() if line.startswith("[finetune] stopped by")]
    assert stops == [_stop_line("finetune", ckpt, iteration)], job.stderr()[-3000:]
    assert "Traceback" not in job.stderr()


def test_ctrl_c_during_generation_ends_in_the_launchers_one_line(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group: the launcher and every rank) while generate.py decodes:
    the ranks end as SIGTERM ends them, without KeyboardInterrupt tracebacks, gloo errors or Megatron-Core's
    faulthandler stack dumps, and the launcher's one line does not speak of fine-tuning's --save."""
    with Job(tmp_path, GENERATE, "--random-init", "--prompt", "hi", "--max-new-tokens", "400") as job:
        job.wait_for("Megatron-Core's static inference engine")
        for pid in (job.proc.pid, job.rank(0), job.rank(1)):
            os.kill(pid, signal.SIGINT)
        assert job.wait() == 128 + signal.SIGINT, job.stderr()[-3000:]
    stderr = job.stderr()
    assert stderr.splitlines()[-1] == "[torchrun] stopped by SIGINT: the workers got it too", stderr[-3000:]
    for noise in ("Traceback", "KeyboardInterrupt", "Stack (most recent call first)", "[rank", "Gloo", "error:"):
        assert noise not in stderr, (noise, stderr[-3000:])


# --- the pieces, in this process ------------------------------------------------------------------------

def test_start_up_and_checkpoint_phases_are_long_ones(monkeypatch):
    """Start-up and checkpoint saves and loads may take 4 timeouts; leaving them restarts the clock."""
    from recipes.runtime import watchdog

    dog = watchdog.Watchdog(10, rank=0, world=2)
    monkeypatch.setattr(watchdog, "_active", dog)
    assert dog._state[2] is True  # start-up
    watchdog.progress("step 1")
    assert dog._state[::2] == ("step 1", False)
    with watchdog.long_phases():
        watchdog.progress("saving iteration 1")
        assert dog._state[::2] == ("saving iteration 1", True)
    assert dog._state[::2] == ("saving iteration 1", False)
    watchdog.progress("building the model", long=True)
    assert dog._state[::2] == ("building the model", True)
    assert watchdog.collective_timeout(60).total_seconds() == 4 * 60 + 120


def test_megatron_lms_collective_timeout_is_set_above_the_watchdog():
    from recipes.runtime.watchdog import megatron_lm_timeouts

    # the longest allowance (4 timeouts) plus half of it, in whole minutes: 60 s -> 360 s, 600 s -> 3600 s
    assert megatron_lm_timeouts(["--llep"], on_gpu=False) == (60.0, ["--llep", "--distributed-timeout-minutes", "6"])
    assert megatron_lm_timeouts([], on_gpu=True) == (600.0, ["--distributed-timeout-minutes", "60"])
    assert megatron_lm_timeouts(["--watchdog-timeout", "0"], on_gpu=False) == (0.0, ["--watchdog-timeout", "0"])
    given = ["--watchdog-timeout", "60", "--distributed-timeout-minutes", "2"]
    assert megatron_lm_timeouts(given, on_gpu=False) == (60.0, given)  # a shorter one, but above a step's allowance
    with pytest.raises(ValueError, match=r"^--distributed-timeout-minutes 1 ends a stuck collective before the "
                                         r"watchdog \(--watchdog-timeout 60\) can name .*give at least 2, or a lower"):
        megatron_lm_timeouts(["--watchdog-timeout", "60", "--distributed-timeout-minutes", "1"], on_gpu=False)
    with pytest.raises(ValueError, match=r"^--watchdog-timeout must be >= 0 seconds \(0: off\), got -1.0$"):
        megatron_lm_timeouts(["--watchdog-timeout", "-1"], on_gpu=False)
    with pytest.raises(ValueError, match=r"^argument --watchdog-timeout: invalid float value: 'soon'$"):
        megatron_lm_timeouts(["--watchdog-timeout", "soon"], on_gpu=False)


def test_a_lost_connection_is_told_from_a_ranks_own_error():
    """Without a watchdog (no heartbeats), a collective's lost connection still ends in one line; any other
    error is this rank's own and keeps its traceback."""
    from recipes.runtime.watchdog import lost_peer_line

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9134: Connection reset by peer. "
                        "This is typically caused by a remote worker hanging")
    assert lost_peer_line(gloo) == ("lost the connection to another rank (Connection reset by peer): a rank died or "
                                    "was cut off; ending the job")
    try:  # wrapped by the code that caught it
        try:
            raise gloo
        except RuntimeError as err:
            raise ValueError("the step failed") from err
    except ValueError as wrapped:
        assert lost_peer_line(wrapped).startswith("lost the connection to another rank (Connection reset by peer)")
    assert lost_peer_line(ValueError("a bug")) is None


def test_a_rank_ending_for_a_lost_peer_is_not_named_as_the_cause(tmp_path):
    """end_after_lost_peer prints the line, runs the Python exit handlers (the save lock's release) and exits
    with the lost-peer status; the launcher then names the rank that died, although torchrun's whole-second
    timestamps tie and the survivor comes first; with a status of its own it names the survivor."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    sys.path.insert(0, os.path.join(ROOT, "launch"))
    from torchrun import LOST_PEER_EXIT_CODE, first_cause

    from recipes.runtime import watchdog

    assert LOST_PEER_EXIT_CODE == watchdog.LOST_PEER_EXIT_CODE
    handled = tmp_path / "atexit"
    code = (f"import atexit, pathlib; atexit.register(pathlib.Path({str(handled)!r}).touch); "
            "from recipes.runtime import watchdog; watchdog.end_after_lost_peer('[finetune] error: rank 1 died'); "
            "print('not reached')")
    ended = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert (ended.returncode, ended.stdout, ended.stderr) == (LOST_PEER_EXIT_CODE, "", "[finetune] error: rank 1 died\n")
    assert handled.exists()

    def failed(local_rank: int, exitcode: int) -> ProcessFailure:
        failure = ProcessFailure(local_rank=local_rank, pid=10 + local_rank, exitcode=exitcode,
                                 error_file=str(tmp_path / "none.json"))
        failure.timestamp = 1_700_000_000  # the same second
        return failure

    killed = failed(1, -signal.SIGKILL)
    assert first_cause(ChildFailedError("finetune.py", {0: failed(0, LOST_PEER_EXIT_CODE), 1: killed}))[0] == 1
    assert first_cause(ChildFailedError("finetune.py", {0: failed(0, 1), 1: killed}))[0] == 0  # negative control


def test_the_watchdog_tells_dead_ranks_from_silent_ones():
    """A rank whose process on this machine is gone died; one whose heartbeat is stale (its process stopped,
    or on another machine) went silent; a fresh heartbeat from another machine is live."""
    from recipes.runtime import watchdog

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    dog = watchdog.Watchdog(10, rank=0, world=5)
    now = time.time()
    here = watchdog._machine()
    beats = {0: {"phase": "step 4", "beat": now, "pid": os.getpid(), "machine": here},
             1: {"phase": "step 3", "beat": now - 1, "pid": dead_pid, "machine": here},
             2: {"phase": "step 3", "beat": now - 60, "pid": os.getpid(), "machine": here},
             3: None,
             4: {"phase": "step 4", "beat": now - 1, "pid": dead_pid, "machine": "elsewhere/1"}}
    gone = dog._gone(beats, now)
    assert gone == {1: "died", 2: "silent", 3: "silent"}
    assert dog._describe(beats, gone, now) == [
        "rank 1 died, last heard in step 3",
        "rank 2 silent for 60 s, last heard in step 3 (stopped, killed or cut off)",
        "rank 3 silent since start-up (stopped, killed or cut off)"]
