"""Launchers: Slurm -> torch.distributed env translation, torchrun.sh, and slurm.sbatch on a real local Slurm."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from recipes.runtime.launch_env import expand_hostlist, first_host, rendezvous_env_from_slurm  # noqa: E402

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release

FINETUNE_ARGS = ["--train-iters", "2", "--seq-length", "16", "--micro-batch-size", "1"]
SCRIPTS = ["launch/env.sh", "launch/torchrun.sh", "launch/slurm.sbatch", "launch/local_slurm/start.sh",
           "launch/local_slurm/stop.sh"]


def _srun_task(**overrides):
    """What srun exports to task 1 of a 4-task step on 2 nodes (node[3-4]) of job 123."""
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "node[3-4]", "SLURM_JOB_ID": "123"}
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("", 0))
        return str(s.getsockname()[1])


def _step_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("[finetune] step")]


# --- host lists -----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, hosts", [
    ("vm", ["vm"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    (" gpu[1-2]-ib,login ", ["gpu1-ib", "gpu2-ib", "login"]),
    ("r[1-2]-n[1,3]", ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]),
    ("a[5],b[2-2]", ["a5", "b2"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec, message", [
    ("", "empty host name"),
    ("a,,b", "empty host name"),
    ("n[1-3", "unclosed"),
    ("n1]", "unbalanced"),
    ("n[[1]]", "nested"),
    ("n[3-1]", "descending"),
    ("n[a-b]", "bad range"),
    ("n[1-]", "bad range"),
    ("n[]", "bad range"),
])
def test_expand_hostlist_rejects_bad_syntax(spec, message):
    with pytest.raises(ValueError, match=message):
        expand_hostlist(spec)


def test_first_host_falls_back_to_scontrol_only_for_syntax_it_rejects(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames n[1-" ] && printf "alpha\\nbeta\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path), prepend=os.pathsep)
    assert first_host("node[2-3]") == "node2"
    assert first_host("n[1-") == "alpha"
    fake.write_text("#!/bin/sh\necho 'invalid hostlist' >&2; exit 1\n")
    with pytest.raises(ValueError, match="cannot expand host list 'n\\[1-'.*invalid hostlist"):
        first_host("n[1-")


def test_first_host_without_scontrol_raises_the_parse_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="unclosed"):
        first_host("n[1-")


# --- rendezvous_env_from_slurm ---------------------------------------------------------------------

def test_srun_task_gets_full_rendezvous_env():
    env = _srun_task()
    assert rendezvous_env_from_slurm(env) is True
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node3"}
    assert env["MASTER_PORT"] == "15123"  # deterministic: every task of the job derives the same port


def test_uneven_nodes_and_nodelist_precedence():
    # node 3 of "2(x3),1" holds a single task; the step's node list wins over the job's
    env = _srun_task(SLURM_PROCID="6", SLURM_LOCALID="0", SLURM_NODEID="3", SLURM_STEP_NUM_TASKS="7",
                     SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURM_STEP_NODELIST=None,
                     SLURM_NODELIST="b[07-10]", SLURM_JOB_NODELIST="a[1-9]")
    assert rendezvous_env_from_slurm(env)
    assert (env["RANK"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == ("6", "1", "b07")
    env = _srun_task(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST="a[1-9]")
    assert rendezvous_env_from_slurm(env) and env["MASTER_ADDR"] == "a1"


def test_existing_master_addr_and_port_win_and_port_defaults_without_job_id():
    env = _srun_task(MASTER_ADDR="10.0.0.1", MASTER_PORT="4242")
    assert rendezvous_env_from_slurm(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "4242")
    env = _srun_task(SLURM_JOB_ID=None)
    assert rendezvous_env_from_slurm(env) and env["MASTER_PORT"] == "29500"


@pytest.mark.parametrize("env", [
    _srun_task(RANK="0", WORLD_SIZE="2"),  # torchrun already set everything, under Slurm or not
    {"PATH": "/usr/bin"},  # no Slurm at all
])
def test_leaves_environment_alone_when_not_an_srun_task(env):
    before = dict(env)
    assert rendezvous_env_from_slurm(env) is False
    assert env == before


@pytest.mark.parametrize("overrides, message", [
    ({"SLURM_STEP_NUM_TASKS": None, "SLURM_STEP_TASKS_PER_NODE": None}, "not an srun task"),
    ({"SLURM_STEP_NODELIST": None}, "SLURM_NODELIST"),
    ({"SLURM_PROCID": "4"}, "outside the step's 4 tasks"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 outside"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 outside"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2"}, "does not add up"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2x2"}, "bad SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not a non-negative integer"),
    ({"SLURM_LOCALID": "-1"}, "SLURM_LOCALID='-1' is not a non-negative integer"),
    ({"SLURM_JOB_ID": "12_3"}, "SLURM_JOB_ID='12_3' is not a non-negative integer"),
    ({"WORLD_SIZE": "8"}, "WORLD_SIZE='8' contradicts Slurm's 4"),
    ({"SLURM_STEP_NODELIST": "node[4-3]"}, "descending"),
])
def test_inconsistent_slurm_vars_raise_and_change_nothing(overrides, message, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol fallback for the bad host list
    env = _srun_task(**overrides)
    before = dict(env)
    with pytest.raises(ValueError, match=message):
        rendezvous_env_from_slurm(env)
    assert env == before


# --- scripts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS)
def test_script_syntax(script):
    proc = subprocess.run(["bash", "-n", os.path.join(ROOT, script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _run(cmd, env=None, timeout=120, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, **(env or {}))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


def test_torchrun_sh_usage_and_bad_input():
    proc = _run(["launch/torchrun.sh", "-h"])
    assert proc.returncode == 0 and proc.stdout.startswith("usage: torchrun.sh")
    proc = _run(["launch/torchrun.sh"], env={"NNODES": "2", "NODE_RANK": "2"})
    assert proc.returncode == 2 and "NODE_RANK < NNODES" in proc.stderr
    proc = _run(["launch/torchrun.sh"], env={"MASTER_PORT": "http"})
    assert proc.returncode == 2 and "MASTER_PORT=http is not a non-negative integer" in proc.stderr
    proc = _run(["launch/torchrun.sh"], env={"DISTRIBUTED_CONFIG": "/nonexistent.env"})
    assert proc.returncode == 2 and "is not a file" in proc.stderr
    proc = _run(["launch/torchrun.sh"], env={"LLEP_ENTRY": "serve"})
    assert proc.returncode == 2 and "LLEP_ENTRY must be finetune, pretrain_gpt, evaluate, generate or cap_pipeline" \
        in proc.stderr


def test_torchrun_py_refuses_a_rendezvous_that_cannot_work():
    """A busy port on this machine, a port out of range and an unresolvable master: one line, exit 2,
    before any worker starts (torchrun would print a traceback or wait)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags, message in ((["--master_port", str(port)], f"--master_port (MASTER_PORT) {port} is in use"),
                               (["--master_port", "70000"], "70000 is not a port: give one in 1-65535"),
                               (["--master_addr", "no-such-host.invalid", "--master_port", "29555"],
                                "--master_addr (MASTER_ADDR) no-such-host.invalid does not resolve")):
            proc = _run([sys.executable, "launch/torchrun.py", "--nproc_per_node", "1", *flags, "recipes/finetune.py"])
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert proc.stderr.strip().splitlines() == [f"[torchrun] error: {proc.stderr.split('error: ')[1].strip()}"]
            assert message in proc.stderr, proc.stderr
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    from torchrun import rendezvous_problem  # no port on one node: torchrun picks a free one (README's command)

    assert rendezvous_problem(["--nproc_per_node", "2", "recipes/finetune.py"]) is None
    assert "does not resolve" in rendezvous_problem(["--nnodes", "2", "--master_addr", "no-such-host.invalid", "x.py"])


def test_torchrun_sh_starts_the_inference_entry_points():
    proc = _run(["launch/torchrun.sh", "--random-init", "--seq-length", "32", "--eval-iters", "1"],
                env={"LLEP_ENTRY": "evaluate", "MASTER_PORT": _free_port()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[evaluate] loss " in proc.stdout, proc.stdout


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_torchrun_sh_ends_a_stopped_run_in_one_line(how, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) or SIGTERM to the launcher: the workers save and
    stop, and the launcher ends with one line and 128 + the signal, not torchrun's traceback."""
    sig = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, MASTER_PORT=_free_port())
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(["launch/torchrun.sh", *FINETUNE_ARGS[2:], "--train-iters", "100000", "--save",
                                 str(ckpt)], cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "[finetune] step 2/" not in out_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.05)
        if how == "ctrl-c":
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = err_path.read_text()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert f"[torchrun] stopped by {sig.name}" in err.splitlines()[-1]
    assert "Traceback" not in err, err[-3000:]
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 2 and (ckpt / f"iter_{iteration:07d}" / "checkpoint_manifest.json").is_file()
    assert f"[finetune] stopped by {sig.name} after iteration {iteration}: saved in {ckpt}/iter_{iteration:07d}" in err


def test_torchrun_sh_reports_a_failed_worker_in_one_line():
    proc = _run(["launch/torchrun.sh", *FINETUNE_ARGS, "--global-batch-size", "3"], env={"MASTER_PORT": _free_port()})
    assert proc.returncode == 2, proc.stderr[-3000:]  # the worker's usage-error status, not torchrun's 1
    assert "not a multiple of micro batch x DP" in proc.stderr
    assert "[torchrun] rank 0 (pid" in proc.stderr and "exited with status 2" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_torchrun_sh_trains_on_two_cpu_ranks(tmp_path):
    # the sourced config file overrides the environment: without it the bad port would be rejected
    config = tmp_path / "distributed_config.env"
    config.write_text(f"MASTER_PORT={_free_port()}\n")
    proc = _run(["launch/torchrun.sh", *FINETUNE_ARGS], env={"DISTRIBUTED_CONFIG": str(config), "MASTER_PORT": "x"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_step_lines(proc.stdout)) == 2, proc.stdout


# --- real single-node Slurm ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "sinfo") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"slurm binaries not installed ({', '.join(missing)}): apt-get install -y slurm-wlm munge")
    cluster = tmp_path_factory.mktemp("slurm")
    try:
        proc = _run(["launch/local_slurm/start.sh", str(cluster)], timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield {"SLURM_CONF": str(cluster / "slurm.conf")}, cluster
    finally:
        _run(["launch/local_slurm/stop.sh", str(cluster)], timeout=60)


def test_sbatch_header_fits_any_node_and_logs_into_ignored_logs_dir():
    """torchrun mode's defaults: one task per node (torchrun starts the processes), not 8 tasks that
    a smaller node never grants; job logs in logs/, which exists (sbatch does not create it) and
    whose contents git ignores."""
    with open(os.path.join(ROOT, "launch", "slurm.sbatch")) as f:
        options = (line.split()[1][2:].partition("=") for line in f if line.startswith("#SBATCH --"))
        header = {name: value for name, _, value in options}
    assert header["ntasks-per-node"] == "1" and header["nodes"] == "1"
    assert header["output"] == "logs/%x-%j.log" and os.path.isdir(os.path.join(ROOT, "logs"))
    if shutil.which("git") and os.path.isdir(os.path.join(ROOT, ".git")):
        ignored = subprocess.run(["git", "check-ignore", "-q", "logs/llep-1.log"], cwd=ROOT)
        kept = subprocess.run(["git", "check-ignore", "-q", "logs/.gitkeep"], cwd=ROOT)
        assert ignored.returncode == 0 and kept.returncode == 1


def _sbatch(local_slurm, mode, ntasks_per_node=None):
    env, cluster = local_slurm
    log = cluster / f"{mode}.log"
    # --time: Slurm itself ends a hung job, so sbatch --wait returns and the log explains
    tasks = [] if ntasks_per_node is None else [f"--ntasks-per-node={ntasks_per_node}"]  # None: the header's
    cmd = ["sbatch", "--wait", "--time=2", *tasks, f"--output={log}", "launch/slurm.sbatch", *FINETUNE_ARGS]
    try:
        proc = _run(cmd, env=dict(env, LAUNCH_MODE=mode, MASTER_PORT=_free_port()), timeout=150)
    except subprocess.TimeoutExpired:
        queue = _run(["squeue", "-o", "%i %T %r"], env=env).stdout
        pytest.fail(f"job did not finish (never scheduled?); squeue:\n{queue}")
    text = log.read_text() if log.exists() else "(no job log)"
    assert proc.returncode == 0, proc.stdout + proc.stderr + text[-3000:]
    assert f"mode {mode}" in text, text[-3000:]
    assert len(_step_lines(text)) == 2, text[-3000:]


def test_sbatch_torchrun_mode_one_task_two_processes(local_slurm):
    _sbatch(local_slurm, "torchrun")  # the header's task count


def test_sbatch_per_task_mode_two_tasks(local_slurm):
    _sbatch(local_slurm, "per-task", 2)
