"""Processes that end with the process that started them (Linux ``PR_SET_PDEATHSIG``).

A process whose parent dies is adopted by init and goes on: a checkpoint writer of a rank killed
mid-save, or a whole rank whose torchrun was killed (nobody then ends the job when a rank fails, and
nobody collects its exit status). :func:`arm` asks the kernel for a signal when the parent dies;
:func:`follow_launcher` arms SIGTERM in a rank started by torchrun, so that the ranks of a killed
launcher stop as on preemption: fine-tuning (and pretraining with ``--exit-signal-handler``) saves
and exits 143; evaluation, generation and pretraining without it end at once. SIGKILL would lose
the steps since the last save; a rank that hangs instead of stopping is ended by its watchdog.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1

_PARENT_AT_START = os.getppid()
"""The parent when this module was first imported (early in every entry point), to tell whether it died
before the signal was armed."""


def arm(sig: int, parent_pid: int) -> bool:
    """Have this process sent ``sig`` when its parent ``parent_pid`` dies, or now if it already died.
    Linux ties the signal to the parent *thread* that forked this process. False where prctl is
    missing (not Linux): nothing is armed."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
    return True


def follow_launcher() -> bool:
    """In a rank started by torchrun (whose agent is its parent): SIGTERM when torchrun dies. Elsewhere
    (srun, a plain process) nothing. Returns whether it was armed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    return arm(signal.SIGTERM, _PARENT_AT_START)


def launcher_gone() -> bool:
    """Whether this rank's torchrun died (this process was re-parented): its rendezvous store is gone too."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.getppid() != _PARENT_AT_START
