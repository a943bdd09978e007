"""Whether a file or directory can be created where a command line asks, found at start-up rather
than after minutes of work."""

from __future__ import annotations

import os
import tempfile
from typing import Optional


def nearest_existing(path: str) -> str:
    """``path`` (absolute) if it exists, else its nearest existing ancestor: where it would be created."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # created later, with its parents
        existing = os.path.dirname(existing)
    return existing


def creation_problem(path: str) -> Optional[str]:
    """Why ``path`` (a file or directory that may not exist yet) could not be created under its
    nearest existing ancestor (None: it can): tried with a real file, which also catches read-only
    mounts and immutable directories."""
    existing = nearest_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(existing):
        return f"{existing} is a file, so {path} cannot be created"
    try:
        fd, probe = tempfile.mkstemp(prefix=".llep-write-test-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        return f"cannot write to {existing} ({err.strerror})"
    return None
