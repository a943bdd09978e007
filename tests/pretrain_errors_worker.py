"""Rank-side code of tests/test_pretrain_errors.py, started by torchrun on 2 ranks: recipes/pretrain_gpt.py's
``main`` once per case, one after another in this process (Megatron-LM is imported once), with Megatron-LM's
global state destroyed in between.

Usage: ``pretrain_errors_worker.py OUT_DIR CASES.json``; the spec is ``{"cases": {name: argv}}``. For each case
and rank, ``OUT_DIR/<name>.rank<r>.json`` records the exit status, the captured stdout and stderr (file
descriptors 1 and 2: Megatron-LM's logging included), and whether the rank stopped where it waits for rank
0's report: the launcher ends it there once rank 0 exits, so it is stopped there (after a marker line).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


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


def main(out_dir: str, spec_path: str) -> None:
    from megatron_llep.compat import megatron_training

    reason = megatron_training.missing_reason()
    if reason is not None:  # megatron.training does not import: the tests skip with this reason
        with open(os.path.join(out_dir, "skip.txt"), "w") as f:
            f.write(reason)
        return
    from megatron.training.training import destroy_global_state

    from recipes import entry_point, pretrain_gpt

    rank = int(os.environ["RANK"])
    if rank != 0:
        entry_point.wait_for_rank_zero_report = _ended_by_launcher
    with open(spec_path) as f:
        cases = json.load(f)["cases"]
    for name, argv in cases.items():
        base = os.path.join(out_dir, f"{name}.rank{rank}")
        code, ended = 0, False
        with _captured(base + ".out", base + ".err"):
            try:
                pretrain_gpt.main(argv)
            except SystemExit as exit_:
                code = exit_.code
            except EndedByLauncher:
                ended = True
            except BaseException:  # noqa: BLE001 - recorded as the process would print it
                traceback.print_exc()
                code = 1
        destroy_global_state()
        with open(base + ".out") as out, open(base + ".err") as err:
            result = {"code": code, "ended_by_launcher": ended, "stdout": out.read(), "stderr": err.read()}
        with open(base + ".json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
