"""A simulated host (``monarch-nb-host --simulate N``): up to N light ranks
(``light.py``) in this one process, served by one thread.

It speaks the agent's channel as the forking agent does (Spawn, Kill, Quit in;
AgentReady, Spawned, Output, Exited out), so the controller's HostAgent and
WorkerSet watch its ranks the same way. One ``zmq.Poller`` waits on the
channel and every rank's socket; a rank "killed" (Kill) closes its socket at
once and is reported ended by that signal, with a line naming its host.
"""

from __future__ import annotations

import os
import signal
import time

import zmq
from zmq.backend import zmq_poll

from .._version import __version__
from ..protocol import host_messages as hm
from .control import ControlChannel
from .light import HEALTH_PERIOD, LightRank

POLL_MS = 100  # the longest the loop sleeps: ticks and the parent check run this often
POLLIN = int(zmq.POLLIN)
TICK = 0.05  # ranks' progress and health are looked at this often, at most


class SimAgent(ControlChannel):
    """Serves one controller over ``ctl_in``/``ctl_out`` with ``slots`` light ranks."""

    def __init__(self, slots: int, ctl_in: int, ctl_out: int, parent_pid, host: str):
        self.slots, self.ctl_in, self.ctl_out = slots, ctl_in, ctl_out
        self.parent_pid, self.host = parent_pid, host
        self.ctx = zmq.Context(1)
        # zmq_poll on plain ints and a list kept between calls: zmq.Poller rebuilds
        # both per call, a cost paid once per message at 32 ranks a host
        self.polled: list = []
        self.by_sock: dict = {}  # socket -> (slot, LightRank)
        self.reader = hm.LineReader()
        self.running = True
        self._rss, self._cpu = 0, 0.0
        self._cpu_at = (time.monotonic(), _cpu_seconds())
        self._next_sample = 0.0

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self._stop())
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the controller's
        self.polled.append((self.ctl_in, POLLIN))
        self.send(hm.AgentReady(os.getpid(), self.host, __version__, self.slots))
        next_tick = 0.0
        try:
            while self.running:
                for what, _ in zmq_poll(self.polled, POLL_MS):
                    if what == self.ctl_in:
                        self._read_control()
                        continue
                    entry = self.by_sock.get(what)
                    if entry is not None:
                        entry[1].receive()
                        if entry[1].ended is not None:
                            self._ended(*entry)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK
                    self._tick(now)
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.running = False  # the controller is gone
        finally:
            for _, r in list(self.by_sock.values()):
                r.stop(-signal.SIGKILL)
            self.ctx.destroy(linger=0)

    def _stop(self) -> None:
        self.running = False

    def _tick(self, now: float) -> None:
        if now >= self._next_sample:
            self._next_sample = now + HEALTH_PERIOD
            self._sample(now)
        for _, r in list(self.by_sock.values()):
            r.tick(now, self._rss, self._cpu)

    def _sample(self, now: float) -> None:
        """This process's RSS and CPU (every light rank reports its host's)."""
        try:
            with open("/proc/self/statm") as f:
                self._rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            self._rss = 0
        cpu = _cpu_seconds()
        then, cpu_then = self._cpu_at
        if now > then:
            self._cpu = 100.0 * (cpu - cpu_then) / (now - then)
        self._cpu_at = (now, cpu)

    # ------------------------------------------------------------ the controller

    def _spawn(self, msg: hm.Spawn) -> None:
        if len(self.by_sock) >= self.slots:
            self.send(
                hm.SpawnFailed(
                    msg.slot,
                    f"simulated host {self.host} has {self.slots} light rank slot(s) "
                    f"(--simulate), all in use: rank {msg.rank} does not fit",
                )
            )
            return
        try:
            r = LightRank(
                self.ctx, msg.address, bytes.fromhex(msg.key_hex), msg.rank, msg.world, self.host
            )
        except (zmq.ZMQError, ValueError) as e:
            self.send(hm.SpawnFailed(msg.slot, f"cannot start light rank {msg.rank}: {e}"))
            return
        self.by_sock[r.sock] = (msg.slot, r)
        self.polled.append((r.sock, POLLIN))
        self.send(hm.Spawned(msg.slot, os.getpid()))

    def _kill(self, slot: int, sig: int) -> None:
        for s, r in list(self.by_sock.values()):
            if s == slot and r.ended is None:
                r.stop(-sig, f"simulated rank {r.rank} on {self.host} was killed (signal {sig})")
                self._ended(s, r)

    def _ended(self, slot: int, r: LightRank) -> None:
        self.by_sock.pop(r.sock, None)
        self.polled = [p for p in self.polled if p[0] is not r.sock]
        if r.note:
            self.send(hm.output(slot, f"[{r.note}]\n".encode()))
        self.send(hm.Exited(slot, os.getpid(), r.ended))


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system
