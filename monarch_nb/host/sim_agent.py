"""A simulated host (``monarch-nb-host --simulate N``): up to N light ranks
(``light.py``) in this one process, served by one thread.

It speaks the agent's channel as the forking agent does (Spawn, Kill, Quit in;
AgentReady, Spawned, Output, Exited out), so the controller's HostAgent and
WorkerSet watch its ranks the same way. One ``zmq.Poller`` waits on the
channel and the host's one socket to the controller (``fanout.HostChannel``), which
carries every command and report of its ranks; a rank "killed" (Kill) stops at once
and is reported ended by that signal, with a line naming its host.
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
from .fanout import HostChannel
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
        # both per call
        self.polled: list = []
        self.channels: dict = {}  # (address, key) -> HostChannel
        self.by_sock: dict = {}  # socket -> HostChannel
        self.ranks: dict = {}  # slot -> (LightRank, HostChannel)
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
                    ch = self.by_sock.get(what)
                    if ch is not None:
                        self._serve_channel(ch)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK
                    self._tick(now)
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.running = False  # the controller is gone
        finally:
            for r, _ in list(self.ranks.values()):
                r.stop(-signal.SIGKILL)
            self.ctx.destroy(linger=0)

    def _serve_channel(self, ch) -> None:
        touched = ch.receive()
        if ch.refused is not None:
            for r, c in list(self.ranks.values()):
                if c is ch:
                    r.stop(2, f"the controller refused simulated host {self.host}: {ch.refused}")
        ch.flush()
        if touched or ch.refused is not None:
            for slot, (r, c) in list(self.ranks.items()):
                if c is ch and r.ended is not None:
                    self._ended(slot, r)
        if ch.refused is not None:
            self._drop_channel(ch)

    def _stop(self) -> None:
        self.running = False

    def _tick(self, now: float) -> None:
        if now >= self._next_sample:
            self._next_sample = now + HEALTH_PERIOD
            self._sample(now)
        for r, _ in self.ranks.values():
            r.tick(now, self._rss, self._cpu)
        for ch in self.channels.values():
            ch.flush()

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

    def _channel(self, msg: hm.Spawn) -> HostChannel:
        key = (msg.address, msg.key_hex)
        ch = self.channels.get(key)
        if ch is None:
            ch = HostChannel(
                self.ctx,
                msg.address,
                bytes.fromhex(msg.key_hex),
                max(msg.host, 0),
                os.getpid(),
                self.host,
            )
            self.channels[key] = ch
            self.by_sock[ch.sock] = ch
            self.polled.append((ch.sock, POLLIN))
        return ch

    def _drop_channel(self, ch) -> None:
        self.channels = {k: c for k, c in self.channels.items() if c is not ch}
        self.by_sock.pop(ch.sock, None)
        self.polled = [p for p in self.polled if p[0] is not ch.sock]
        ch.close()

    def _spawn(self, msg: hm.Spawn) -> None:
        if len(self.ranks) >= self.slots:
            self.send(
                hm.SpawnFailed(
                    msg.slot,
                    f"simulated host {self.host} has {self.slots} light rank slot(s) "
                    f"(--simulate), all in use: rank {msg.rank} does not fit",
                )
            )
            return
        try:
            ch = self._channel(msg)
            r = LightRank(ch, msg.rank, msg.world, self.host)
        except (zmq.ZMQError, ValueError) as e:
            self.send(hm.SpawnFailed(msg.slot, f"cannot start light rank {msg.rank}: {e}"))
            return
        ch.ranks[msg.rank] = r
        ch.flush()
        self.ranks[msg.slot] = (r, ch)
        self.send(hm.Spawned(msg.slot, os.getpid()))

    def _kill(self, slot: int, sig: int) -> None:
        entry = self.ranks.get(slot)
        if entry is not None and entry[0].ended is None:
            r = entry[0]
            r.stop(-sig, f"simulated rank {r.rank} on {self.host} was killed (signal {sig})")
            self._ended(slot, r)

    def _ended(self, slot: int, r: LightRank) -> None:
        entry = self.ranks.pop(slot, None)
        if entry is not None and entry[1].ranks.get(r.rank) is r:
            del entry[1].ranks[r.rank]
        if r.note:
            self.send(hm.output(slot, f"[{r.note}]\n".encode()))
        self.send(hm.Exited(slot, os.getpid(), r.ended))


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system
