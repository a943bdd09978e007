"""Output files: whether one can be created where a command line asks (found at start-up rather than
after minutes of work), and writing them whole or not at all.

Every file the project produces (results, JSONL, placements, routing traces, Hugging Face exports,
corpora, indexed datasets, checkpoint manifests, the save lock) is written by :class:`StagedOutputs`:
under a temporary name in its own directory (``.<name>.<token>.partial<ext>``), renamed into place
only once it is complete and on disk. A failure part-way (a full disk, an unwritable directory, an
exception) removes the partial files and leaves every previous file untouched; a full disk or an
unwritable path is an :class:`OutputError`, one line naming the file and, where known, the bytes it
needs. A process killed outright (SIGKILL, or a signal with the default action) cannot clean up: it
may leave a ``.partial`` file, never a truncated output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import secrets
import shutil
import tempfile
from typing import IO, Iterator, Optional

# Rust-backed writers (safetensors, tokenizers) report an OS error inside their own message
_RUST_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+), kind:")
_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def readable_bytes(count: float) -> str:
    """``count`` bytes in GiB, MiB, KiB or B, one decimal."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


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


def file_problem(path: str) -> Optional[str]:
    """Why the output file ``path`` could not be written (None: it can): a directory, or a place
    where no file can be created."""
    if os.path.isdir(path):
        return f"{path} is a directory; give a file name"
    return creation_problem(path)


def directory_problem(directory: str) -> Optional[str]:
    """Why files could not be written under ``directory`` (None: they can)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"{directory} is a file, not a directory"
    # the directory itself when it exists (a probe file goes into it), else where it will be created
    return creation_problem(os.path.join(directory, "probe") if os.path.isdir(directory) else directory)


class OutputError(OSError):
    """An output file that could not be written (a full disk, an unwritable directory): one line
    naming it, why, the bytes it needs where known, and what to do. ``errno`` is the OS error."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.errno = code


def os_error(err: BaseException) -> Optional[tuple[int, str]]:
    """The OS error (errno, text) behind ``err``, a write error of Python's I/O or of a library that
    wraps it (safetensors, tokenizers, numpy), or None when ``err`` is no I/O error."""
    if isinstance(err, OutputError):
        return None  # already said, with its file
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno, err.strerror or os.strerror(err.errno)
    match = _RUST_OS_ERROR.search(str(err))
    if match:
        code = int(match.group(1) or match.group(2))
        return code, os.strerror(code)
    return None


@dataclasses.dataclass
class StagedFile:
    """One output: where it ends up (``final``; may be renamed before the commit), where it is
    written meanwhile (``temporary``), the bytes it needs if known, and whether a previous file is
    there (it stays until the commit replaces it)."""

    final: str
    temporary: str
    needed: Optional[int] = None
    existed: bool = False


class StagedOutputs:
    """Files written under temporary names beside their final ones and renamed into place together
    by :meth:`commit` once all are complete (each flushed to disk first); :meth:`discard` removes
    them. As a context manager: commit on success; on an exception, discard, and a write error
    (see :func:`os_error`) becomes an :class:`OutputError` naming the file being written (``flag``,
    e.g. ``"--output"``, names the flag that chose it). ``exclusive``: one file that must not exist yet
    (a lock): the commit raises ``FileExistsError`` if it does."""

    def __init__(self, flag: Optional[str] = None, exclusive: bool = False) -> None:
        self.flag, self.exclusive = flag, exclusive
        self.files: list[StagedFile] = []
        self._token = f"{os.getpid()}-{secrets.token_hex(3)}"  # one per group: a pair keeps a common prefix

    def stage(self, final: str, needed: Optional[int] = None) -> StagedFile:
        """A new output ``final``: its (empty, created) temporary file in the same directory, which the
        caller writes; the directory is created if missing."""
        directory, name = os.path.split(os.path.abspath(final))
        stem, ext = os.path.splitext(name)
        try:
            os.makedirs(directory, exist_ok=True)
            temporary = os.path.join(directory, f".{stem}.{self._token}.partial{ext}")
            os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # less the umask, as open()
            if os.path.exists(final):  # a replaced file keeps its mode
                os.chmod(temporary, os.stat(final).st_mode & 0o7777)
        except OSError as err:
            raise self._error(final, needed, os.path.exists(final), err.errno, err.strerror) from None
        staged = StagedFile(final, temporary, needed, os.path.exists(final))
        self.files.append(staged)
        return staged

    @contextlib.contextmanager
    def open(self, final: str, mode: str = "w", needed: Optional[int] = None, **kwargs) -> Iterator[IO]:
        """``final`` opened for writing (``mode`` "w" or "wb"), through its temporary file."""
        with open(self.stage(final, needed).temporary, mode, **kwargs) as f:
            yield f

    def commit(self) -> None:
        """Every staged file to disk, then renamed into place (the previous ones replaced)."""
        if self.exclusive:
            return self._commit_exclusively()
        directories = set()
        for staged in self.files:
            self._sync(staged)
        for staged in self.files:
            try:
                os.replace(staged.temporary, staged.final)
            except OSError as err:
                raise self._error(staged.final, staged.needed, staged.existed, err.errno, err.strerror) from None
            directories.add(os.path.dirname(os.path.abspath(staged.final)))
        self.files = []
        for directory in directories:
            fsync_directory(directory)

    def _commit_exclusively(self) -> None:
        """A hard link creates the name atomically with its whole content (also on NFS), or fails
        with ``FileExistsError``."""
        staged, = self.files
        self._sync(staged)
        try:
            os.link(staged.temporary, staged.final)
        except FileExistsError:
            self.discard()
            raise
        except OSError as err:
            raise self._error(staged.final, staged.needed, False, err.errno, err.strerror) from None
        self.discard()
        fsync_directory(os.path.dirname(os.path.abspath(staged.final)))

    def discard(self) -> None:
        """Remove the temporary files; the previous outputs stay as they were."""
        for staged in self.files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(staged.temporary)
        self.files = []

    def abandon(self, err: BaseException) -> Optional[OutputError]:
        """After ``err`` stopped the writing: the temporary files removed, and the :class:`OutputError`
        to raise instead when ``err`` is a write error (None: re-raise ``err``)."""
        failed = self.files[-1] if self.files else None  # written in order: the last one was being written
        self.discard()
        cause = os_error(err)
        return None if cause is None or failed is None else self._error(failed.final, failed.needed, failed.existed,
                                                                           *cause)

    def __enter__(self) -> "StagedOutputs":
        return self

    def __exit__(self, kind, err, _traceback) -> None:
        if err is None:
            try:
                self.commit()
            except BaseException:
                self.discard()
                raise
            return
        failure = self.abandon(err)
        if failure is not None:
            raise failure from None

    def _sync(self, staged: StagedFile) -> None:
        try:
            fd = os.open(staged.temporary, os.O_RDONLY)
            try:
                os.fsync(fd)  # a delayed-allocation disk reports a full disk here
            finally:
                os.close(fd)
        except OSError as err:
            self.discard()
            raise self._error(staged.final, staged.needed, staged.existed, err.errno, err.strerror) from None

    def _error(self, final: str, needed: Optional[int], existed: bool, code: Optional[int],
               reason: Optional[str]) -> OutputError:
        code = code or errno.EIO
        where = f"{self.flag} {final}" if self.flag else final
        space = ""
        if code in _SPACE_ERRORS:
            free = shutil.disk_usage(nearest_existing(os.path.dirname(os.path.abspath(final)))).free
            space = f"; it needs {readable_bytes(needed)}, " if needed else "; "
            space += f"{readable_bytes(free)} free there"
        kept = f"the previous {os.path.basename(final)} is untouched" if existed else "no partial file is left"
        todo = "free space there" if code in _SPACE_ERRORS else "make it writable"
        other = f"give {self.flag} another path" if self.flag else "write elsewhere"
        return OutputError(f"{where}: cannot write it ({reason or os.strerror(code)}{space}); {kept}; "
                           f"{todo} or {other}", code)


@contextlib.contextmanager
def staged(final: str, flag: Optional[str] = None, needed: Optional[int] = None) -> Iterator[str]:
    """The temporary path to write ``final`` through (for writers that take a path), renamed into
    place when the block ends without an error (see :class:`StagedOutputs`)."""
    with StagedOutputs(flag) as outputs:
        yield outputs.stage(final, needed).temporary


def write_text(path: str, text: str, flag: Optional[str] = None, exclusive: bool = False) -> None:
    """``path`` holds ``text`` (UTF-8), whole or, after an :class:`OutputError`, as it was;
    ``exclusive``: only if ``path`` does not exist yet (else ``FileExistsError``: a lock)."""
    data = text.encode("utf-8")
    with StagedOutputs(flag, exclusive) as outputs, outputs.open(path, "wb", needed=len(data)) as f:
        f.write(data)


def fsync_directory(path: str) -> None:
    """A rename in ``path`` made durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
