"""A rank that stops making progress ends the job with one line, instead of hanging it forever.

A stopped (SIGSTOP), wedged or unreachable rank leaves the others waiting in a collective with
no message. Every rank runs a :class:`Watchdog` thread that

* publishes a heartbeat (its phase, e.g. "step 5", and the time) to the job's rendezvous store,
  the TCPStore at ``MASTER_ADDR:MASTER_PORT`` that torchrun's agent (or rank 0 under srun) holds;
* when its own phase (set with :func:`progress`) has not changed for ``timeout`` seconds
  (:data:`LONG_PHASE_FACTOR` times that in start-up and checkpoint phases, :func:`long_phases`), reads
  everyone's heartbeats and exits with :data:`EXIT_CODE`. The lowest rank still beating prints the one line: which ranks
  went silent (stopped, killed or cut off) and in which phase, which are waiting where.
  torchrun, or srun with ``--kill-on-bad-exit``, then ends the remaining ranks.

The process group's own timeout (``init_process_group(timeout=...)``) is the backstop where the
watchdog thread cannot run; set it above the watchdog's (see :func:`collective_timeout`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import threading
import time
from typing import Iterator, Optional

from recipes import parent_death

EXIT_CODE = 124
"""Exit status of a rank ended by the watchdog (as ``timeout(1)``)."""

LONG_PHASE_FACTOR = 4
"""Start-up and checkpoint phases (:func:`long_phases`) may go this many timeouts without progress: they
are single opaque calls (Megatron-LM's set-up, a dist_checkpointing save of every rank's shards) that
can take far longer than a training step."""

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


def stop() -> None:
    """Stop the running watchdog, if any (before a normal exit)."""
    if _active is not None:
        _active.stop()


class Watchdog:
    """Ends this rank, with one line for the job, when its phase does not change for ``timeout`` s.

    ``start()`` makes it the process's watchdog, which :func:`progress` and :func:`stop` address.
    ``label`` prefixes the message (``[label] error: ...``)."""

    def __init__(self, timeout: float, rank: int, world: int, label: str = "finetune") -> None:
        self.timeout, self.rank, self.world, self.label = timeout, rank, world, label
        self.interval = min(10.0, max(0.5, timeout / 10))
        self._min_gap = max(0.2, self.interval / 10)  # heartbeats per second per rank: at most 5
        self._state = ("start-up", time.monotonic(), True)  # (phase, since, long)
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
                              json.dumps({"phase": name, "beat": time.time()}))
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

    def _expire(self, store, name: str, stuck_for: float, long: bool) -> None:
        beats = self._beats(store) if store is not None else None
        allowance = f"{LONG_PHASE_FACTOR} x " if long else ""
        head = (f"[{self.label}] error: no progress for {stuck_for:.0f} s ({allowance}--watchdog-timeout "
                f"{self.timeout:g})")
        if beats is None:
            line = (f"{head}: rank {self.rank} stuck in {name}; the other ranks' heartbeats are unreadable "
                    f"(is the rendezvous host {os.environ.get('MASTER_ADDR', '?')} stopped?); ending the job")
            self._exit(line)
        now, stale = time.time(), 3 * self.interval + 2
        beats[self.rank] = {"phase": name, "beat": now}
        silent = {r: b for r, b in beats.items() if b is None or now - b["beat"] > stale}
        live = {r: b for r, b in beats.items() if r not in silent}
        parts = []
        for phase in sorted({b["phase"] for b in silent.values() if b}):
            ranks = [r for r, b in silent.items() if b and b["phase"] == phase]
            ago = max(now - silent[r]["beat"] for r in ranks)
            parts.append(f"{_ranks(ranks)} silent for {ago:.0f} s, last heard in {phase} (stopped, killed or cut off)")
        never = [r for r, b in silent.items() if b is None]
        if never:
            parts.append(f"{_ranks(never)} silent since start-up (stopped, killed or cut off)")
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
        self._exit(line)

    def _exit(self, line: Optional[str], store=None) -> None:
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            if store is not None:
                try:
                    store.set(f"{self._prefix}reported", str(self.rank))
                except RuntimeError:
                    pass
        sys.stdout.flush()
        os._exit(EXIT_CODE)
