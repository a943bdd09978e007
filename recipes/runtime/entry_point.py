"""What the command-line entry points of recipes/ (finetune.py, evaluate.py, generate.py; pretrain_gpt.py
its supervision) do alike: report usage errors and bad input once per job (rank 0's line, exit status
2, no traceback), say what a long phase is doing, start the process group (NCCL on GPUs, gloo with the
CPU compatibility layer on CPU), the watchdog that ends a job whose ranks stopped making progress, and
end in one line, not a traceback, when another rank died (:meth:`EntryPoint.ending_cleanly`), when a
signal stopped the run (:meth:`EntryPoint.stopped_by`; Ctrl-C ends a rank as SIGTERM does where the run
has no handler of its own) or when an output could not be written (:meth:`EntryPoint.write_or_fail`:
megatron_llep/writable.py writes every output whole or leaves the previous one). A rank started by
torchrun stops (SIGTERM) when torchrun dies (recipes/runtime/parent_death.py).

Every line an entry point prints starts with its name (``[finetune] ...``, ``[evaluate] error: ...``):
:class:`EntryPoint` holds it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import signal
import sys
import time
from typing import Callable, Iterator, NoReturn, Optional, Sequence, TextIO

import torch
import torch.distributed as dist

from megatron_llep.writable import OutputError, directory_problem, file_problem
from recipes.runtime import parent_death

# seconds a rank other than 0 waits, after finding a usage error, for the launcher to end it once rank 0
# (which finds the same error) has reported it; then it reports the error itself
PEER_ERROR_GRACE_S = 30.0


def launch_rank() -> int:
    """This process's global rank before any process group exists (torchrun's RANK, srun's SLURM_PROCID)."""
    value = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return int(value) if value.isdigit() else 0


def wait_for_rank_zero_report() -> None:
    """On ranks other than 0: give rank 0 time to report an error every rank found, so the job prints it
    once (torchrun and ``srun --kill-on-bad-exit`` end this process when rank 0 exits)."""
    if launch_rank() != 0:
        time.sleep(PEER_ERROR_GRACE_S)


class RankZeroArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors (usage and one line, exit 2) are printed once per job, by rank 0."""

    def error(self, message: str) -> NoReturn:
        wait_for_rank_zero_report()
        super().error(message)


def utf8_text(text: str) -> str:
    """argparse ``type`` of a free-text flag (a prompt, a run name): its bytes must be UTF-8. Python
    keeps other bytes of a command line as lone surrogates, which no output file or tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        byte = text.encode("utf-8", "surrogateescape")[len(text[:err.start].encode("utf-8"))]
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (byte 0x{byte:02x} at character {err.start + 1}): "
                                         "give the text in UTF-8") from None
    return text


def check_numeric_domains(parser: argparse.ArgumentParser, args: argparse.Namespace, positive: Sequence[str],
                          non_negative: Sequence[str] = ()) -> None:
    """Usage error for a numeric flag outside its domain (nan and infinities included), checked before
    any process group or model exists."""
    for names, holds, domain in ((positive, lambda v: v > 0, "positive"), (non_negative, lambda v: v >= 0, ">= 0")):
        for name in names:
            value = getattr(args, name)
            if value is not None and ((isinstance(value, float) and not math.isfinite(value)) or not holds(value)):
                parser.error(f"--{name.replace('_', '-')} must be {domain}, got {value}")


def check_existing_files(parser: argparse.ArgumentParser, paths: Sequence[tuple[Optional[str], str]],
                         directories_allowed: Sequence[str] = ()) -> None:
    """Usage error for a ``(path, flag)`` that does not exist, or is a directory where a file is needed
    (flags in ``directories_allowed`` take either)."""
    for path, flag in paths:
        if path is not None and not os.path.exists(path):
            parser.error(f"{flag}: {path} does not exist")
        if path is not None and flag not in directories_allowed and os.path.isdir(path):
            parser.error(f"{flag}: {path} is a directory; give the file")


def check_writable_directories(parser: argparse.ArgumentParser, directories: Sequence[tuple[Optional[str], str]]) -> None:
    """Usage error for a ``(directory, flag)`` output directory that cannot be created or written
    (tried with a real file, which also catches read-only mounts and immutable directories)."""
    for directory, flag in directories:
        problem = directory and directory_problem(directory)
        if problem:
            parser.error(f"{flag}: {problem}; give a writable directory")


def check_writable_files(parser: argparse.ArgumentParser, files: Sequence[tuple[Optional[str], str]]) -> None:
    """Usage error for a ``(file, flag)`` output file that is a directory or cannot be created."""
    for path, flag in files:
        problem = path and file_problem(path)
        if problem:
            parser.error(f"{flag}: {problem}")


def interrupt_like_terminate() -> None:
    """Ctrl-C (SIGINT) ends this rank as SIGTERM does (at once, without Python's KeyboardInterrupt
    traceback from every rank), where the run has no handler of its own for it: torchrun, which got it
    too, says in one line that the job was stopped. finetune.py installs its own later (it saves first)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.getsignal(signal.SIGTERM))


class EntryPoint:
    """One entry point's voice (``name`` prefixes its lines) and its start-up as a distributed job."""

    def __init__(self, name: str) -> None:
        self.name = name

    def say(self, message: str, file: Optional[TextIO] = None) -> None:
        """Print ``[name] message`` once per job (on rank 0), to ``file`` (default: stdout)."""
        if (dist.get_rank() if dist.is_initialized() else launch_rank()) == 0:
            print(f"[{self.name}] {message}", file=file or sys.stdout, flush=True)

    def progress(self, rank: int, message: str) -> None:
        """A line before a long phase (rank 0), so that a quiet minute is never a mystery; the phase is
        also the watchdog's (every rank)."""
        from recipes.runtime import watchdog

        watchdog.progress(message)
        if rank == 0:
            print(f"[{self.name}] {message}", flush=True)

    def fail(self, err: Exception, rank: int, status: int = 2) -> NoReturn:
        """An error found on every rank alike: one message (rank 0's), no traceback, exit ``status``
        (2: bad input; 1: a run that failed, e.g. a save on a full disk)."""
        from recipes.runtime import watchdog

        del rank  # every rank finds it; rank 0 reports it and the launcher ends the others
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's SIGTERM ends us, whatever the run set
        wait_for_rank_zero_report()
        watchdog.claim_report()  # the others, losing their connection to this rank, stay quiet
        print(f"[{self.name}] error: {err}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(status)

    def init_distributed(self, timeout: Optional[datetime.timedelta] = None) -> tuple[int, int, torch.device]:
        """Process group from torchrun's (or slurm's) environment: NCCL on GPUs, gloo + the CPU
        compatibility layer on CPU. ``timeout``: how long a collective may wait (None: torch's default)."""
        from recipes.runtime.launch_env import rendezvous_env_from_slurm

        interrupt_like_terminate()
        try:
            rendezvous_env_from_slurm()
        except ValueError as err:  # inconsistent SLURM_* variables
            raise SystemExit(f"[{self.name}] error: {err}") from None
        if "RANK" not in os.environ:
            raise SystemExit(f"run me under torchrun (python -m torch.distributed.run --nproc_per_node 2 "
                             f"recipes/{self.name}.py ...) or srun (see launch/)")
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", timeout=timeout)
            dist.barrier()
            return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)
        from megatron_llep.testing import cpu_gloo

        cpu_gloo.enable()
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        dist.init_process_group("gloo", timeout=timeout)
        dist.barrier()  # every rank connected: one that fails at once cannot cut a peer off mid-connection
        return dist.get_rank(), dist.get_world_size(), torch.device("cpu")

    def start(self, watchdog_timeout: Optional[float]) -> tuple[int, int, torch.device]:
        """The process group and, unless ``watchdog_timeout`` is 0, the watchdog (None: its default for
        this machine, 60 s on CPU and 600 s on GPU); collectives time out a little after its longest
        allowance. See :meth:`watch`."""
        from recipes.runtime import watchdog

        timeout = watchdog_timeout
        if timeout is None:
            timeout = watchdog.default_timeout(torch.cuda.is_available())
        rank, world, device = self.init_distributed(watchdog.collective_timeout(timeout) if timeout else None)
        self.watch(timeout, rank, world)
        return rank, world, device

    def watch(self, watchdog_timeout: float, rank: int, world: int) -> None:
        """This rank's supervision where something else starts the process group (Megatron-LM): it
        stops with torchrun, and unless ``watchdog_timeout`` is 0 a watchdog thread ends it when it
        makes no progress. Start-up is a long phase until the first :func:`recipes.runtime.watchdog.progress`."""
        from recipes.runtime import watchdog

        interrupt_like_terminate()
        parent_death.follow_launcher()
        if watchdog_timeout:
            watchdog.Watchdog(watchdog_timeout, rank, world, label=self.name).start()

    @contextlib.contextmanager
    def ending_cleanly(self) -> Iterator[None]:
        """Around an entry point's work: an error caused by a rank that died (its collective's peer is
        gone) ends this rank with one line for the job naming that rank, exit status
        :data:`recipes.runtime.watchdog.LOST_PEER_EXIT_CODE`, instead of gloo's traceback
        (:func:`recipes.runtime.watchdog.end_after_lost_peer`); an LLEP row budget
        no plan can meet (``--llep-max-tokens-per-rank``) is a usage error (one line, exit 2); this
        rank's other errors pass through."""
        from megatron_llep.planning import InfeasibleBudgetError
        from recipes.runtime import watchdog

        try:
            yield
        except InfeasibleBudgetError as err:  # every EP rank of the step raises it alike: a setting to change
            self.fail(err, launch_rank())
        except Exception as err:  # a lost peer is handled, the rest re-raised
            line = watchdog.lost_peer_line(err)
            if line is None:
                raise
            if line and not watchdog.supervised():  # no heartbeat says who died: most likely rank 0, which says why
                wait_for_rank_zero_report()
            watchdog.end_after_lost_peer(f"[{self.name}] error: {line}" if line else None)

    def stopped_by(self, signum: int, iteration: int, checkpoint: Optional[str], save: Optional[str],
                   load: Optional[str]) -> NoReturn:
        """End a run that a signal (SIGTERM: preemption, scancel; Ctrl-C) stopped after ``iteration``, after
        it saved ``checkpoint`` (None: not saved) under ``save``: one line from rank 0 saying so and how to
        resume, exit status 128 + the signal, as a shell reports a process the signal ended."""
        if checkpoint:
            same = load and save and os.path.realpath(load) == os.path.realpath(save)
            how = f"saved in {checkpoint}; resume with {'the same command' if same else f'--load {save}'}"
        else:
            how = "not saved (no --save): its progress is lost"
        self.say(f"stopped by {signal.Signals(signum).name} after iteration {iteration}: {how}", file=sys.stderr)
        raise SystemExit(128 + signum)

    def lock_save_directory(self, directory: str, rank: int, flag: str = "--save") -> None:
        """One run per save directory (recipes/runtime/save_lock.py): rank 0 takes ``directory``'s lock and
        every rank learns whether it could; when another run holds it, one line and exit status 2
        (1 when the lock cannot be written). Collective."""
        from recipes.runtime import save_lock

        problem: list[Optional[tuple[str, int]]] = [None]
        if rank == 0:
            try:
                save_lock.acquire(directory, self.say, flag)
            except (save_lock.SaveDirectoryInUse, OSError) as err:
                problem[0] = (str(err), 1 if isinstance(err, OutputError) else 2)
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            self.fail(RuntimeError(problem[0][0]), rank, status=problem[0][1])

    def write_or_fail(self, write: Callable[[], None], rank: int) -> None:
        """This rank's part of writing the run's outputs (``write`` may write nothing on this rank),
        agreed by every rank: a write that failed on any rank (:class:`OutputError`: a full disk, an
        unwritable directory; the partial file removed, the previous one untouched) ends the run on
        every rank with rank 0's one line naming the file, exit status 1. Collective."""
        failure = None
        try:
            write()
        except OutputError as err:
            failure = str(err)
        failures: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        first = next((line for line in failures if line), None)
        if first:
            self.fail(RuntimeError(first), rank, status=1)

    def finish(self) -> None:
        """End a run that went well: the watchdog, Megatron's process groups and the process group."""
        from megatron.core import parallel_state

        from recipes.runtime import watchdog

        watchdog.stop()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
