"""Writing files so that an interruption never leaves half of one: write beside the target, then rename.

A rename within a file system is atomic, so a reader sees the old file or the new one, never a mixture;
fsyncing the file and then its folder makes the new one survive a power cut.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename durable: the directory entry itself must reach the disk (POSIX only)."""
    if os.name == "posix":
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; once the caller has written it, it replaces `path` in one rename.

    If the body raises (or the process is interrupted), the temporary file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.part"
    # created here, not by mkstemp (which makes it private, 0600): the file gets the mode any new file gets (umask)
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@contextmanager
def atomic_directory(directory: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder next to `directory`; once the caller has filled it, it replaces `directory`.

    An interrupted body leaves the previous folder as it was. Replacing a folder takes two steps (remove, then
    rename), so a crash between them leaves none; never a half-written one.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".part"))
    try:
        yield tmp
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(directory.parent)


CACHE_ENV = "COURSE_CACHE_DIR"


def cache_dir() -> Path:
    """Where the course keeps downloads and this machine's calibration: `$COURSE_CACHE_DIR`, else
    `~/.cache/gpt-from-scratch-fast`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gpt-from-scratch-fast")
