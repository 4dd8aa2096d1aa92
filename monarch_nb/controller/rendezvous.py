"""Where the workers of a generation meet to start torch.distributed.

On one host: a FileStore in a private (0700) directory, one file per
generation, no socket at all. Workers on other hosts need a TCPStore served by
the controller, which listens on every interface and is not authenticated:
use that on trusted networks (docs/clusters.md).
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import tempfile

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class Rendezvous:
    def __init__(self, advertise: str):
        self._advertise = advertise
        self._dir: str | None = None
        self._store = None  # the TCPStore of the current generation, kept alive here

    def address(self, generation: int) -> str:
        """The store address the workers of ``generation`` join through."""
        if self._advertise in _LOOPBACK:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="mnb-store-")
                os.chmod(self._dir, 0o700)
            return "file://" + os.path.join(self._dir, f"gen{generation}")
        import torch.distributed as dist

        self._store = dist.TCPStore(
            self._advertise,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
        )
        return f"tcp://{self._advertise}:{self._store.port}"

    def new_generation(self) -> None:
        self._store = None

    def close(self) -> None:
        self._store = None
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
