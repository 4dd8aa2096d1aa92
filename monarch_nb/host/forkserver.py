"""``python -m monarch_nb.host.forkserver``: a warm fork server of local host agents.

A host agent imports torch and the worker before it forks ranks: ~2 s of CPU,
paid by every process that starts a local mesh (each kernel, each script). The
fork server pays it once per user and environment: it imports what an agent
imports, listens on its socket (the wire: ``protocol/forkserver.py``) and forks
an agent for each controller that asks, which then runs as a fresh
``monarch-nb-host --stdio`` would, in the caller's environment, working
directory and stdio. An agent it forked dies with it (a parent-death signal) and
watches its controller by pid. The server stays single-threaded (fork stays
safe), detaches from whoever started it, and exits once it has had no agent and
no request for ``--idle`` seconds. Its socket's name holds a digest of what its
agents would import (``launchers/agent_forkserver.py``): an edit of monarch_nb or
another torch gets another server.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import tempfile
import time

from ..protocol import forkserver as fs
from .child import reaped, run_child, set_title
from .door import Door, peer


class ForkServer:
    """Serves fork requests on the Unix socket at ``path`` until idle for ``idle`` s."""

    def __init__(self, path: str, idle: float):
        self.idle = idle
        self.door = Door(path, socket.SOCK_SEQPACKET, backlog=64)
        self.sock = self.door.sock
        self.conns: dict[int, socket.socket] = {}  # fd -> a caller's connection
        self.agents: dict[int, socket.socket | None] = {}  # pid -> who asked (None: gone)
        self.last = time.monotonic()
        self.poll = select.poll()

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        self.wake = (wake_r, wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd does the work
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.set_wakeup_fd(wake_w)
        self.poll.register(self.sock.fileno(), select.POLLIN)
        self.poll.register(wake_r, select.POLLIN)
        try:
            while True:
                self._reap()
                if not self.agents and time.monotonic() - self.last >= self.idle:
                    break
                for fd, _ in self.poll.poll(1000 * min(self.idle, 60.0)):
                    if fd == self.sock.fileno():
                        self._accept()
                    elif fd == wake_r:
                        try:
                            os.read(wake_r, 4096)
                        except BlockingIOError:
                            pass
                    elif fd in self.conns:
                        self._request(self.conns[fd])
        finally:
            self.door.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        if peer(conn)[1] != os.getuid():
            _reply(conn, error="this fork server belongs to another user")
            conn.close()
            return
        self.conns[conn.fileno()] = conn
        self.poll.register(conn.fileno(), select.POLLIN)
        self.last = time.monotonic()

    def _drop(self, conn: socket.socket) -> None:
        self.poll.unregister(conn.fileno())
        del self.conns[conn.fileno()]
        for pid, who in self.agents.items():
            if who is conn:
                self.agents[pid] = None
        conn.close()

    def _request(self, conn: socket.socket) -> None:
        self.last = time.monotonic()
        try:
            data, fds, _, _ = socket.recv_fds(conn, fs.MAX_MESSAGE, fs.REQUEST_FDS)
        except OSError:
            data, fds = b"", []
        if not data:  # the caller hung up
            self._drop(conn)
            return
        try:
            if len(fds) != fs.REQUEST_FDS:
                raise fs.ForkRequestError(
                    f"a fork request carries {fs.REQUEST_FDS} file descriptors (got {len(fds)})"
                )
            if conn in self.agents.values():
                raise fs.ForkRequestError("one agent per connection")
            argv, env, cwd = fs.decode_request(data)
            pid = self._fork(argv, env, cwd, fds)
        except (fs.ForkRequestError, OSError) as e:
            _reply(conn, error=str(e))
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.agents[pid] = conn
        _reply(conn, pid=pid, server=os.getpid())

    def _fork(self, argv, env, cwd, fds) -> int:
        pid = os.fork()
        if pid == 0:  # the agent: never returns
            run_child(self._become_agent, argv, env, cwd, fds)
        return pid

    def _become_agent(self, argv, env, cwd, fds) -> None:
        os.setsid()  # as a Popen(start_new_session=True) agent: a terminal's Ctrl-C is not its
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for fd in (*self.wake, self.sock.fileno(), *self.conns):
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        from ..worker.__main__ import set_parent_death_signal

        set_parent_death_signal(os.getppid())  # SIGKILL when this server goes
        set_title(["monarch_nb.host", *argv], "mnb-agent")
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = list(dict.fromkeys([cwd, *paths, *sys.path[1:]]))  # as `python -m` would
        sys.argv = ["monarch_nb.host", *argv]
        tempfile.tempdir = None  # found again from this env's TMPDIR
        if hasattr(time, "tzset"):
            time.tzset()
        from .__main__ import main

        main(argv)

    def _reap(self) -> None:
        if not self.agents:
            return
        for pid, code in reaped():
            conn = self.agents.pop(pid, None)
            self.last = time.monotonic()
            if conn is not None:
                _reply(conn, exit=code)


def _reply(conn: socket.socket, **fields) -> None:
    try:
        conn.send(fs.encode_reply(**fields))
    except OSError:
        pass  # the caller is gone


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m monarch_nb.host.forkserver", description=__doc__)
    p.add_argument("--socket", required=True, help="the Unix socket to listen on")
    p.add_argument("--idle", type=float, required=True, help="exit after this many idle seconds")
    a = p.parse_args(argv)
    if not a.idle > 0:
        p.error(f"--idle must be > 0 (got {a.idle})")
    if os.fork() > 0:  # detach: the starter waits for "ready" on its pipe, not for us
        os._exit(0)
    os.setsid()
    from .__main__ import preload

    preload()
    try:
        server = ForkServer(a.socket, a.idle)
    except OSError as e:
        print(f"monarch_nb fork server: cannot listen on {a.socket}: {e}", file=sys.stderr)
        os._exit(1)
    os.write(1, b"ready\n")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # nobody reads its output once its starter has gone
        os.dup2(null, fd)
    os.close(null)
    server.serve()
    os._exit(0)


if __name__ == "__main__":
    main()
