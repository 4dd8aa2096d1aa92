"""The controller's end of a kept-alive mesh's agent, reached through its door
(``host/door.py``) by a controller that attaches (``mnb.attach``): the same
records as over a first controller's pipe, on a Unix socket."""

from __future__ import annotations

import os
import socket
import time

from ..protocol import host_messages as hm
from ..protocol import keepalive
from .host_agent import LET_GO_WAIT, HostAgent

CONNECT_TIMEOUT = 5.0


class LinkedAgent(HostAgent):
    """The agent of the kept-alive mesh of registry ``entry``; its ranks arrive in
    its Held report (``held``). ``steal``: take the mesh from the controller that
    has it (that one is told, and lets go)."""

    def __init__(self, entry: dict, steal: bool = False):
        self.entry, self.steal = entry, steal
        self.sock: socket.socket | None = None
        self._refusal: str | None = None
        super().__init__(wait=False, keep_alive=entry["keep_alive"], mesh_name=entry["name"])
        self.label = f"the agent of mesh {entry['name']!r}"

    @property
    def pid(self) -> int | None:
        return self.entry["agent_pid"]

    @property
    def alive(self) -> bool:
        return self.error is None and self.sock is not None and not self.detached

    def _open(self, env: dict) -> int | None:
        path = keepalive.door_path(self.entry["name"])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            sock.connect(path)
            sock.sendall(hm.encode(hm.Attach(os.getpid(), self.steal)))
            sock.settimeout(None)
        except OSError as e:
            sock.close()
            self.error = f"cannot reach the agent of mesh {self.entry['name']!r} at {path}: {e}"
            self._ready.set()
            self._started.set()
            return None
        self.sock = sock
        self._started.set()
        return sock.fileno()

    def _exit_code(self) -> int:
        return 0

    def Refused(self, msg: hm.Refused) -> None:
        if self.info is None:  # the door's answer: not let in
            self._refusal = msg.error
        else:
            super().Refused(msg)

    def _gone(self, code: int) -> None:
        if self.info is None:
            self.error = self._refusal or f"{self.label} hung up before it was ready"
            self._ready.set()
            self.held.set()
        else:
            why = f"{self.label} (pid {self.pid}) ended or hung up"
            self.error = why
            self.end_all(why)
        if self.sock is not None:
            self.sock.close()

    def send(self, msg) -> None:
        line = hm.encode(msg)
        with self._write_lock:
            if not self.alive:
                raise RuntimeError(self.error or f"{self.label} is not linked")
            try:
                self.sock.sendall(line)
            except OSError as e:
                raise RuntimeError(f"{self.label} (pid {self.pid}) is gone: {e}") from None

    def _close_link(self) -> None:
        self.sock.close()

    def let_go(self, timeout: float = LET_GO_WAIT) -> None:
        """As HostAgent's: our end of the link closed, then the agent's, within ``timeout``."""
        self.detached = True
        if self.sock is None:
            return
        _shutdown(self.sock, socket.SHUT_WR)
        self._await_hangup(timeout)  # the agent hangs up in turn
        _shutdown(self.sock, socket.SHUT_RD)  # one that did not: our reader ends anyway

    def wait_ended(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while keepalive.agent_alive(self.entry) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._quit()
        self.wait_ended(10)
        self._thread.join(10)


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:  # closed already: the agent hung up
        pass


def held_ranks(agent: LinkedAgent, world: int, timeout: float = 10.0) -> dict:
    """rank -> AgentRank of every rank of the mesh, once the agent said which it holds;
    RuntimeError naming the ranks that ended while no controller was attached."""
    agent.wait_ready()
    if not agent.held.wait(timeout) or agent.error is not None:
        raise RuntimeError(agent.error or f"{agent.label} did not list its ranks")
    procs = {r.rank: r for r in agent.ranks.values()}
    missing = sorted(set(range(world)) - set(procs))
    if missing:
        raise RuntimeError(
            f"mesh {agent.entry['name']!r}: rank(s) {missing} ended while no controller was "
            f"attached; it cannot be used again (end it: monarch-nb kill {agent.entry['name']})"
        )
    return procs
