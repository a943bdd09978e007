"""Rank-side code of the tests that run many cases of the entry points in one torchrun launch
(tests/integrations/test_pretrain_errors.py, tests/entry_points/test_outputs.py): each case's ``main`` runs in this process, one
after another (torch, Megatron-Core and Megatron-LM are imported once), with the process group, the
watchdog, Megatron's global state and the environment variables put back in between.

Usage: ``entry_cases_worker.py OUT_DIR SPEC.json``. The spec is ``{"full_disk": "tmpfs" | "injected" |
null, "cases": {name: case}}``, a case ``{"entry": module, "argv": [...], "ranks": [0, 1] (who runs
it; default all), "full": {"dir": D, "size": bytes, "leave": bytes, "part": text, "previous":
{path: text}} (optional)}``. With ``full``, before the case rank 0 writes the ``previous`` files
(paths under D) and D's disk is full: a tmpfs of ``size`` (default 1 MiB) mounted at D at start-up
(this launch runs in a user and mount namespace; megatron_llep/testing/full_disk.py) filled up to
``leave`` free bytes, or writes to paths containing ``part`` (default D) failing with ENOSPC on every
rank; after the case, rank 0 records what D holds then. Without megatron.training (megatron-core
0.16), pretraining cases are skipped and ``OUT_DIR/skip.txt`` says why.

For each case and rank, ``OUT_DIR/<name>.rank<r>.json`` records the exit status, the captured stdout
and stderr (file descriptors 1 and 2: Megatron's logging included), whether the rank stopped where
it waits for rank 0's report (the launcher ends it there once rank 0 exits, so it is stopped there,
after a marker line) and, on rank 0 of a full-disk case, ``files``: every file under D (the filler
aside) with its text.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import sys
import traceback
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_llep.testing import full_disk  # noqa: E402


class EndedByLauncher(BaseException):
    """Where torchrun would end this rank (rank 0 has exited with the error)."""


@contextlib.contextmanager
def _captured(stdout_path: str, stderr_path: str) -> Iterator[None]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _ended_by_launcher() -> None:
    print("<ended by the launcher while waiting for rank 0's report>", file=sys.stderr, flush=True)
    raise EndedByLauncher


def _process_groups_per_case() -> None:
    """Each case's process group gets keys of its own in the launcher's store: a second
    ``init_process_group`` over the same keys reads the last one's addresses."""
    import torch.distributed as dist

    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=120))
    init = dist.init_process_group

    def init_for_this_case(backend=None, **kwargs):
        if kwargs.get("store") is None:
            kwargs.pop("init_method", None)
            kwargs.update(store=dist.PrefixStore(f"case{os.environ['TORCHELASTIC_RESTART_COUNT']}/", base),
                          rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        return init(backend, **kwargs)

    dist.init_process_group = init_for_this_case


def _tear_down() -> None:
    """What a case's process leaves for the next one: the watchdog, Megatron's and Megatron-LM's
    state, the process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from recipes.runtime import watchdog

    watchdog.stop()
    parallel_state.destroy_model_parallel()
    if "megatron.training" in sys.modules:
        from megatron.training.training import destroy_global_state

        destroy_global_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def _files(directory: str) -> dict[str, str]:
    found = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            if name != ".filler":
                with open(path, "rb") as f:
                    found[os.path.relpath(path, directory)] = f.read(4096).decode("utf-8", "replace")
    return found


def _run(case: dict) -> tuple[object, bool]:
    """The case's exit status (0: returned) and whether it stopped waiting for rank 0's report."""
    try:
        importlib.import_module(case["entry"]).main(case["argv"])
    except SystemExit as exit_:
        return exit_.code, False
    except EndedByLauncher:
        return None, True
    except BaseException:  # noqa: BLE001 - recorded as the process would print it
        traceback.print_exc()
        return 1, False
    return 0, False


def main(out_dir: str, spec_path: str) -> None:
    from megatron_llep.compat import megatron_training
    from recipes.runtime import entry_point

    rank = int(os.environ["RANK"])
    with open(spec_path) as f:
        spec = json.load(f)
    reason = megatron_training.missing_reason()
    if reason is not None and any(case["entry"] == "recipes.pretrain_gpt" for case in spec["cases"].values()):
        with open(os.path.join(out_dir, "skip.txt"), "w") as f:  # the pretraining tests skip with this reason
            f.write(reason)
    if rank != 0:
        entry_point.wait_for_rank_zero_report = _ended_by_launcher
    _process_groups_per_case()
    if spec.get("full_disk") == "tmpfs" and rank == 0:
        for case in spec["cases"].values():
            if case.get("full"):
                full_disk.mount_tmpfs(case["full"]["dir"], case["full"].get("size", 2**20))
    for number, (name, case) in enumerate(spec["cases"].items()):
        if rank not in case.get("ranks", [rank]) or (reason is not None and case["entry"] == "recipes.pretrain_gpt"):
            continue
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(number)  # the watchdog's and process group's keys
        base = os.path.join(out_dir, f"{name}.rank{rank}")
        full = case.get("full")
        filler = None
        if full and rank == 0:
            for path, text in full.get("previous", {}).items():
                os.makedirs(os.path.dirname(os.path.join(full["dir"], path)), exist_ok=True)
                with open(os.path.join(full["dir"], path), "w") as f:
                    f.write(text)
            if spec.get("full_disk") == "tmpfs":
                filler = full_disk.fill(full["dir"], full.get("leave", 0))
        injected = full_disk.injected(full.get("part", full["dir"].rstrip("/") + "/")) \
            if full and spec.get("full_disk") == "injected" else contextlib.nullcontext()
        environment = dict(os.environ)
        with _captured(base + ".out", base + ".err"), injected:
            code, ended = _run(case)
            _tear_down()
        os.environ.clear()  # what the case set (Megatron's NVTE_* attention choices, WANDB_MODE) goes with it
        os.environ.update(environment)
        result = {"code": code, "ended_by_launcher": ended}
        with open(base + ".out") as out, open(base + ".err") as err:
            result.update(stdout=out.read(), stderr=err.read())
        if full and rank == 0:
            result["files"] = _files(full["dir"])
            if filler:
                os.remove(filler)
        with open(base + ".json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
