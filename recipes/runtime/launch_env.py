"""torch.distributed rendezvous variables from Slurm, for ``srun`` launching one task per process.

torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT itself;
an ``srun`` step without torchrun only has SLURM_* variables. ``rendezvous_env_from_slurm`` translates
them so ``init_process_group`` (env:// rendezvous) works unchanged under both launchers.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from typing import MutableMapping

# Below Linux's ephemeral range (32768+), so the derived port does not collide with client sockets.
_PORT_BASE, _PORT_SPAN = 15000, 15000
_DEFAULT_PORT = 29500  # torchrun's default, when there is no job id to derive one from
# One task's view of its step. SLURM_STEP_* exist only inside srun steps: a batch script also has
# SLURM_PROCID=0 but the job's SLURM_NTASKS, and would wait forever for ranks that never start.
_REQUIRED = ("SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE")
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")


def _split_top_level(spec: str) -> list[str]:
    """Split at commas outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in host list {spec!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {spec!r}")
        elif char == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in host list {spec!r}")
    parts.append(spec[start:])
    return parts


def _expand_range_set(body: str, spec: str) -> list[str]:
    """ "01-03,7" -> ["01", "02", "03", "7"]; a range keeps the zero padding of its lower bound, as Slurm does."""
    values = []
    for item in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise ValueError(f"bad range {item!r} in host list {spec!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"descending range {item!r} in host list {spec!r}")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return values


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm host list ("node[01-03,7],gpu[1-2]-ib,login") into host names, in order."""
    hosts = []
    for part in _split_top_level(spec.strip()):
        part = part.strip()
        if not part:
            raise ValueError(f"empty host name in host list {spec!r}")
        # "rack[1-2]-n[1-2]" is a product of its bracket groups, the literal text in between is kept
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [[text] if i % 2 == 0 else _expand_range_set(text, spec) for i, text in enumerate(pieces)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def first_host(spec: str) -> str:
    """First host of a Slurm host list; ``scontrol show hostnames`` only for syntax this parser rejects."""
    try:
        return expand_hostlist(spec)[0]
    except ValueError:
        if shutil.which("scontrol") is None:
            raise
        out = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True, text=True)
        if out.returncode != 0 or not out.stdout.split():
            raise ValueError(f"cannot expand host list {spec!r}: {out.stderr.strip()}") from None
        return out.stdout.split()[0]


def _tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"bad SLURM_STEP_TASKS_PER_NODE {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _int(environ: MutableMapping[str, str], name: str) -> int:
    if not re.fullmatch(r"\d+", environ[name]):  # int() would also take "-1", " 7" and "1_0"
        raise ValueError(f"{name}={environ[name]!r} is not a non-negative integer")
    return int(environ[name])


def rendezvous_env_from_slurm(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Fill RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from an srun task's SLURM_*.

    Returns False and changes nothing when RANK is already set (torchrun) or SLURM_PROCID is not (no srun).
    MASTER_ADDR and MASTER_PORT already in the environment win; otherwise rank 0's host (the first host of
    the step) and a port derived from SLURM_JOB_ID, so concurrent jobs sharing a node do not collide.
    Raises ValueError when the Slurm variables are missing or contradict each other.
    """
    if "RANK" in environ or "SLURM_PROCID" not in environ:
        return False
    missing = [name for name in _REQUIRED if name not in environ]
    nodelist_var = next((name for name in _NODELIST_VARS if name in environ), None)
    if nodelist_var is None:
        missing.append("SLURM_NODELIST")
    if missing:
        raise ValueError(
            f"SLURM_PROCID is set but {', '.join(missing)} not: this is not an srun task "
            "(e.g. the batch script itself); launch one task per process with srun, or use torchrun"
        )
    rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_STEP_NUM_TASKS")
    local_rank, node = _int(environ, "SLURM_LOCALID"), _int(environ, "SLURM_NODEID")
    per_node = _tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
    if sum(per_node) != world:
        raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']!r} does not add up to "
                         f"SLURM_STEP_NUM_TASKS={world}")
    if node >= len(per_node):
        raise ValueError(f"SLURM_NODEID={node} outside the step's {len(per_node)} node(s)")
    if rank >= world or local_rank >= per_node[node]:
        raise ValueError(f"SLURM_PROCID={rank} / SLURM_LOCALID={local_rank} outside the step's {world} tasks "
                         f"({per_node[node]} on node {node})")
    values = {"WORLD_SIZE": world, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": per_node[node]}
    for name, value in values.items():
        if name in environ and environ[name] != str(value):
            raise ValueError(f"{name}={environ[name]!r} contradicts Slurm's {value}; unset it or use torchrun")
    if "MASTER_ADDR" not in environ:
        values["MASTER_ADDR"] = first_host(environ[nodelist_var])
    if "MASTER_PORT" not in environ:
        job = _int(environ, "SLURM_JOB_ID") if "SLURM_JOB_ID" in environ else None
        values["MASTER_PORT"] = _DEFAULT_PORT if job is None else _PORT_BASE + job % _PORT_SPAN
    values["RANK"] = rank  # last and only after every check, so a failure leaves the environment untouched
    environ.update({name: str(value) for name, value in values.items()})
    return True
