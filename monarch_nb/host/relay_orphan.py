"""A kept-alive mesh's relay while no controller is there (``connect_mesh(...,
keep_alive=D)``): it keeps its agent and ranks running for ``D`` and waits at the
same address for a controller that attaches (``mnb.attach``).

When its controller goes, the relay closes its fan-out's sockets (the ranks' ipc
ROUTER too: each rank sees its controller gone, so what it sends waits in its own
bounded queues, as a local kept-alive rank's does), keeps the agent's reports
(the output of each rank within ``ORPHAN_OUTPUT`` bytes), and says Hello again on
a fresh socket, naming the block of ranks it holds. A controller of the mesh (its
key) that answers Welcome gets the agent's AgentReady, ``Held`` (its ranks) and
the output kept; the relay joins the mesh's ROUTER as its host again and binds the
ranks' socket where it was, so each rank reconnects and says ``WorkerRejoined``.
"""

from __future__ import annotations

import time

import zmq

from ..protocol import agent_link
from ..protocol import host_messages as hm
from ..protocol.envelope import CONTROLLER, PeerTable, Sealer

ORPHAN_OUTPUT = 1 << 20  # bytes of each rank's output kept while no controller listens
HELLO_EVERY = 1.0  # s: Hello again, while connected and not taken (a Hello may be dropped)


class HeldRanks:
    """This host's ranks (slot -> [rank, pid]) from the Spawns sent to its agent and
    the agent's reports; while orphaned, what they print, within a bound."""

    def __init__(self):
        self.ranks: dict[int, list] = {}
        self.ready: hm.AgentReady | None = None
        self.pending: dict[int, bytearray] = {}  # slot -> output kept while orphaned

    def spawning(self, msg: hm.Spawn) -> None:
        self.ranks[msg.slot] = [msg.rank, None]

    def report(self, msg, orphaned: bool) -> bool:
        """Note one of the agent's records; True when it goes to the controller now."""
        kind = type(msg)
        if kind is hm.AgentReady:
            self.ready = msg
        elif kind is hm.Spawned:
            r = self.ranks.get(msg.slot)
            if r is not None:
                r[1] = msg.pid
        elif kind in (hm.Exited, hm.SpawnFailed):
            self.ranks.pop(msg.slot, None)
        if not orphaned:
            return True
        if kind is hm.Output:
            buf = self.pending.setdefault(msg.slot, bytearray())
            buf += hm.output_bytes(msg)
            del buf[: max(0, len(buf) - ORPHAN_OUTPUT)]
        return False  # a rank that ended is left out of Held

    def replay(self) -> list:
        """What a controller that attached hears first: AgentReady, Held, the output kept."""
        out = [] if self.ready is None else [self.ready]
        out.append(hm.Held([[s, r, p] for s, (r, p) in self.ranks.items() if p is not None]))
        for slot, buf in self.pending.items():
            if slot in self.ranks:
                out += [hm.output(slot, bytes(buf[i : i + (1 << 16)])) for i in range(0, len(buf), 1 << 16)]
        self.pending.clear()
        return out


class Orphanage:
    """The relay's keep-alive (a mixin of ``relay.Relay``, which has the socket,
    the fan-out and the agent)."""

    keep_alive: float | None = None  # from the Welcome
    orphaned_at: float | None = None  # monotonic: when the controller went
    slot: int = -1  # this host's index in the mesh (from a fan-out Spawn)
    _fan_spec: tuple | None = None  # (address, host, ranks directory) of the fan-out to rebuild
    _kept: tuple | list = ()  # the ranks' output the fan-out had not sent when the controller went
    connected = False  # the socket to the controller's address is connected (its monitor)
    _next_hello = 0.0

    def _lose(self, why: str) -> None:
        """The controller is gone: end, or (a kept-alive mesh) wait for another."""
        if self.keep_alive is None or self.block is None or self.agent is None:
            self.log(f"{why}: ending this host's agent and ranks")
            self._stop(3)
            return
        self.orphaned_at = time.monotonic()
        self.log(
            f"{why}: keeping {len(self.book.ranks)} rank(s) for {self.keep_alive:g} s for "
            "another controller (mnb.attach)"
        )
        fan, self.fan = self.fan, None
        if fan is not None:
            self._fan_spec = (fan.address, fan.host, fan.rank_sockets.dir)
            self._kept = fan.kept_output()
            self.poller.unregister(fan.sock)
            self.poller.unregister(fan.rank_sockets.sock)
            fan.close(keep_dir=True)  # its ranks see their controller gone
            self._gated = False
        self._new_socket()  # it says Hello once connected (_orphan_tick)

    def _new_socket(self) -> None:
        """A fresh DEALER to the controller's address (what the old one queued for a
        controller that is gone is dropped) and a fresh sequence."""
        if self.sock is not None:
            self.poller.unregister(self.sock)
            self.poller.unregister(self.monitor)
            self.monitor.close(0)
            self.sock.close(0)
        self.sealer = Sealer(self.signer, agent_link.AGENT)
        self.peers = PeerTable()
        self.peers.allow(CONTROLLER)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)  # while the controller is away: then dropped
        # watched before it connects: a controller listening there already connects it at once
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.connected = False
        self.sock.connect(self.address)
        if self.poller is not None:
            self.poller.register(self.sock, zmq.POLLIN)
            self.poller.register(self.monitor, zmq.POLLIN)

    def _orphan_tick(self, now: float) -> None:
        if self.connected and now >= self._next_hello:
            # only while connected: a Hello queued meanwhile would reach the next
            # controller with every other one; again and again, since a controller that
            # is not ready for it (or one that failed to attach) drops it
            self._next_hello = now + HELLO_EVERY
            first, count = self.block
            self._send(self._hello([first, count, self.slot]))
        if now - self.orphaned_at > self.keep_alive:
            self.log(
                f"no controller attached within the keep-alive ({self.keep_alive:g} s): "
                "ending this host's agent and ranks"
            )
            self._stop(0)
        elif not self.book.ranks:
            self.log("every rank of this host ended while no controller was there: ending")
            self._stop(0)

    def _adopted(self) -> None:
        """A controller attached (its Welcome): tell it what runs here, then carry the
        ranks' traffic again."""
        self.orphaned_at = None
        self.log("a controller attached: its ranks rejoin")
        for msg in self.book.replay():
            self._send(msg)
        spec, self._fan_spec = self._fan_spec, None
        if spec is not None:
            address, host, directory = spec
            self._fan_out_to(address, host, directory).send_after_rejoins(self._kept)
            self._kept = ()
