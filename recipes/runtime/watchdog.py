"""A rank that stops making progress ends the job with one line, instead of hanging it forever.

A stopped (SIGSTOP), wedged or unreachable rank leaves the others waiting in a collective with
no message. Every rank runs a :class:`Watchdog` thread that

* publishes a heartbeat (its phase, e.g. "step 5", and the time) to the job's rendezvous store,
  the TCPStore at ``MASTER_ADDR:MASTER_PORT`` that torchrun's agent (or rank 0 under srun) holds;
* when its own phase (set with :func:`progress`) has not changed for ``timeout`` seconds
  (:data:`LONG_PHASE_FACTOR` times that in start-up and checkpoint phases, :func:`long_phases`), reads
  everyone's heartbeats and exits with :data:`EXIT_CODE`. The lowest rank still beating prints the one line: which ranks
  went silent (stopped, killed or cut off) or died, and in which phase, which are waiting where.
  torchrun, or srun with ``--kill-on-bad-exit``, then ends the remaining ranks.

A rank whose collective fails because a peer died (kill -9, the OOM killer: gloo's "Connection
reset by peer") reports it with :func:`lost_peer_line` instead of a traceback: the heartbeats carry
each rank's pid and host, so a dead peer on the same machine is named at once.

The process group's own timeout (``init_process_group(timeout=...)``) is the backstop where the
watchdog thread cannot run; set it above the watchdog's (see :func:`collective_timeout`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence

from recipes.runtime import parent_death

EXIT_CODE = 124
"""Exit status of a rank ended by the watchdog (as ``timeout(1)``)."""

LOST_PEER_EXIT_CODE = 75
"""Exit status of a rank that ends because another rank died (see :func:`lost_peer_line`): EX_TEMPFAIL of
sysexits.h (the job can be resumed), a status no Python error gives, so that launch/torchrun.py names the
rank that died rather than this one (torchrun orders failures by whole-second timestamps, which tie)."""

LONG_PHASE_FACTOR = 4
"""Start-up and checkpoint phases (:func:`long_phases`) may go this many timeouts without progress: they
are single opaque calls (Megatron-LM's set-up, a dist_checkpointing save of every rank's shards) that
can take far longer than a training step."""

CONNECTION_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
                   "NCCL communicator was aborted", "remote process exited")
"""What a collective's error says when a peer rank's process is gone (gloo's TCP pairs, NCCL)."""

CPU_DEFAULT_TIMEOUT = 60.0
GPU_DEFAULT_TIMEOUT = 600.0
"""Default timeouts in seconds: on GPU that of NCCL and Megatron-LM's ``--distributed-timeout-minutes``
(long steps and Hugging Face imports must fit); on CPU a minute, so that a hung CPU job ends within
about a minute."""


def default_timeout(on_gpu: bool) -> float:
    return GPU_DEFAULT_TIMEOUT if on_gpu else CPU_DEFAULT_TIMEOUT


def collective_timeout(watchdog_timeout: float) -> datetime.timedelta:
    """The process group's timeout for a watchdog timeout T: L + max(30 s, L / 2) with L the longest
    allowance (:data:`LONG_PHASE_FACTOR` x T), so the watchdog (which names the stuck rank) fires first
    and a collective error only where it cannot run."""
    longest = LONG_PHASE_FACTOR * watchdog_timeout
    return datetime.timedelta(seconds=longest + max(30.0, longest / 2))


def add_argument(group: argparse._ArgumentGroup) -> None:
    """``--watchdog-timeout`` (every entry point's)."""
    group.add_argument("--watchdog-timeout", type=float, default=None, metavar="SECONDS",
                       help="end the job with a message when a rank makes no progress (a step, a collective waiting "
                            f"for a stopped or dead rank) for this long; start-up and checkpoint saves and loads get "
                            f"{LONG_PHASE_FACTOR} times as long, and collectives time out after that. Default "
                            f"{CPU_DEFAULT_TIMEOUT:g} on CPU, {GPU_DEFAULT_TIMEOUT:g} on GPU; 0 turns the watchdog off")


def timeout_problem(value: Optional[float]) -> Optional[str]:
    """Why ``--watchdog-timeout value`` is refused (None: it is fine)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        return f"--watchdog-timeout must be >= 0 seconds (0: off), got {value}"
    return None


def megatron_lm_timeouts(argv: Sequence[str], on_gpu: bool) -> tuple[float, list[str]]:
    """The ``--watchdog-timeout`` of a Megatron-LM command line (0: off; absent: this machine's default)
    and the command line with Megatron-LM's ``--distributed-timeout-minutes`` (its collectives' timeout)
    above the watchdog's longest allowance, added when absent. ``ValueError`` (one line) for a bad
    timeout or a given collective timeout that would end a stuck step before the watchdog names it."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--watchdog-timeout", type=float, default=None)
    parser.add_argument("--distributed-timeout-minutes", type=int, default=None)
    try:
        known, _ = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as err:  # e.g. a value that is not a number
        raise ValueError(str(err)) from None
    problem = timeout_problem(known.watchdog_timeout)
    if problem:
        raise ValueError(problem)
    timeout = default_timeout(on_gpu) if known.watchdog_timeout is None else known.watchdog_timeout
    if not timeout:
        return 0.0, list(argv)
    if known.distributed_timeout_minutes is None:
        minutes = math.ceil(collective_timeout(timeout).total_seconds() / 60)
        return timeout, [*argv, "--distributed-timeout-minutes", str(minutes)]
    if known.distributed_timeout_minutes * 60 < timeout + 30:
        raise ValueError(f"--distributed-timeout-minutes {known.distributed_timeout_minutes} ends a stuck collective "
                         f"before the watchdog (--watchdog-timeout {timeout:g}) can name the rank that holds it up: "
                         f"give at least {math.ceil((timeout + 30) / 60)}, or a lower --watchdog-timeout")
    return timeout, list(argv)


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2,5"``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie waiting to be reaped has died); without
    /proc (not Linux) it cannot be told: yes."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return not os.path.isdir("/proc/self")


def _machine() -> str:
    """This host and PID namespace: pids of heartbeats from the same one can be checked here."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


_active: Optional["Watchdog"] = None
_long_depth = 0  # > 0 inside long_phases()


def progress(phase: str, long: bool = False) -> None:
    """This process made progress and is now in ``phase`` (e.g. "step 5", "saving ..."): restarts
    the running watchdog's clock; nothing without one. ``long``: a start-up or checkpoint phase
    (:data:`LONG_PHASE_FACTOR` timeouts). Cheap: call it at every step."""
    if _active is not None:
        _active.phase(phase, long)


@contextlib.contextmanager
def long_phases() -> Iterator[None]:
    """Every phase inside, the innermost ones of the code called too, is a long one (checkpoint saves
    and loads); leaving restarts the clock of the phase then current under the normal timeout."""
    global _long_depth
    _long_depth += 1
    try:
        yield
    finally:
        _long_depth -= 1
        if _active is not None:
            _active.phase(_active.current_phase())


def during(phase: str, function: Callable, long: bool = False) -> Callable:
    """``function`` entering ``phase`` (see :func:`progress`) whenever it is called: the phases of code
    that calls back, such as Megatron-LM's model and dataset providers."""

    @functools.wraps(function)
    def in_phase(*args: Any, **kwargs: Any) -> Any:
        progress(phase, long)
        return function(*args, **kwargs)

    return in_phase


def stop() -> None:
    """Stop the running watchdog, if any (before a normal exit)."""
    if _active is not None:
        _active.stop()


def lost_peer_line(error: BaseException) -> Optional[str]:
    """After ``error`` ended this rank's work: the line that says which rank died (or that a peer's
    connection closed) and that the job is ending, ``""`` when another rank says it, None when no peer
    is lost (``error`` is this rank's own). Peers are judged by their heartbeats (a same-machine pid
    that is gone, a heartbeat gone stale), waiting a few seconds for them when the error is a lost
    connection that no heartbeat explains yet."""
    messages, cause = [], error  # the error and what caused it: a wrapped gloo error still counts
    while cause is not None and len(messages) < 8:
        messages.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    connection = next((text for text in CONNECTION_LOST if any(text in m for m in messages)), None)
    if _active is None:
        return f"lost the connection to another rank ({connection}): a rank died or was cut off; ending the job" \
            if connection else None
    return _active.lost_peer(connection)


def claim_report() -> None:
    """This rank tells the job why it ends, in a line it prints now: the other ranks, which lose their
    connection to it next, stay quiet (:func:`lost_peer_line` returns ``""``). Nothing without a
    running watchdog."""
    if _active is not None:
        store = _active._connect()
        if store is not None:
            _active._claim(store)


def supervised() -> bool:
    """Whether this process runs a watchdog (its heartbeats name a peer that died)."""
    return _active is not None


def end_after_lost_peer(line: Optional[str]) -> NoReturn:
    """End this rank because another rank died: ``line`` (None or "": another rank says it) on stderr, the
    Python exit handlers (save lock, wandb), then ``os._exit(LOST_PEER_EXIT_CODE)``. Not a normal
    interpreter exit: the process group's C++ threads may still wait on the dead peer, and tearing them
    down at exit aborts the process (SIGABRT, "terminate called without an active exception"; seen about
    once in 25 kill -9 runs)."""
    import atexit

    if line:
        print(line, file=sys.stderr, flush=True)
    atexit._run_exitfuncs()  # what a normal exit runs first; the C++ teardown after it is what aborts
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LOST_PEER_EXIT_CODE)


class Watchdog:
    """Ends this rank, with one line for the job, when its phase does not change for ``timeout`` s.

    ``start()`` makes it the process's watchdog, which :func:`progress` and :func:`stop` address.
    ``label`` prefixes the message (``[label] error: ...``)."""

    def __init__(self, timeout: float, rank: int, world: int, label: str = "finetune") -> None:
        self.timeout, self.rank, self.world, self.label = timeout, rank, world, label
        self.interval = min(10.0, max(0.5, timeout / 10))
        self._min_gap = max(0.2, self.interval / 10)  # heartbeats per second per rank: at most 5
        self._stale = 3 * self.interval + 2  # a heartbeat older than this: its rank went silent
        self._state = ("start-up", time.monotonic(), True)  # (phase, since, long)
        self._machine = _machine()
        self._stopped = threading.Event()
        self._wake = threading.Event()  # a new phase: beat it soon, so a stopped rank's last phase is known
        run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID", "")
        self._prefix = f"megatron_llep/watchdog/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._thread = threading.Thread(target=self._run, name="llep-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        global _active
        _active = self
        self._thread.start()
        return self

    def phase(self, name: str, long: bool = False) -> None:
        """This rank made progress and is now in ``name`` (``long``: see :func:`progress`)."""
        self._state = (name, time.monotonic(), long or _long_depth > 0)
        self._wake.set()

    def current_phase(self) -> str:
        return self._state[0]

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None
        self._stopped.set()
        self._wake.set()
        self._thread.join()

    def lost_peer(self, connection: Optional[str]) -> Optional[str]:
        """:func:`lost_peer_line` for this rank; ``connection``: what its error says of a lost connection."""
        name = self.current_phase()
        self.phase(f"{name}, ending the job")  # the clock restarts: no second line from the thread meanwhile
        store = self._connect()
        deadline = time.monotonic() + (min(15.0, self._stale) if connection else 0.0)
        gone: dict[int, str] = {}
        while store is not None:
            try:
                if store.check([f"{self._prefix}reported"]):
                    return ""  # another rank (or its watchdog) told the job already
            except RuntimeError:
                store = None
                break
            beats, now = self._beats(store), time.time()
            gone = {r: how for r, how in self._gone(beats or {}, now).items() if beats[r] is not None}
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if not gone and not connection:
            return None
        if store is not None and not self._claim(store):
            return ""
        if gone:
            return f"{'; '.join(self._describe(beats, gone, now))}; ending the job"
        return (f"lost the connection to another rank ({connection}) in {name}, and no heartbeat says which one died "
                "or was cut off; ending the job")

    # --- the thread ---------------------------------------------------------------------------

    def _connect(self):
        """A client of the job's rendezvous store, or None if it cannot be reached now."""
        import torch.distributed as dist

        try:
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=datetime.timedelta(seconds=max(5.0, self.interval)),
                                 wait_for_workers=False)
        except (KeyError, ValueError, RuntimeError):
            return None

    def _run(self) -> None:
        store = None
        while not self._stopped.is_set():
            name, since, long = self._state
            if parent_death.launcher_gone():  # its store went with it (and this rank is stopping on SIGTERM)
                store = None
            elif store is None:  # (re)connect: a busy or restarted store host is no reason to give up
                store = self._connect()
            if store is not None:
                try:
                    store.set(f"{self._prefix}beat/{self.rank}",
                              json.dumps({"phase": name, "beat": time.time(), "pid": os.getpid(),
                                          "machine": self._machine}))
                except RuntimeError:
                    store = None
            stuck_for = time.monotonic() - since
            if stuck_for >= self.timeout * (LONG_PHASE_FACTOR if long else 1) and not self._stopped.is_set():
                self._expire(store, name, stuck_for, long)
            self._wake.wait(self.interval)
            self._wake.clear()
            self._stopped.wait(self._min_gap)

    def _beats(self, store) -> Optional[dict[int, Optional[dict]]]:
        """Every rank's last heartbeat (None for a rank that never sent one), or None if unreadable."""
        try:
            keys = [f"{self._prefix}beat/{r}" for r in range(self.world)]
            return {r: json.loads(store.get(k)) if store.check([k]) else None for r, k in enumerate(keys)}
        except (RuntimeError, ValueError):
            return None

    def _gone(self, beats: dict[int, Optional[dict]], now: float) -> dict[int, str]:
        """The other ranks that ``"died"`` (their process on this machine is gone) or went ``"silent"``
        (no heartbeat for a while, or never one)."""
        gone = {}
        for r, beat in beats.items():
            if r == self.rank:
                continue
            if beat is not None and beat.get("machine") == self._machine and not _running(beat["pid"]):
                gone[r] = "died"
            elif beat is None or now - beat["beat"] > self._stale:
                gone[r] = "silent"
        return gone

    @staticmethod
    def _describe(beats: dict[int, Optional[dict]], gone: dict[int, str], now: float) -> list[str]:
        """What became of the ``gone`` ranks, grouped by how and by their last phase."""
        parts = []
        for how in ("died", "silent"):
            heard = {r: beats[r] for r, h in gone.items() if h == how and beats[r] is not None}
            for phase in sorted({b["phase"] for b in heard.values()}):
                ranks = [r for r, b in heard.items() if b["phase"] == phase]
                if how == "died":
                    parts.append(f"{_ranks(ranks)} died, last heard in {phase}")
                else:
                    ago = max(now - heard[r]["beat"] for r in ranks)
                    parts.append(f"{_ranks(ranks)} silent for {ago:.0f} s, last heard in {phase} "
                                 "(stopped, killed or cut off)")
        never = [r for r in gone if beats[r] is None]
        if never:
            parts.append(f"{_ranks(never)} silent since start-up (stopped, killed or cut off)")
        return parts

    def _expire(self, store, name: str, stuck_for: float, long: bool) -> None:
        beats = self._beats(store) if store is not None else None
        allowance = f"{LONG_PHASE_FACTOR} x " if long else ""
        head = (f"[{self.label}] error: no progress for {stuck_for:.0f} s ({allowance}--watchdog-timeout "
                f"{self.timeout:g})")
        if beats is None:
            line = (f"{head}: rank {self.rank} stuck in {name}; the other ranks' heartbeats are unreadable "
                    f"(is the rendezvous host {os.environ.get('MASTER_ADDR', '?')} stopped?); ending the job")
            self._exit(line)
        now = time.time()
        beats[self.rank] = {"phase": name, "beat": now}
        gone = self._gone(beats, now)
        live = {r: b for r, b in beats.items() if r not in gone}
        parts = self._describe(beats, gone, now)
        for phase in sorted({b["phase"] for b in live.values()}):
            parts.append(f"{_ranks([r for r, b in live.items() if b['phase'] == phase])} stuck in {phase}")
        line = f"{head}: {'; '.join(parts)}; ending the job"
        if min(live) == self.rank:
            self._exit(line, store)
        # a lower rank reports; give it the time to (it may have entered its phase a step later)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                if store.check([f"{self._prefix}reported"]):
                    self._exit(None)
            except RuntimeError:
                break
            time.sleep(0.5)
        self._exit(line, store)

    def _claim(self, store) -> bool:
        """Whether this rank is the first to tell the job why it ends (the others stay quiet)."""
        try:
            return store.add(f"{self._prefix}reported", 1) == 1
        except RuntimeError:
            return True

    def _exit(self, line: Optional[str], store=None) -> None:
        if line is not None and (store is None or self._claim(store)):
            print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_CODE)
