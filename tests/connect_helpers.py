"""For the tests of meshes that others join (``connect_mesh``): the mesh made in a
thread while the test starts its workers or host agents, the wait for the
connection file, and a joined worker started as another launcher would."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from wait_helpers import wait_for

import monarch_nb as mnb


class Waiting:
    """connect_mesh in a thread: it blocks until every rank has joined."""

    def __init__(self, **kw):
        self.result: list = []
        self.error: list = []
        self.thread = threading.Thread(target=self._run, args=(kw,), daemon=True)
        self.thread.start()

    def _run(self, kw):
        try:
            self.result.append(mnb.connect_mesh(**kw))
        except BaseException as e:  # noqa: B036 - handed to the test
            self.error.append(e)

    def mesh(self, timeout=120):
        self.thread.join(timeout)
        if self.error:
            raise self.error[0]
        assert self.result, "connect_mesh did not return"
        return self.result[0]


def wait_file(path, timeout=30):
    wait_for(lambda: os.path.exists(path), timeout, f"{path} to appear")


# joined workers import what their own environment has: the tests' modules too, and the
# monarch_nb the tests run (a worker of another protocol version would be refused)
TESTS_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        p for p in (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")) if p
    ),
}


def worker(conn, *args, env=None, **kw):
    """``monarch-nb-worker --connection-file CONN *args`` (stderr piped unless given)."""
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        [sys.executable, "-m", "monarch_nb.worker", "--connection-file", str(conn), *args],
        env={**TESTS_ENV, **(env or {})},
        text=True,
        **kw,
    )
