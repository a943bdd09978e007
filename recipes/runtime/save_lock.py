"""One run per save directory: two runs given the same ``--save`` would write their shards into the
same checkpoints and leave one that mixes both.

The first rank of a run that saves creates ``<save>/.megatron-llep.lock`` exclusively with its
host, pid, the pid's start time and the command, and removes it when the process ends. The lock is
written whole under a temporary name and hard-linked into place (megatron_llep/writable.py), so it
appears complete or not at all, also on a full disk. A run that finds the lock held is refused with
one line naming the holder. A lock left by a run that died (on this host, its pid gone or reused by
another process) is recognised and taken over with one line; a holder on another host cannot be
checked from here, so the message says which file to remove once that run is known to be gone, as
does the message for a file there that is no lock of this project. No lock library is used:
``fcntl`` locks are not reliable on the network filesystems checkpoints live on, while creating a
name exclusively (a hard link) is.

The entry points take the lock from their parsed arguments (every spelling of the flag), for every
directory the run will save checkpoints into: finetune.py's ``--save``, pretrain_gpt.py's ``--save``
and ``--ckpt-convert-save``, ``python -m recipes.hf import``'s ``--out``.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from typing import Callable, Optional

from megatron_llep.writable import write_text

LOCK_FILE = ".megatron-llep.lock"
_TAKEN: set[str] = set()  # the locks this process took


class SaveDirectoryInUse(ValueError):
    """Another live run holds the save directory's lock (or something that is no lock is in its place)."""


def _start_time(pid: int) -> Optional[str]:
    """The kernel's start time of ``pid`` (field 22 of /proc/<pid>/stat; None: no such process or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process that wrote ``holder`` (on this host) still runs."""
    pid = holder["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's live process
    started = _start_time(pid)
    return started is None or holder.get("pid_start") in (None, started)  # a reused pid is another process


def acquire(directory: str, say: Callable[[str], None] = print, flag: str = "--save") -> str:
    """Take ``directory``'s lock for this process (creating the directory); returns the lock file.
    Raises :class:`SaveDirectoryInUse` naming the holder when a live run has it (``flag``: the
    command-line flag that chose ``directory``), :class:`megatron_llep.writable.OutputError` when
    the lock cannot be written."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    for _ in range(3):  # a stale lock is removed once, then created again
        try:
            write_text(path, json.dumps(me), flag, exclusive=True)
        except FileExistsError:
            holder = _read(path, f"{flag} {directory}")
            if holder is None:
                continue  # removed meanwhile
            if path in _TAKEN and (holder["host"], holder["pid"]) == (me["host"], me["pid"]):
                return path  # this process took it already
            if holder["host"] == me["host"] and not _alive(holder):
                say(f"{directory}: taking over the lock of a run that is gone (pid {holder['pid']}, since "
                    f"{holder.get('since')})")
                _remove(path)
                continue
            where = "this host" if holder["host"] == me["host"] else f"host {holder['host']}"
            raise SaveDirectoryInUse(
                f"{flag} {directory} is in use by another run (pid {holder['pid']} on {where}, since "
                f"{holder.get('since')}: {holder.get('command', '?')}); two runs writing one directory mix their "
                f"checkpoints: give another {flag}, or remove {path} if that run is gone") from None
        atexit.register(release, path, me)
        _TAKEN.add(path)
        return path
    raise SaveDirectoryInUse(f"{flag} {directory}: could not take {path} (it keeps reappearing); is another run starting?")


def release(path: str, me: Optional[dict] = None) -> None:
    """Remove the lock if it is still this process's."""
    try:
        holder = _read(path, path)
    except SaveDirectoryInUse:
        return  # not a lock of this project's: not ours to remove
    if holder is not None and (me is None or (holder["pid"], holder["host"]) == (me["pid"], me["host"])):
        _remove(path)


def _read(path: str, where: str) -> Optional[dict]:
    """The holder recorded in ``path`` (None: no lock there). :class:`SaveDirectoryInUse` (``where``
    begins its line) when ``path`` cannot be read or holds no lock record: locks are written whole, so
    it is no lock of this project's, and whether a run uses the directory cannot be told."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise SaveDirectoryInUse(f"{where}: cannot read its lock {path} ({err.strerror})") from None
    from recipes.runtime.sft_data import json_type

    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
        found = "an empty file" if not text else "not JSON"
    else:
        found = "an object without host and pid" if isinstance(holder, dict) else json_type(holder)
    if isinstance(holder, dict) and isinstance(holder.get("pid"), int) and isinstance(holder.get("host"), str):
        return holder
    raise SaveDirectoryInUse(f"{where}: {path} is not a lock of this project ({found}), so whether a run uses the "
                             "directory cannot be told: remove it if none does, then start again")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
