"""Directories that several processes use and that must outlive whichever of them
made it: a local rendezvous's FileStore (the controller and every rank), a host's
code folder (its ranks). Each user holds a shared ``flock`` on the directory's
``held`` file while it may use it; the last one out, or a later process that
sweeps (the lock goes with its holder however it ended, SIGKILL included),
removes a directory nobody holds.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
import time

HELD = "held"
SWEEP_AFTER_S = 60.0  # a younger directory may be one whose maker is about to hold it
UNHELD_AFTER_S = 2 * 86400.0  # a directory without a held file (an earlier version's)


def make(prefix: str) -> tuple[str, int]:
    """A new private (0700) directory in the temp directory, held: ``(path, fd)``."""
    path = tempfile.mkdtemp(prefix=prefix)
    return path, hold(path, create=True)


def hold(directory: str, create: bool = False) -> int | None:
    """Hold ``directory`` (a shared lock on its held file, made if ``create``) until
    ``release``: the fd, or None where it has no held file (an earlier version's) or
    its filesystem has no locks."""
    flags = os.O_RDONLY | (os.O_CREAT if create else 0)
    try:
        fd = os.open(os.path.join(directory, HELD), flags, 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:  # a filesystem without flock: nobody can sweep it either (_unheld)
        os.close(fd)
        return None
    return fd


def release(fd: int | None) -> None:
    """Stop holding (the directory stays)."""
    if fd is not None:
        os.close(fd)


def remove_if_unheld(directory: str) -> bool:
    """Remove ``directory`` if nobody holds it (this process released its hold)."""
    if not _unheld(directory, 0.0):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


def sweep(prefix: str, directory: str | None = None) -> list[str]:
    """Remove this user's ``prefix*`` directories in ``directory`` (the temp
    directory) that nobody holds and that are older than a minute; returns them."""
    now, removed = time.time(), []
    for path in glob.glob(os.path.join(directory or tempfile.gettempdir(), prefix + "*")):
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid() or now - st.st_mtime < SWEEP_AFTER_S:
                continue
            if not _unheld(path, now - st.st_mtime):
                continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _unheld(path: str, age: float) -> bool:
    try:
        fd = os.open(os.path.join(path, HELD), os.O_RDONLY)
    except FileNotFoundError:
        return os.path.isdir(path) and age > UNHELD_AFTER_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held (BlockingIOError), or a filesystem without flock: kept
        return False
    finally:
        os.close(fd)  # the lock (if taken) goes with it
