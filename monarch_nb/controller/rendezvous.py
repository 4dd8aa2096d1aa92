"""Where the workers of a generation meet to start torch.distributed.

On one host: a FileStore in a private (0700) directory, one file per
generation, no socket at all. The directory lives as long as anyone may use it:
the controller and every rank hold a shared lock on its ``held`` file (the ranks
for their whole life: a kept-alive mesh's ranks create process groups through it
after their controller is gone); a controller removes its directory at shutdown,
and each new one removes the directories nobody holds any more (those of
controllers that died). A mesh whose controller binds beyond loopback
(workers on other hosts): the controller's own store (``store_server``), which
workers reach through the signed controller channel; nothing listens for it.
``MONARCH_NB_RENDEZVOUS=controller`` (or ``file``) picks one explicitly.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import socket
import tempfile
import time

from ..protocol.constants import STORE_HELD
from .store_server import StoreServer

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
KINDS = ("file", "controller")
PREFIX = "mnb-store-"
STALE_AFTER_S = 60.0  # a younger directory may be one whose controller is about to hold it
UNHELD_STALE_AFTER_S = 2 * 86400.0  # a directory without a held file (an older version's)


class Rendezvous:
    """The rendezvous of one mesh; ``store`` serves the ``controller`` kind."""

    def __init__(self, advertise: str, kind: str = "auto"):
        """``kind``: the setting ``rendezvous`` (``auto``: file on loopback)."""
        if kind == "auto":
            kind = "file" if advertise in _LOOPBACK else "controller"
        if kind not in KINDS:
            raise ValueError(f"rendezvous must be one of auto, {', '.join(KINDS)}; got {kind!r}")
        self.kind = kind
        self._dir: str | None = None
        self._held: int | None = None  # the fd of our shared lock on the directory
        self.store = StoreServer()

    def address(self, generation: int) -> str:
        """The store address the workers of ``generation`` join through."""
        if self.kind == "file":
            if self._dir is None:
                sweep_stale()
                self._dir = tempfile.mkdtemp(prefix=PREFIX)  # mode 0700: this user only
                self._held = os.open(os.path.join(self._dir, STORE_HELD), os.O_CREAT | os.O_RDONLY)
                fcntl.flock(self._held, fcntl.LOCK_SH)
            return "file://" + os.path.join(self._dir, f"gen{generation}")
        self.store.begin(generation)
        return f"controller://{generation}"

    def new_generation(self) -> None:
        self.store.begin(-1)  # nothing is served until the generation's address is given

    def serve(self, generation: int) -> None:
        """Serve the store of ``generation`` (of ranks this controller attached to)."""
        if self.kind == "controller":
            self.store.begin(generation)

    def let_go(self) -> None:
        """Stop serving, and leave the directory to the ranks that go on without us."""
        self.store.begin(-1)
        self._release()
        self._dir = None

    def close(self) -> None:
        """Stop serving and remove the directory (the mesh's ranks are gone)."""
        self.store.begin(-1)
        self._release()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _release(self) -> None:
        if self._held is not None:
            os.close(self._held)
            self._held = None


def sweep_stale(directory: str | None = None) -> list[str]:
    """Remove this user's rendezvous directories in ``directory`` (the temp
    directory) that nobody holds and that are older than a minute; returns them."""
    now, removed = time.time(), []
    for path in glob.glob(os.path.join(directory or tempfile.gettempdir(), PREFIX + "*")):
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid() or now - st.st_mtime < STALE_AFTER_S:
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
        fd = os.open(os.path.join(path, STORE_HELD), os.O_RDONLY)
    except FileNotFoundError:
        return age > UNHELD_STALE_AFTER_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # the lock (if taken) goes with it


def advertised_host(interface: str) -> str:
    """The address workers reach this controller at, for a bind address."""
    if interface in ("0.0.0.0", "*", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()
    return interface
