"""Host agents on other hosts (``monarch-nb-host --connect``): the channel a joined
mesh binds for them, and the controller's record of each.

The channel is a ROUTER of its own (beside the mesh's, on the same interface) with a
thread that owns it. Every record is sealed with the mesh key
(``protocol/agent_link.py``): what does not verify is dropped unread and never
answered. A relay says Hello with the ranks its agent offers and the host slot it
claims; it gets a block of ranks (the slot's, or the next free one), and once the
mesh launches and the agent is ready, a Spawn per rank. With the fan-out (the
default; ``MONARCH_NB_RELAY_FANOUT=0`` turns it off) the Spawn names the agent's
host slot, and the relay joins the mesh's ROUTER as that host
(``launcher.host_ranks``: ``host_ranks`` here) and carries its ranks' traffic;
otherwise each rank joins the mesh's ROUTER itself. The agent's reports (Spawned,
Output, Exited) go to the same ``AgentRank`` records as the local agent's. A relay
whose connection closes (its process died) or that is silent for the heartbeat
timeout is lost, and its ranks with it, the host named.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import zmq

from .. import config
from ..controller.errors import describe_exit
from ..controller.io_items import Raw
from ..protocol import agent_link, keepalive
from ..protocol import host_messages as hm
from ..protocol.constants import BEAT_S
from ..protocol.envelope import CONTROLLER, PROTOCOL_VERSION, PeerTable, Sealer, VersionMismatch
from ..protocol.receivers import AGENT_CHANNEL, handler_table
from ..protocol.wire import BadMessage, Signer
from .agent_ranks import RankBook
from .remote_agent import RemoteAgent
from .remote_blocks import host_slot, place, place_held

logger = logging.getLogger("monarch_nb.controller")

POLL_MS = 100
GRACE_S = 0.5  # a closed connection may come back (a reconnect) within this
QUIT_WAIT_S = 2.0  # at shutdown: how long the relays have to read their Quit and go


def fanout() -> bool:
    """Whether relays carry their ranks' traffic (``MONARCH_NB_RELAY_FANOUT``, read
    at each launch: ``0`` makes every rank connect to the mesh's ROUTER itself)."""
    return config.setting("relay_fanout")


class AgentChannel:
    """The host agents of mesh ``name``: their relays reach the mesh's own ROUTER
    (``io``, its port advertised as ``host``), which hands their envelopes here
    (``deliver``) and sends what this channel seals; a thread of its own reads
    them, beats and checks, so the IO thread never waits on an agent."""

    def __init__(
        self, name: str, io, host: str, key: bytes, world: int,
        heartbeat_timeout: float, out=print, keep_alive: float | None = None,
        rejoin: bool = False,
    ):  # fmt: skip
        """``keep_alive``: the relays keep their ranks that long once this controller is
        gone (its registry entry, ``name``'s, touched at each beat); ``rejoin``: a
        controller that attached, which takes back the relays that kept their ranks."""
        self.keep_alive, self.rejoin = keep_alive, rejoin
        self._entry = keepalive.entry_path(name) if keep_alive is not None else None
        self.name, self.world, self.heartbeat_timeout, self._out = (
            name,
            world,
            heartbeat_timeout,
            out,
        )
        self.signer = Signer(key)
        self.sealer = Sealer(self.signer, CONTROLLER)
        self.peers = PeerTable()
        self.agents: dict[bytes, RemoteAgent] = {}
        self._handlers = handler_table(self, AGENT_CHANNEL, prefix="_on_")
        self.refusals: list[str] = []  # why agents were refused (kept for a look later)
        self.lost_note = None  # () -> str | None: more on a loss (the launcher's job ended)
        self._lock = threading.Lock()  # agents, the launch target, procs
        self._target: str | None = None  # the ranks' address, once a generation launched
        self._procs: dict = {}
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (frames, fd) or (None, fd)
        self._version_told: set[bytes] = set()
        self._io = io
        self.port = io.port
        self.address = f"tcp://{host}:{self.port}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._running = True
        self._thread = threading.Thread(
            target=self._run, name=f"monarch-agents-{name}", daemon=True
        )
        self._thread.start()

    def deliver(self, frames, fd) -> None:
        """An envelope of an agent link (the lease holder): read on this channel's thread."""
        self._inbox.put((frames, fd))
        self._wake()

    def disconnected(self, fd) -> None:
        """A connection of the mesh's ROUTER closed (the lease holder)."""
        self._inbox.put((None, fd))
        self._wake()

    def _wake(self) -> None:
        wake = self._wake_w
        if wake is not None:
            try:
                os.write(wake, b"x")
            except (BlockingIOError, OSError):
                pass  # a wake-up is pending

    # ------------------------------------------------------------ API (any thread)

    def post(self, identity: bytes, msg) -> None:
        """Send ``msg`` to the relay of ``identity`` (from the channel's thread);
        RuntimeError once the channel is closed."""
        wake = self._wake_w
        if wake is None:
            raise RuntimeError(f"mesh {self.name!r}: the host agents' channel is closed")
        self._posted.put((identity, msg))
        self._wake()

    def launch(self, address: str, key: bytes, world: int) -> dict:
        """A generation starts: its ranks' address; the ranks of every ready agent
        are forked now, those of agents that come later when they are ready. The
        dict (rank -> AgentRank) fills as they are asked for."""
        on = fanout()  # a bad value raises here, at the mesh's start
        with self._lock:
            self._target, self._fanout = address, on
            self._procs = {}
            for agent in self.agents.values():
                if agent.info is not None:
                    self._spawn_block(agent)
            return self._procs

    def hosts(self) -> list[RemoteAgent]:
        with self._lock:
            return sorted(self.agents.values(), key=lambda a: a.first)

    def host_ranks(self, host: int, pid: int) -> range | None:
        """The ranks of the agent of host slot ``host`` whose relay is process ``pid``
        (a HostJoin's claim), else None."""
        with self._lock:
            for a in self.agents.values():
                if a.slot == host and a.hello.pid == pid:
                    return range(a.first, a.first + a.count)
        return None

    def close(self, quit: bool = True) -> None:
        """The mesh is gone: every relay is told Quit (its agent and ranks end). Called
        while the mesh's ROUTER still runs: waits (a bound) until each relay's
        connection closed, so that no Quit is lost with the socket. ``quit=False``:
        this controller lets go (a kept-alive mesh's relays wait for another)."""
        if self._wake_w is None:
            return
        told = self.hosts() if quit else []
        for agent in told:
            self.post(agent.identity, hm.Quit())
        deadline = time.monotonic() + QUIT_WAIT_S
        while time.monotonic() < deadline and any(
            a.closed_at is None and a.lost is None for a in told
        ):
            time.sleep(0.01)  # polled: a relay that ends closes its connection
        self._running = False
        self.post(b"", None)
        self._thread.join(5)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = 0.0
        try:
            while True:
                poller.poll(POLL_MS)
                self._read_inbox()
                self._flush()
                if not self._running:
                    return
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + BEAT_S
                    for agent in self.hosts():
                        self._send(agent.identity, hm.Beat())
                    if self._entry is not None:
                        keepalive.touch_entry(self._entry)  # its mtime: when we were last here
                self._check(now)
        finally:
            self._flush()
            wake, self._wake_w = self._wake_w, None
            os.close(wake)
            os.close(self._wake_r)

    def _read_inbox(self) -> None:
        while True:
            try:
                frames, fd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if frames is None:
                self._on_disconnect(fd)
                continue
            try:
                self._on_frames(frames, fd)
            except Exception:
                logger.exception("mesh %r: an agent's message failed", self.name)

    def _flush(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                identity, msg = self._posted.get_nowait()
            except queue.Empty:
                return
            if msg is not None:
                self._send(identity, msg)

    def _send(self, identity: bytes, msg) -> None:
        frames = agent_link.seal(self.sealer, self.signer, msg, identity)
        self._io.submit(Raw(identity, frames))  # in order: this thread seals, one queue

    def _on_disconnect(self, fd) -> None:
        now = time.monotonic()
        for agent in self.hosts():
            if agent.fd == fd:
                agent.closed_at = now

    def _check(self, now: float) -> None:
        for agent in self.hosts():
            if agent.closed_at is not None and now - agent.closed_at > GRACE_S:
                if agent.last_heard < agent.closed_at:
                    self._lose(agent, "its connection closed (the relay process is gone)")
                else:
                    agent.closed_at = None  # it reconnected
            elif now - agent.last_heard > self.heartbeat_timeout:
                self._lose(agent, f"silent for {self.heartbeat_timeout:g} s")

    # ------------------------------------------------------------ records

    def _on_frames(self, frames, fd) -> None:
        identity = frames[0].bytes
        try:
            h, msg = agent_link.open_record(frames[1:], self.signer)
            self.peers.admit(identity, h)
        except VersionMismatch as e:
            self._refuse_version(identity, e.version)
            return
        except BadMessage as e:
            self.peers.count(e.kind)  # never answered: a wrong key learns nothing
            return
        agent = self.agents.get(identity)
        if agent is None:
            if type(msg) is hm.Hello:
                self._hello(identity, h, msg, fd)
            else:
                self.peers.count("rank")
            return
        agent.last_heard = time.monotonic()
        if fd is not None:
            agent.fd = fd
        self._handlers.get(type(msg), self._on_Hello)(agent, msg)

    def _on_Hello(self, agent: RemoteAgent, msg: hm.Hello) -> None:
        self.peers.count("malformed")  # again on a joined socket, or a record agents never send

    _on_Beat = staticmethod(lambda agent, msg: None)  # it was heard: all a beat says

    def _on_Held(self, agent: RemoteAgent, msg: hm.Held) -> None:
        agent.adopt(msg.ranks)
        agent.held.set()

    def _on_AgentReady(self, agent: RemoteAgent, msg: hm.AgentReady) -> None:
        with self._lock:
            agent.info = msg
            # a generation that had these ranks (a host since lost) is past its start
            had = any(agent.first + i in self._procs for i in range(agent.count))
            if self._target is not None and not had:
                self._spawn_block(agent)

    def _on_AgentGone(self, agent: RemoteAgent, msg: hm.AgentGone) -> None:
        how = describe_exit(msg.code)
        why = f"its host agent {f'was {how}' if msg.code < 0 else f'exited ({how})'}"
        self._lose(agent, f"{why}: {agent.error}" if agent.error else why)

    def _on_Refused(self, agent: RemoteAgent, msg: hm.Refused) -> None:
        agent.error = msg.error
        self._say(f"the host agent on {agent.label} says: {agent.error}")

    # a rank's records: (agent, msg) -> the agent's book of its ranks
    _on_Spawned = _on_SpawnFailed = _on_Output = _on_Exited = staticmethod(RankBook.on_rank)

    def _spawn_block(self, agent: RemoteAgent) -> None:
        """Ask ``agent`` for its ranks of the launched generation (``_lock`` held)."""
        address = self._target
        host = agent.slot if getattr(self, "_fanout", True) else -1
        for i in range(agent.count):
            rank = agent.first + i
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world),
                "LOCAL_RANK": str(i),
                "LOCAL_WORLD_SIZE": str(agent.count),
            }
            # no key: the relay has it, and it never crosses the network
            self._procs[rank] = agent.spawn(
                rank, self.world, address, b"", env, i, here=False, host=host
            )

    def _hello(self, identity: bytes, h, msg: hm.Hello, fd) -> None:
        who = f"host {msg.host} (relay pid {msg.pid})"
        with self._lock:
            agents = list(self.agents.values())
            if msg.held is not None:  # a relay that kept its ranks
                why, first, slot = place_held(agents, msg, self.world, self.rejoin)
            else:
                why, first = place(agents, msg, self.world)
                slot = host_slot(agents, msg, first, self.world) if why is None else -1
            if why is None:
                agent = RemoteAgent(self, identity, msg, first, slot)
                agent.fd = fd
                self.agents[identity] = agent
                self.peers.join(identity, h)
        if why is not None:
            self.peers.refuse(identity, h)
            self.refusals.append(f"{who}: {why}")
            self._send(identity, hm.Refused(why))
            self._say(f"refused the host agent on {who}: {why}")
            return
        self._send(identity, hm.Welcome(first, msg.local_ranks, self.world, self.keep_alive))
        logger.info(
            "mesh %r: the host agent on %s runs ranks %d-%d",
            self.name, who, first, first + msg.local_ranks - 1,
        )  # fmt: skip

    def _lose(self, agent: RemoteAgent, why: str) -> None:
        with self._lock:
            if self.agents.pop(agent.identity, None) is None:
                return
        note = self.lost_note() if self.lost_note is not None else None
        agent.lost = f"{agent.label}: {why}" + (f"; {note}" if note else "")
        agent.end_all(agent.lost)
        self._say(f"lost the host agent on {agent.lost}")

    def refuse_version(self, identity: bytes, version: int) -> None:
        """A peer of another protocol version (the mesh's ROUTER could not tell a
        relay from a worker): told in a relay's language too."""
        self._refuse_version(identity, version)

    def _refuse_version(self, identity: bytes, version: int) -> None:
        why = f"a host agent speaks protocol {version}, this mesh {PROTOCOL_VERSION}"
        self.peers.count("version")
        logger.warning("mesh %r: %s: run the same monarch_nb release on both sides", self.name, why)
        if identity not in self._version_told and len(self._version_told) < 4096:
            self._version_told.add(identity)
            self.refusals.append(why)
            self._send(identity, hm.Refused(why))

    def _say(self, text: str) -> None:
        """Shown where the mesh's start-up lines are (the notebook), and logged."""
        logger.info("mesh %r: %s", self.name, text)
        try:
            self._out(f"mesh {self.name!r}: {text}")
        except Exception:
            logger.warning("mesh %r: %s", self.name, text)
