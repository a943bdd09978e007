"""Spawn a gloo process group on CPU, run a function on every rank, collect the results."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the launching process dies, so no orphaned rank keeps running."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    _die_with_parent()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    from megatron_llep.testing import cpu_gloo

    cpu_gloo.enable()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report every failure to the parent, then let the group die
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if result[0] != "ok":
        os._exit(1)  # peers may be blocked in a collective with us: do not wait for them
    dist.barrier()
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:
        pass
    dist.destroy_process_group()


def _join_or_kill(procs: list, timeout_s: float, grace_s: float = 20.0) -> None:
    """Wait for all ranks; once one dies abnormally, give the rest ``grace_s`` and kill them (a
    rank blocked in a collective with a dead peer would otherwise hang until ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 900.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo CPU processes; returns per-rank
    results. ``fn`` must be importable (a module-level function). Raises with the failing rank's
    traceback if any rank fails."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, out_dir, fn, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        _join_or_kill(procs, timeout_s)
        results = []
        errors = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}; killed if negative)")
                continue
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
