"""``monarch-nb-host --connect ADDR``: the relay between a controller on another
host and this host's forking agent.

A ZeroMQ context starts I/O threads, and the agent forks ranks, so it must
have none: the relay holds the socket (a DEALER to the controller's agent
channel), seals and opens every record with the mesh key, sends heartbeats,
and starts the same single-threaded ``--stdio`` agent as a local mesh has as
its child (once the controller has taken this host). Records pass between the
two unchanged, except that a Spawn gets this host's environment, sys.path and
working directory (the controller's are another host's).

The fan-out (a Spawn that names the host's index, ``host >= 0``): the ranks
connect to the relay's own ROUTER, an ipc socket in a 0700 directory, and the
relay joins the mesh's ROUTER as that host (``relay_fanout.RelayHost``): each
command arrives once for the host, and what the ranks send leaves in the
host's envelopes. Otherwise (``MONARCH_NB_RELAY_FANOUT=0`` at the controller)
each rank connects to the mesh's ROUTER itself.

The relay ends, and its agent and ranks with it, when the controller says
Quit, refuses the agent, or has been silent for the heartbeat timeout (a
kept-alive mesh's relay waits for another controller instead:
``relay_orphan.py``); the agent dies with the relay (its parent-death signal).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from .._version import __version__
from ..protocol import agent_link
from ..protocol import host_messages as hm
from ..protocol.constants import BEAT_S
from ..protocol.envelope import PROTOCOL_VERSION, VersionMismatch
from ..protocol.receivers import AGENT_RELAY, handler_table
from ..protocol.wire import BadMessage, Signer
from .relay_fanout import RelayHost
from .relay_orphan import HeldRanks, Orphanage

POLL_MS = 200
GONE_S = (
    2.0  # a closed connection that is not back (and heard on) this soon: the controller is gone
)


class Relay(Orphanage):
    """One host's link to its controller at ``address`` (the agent channel)."""

    def __init__(
        self,
        address: str,
        key: bytes,
        local_ranks: int,
        node_rank: int | None,
        heartbeat_timeout: float,
    ):
        self.address, self.local_ranks, self.node_rank = address, local_ranks, node_rank
        self.heartbeat_timeout = heartbeat_timeout
        self.key = key
        self.signer = Signer(key)
        self._handlers = handler_table(self, AGENT_RELAY, prefix="_on_")
        self.reader = hm.LineReader()
        self.running = True
        self.code = 0
        self.heard = False
        self.dropped = 0
        self._to_write = bytearray()  # for the agent's stdin (non-blocking: the agent may be busy)
        self.block: tuple | None = None  # (first rank, count), from the Welcome
        self.fan: RelayHost | None = None  # the fan-out, from the first Spawn that asks for it
        self._gated = False  # the ranks' sockets unread while the fan-out's socket is full
        self.book = HeldRanks()

    def log(self, text: str) -> None:
        print(f"[monarch host relay {os.getpid()}] {text}", file=sys.stderr, flush=True)

    def serve(self) -> int:
        """Run until the controller or the agent is gone; the exit code."""
        signal.signal(signal.SIGTERM, lambda *_: self._stop(0))
        signal.signal(signal.SIGINT, lambda *_: self._stop(0))
        self.agent: subprocess.Popen | None = None  # started once the controller takes it
        # two I/O threads: the ranks' ipc socket and the controller's TCP ones are read and
        # written in parallel (a 4 x 4 MB fetch through a relay: 17 ms with one, 11-12 with two)
        self.ctx = ctx = zmq.Context(2)
        self.sock = self.poller = None
        self._new_socket()
        try:
            self._send(self._hello())
            self._loop()
        finally:
            if self.fan is not None:  # first: its directory must not outlive a kill that
                self.fan.close()  # comes while the agent ends its ranks
            if self._fan_spec is not None:
                shutil.rmtree(self._fan_spec[2], ignore_errors=True)
            self._end_agent()
            self.monitor.close(0)
            self.sock.close()
            ctx.term()
        return self.code

    def _hello(self, held: list | None = None) -> hm.Hello:
        return hm.Hello(
            # Slurm's name of the node, where srun started this agent
            os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            os.getpid(), __version__, self.local_ranks, self.node_rank, held,
        )  # fmt: skip

    def _loop(self) -> None:
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        last_heard = next_beat = time.monotonic()
        closed_at = None  # when the connection to the controller last closed
        while self.running:
            self._gate()
            hold = self.fan.hold_left() if self.fan is not None else None
            wait = POLL_MS if hold is None else min(POLL_MS, int(hold * 1000) + 1)
            for what, _ in self.poller.poll(wait):
                fan = self.fan
                if not self.running:
                    break
                if fan is not None and what is fan.rank_sockets.sock:
                    fan.from_ranks()
                elif fan is not None and what is fan.sock:
                    fan.drain()
                    fan.receive()
                    if fan.refused is not None:
                        self.log(f"the controller refused this host's fan-out: {fan.refused}")
                        self._stop(2)
                elif what is self.sock:
                    while self.running and self.sock.poll(0):
                        if self._from_controller(self.sock.recv_multipart(copy=False)):
                            last_heard = time.monotonic()
                            if self.fan is not None:
                                self.fan.holding = False
                elif what is self.monitor:
                    while self.monitor.poll(0):
                        if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_CONNECTED:
                            self.connected = True
                            continue
                        self.connected = False
                        closed_at = time.monotonic()
                        if self.fan is not None and self.keep_alive is not None:
                            self.fan.holding = True  # what the ranks send waits here
                elif self.agent is not None and what == self.agent.stdout.fileno():
                    self._from_agent(what)
                elif self.agent is not None and what == self.agent.stdin.fileno():
                    self._write_agent()
            if self.fan is not None:
                self.fan.flush()
            now = time.monotonic()
            if self.orphaned_at is not None:
                closed_at = None
                if self.running:
                    self._orphan_tick(now)
                last_heard = now
                continue
            if closed_at is not None and now - closed_at > GONE_S:
                if last_heard < closed_at and self.heard:
                    self._lose(
                        f"the connection to the controller at {self.address} closed and it has "
                        f"not answered since ({GONE_S:g} s)"
                    )
                    last_heard = time.monotonic()
                    continue
                closed_at = None
            if now >= next_beat:
                next_beat = now + BEAT_S
                self._send(hm.Beat())
            if self.running and now - last_heard > self.heartbeat_timeout:
                why = (
                    "it is gone"
                    if self.heard
                    else "wrong key (its messages are never answered), or no controller there"
                )
                self._lose(
                    f"no signed word from the controller at {self.address} for "
                    f"{self.heartbeat_timeout:g} s ({why})"
                )

    def _gate(self) -> None:
        """While the socket up to the controller is at its bound (the controller does not
        read), the ranks' sockets are not read either: a flood waits in the ranks, whose
        sends block, as it does with a socket of their own at the controller."""
        fan = self.fan
        if fan is None or bool(fan.backlog) == self._gated:
            return
        self._gated = bool(fan.backlog)
        self.poller.modify(fan.rank_sockets.sock, 0 if self._gated else zmq.POLLIN)
        self.poller.modify(fan.sock, zmq.POLLIN | (zmq.POLLOUT if self._gated else 0))

    def _stop(self, code: int) -> None:
        self.code = self.code or code
        self.running = False

    def _send(self, msg) -> None:
        """Never blocks (the heartbeat checks must go on): a record the socket cannot
        queue is dropped (the controller is gone, or far behind)."""
        frames = agent_link.seal(self.sealer, self.signer, msg)
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            self.sealer.retract()
            if not self.dropped:
                self.log(f"cannot send to the controller ({e}): dropping records")
            self.dropped += 1

    # ------------------------------------------------------------ controller -> agent

    def _from_controller(self, frames) -> bool:
        """Handle one message; True when it was the controller's (signed, in order)."""
        try:
            h, msg = agent_link.open_record(frames, self.signer)
            if self.peers.admit(b"", h) is None:
                raise BadMessage(f"a message of rank {h.rank}, not of the controller", "rank")
        except VersionMismatch as e:
            self.log(
                f"the controller speaks protocol {e.version}, this host agent "
                f"{PROTOCOL_VERSION}: run the same monarch_nb version on both sides; exiting"
            )
            self._stop(2)
            return False
        except BadMessage as e:
            self.peers.count(e.kind)
            return False
        self.heard = True
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.peers.count("malformed")  # a record the controller never sends a relay
        else:
            handler(msg)
        return True

    def _on_Refused(self, msg: hm.Refused) -> None:
        self.log(f"the controller refused this host agent: {msg.error}")
        self._stop(2)

    def _on_Welcome(self, msg: hm.Welcome) -> None:
        self.keep_alive = msg.keep_alive
        if self.orphaned_at is not None:
            self._adopted()
            return
        last = msg.first + msg.count - 1
        self.block = (msg.first, msg.count)
        self.log(f"joined: ranks {msg.first}-{last} of {msg.world} run here")
        self._start_agent()

    def _on_Spawn(self, msg: hm.Spawn) -> None:
        self.book.spawning(msg)
        self._to_agent(self._here(msg))

    def _on_Kill(self, msg: hm.Kill) -> None:
        self._to_agent(msg)

    def _on_Quit(self, msg: hm.Quit) -> None:
        self._to_agent(msg)
        self._stop(0)

    def _on_Beat(self, msg: hm.Beat) -> None:  # heard: all it says
        pass

    def _start_agent(self) -> None:
        if self.agent is not None:
            return
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "monarch_nb.host", "--stdio"]
            + ["--local-ranks", str(self.local_ranks), "--parent-pid", str(os.getpid())]
            + ["--one-per-gpu"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
        )
        os.set_blocking(self.agent.stdin.fileno(), False)
        self.poller.register(self.agent.stdout.fileno(), zmq.POLLIN)

    def _here(self, msg: hm.Spawn) -> hm.Spawn:
        """The Spawn with this host's environment (the controller sent the rank's
        variables) and the mesh key (which the controller does not send: the
        channel is signed, not encrypted)."""
        env = {k: v for k, v in os.environ.items() if k != "MONARCH_NB_KEY"}
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.local_ranks)))
        env.update(msg.env)
        cwd = os.getcwd()
        paths = [p if p else cwd for p in sys.path]
        address = msg.address
        if msg.host >= 0 and self.block is not None:
            self.slot = msg.host
            address = self._fan_out_to(msg.address, msg.host).ranks_address
        return msg._replace(
            env=env, sys_path=paths, cwd=cwd, key_hex=self.key.hex(), address=address
        )

    def _fan_out_to(self, address: str, host: int, directory: str | None = None) -> RelayHost:
        """This host's socket to the mesh's ROUTER at ``address`` (joined once);
        ``directory``: the ranks' socket's, where they reconnect (a controller attached)."""
        fan = self.fan
        if fan is not None and fan.address == address and fan.host == host:
            return fan
        if fan is not None:
            self.poller.unregister(fan.sock)
            self.poller.unregister(fan.rank_sockets.sock)
            fan.close()
        first, count = self.block
        self.fan = fan = RelayHost(
            self.ctx, address, self.key, host, first, count, socket.gethostname(), directory
        )
        self.poller.register(fan.sock, zmq.POLLIN)
        self.poller.register(fan.rank_sockets.sock, zmq.POLLIN)
        self._gated = False
        self.log(f"fans out as host {host}: its ranks connect to {fan.ranks_address}")
        return fan

    def _to_agent(self, msg) -> None:
        if self.agent is not None:
            self._to_write += hm.encode(msg)
            self._write_agent()

    def _write_agent(self) -> None:
        """Write what the pipe takes now; the rest when the poll says it has room."""
        fd = self.agent.stdin.fileno()
        while self._to_write:
            try:
                n = os.write(fd, self._to_write)
            except BlockingIOError:
                break
            except OSError:
                self._to_write.clear()  # the agent is gone: its end is read from its stdout
                break
            del self._to_write[:n]
        self.poller.register(fd, zmq.POLLOUT if self._to_write else 0)

    # ------------------------------------------------------------ agent -> controller

    def _from_agent(self, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            code = self.agent.wait()
            if self.orphaned_at is None:
                self._send(hm.AgentGone(code))
            if self.running:
                self.log(f"this host's agent (pid {self.agent.pid}) ended (code {code})")
            self._stop(1 if code == 0 else 4)
            return
        for msg in self.reader.feed(data):
            if isinstance(msg, hm.HostMessageError):
                self.log(f"the agent wrote a line that is not a record: {msg}")
            elif self.book.report(msg, self.orphaned_at is not None):
                self._send(msg)

    def _end_agent(self) -> None:
        """Close the agent's channel: it kills its ranks and exits (then SIGKILL)."""
        if self.agent is None:
            return
        try:
            self.agent.stdin.close()
        except OSError:
            pass
        try:
            self.agent.wait(5)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait(5)
