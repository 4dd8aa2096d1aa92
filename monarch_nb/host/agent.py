"""The agent's loop: one thread, one poll over the controller's channel, the
ranks' output pipes and a SIGCHLD wake-up pipe.

A rank that ends is reaped at once (SIGCHLD wakes the poll) and reported with
its exit status after the output it wrote. When the controller goes (its
channel closes, or the agent's parent changes) the agent kills its ranks and
exits, unless it keeps its ranks alive (``--keep-alive S``, a kept-alive mesh's
own agent): then it serves on, orphaned, keeping the last ``ORPHAN_OUTPUT`` bytes
each rank prints, until S seconds after its controller went (or its ranks all
ended, or a SIGTERM: ``monarch-nb kill``), then kills its ranks and exits.
Meanwhile its door (``door.py``) takes a controller that attaches: the output kept
comes first, then the agent serves that controller as it served the first.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

from .._version import __version__
from ..protocol import host_messages as hm
from ..protocol import keepalive
from ..protocol.receivers import AGENT_DOOR, handler_table
from .child import fork_rank, reaped
from .control import ControlChannel
from .door import Door, refuse

POLL_MS = 500  # the longest the loop sleeps: the parent check runs at least this often
ORPHAN_OUTPUT = 1 << 20  # bytes of each rank's output kept while no controller listens
STEAL_WAIT = 10.0  # s a controller stolen from has to let go before it is cut off


class Rank:
    """A forked rank the agent watches."""

    def __init__(self, slot: int, rank: int, pid: int, out: int):
        self.slot, self.rank, self.pid, self.out = slot, rank, pid, out


class Agent(ControlChannel):
    """Serves one controller over ``ctl_in``/``ctl_out`` (host_messages lines)."""

    def __init__(
        self,
        local_ranks: int,
        ctl_in: int,
        ctl_out: int,
        parent_pid: int | None,
        keep_alive: float | None = None,
        mesh_name: str | None = None,
    ):
        self.local_ranks = local_ranks
        self.keep_alive, self.mesh_name = keep_alive, mesh_name
        self.orphaned_at: float | None = None  # monotonic: when the controller went
        self.stopped = False  # SIGTERM: no keeping alive
        self.pending: dict[int, bytearray] = {}  # slot -> output kept while orphaned
        self.ctl_in, self.ctl_out = ctl_in, ctl_out
        self.parent_pid = parent_pid
        self.ranks: dict[int, Rank] = {}  # pid -> rank
        self.by_out: dict[int, Rank] = {}  # output fd -> rank
        self.reader = hm.LineReader()
        self.poll = select.poll()  # no fd of its own: nothing to close in a child
        self.running = True
        self.controller_pid = os.getppid()  # the controller it serves (the first: its parent)
        self.door: Door | None = None  # a kept-alive mesh's: where a new controller attaches
        self.link = None  # the socket of a controller that attached (else stdin/stdout)
        self.stealer = None  # (socket, pid, deadline): a controller stealing the mesh
        self._door_handlers = handler_table(self, AGENT_DOOR, prefix="_door_")
        self.controller_fd: int | None = None  # a pidfd: the fork server's agents watch by pid

    def watch_controller(self, pid: int) -> None:
        """Serve the controller ``pid`` that is not this process's parent (the fork
        server forked it): its end ends this agent, as a parent's would."""
        self.controller_pid = pid
        try:
            self.controller_fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.running = False
            return
        self.poll.register(self.controller_fd, select.POLLIN)

    # ------------------------------------------------------------ the loop

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        self.wake = (wake_r, wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd does the work
        signal.signal(signal.SIGTERM, lambda *_: self._stop())
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the controller's
        signal.set_wakeup_fd(wake_w)
        self.poll.register(self.ctl_in, select.POLLIN)
        self.poll.register(wake_r, select.POLLIN)
        self.send(self._ready())
        if self.keep_alive is not None and self.mesh_name is not None:
            self.door = Door(keepalive.door_path(self.mesh_name))
            self.poll.register(self.door.fd, select.POLLIN)
        try:
            while self.running:
                for fd, _ in self.poll.poll(POLL_MS):
                    if fd == self.ctl_in:
                        self._read_control()
                    elif fd == wake_r:
                        _drain(wake_r)
                    elif fd == self.controller_fd:
                        self.running = False  # the controller is gone
                    elif self.door is not None and fd == self.door.fd:
                        self._knock()
                    elif fd in self.by_out:
                        self._read_output(self.by_out[fd])
                self._reap()
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.running = False  # the controller is gone
                if self.keep_alive is not None:
                    self._keep_alive()
        finally:
            if self.door is not None:
                self.door.close()
            self._kill_all()
            if self.mesh_name is not None:
                keepalive.remove_entry(self.mesh_name)

    def _ready(self) -> hm.AgentReady:
        return hm.AgentReady(os.getpid(), socket.gethostname(), __version__, self.local_ranks)

    def _stop(self) -> None:
        self.running = False
        self.stopped = True

    def _on_Quit(self, msg: hm.Quit) -> None:
        self.running = False
        self.stopped = True  # the controller ended the mesh: nothing to keep

    def _keep_alive(self) -> None:
        """Orphaned (the controller went): serve on until the keep-alive passes."""
        now = time.monotonic()
        if self.stealer is not None and not self.stopped:
            if self.running and now < self.stealer[2]:
                return  # the controller stolen from has not hung up yet
            (conn, pid, _), self.stealer = self.stealer, None
            self._let_go()
            self._adopt(conn, pid)
            return
        if self.orphaned_at is None:
            if self.running or self.stopped:
                return
            self.orphaned_at, self.running = now, True
            self._let_go()
            if self.mesh_name is not None:
                keepalive.update_entry(self.mesh_name, orphaned_at=time.time())
            log(f"controller gone; keeping {len(self.ranks)} rank(s) for {self.keep_alive:g} s")
        elif not self.ranks or now - self.orphaned_at > self.keep_alive:
            self.running = False

    # ------------------------------------------------------------ a controller attaches

    def _knock(self) -> None:
        got = self.door.knock()
        if got is not None:
            self._door_handlers[type(got[1])](*got)

    def _door_Attach(self, conn, msg: hm.Attach, pid: int) -> None:
        if self.stopped:  # a Quit or a SIGTERM (monarch-nb kill): it ends now
            refuse(conn, f"mesh {self.mesh_name!r} is ending")
            return
        if self.stealer is not None:
            refuse(conn, f"mesh {self.mesh_name!r} is being taken over by pid {self.stealer[1]}")
            return
        if self.orphaned_at is None:
            self._settle_controller()
        if self.orphaned_at is None:  # a controller has the mesh
            if not msg.steal:
                refuse(
                    conn,
                    f"mesh {self.mesh_name!r} is attached to the controller of pid "
                    f"{self.controller_pid}: attach(..., steal=True) takes it over",
                )
                return
            # that controller lets go (its ranks stay) and hangs up once its socket is
            # closed, so the new one can listen there; then the new one is let in
            super().send(hm.Detach(pid))
            self.stealer = (conn, pid, time.monotonic() + STEAL_WAIT)
            return
        self._adopt(conn, pid)

    def _settle_controller(self) -> None:
        """Take in what the controller's channel holds now: a knock that follows its
        hang-up (a SIGKILLed controller: the kernel closed its socket) in the same
        poll round finds the mesh orphaned, not held."""
        if not self.running:  # it went earlier in this round
            self._keep_alive()
            return
        watched = select.poll()
        watched.register(self.ctl_in, select.POLLIN)
        if self.controller_fd is not None:
            watched.register(self.controller_fd, select.POLLIN)
        for fd, _ in watched.poll(0):
            if fd == self.ctl_in:
                self._read_control()
            else:
                self.running = False  # the controller is gone
        if not self.running:
            self._keep_alive()

    def _adopt(self, conn, pid: int) -> None:
        log(f"controller pid {pid} attached")
        self.link, self.ctl_in, self.ctl_out = conn, conn.fileno(), conn.fileno()
        self.reader = hm.LineReader()
        self.poll.register(self.ctl_in, select.POLLIN)
        self.orphaned_at, self.running, self.controller_pid = None, True, pid
        keepalive.update_entry(self.mesh_name, controller_pid=pid, orphaned_at=None)
        self.send(self._ready())
        self.send(hm.Held([[r.slot, r.rank, r.pid] for r in self.ranks.values()]))
        for slot, buf in self.pending.items():  # what the ranks printed meanwhile
            for i in range(0, len(buf), 1 << 16):
                self.send(hm.output(slot, bytes(buf[i : i + (1 << 16)])))
        self.pending.clear()

    def _let_go(self) -> None:
        """Stop serving the current controller's channel."""
        self.poll.unregister(self.ctl_in)
        if self.controller_fd is not None:  # the first controller's pidfd: it has ended
            self.poll.unregister(self.controller_fd)
            os.close(self.controller_fd)
            self.controller_fd = None
        if self.link is not None:
            self.link.close()
            self.link = None
        else:  # the first controller's pipes: its reader sees their end
            for fd in {self.ctl_in, self.ctl_out}:
                os.close(fd)

    def send(self, msg) -> None:
        if self.orphaned_at is None:
            super().send(msg)
        elif isinstance(msg, hm.Output):  # kept, within a bound, for a later controller
            buf = self.pending.setdefault(msg.slot, bytearray())
            buf += hm.output_bytes(msg)
            del buf[: max(0, len(buf) - ORPHAN_OUTPUT)]

    # ------------------------------------------------------------ the controller

    def _spawn(self, msg: hm.Spawn) -> None:
        if len(self.ranks) >= self.local_ranks:
            self.send(
                hm.SpawnFailed(
                    msg.slot,
                    f"this host agent has {self.local_ranks} rank slot(s) (--local-ranks), "
                    f"all in use: rank {msg.rank} does not fit",
                )
            )
            return
        close = [self.ctl_in, self.ctl_out, *self.wake, *self.by_out]
        if self.door is not None:
            close.append(self.door.fd)
        if self.controller_fd is not None:
            close.append(self.controller_fd)
        try:
            pid, out = fork_rank(msg, close)
        except OSError as e:
            self.send(hm.SpawnFailed(msg.slot, f"cannot fork rank {msg.rank}: {e}"))
            return
        r = Rank(msg.slot, msg.rank, pid, out)
        self.ranks[pid] = r
        self.by_out[out] = r
        self.poll.register(out, select.POLLIN)
        self.send(hm.Spawned(msg.slot, pid))

    def _kill(self, slot: int, sig: int) -> None:
        for r in self.ranks.values():
            if r.slot == slot:
                _signal_group(r.pid, sig)

    # ------------------------------------------------------------ the ranks

    def _read_output(self, r: Rank, drain: bool = False) -> None:
        while True:
            try:
                data = os.read(r.out, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._close_output(r)
                return
            self.send(hm.output(r.slot, data))
            if not drain:
                return

    def _close_output(self, r: Rank) -> None:
        if self.by_out.pop(r.out, None) is not None:
            self.poll.unregister(r.out)
            os.close(r.out)

    def _reap(self) -> None:
        if not self.ranks:
            return
        for pid, code in reaped():
            r = self.ranks.pop(pid, None)
            if r is None:
                continue
            if r.out in self.by_out:
                self._read_output(r, drain=True)  # what it wrote comes before its end
                self._close_output(r)  # a grandchild may hold the pipe: not waited for
            self.send(hm.Exited(r.slot, pid, code))

    def _kill_all(self) -> None:
        for r in list(self.ranks.values()):
            _signal_group(r.pid, signal.SIGKILL)
        for pid in list(self.ranks):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def log(text: str) -> None:
    print(f"[monarch host agent {os.getpid()}] {text}", file=sys.stderr, flush=True)
