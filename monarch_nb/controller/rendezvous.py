"""Where the workers of a generation meet to start torch.distributed.

On one host: a FileStore in a private (0700) directory, one file per
generation, no socket at all. A mesh whose controller binds beyond loopback
(workers on other hosts): the controller's own store (``store_server``), which
workers reach through the signed controller channel; nothing listens for it.
``MONARCH_NB_RENDEZVOUS=controller`` (or ``file``) picks one explicitly.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

from .store_server import StoreServer

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
KINDS = ("file", "controller")


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
        self.store = StoreServer()

    def address(self, generation: int) -> str:
        """The store address the workers of ``generation`` join through."""
        if self.kind == "file":
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="mnb-store-")
                os.chmod(self._dir, 0o700)
            return "file://" + os.path.join(self._dir, f"gen{generation}")
        self.store.begin(generation)
        return f"controller://{generation}"

    def new_generation(self) -> None:
        self.store.begin(-1)  # nothing is served until the generation's address is given

    def close(self) -> None:
        self.store.begin(-1)
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
