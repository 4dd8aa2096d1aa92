"""This process's local host agent, forked by the fork server (``host/forkserver.py``).

A controller's first local mesh needs a host agent, which imports torch (~2 s of
CPU) before it forks ranks. The fork server has done that once for this user:
``spawn_agent`` asks it for an agent (starting it first when there is none) and
returns a ``ForkedAgent``, the parts of a Popen the ``HostAgent`` uses. Each
server serves one interpreter, one copy of monarch_nb and torch as they are on
disk now, and one set of variables read at import (``import_time_env``): its
socket's name is a digest of them, so an edited checkout or a changed variable
gets a server of its own, and an unused one exits after ``agent_forkserver_idle``
seconds. The socket is in a 0700 directory of this user's under the temp
directory (``monarch-nb-UID``). Any failure here leaves the caller to start its
agent itself, as before.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

from ..protocol import forkserver as fs

START_TIMEOUT = 120.0  # s for a new server's imports (torch, on a busy machine)
REPLY_TIMEOUT = 30.0  # s for the server's pid (it forks at once; a busy machine)
MAX_SOCKET_PATH = 100  # bytes: sun_path holds 108 on Linux (104 elsewhere), with its NUL
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # monarch_nb/


class ForkedAgent:
    """A host agent the fork server forked: what ``HostAgent`` uses of a Popen
    (``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``kill``). Its exit status
    comes from the server; a server gone took its agents with it (SIGKILL)."""

    def __init__(self, pid: int, server: int, conn: socket.socket, stdin: int, stdout: int):
        self.pid, self.server_pid, self._conn = pid, server, conn
        self.stdin = open(stdin, "wb", buffering=0)  # noqa: SIM115 - closed by HostAgent
        self.stdout = open(stdout, "rb", buffering=0)  # noqa: SIM115
        self.returncode: int | None = None
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)  # a kill never hits a reused pid
        except ProcessLookupError:
            self._pidfd = None

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._status(0)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("monarch-nb-host", timeout)
            try:
                select.select([self._conn], [], [], left)
            except (OSError, ValueError):  # closed by another thread meanwhile
                pass
        return self.returncode

    def kill(self) -> None:
        with self._lock:
            if self.returncode is None and self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _status(self, timeout: float) -> None:
        """Take the server's exit report when one is in (the lock held)."""
        try:
            if not select.select([self._conn], [], [], timeout)[0]:
                return
            data = self._conn.recv(4096)
        except OSError:
            data = b""
        if data:
            try:
                reply = fs.decode_reply(data)
            except fs.ForkRequestError:
                return
            if "exit" not in reply:
                return
            self.returncode = int(reply["exit"])
        else:  # the server is gone, and its agents with it (their parent-death signal)
            self.returncode = -signal.SIGKILL
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def import_time_env(env: dict) -> tuple:
    """The variables a process reads once, at start or import (glibc's malloc, torch's,
    Python's, the loader's): the agent read them when it started, so ranks forked from
    it see their values of then. A change starts a fresh agent. (Per fork: the rest of
    the env, our MONARCH_NB_* settings among it (config.process_settings reads them
    again after the fork), OMP_NUM_THREADS through torch.set_num_threads, sys.path,
    the cwd.)"""
    prefixes = ("MALLOC_", "TORCH_", "PYTHON", "LD_")
    skip = {"PYTHONPATH", "CUDA_VISIBLE_DEVICES"}
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(prefixes) and k not in skip))


def spawn_agent(argv: list[str], env: dict, idle: float) -> ForkedAgent:
    """An agent run as ``monarch-nb-host ARGV`` in ``env`` and this process's working
    directory, forked by the server for ``env`` (started when there is none, to wait
    ``idle`` s for work). Raises OSError when no server can be had."""
    if not hasattr(os, "pidfd_open"):  # its agents watch their controller by pidfd
        raise OSError("the fork server needs Linux 5.3's pidfd")
    path = server_path(import_time_env(env))
    for _ in range(2):  # a server that exits idle as we connect: start another
        conn = _connect(path)
        if conn is None:
            with _StartLock(path):
                conn = _connect(path)
                if conn is None:
                    _start_server(path, env, idle)
                    conn = _connect(path)
        if conn is None:
            raise OSError(f"the fork server at {path} does not answer")
        agent = _ask(conn, argv, env)
        if agent is not None:
            return agent
    raise OSError(f"the fork server at {path} hung up twice")


def server_path(env_key: tuple) -> str:
    """The socket of the server for this interpreter, monarch_nb and torch on disk and
    ``env_key``: in this user's directory of the temp directory, or of /tmp where that
    path is too long for a Unix socket; OSError where no such directory is safe to use."""
    name = f"agents-{server_digest(env_key)}.sock"
    path = ""
    for tmp in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
        path = os.path.join(tmp, f"monarch-nb-{os.getuid()}", name)
        if len(path.encode()) <= MAX_SOCKET_PATH:
            _own_directory(os.path.dirname(path))
            return path
    raise OSError(f"{path} is too long for a Unix socket")


def _own_directory(base: str) -> None:
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{base} is not a directory of this user's")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(base, 0o700)


def server_digest(env_key: tuple, package: str = _PACKAGE) -> str:
    """What a server's agents import, as a digest: the interpreter, ``package``'s
    sources (each file's name, size and mtime), torch's place and ``env_key``."""
    h = hashlib.sha256(repr((sys.executable, sys.version, package, env_key)).encode())
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        h.update(repr((spec.origin, os.stat(spec.origin).st_mtime_ns)).encode())
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(root, name))
                h.update(f"{root}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except OSError:
        sock.close()
        raise
    return sock


class _StartLock:
    """The file lock of one server's start: one process starts it, the others wait."""

    def __init__(self, path: str):
        self.fd = os.open(path[: -len(".sock")] + ".lock", os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the lock


def _start_server(path: str, env: dict, idle: float) -> None:
    try:
        os.unlink(path)  # a socket no server listens on (one that died)
    except FileNotFoundError:
        pass
    cmd = [sys.executable, "-m", "monarch_nb.host.forkserver", "--socket", path]
    popen = subprocess.Popen(
        [*cmd, "--idle", repr(float(idle))],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        cwd="/",
        close_fds=True,
    )
    with popen.stdout:
        popen.wait()  # it detaches at once; the server writes "ready" once it listens
        if not select.select([popen.stdout], [], [], START_TIMEOUT)[0]:
            raise OSError(f"the fork server did not start within {START_TIMEOUT:.0f} s")
        line = popen.stdout.readline()
    if line != b"ready\n":
        raise OSError("the fork server did not start (its stderr went to this process's)")


def _ask(conn: socket.socket, argv: list[str], env: dict) -> ForkedAgent | None:
    """Have the server behind ``conn`` fork the agent; None when it hung up."""
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    err = 2
    try:
        os.fstat(2)
    except OSError:  # no stderr here: the agent's goes nowhere
        err = os.open(os.devnull, os.O_WRONLY)
    try:
        request = fs.encode_request(argv, env, os.getcwd())
        socket.send_fds(conn, [request], [stdin_r, stdout_w, err])
        conn.settimeout(REPLY_TIMEOUT)
        data = conn.recv(4096)
        conn.settimeout(None)
    except OSError:
        data = b""
    finally:
        for fd in (stdin_r, stdout_w, *([err] if err != 2 else [])):
            os.close(fd)
    if not data:
        conn.close()
        os.close(stdin_w)
        os.close(stdout_r)
        return None
    reply = fs.decode_reply(data)
    if "pid" not in reply:
        conn.close()
        os.close(stdin_w)
        os.close(stdout_r)
        raise OSError(f"the fork server refused: {reply.get('error', reply)}")
    return ForkedAgent(int(reply["pid"]), int(reply["server"]), conn, stdin_w, stdout_r)
