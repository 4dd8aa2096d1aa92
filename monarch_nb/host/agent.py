"""The agent's loop: one thread, one poll over the controller's channel, the
ranks' output pipes and a SIGCHLD wake-up pipe.

A rank that ends is reaped at once (SIGCHLD wakes the poll) and reported with
its exit status after the output it wrote. When the controller goes (its
channel closes, or the agent's parent changes) the agent kills its ranks and
exits, unless it keeps its ranks alive (``--keep-alive S``, a kept-alive mesh's
own agent): then it serves on, orphaned, keeping the last ``ORPHAN_OUTPUT`` bytes
each rank prints, until S seconds after its controller went (or its ranks all
ended, or a SIGTERM: ``monarch-nb kill``), then kills its ranks and exits.
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
from .child import fork_rank
from .control import ControlChannel

POLL_MS = 500  # the longest the loop sleeps: the parent check runs at least this often
ORPHAN_OUTPUT = 1 << 20  # bytes of each rank's output kept while no controller listens


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
        self.send(hm.AgentReady(os.getpid(), socket.gethostname(), __version__, self.local_ranks))
        try:
            while self.running:
                for fd, _ in self.poll.poll(POLL_MS):
                    if fd == self.ctl_in:
                        self._read_control()
                    elif fd == wake_r:
                        _drain(wake_r)
                    elif fd in self.by_out:
                        self._read_output(self.by_out[fd])
                self._reap()
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.running = False  # the controller is gone
                if self.keep_alive is not None:
                    self._keep_alive()
        finally:
            self._kill_all()
            if self.mesh_name is not None:
                keepalive.remove_entry(self.mesh_name)

    def _stop(self) -> None:
        self.running = False
        self.stopped = True

    def _on_Quit(self, msg: hm.Quit) -> None:
        self.running = False
        self.stopped = True  # the controller ended the mesh: nothing to keep

    def _keep_alive(self) -> None:
        """Orphaned (the controller went): serve on until the keep-alive passes."""
        now = time.monotonic()
        if self.orphaned_at is None:
            if self.running or self.stopped:
                return
            self.orphaned_at, self.running = now, True
            self.poll.unregister(self.ctl_in)
            if self.mesh_name is not None:
                keepalive.update_entry(self.mesh_name, orphaned_at=time.time())
            log(f"controller gone; keeping {len(self.ranks)} rank(s) for {self.keep_alive:g} s")
        elif not self.ranks or now - self.orphaned_at > self.keep_alive:
            self.running = False

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
        while self.ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            r = self.ranks.pop(pid, None)
            if r is None:
                continue
            if r.out in self.by_out:
                self._read_output(r, drain=True)  # what it wrote comes before its end
                self._close_output(r)  # a grandchild may hold the pipe: not waited for
            code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
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
