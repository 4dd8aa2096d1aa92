"""Where the workers of a generation meet to start torch.distributed.

On one host: a FileStore in a private (0700) directory, one file per
generation, no socket at all. The directory lives as long as anyone may use
it: the controller and every rank hold it (``protocol/held_dirs``; the ranks
for their whole life: a kept-alive mesh's ranks create process groups through
it after their controller is gone); a controller removes its directory at
shutdown, and each new one removes those nobody holds any more (of controllers
that died). A mesh whose controller binds beyond loopback (workers on other
hosts): the controller's own store (``store_server``), which workers reach
through the signed controller channel; nothing listens for it.
``MONARCH_NB_RENDEZVOUS=controller`` (or ``file``) picks one explicitly.
"""

from __future__ import annotations

import os
import shutil
import socket

from ..protocol import held_dirs
from .store_server import StoreServer

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
KINDS = ("file", "controller")
PREFIX = "mnb-store-"


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
                held_dirs.sweep(PREFIX)  # those of controllers gone, whose ranks are too
                self._dir, self._held = held_dirs.make(PREFIX)  # mode 0700: this user only
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
        held_dirs.release(self._held)
        self._dir = self._held = None

    def close(self) -> None:
        """Stop serving and remove the directory (the mesh's ranks are gone)."""
        self.store.begin(-1)
        held_dirs.release(self._held)
        self._held = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def advertised_host(interface: str) -> str:
    """The address workers reach this controller at, for a bind address."""
    if interface in ("0.0.0.0", "*", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()
    return interface
