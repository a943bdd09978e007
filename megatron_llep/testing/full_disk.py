"""A full disk for tests of what the project writes: a real one (a small tmpfs, mounted in a user and
mount namespace, filled up), or, where no such namespace can be made, an injected one (writes and
fsyncs of files under a directory fail with ENOSPC, after a write has stored half its bytes, as a
disk that fills up mid-write does).

A real full disk needs the process that writes to run inside the namespace: launch it with
:func:`namespace_command` and call :func:`mount_tmpfs` there, before :func:`fill`.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import shutil
import subprocess
from typing import Iterator

def namespaces_available() -> bool:
    """Whether this machine lets an unprivileged process mount a tmpfs in its own namespaces
    (``unshare --map-root-user --mount``)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=4k tmpfs /mnt 2>/dev/null || mount -t tmpfs -o size=4k tmpfs /tmp"],
                           capture_output=True)
    return probe.returncode == 0


def namespace_command(command: list[str]) -> list[str]:
    """``command`` run in a new user and mount namespace, where :func:`mount_tmpfs` works."""
    return [shutil.which("unshare") or "unshare", "--map-root-user", "--mount", *command]


def mount_tmpfs(directory: str, size_bytes: int) -> None:
    """A tmpfs of ``size_bytes`` at ``directory`` (created), visible inside this mount namespace."""
    os.makedirs(directory, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", directory], check=True)


def fill(directory: str, leave_bytes: int = 0) -> str:
    """Fill the disk of ``directory`` until it has at most ``leave_bytes`` free (a tmpfs counts whole
    4 KiB pages); returns the filler file (remove it to free the space again)."""
    filler = os.path.join(directory, ".filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        chunk = b"\0" * 4096
        while shutil.disk_usage(directory).free > leave_bytes:
            os.write(fd, chunk[:max(1, min(len(chunk), shutil.disk_usage(directory).free - leave_bytes))])
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler


class _FullDiskFile(io.FileIO):
    """A file on a disk that fills up: the first write stores half its bytes, then fails."""

    def write(self, data) -> int:
        data = bytes(data)
        super().write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@contextlib.contextmanager
def injected(part: str) -> Iterator[None]:
    """Inside the block, files whose path contains ``part`` (a directory with its trailing ``/``, or a
    piece of a name) are on a full disk: opened for writing through Python, their first write stores
    half its bytes and fails with ENOSPC; an ``os.fsync`` of any of them fails so too (what a disk
    that allocates late reports, and how writers outside Python, e.g. safetensors', meet it)."""
    real_open, real_fsync = builtins.open, os.fsync

    def on_full_disk(path) -> bool:
        return isinstance(path, (str, bytes, os.PathLike)) and part in os.path.abspath(os.fsdecode(path))

    def open_on_full_disk(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True,
                          opener=None):
        if not on_full_disk(file) or not any(c in mode for c in "wax+"):
            return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
        raw = _FullDiskFile(file, mode.replace("b", "").replace("t", ""))
        buffered = io.BufferedWriter(raw) if buffering != 0 else raw
        return buffered if "b" in mode else io.TextIOWrapper(buffered, encoding or "utf-8", errors, newline)

    def fsync_on_full_disk(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = None
        if on_full_disk(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    builtins.open, os.fsync = open_on_full_disk, fsync_on_full_disk
    try:
        yield
    finally:
        builtins.open, os.fsync = real_open, real_fsync
