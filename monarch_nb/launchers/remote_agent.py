"""A host agent on another host as the controller sees it (``RemoteAgent``: its
relay, its block of ranks and their book), and the ranks a kept-alive mesh's
relays hold when a controller attaches (``held_ranks``)."""

from __future__ import annotations

import threading
import time

from ..protocol import host_messages as hm
from .agent_ranks import AgentRank, RankBook


class RemoteAgent(RankBook):
    """A relay and its agent on another host: ranks ``first`` .. ``first + count - 1``."""

    failed_spawn_code = 1  # a fork that failed there fails the mesh's start

    def __init__(self, channel, identity: bytes, hello: hm.Hello, first: int, slot: int):
        self._init_ranks()
        self.channel, self.identity, self.hello = channel, identity, hello
        self.first, self.count = first, hello.local_ranks
        self.slot = slot  # the mesh's index of this host (its HostJoin's)
        self.info: hm.AgentReady | None = None
        self.lost: str | None = None
        self.error: str | None = None  # what the agent refused (it ends next)
        self.fd: int | None = None
        self.last_heard = time.monotonic()
        self.closed_at: float | None = None
        self.held = threading.Event()  # its Held arrived (a relay back to a controller that attached)

    @property
    def label(self) -> str:
        return f"host {self.hello.host} (relay pid {self.hello.pid})"

    def send(self, msg) -> None:
        if self.lost is not None:
            raise RuntimeError(self.lost)
        self.channel.post(self.identity, msg)

    def exit_note(self, r: AgentRank, code: int | None) -> str:
        # killed by a signal, the job's end may be why (a time limit signals ranks first)
        note = self.channel.lost_note
        why = note() if note is not None and code is not None and code < 0 else None
        return f"[rank {r.rank} ran on {self.label}; its host agent reported its end{'; ' + why if why else ''}]"

    def spawn_note(self, r: AgentRank, error: str) -> str:
        return f"[{self.label} could not start rank {r.rank}: {error}]"


def held_ranks(agents, name: str, world: int, timeout: float) -> dict:
    """rank -> AgentRank of every rank of kept-alive mesh ``name``, once the relays that
    came back said which they hold (``agents()``: the RemoteAgents now). TimeoutError
    naming the ranks whose relays did not come back within ``timeout``; RuntimeError
    naming those that ended while no controller was attached."""
    deadline = time.monotonic() + timeout
    while True:
        back = [a for a in agents() if a.held.is_set()]
        procs = {r.rank: r for a in back for r in a.ranks.values()}
        blocks = {a.first + i for a in back for i in range(a.count)}
        if len(blocks) == world or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    gone = sorted(blocks - set(procs))
    if gone:
        raise RuntimeError(
            f"mesh {name!r}: rank(s) {gone} ended while no controller was attached; it "
            f"cannot be used again (end it: monarch-nb kill {name})"
        )
    missing = sorted(set(range(world)) - blocks)
    if missing:
        raise TimeoutError(
            f"mesh {name!r}: the host agents of rank(s) {missing} did not come back within "
            f"{timeout:.0f} s (their keep-alive passed, or their hosts are unreachable)"
        )
    return procs


def quit_kept(entry: dict, timeout: float) -> int:
    """End remote kept-alive mesh ``entry`` while no controller has it
    (``monarch-nb kill``): listen where it did, with its key, and tell each relay that
    comes back Quit (its agent kills its ranks). Returns the ranks told to end; waits
    until those are the mesh's world, or ``timeout``."""
    import zmq

    from ..protocol import agent_link
    from ..protocol.envelope import CONTROLLER, PeerTable, Sealer
    from ..protocol.wire import BadMessage, Signer

    signer = Signer(bytes.fromhex(entry["key"]))
    sealer, peers = Sealer(signer, CONTROLLER), PeerTable()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 2000)
    port = entry["address"].rsplit(":", 1)[1]
    sock.bind(f"tcp://{entry['interface']}:{port}")
    told: dict[bytes, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while sum(told.values()) < entry["world"] and time.monotonic() < deadline:
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            try:
                h, msg = agent_link.open_record(frames[1:], signer)
                peers.admit(identity, h)
            except BadMessage:
                continue
            if type(msg) is hm.Hello and msg.held is not None and identity not in told:
                peers.join(identity, h)
                told[identity] = int(msg.held[1])
                sock.send_multipart([identity, *agent_link.seal(sealer, signer, hm.Quit(), identity)])
    finally:
        sock.close()  # its linger sends the Quits
    return sum(told.values())
