"""torchrun (``python -m torch.distributed.run``, same arguments) that ends in one line, not a traceback.

torchrun itself reports Ctrl-C / SIGTERM (slurm preemption) by raising ``SignalException`` and a
failed worker by raising ``ChildFailedError``, each with a Python traceback; it has no option to
turn them off. This wrapper runs torchrun's own ``main`` (its error-file handling included) and
turns both into one line and the conventional exit status: 128 + the signal for a signal (the
workers were sent it too; the line says so where the entry point saves on it first: finetune.py with
``--save``), the first failed worker's own
status (e.g. 2 for a usage error) when a worker fails (a worker that ended because another died, exit
status 75, is not the first: :func:`first_cause`). Workers' own messages are theirs.

Before starting anything it checks the static rendezvous (``--master_addr`` / ``--master_port``, what
launch/torchrun.sh and slurm.sbatch pass): a port outside 1-65535, a master address that does not
resolve, or, on node rank 0 when the master is this machine, a port another process holds is one line
and exit status 2 (torchrun would print a traceback or wait for a rendezvous that cannot happen).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import main as torchrun_main
from torch.distributed.run import parse_args as torchrun_args
from torch.distributed.run import parse_min_max_nnodes


def exit_status(exitcode: int) -> int:
    """A worker's status as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


LOST_PEER_EXIT_CODE = 75
"""Exit status of a worker that ended because another worker died (``recipes.runtime.watchdog.LOST_PEER_EXIT_CODE``;
the launcher imports nothing of the project, so it starts at once)."""


def first_cause(err: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The failed worker to name: torchrun's first failure, except that workers which ended because a peer
    died come after those that did not. torchrun orders failures by whole-second timestamps, so a survivor
    that ends within a second of the worker that died would otherwise be named in its place."""
    return min(err.failures.items(), key=lambda item: (item[1].exitcode == LOST_PEER_EXIT_CODE, item[1].timestamp))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


SAVES_ON_SIGNAL = {
    "finetune.py": ((signal.SIGTERM, signal.SIGINT), "recipes/finetune.py saves with --save, then stops"),
    "pretrain_gpt.py": ((signal.SIGTERM,), "recipes/pretrain_gpt.py saves with --save and --exit-signal-handler, "
                                           "then stops"),
}
"""The entry points that save when a signal stops them: the signals and what they do."""


def _saving_on(argv: Optional[Sequence[str]], sig: signal.Signals) -> str:
    """What the launched entry point does with ``sig`` when it saves on it (a parenthesised phrase), else ""."""
    script = torchrun_args(list(argv) if argv is not None else sys.argv[1:]).training_script
    signals, what = SAVES_ON_SIGNAL.get(os.path.basename(script), ((), ""))
    return f" ({what})" if sig in signals else ""


def rendezvous_problem(argv: Optional[Sequence[str]]) -> Optional[str]:
    """Why torchrun's static rendezvous of ``argv`` cannot work (None: it may)."""
    args = torchrun_args(list(argv) if argv is not None else sys.argv[1:])
    if args.standalone or args.rdzv_backend != "static" or args.rdzv_endpoint:
        return None  # torchrun chooses the port (standalone) or an external store holds the rendezvous
    if args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            return None  # one node without a port: torchrun picks a free one
        args.master_port = 29500  # torchrun's default
    if not 0 < args.master_port < 65536:
        return f"--master_port (MASTER_PORT) {args.master_port} is not a port: give one in 1-65535"
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(args.master_addr, args.master_port, type=socket.SOCK_STREAM)}
    except socket.gaierror as err:
        return f"--master_addr (MASTER_ADDR) {args.master_addr} does not resolve ({err.strerror}): give node 0's host name or address"
    if args.node_rank != 0:
        return None
    for address in addresses:  # node 0 serves the store there: the port must be free on this machine
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, args.master_port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return (f"--master_port (MASTER_PORT) {args.master_port} is in use on {args.master_addr} (another job?): "
                            "choose a free port")
                # EADDRNOTAVAIL: the master address is another machine's; node 0 is expected to run there
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun with ``argv`` (default: the command line); returns the exit status."""
    problem = rendezvous_problem(argv)
    if problem:
        print(f"[torchrun] error: {problem}", file=sys.stderr, flush=True)
        return 2
    try:
        torchrun_main(list(argv) if argv is not None else None)
    except SignalException as err:
        print(f"[torchrun] stopped by {err.sigval.name}: the workers got it too{_saving_on(argv, err.sigval)}",
              file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, failure = first_cause(err)
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
