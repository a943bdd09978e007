"""torchrun (``python -m torch.distributed.run``, same arguments) that ends in one line, not a traceback.

torchrun itself reports Ctrl-C / SIGTERM (slurm preemption) by raising ``SignalException`` and a
failed worker by raising ``ChildFailedError``, each with a Python traceback; it has no option to
turn them off. This wrapper runs torchrun's own ``main`` (its error-file handling included) and
turns both into one line and the conventional exit status: 128 + the signal for a signal (the
workers were sent it too and, with ``--save``, save and stop), the first failed worker's own
status (e.g. 2 for a usage error) when a worker fails. Workers' own messages are theirs.
"""

from __future__ import annotations

import signal
import sys
from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


def exit_status(exitcode: int) -> int:
    """A worker's status as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun with ``argv`` (default: the command line); returns the exit status."""
    try:
        torchrun_main(list(argv) if argv is not None else None)
    except SignalException as err:
        print(f"[torchrun] stopped by {err.sigval.name}: the workers got it too (recipes/finetune.py saves with "
              "--save, then stops)", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        how = (f"was killed by {_signal_name(-failure.exitcode)}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode}")
        others = len(err.failures) - 1
        after = f" ({others} other rank(s) failed after it)" if others else ""
        print(f"[torchrun] rank {rank} (pid {failure.pid}) {how}{after}; the workers' own messages are above",
              file=sys.stderr, flush=True)
        return exit_status(failure.exitcode) or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
