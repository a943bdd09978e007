"""One run per save directory: two runs given the same ``--save`` would write their shards into the
same checkpoints and leave one that mixes both.

The first rank of a run that saves creates ``<save>/.megatron-llep.lock`` exclusively (``O_EXCL``)
with its host, pid, the pid's start time and the command, and removes it when the process ends.
A run that finds the lock held is refused with one line naming the holder. A lock left by a run
that died (on this host, its pid gone or reused by another process) is recognised and taken over
with one line; a holder on another host cannot be checked from here, so the message says which
file to remove once that run is known to be gone. No lock library is used: ``fcntl`` locks are
not reliable on the network filesystems checkpoints live on, while ``O_EXCL`` creation is.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from typing import Callable, Optional

LOCK_FILE = ".megatron-llep.lock"


class SaveDirectoryInUse(ValueError):
    """Another live run holds the save directory's lock."""


def _start_time(pid: int) -> Optional[str]:
    """The kernel's start time of ``pid`` (field 22 of /proc/<pid>/stat; None: no such process or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process that wrote ``holder`` (on this host) still runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's live process
    started = _start_time(pid)
    return started is None or holder.get("pid_start") in (None, started)  # a reused pid is another process


def acquire(directory: str, say: Callable[[str], None] = print) -> str:
    """Take ``directory``'s lock for this process (creating the directory); returns the lock file.
    Raises :class:`SaveDirectoryInUse` naming the holder when a live run has it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    for _ in range(3):  # a stale lock is removed once, then created again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                continue  # removed meanwhile
            if holder.get("host") == me["host"] and not _alive(holder):
                say(f"{directory}: taking over the lock of a run that is gone (pid {holder.get('pid')}, since "
                    f"{holder.get('since')})")
                _remove(path)
                continue
            where = "this host" if holder.get("host") == me["host"] else f"host {holder.get('host')}"
            raise SaveDirectoryInUse(
                f"--save {directory} is in use by another run (pid {holder.get('pid')} on {where}, since "
                f"{holder.get('since')}: {holder.get('command', '?')}); two runs writing one directory mix their "
                f"checkpoints: give another --save, or remove {path} if that run is gone") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        atexit.register(release, path, me)
        return path
    raise SaveDirectoryInUse(f"--save {directory}: could not take {path} (it keeps reappearing); is another run starting?")


def release(path: str, me: Optional[dict] = None) -> None:
    """Remove the lock if it is still this process's."""
    holder = _read(path)
    if holder is not None and (me is None or (holder.get("pid"), holder.get("host")) == (me["pid"], me["host"])):
        _remove(path)


def _read(path: str) -> Optional[dict]:
    """The holder recorded in ``path`` (None: no lock; an unreadable one counts as a dead holder's)."""
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"host": socket.gethostname()}  # half-written by a run killed while taking it


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
