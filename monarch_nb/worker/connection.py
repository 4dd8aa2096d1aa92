"""The worker's link to the controller: its socket and who drives it, the receive
step (open the envelope, verify, dispatch each message to the handler of its name)
and the tick (stale output, progress, health, stalls, and whether the controller is
still there).

One thread at a time holds the socket's *lease*. The default stream's thread, while
its queue is empty, receives itself: a command for it starts on the thread that
received it, with no hand-over (one wake-up less per round trip). While it runs a
command, the receiver thread finds the lease free (it looks every TAKE_OVER s, so a
short command wakes nobody) and drives the socket, answering interrupts, pings and
other streams' commands; the idle stream's thread then asks for it back."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback

import zmq
from zmq.backend import zmq_poll

from ..protocol import BadMessage, encode
from ..protocol import messages as m
from ..protocol.envelope import (
    CONTROLLER,
    PROTOCOL_VERSION,
    PeerTable,
    Sealer,
    VersionMismatch,
    decode_each,
    open_from_controller,
)
from ..protocol.wire import recv_ready, send_frames
from .health import HealthSampler, check_stalls
from .timings import take_timings

logger = logging.getLogger("monarch_nb.worker")

OUTPUT_AGE = 0.05  # flush output buffered longer than this
PROGRESS_PERIOD = 0.1
HEALTH_PERIOD = 1.0
LOST_CONNECTION_GRACE = 3.0  # a dropped connection not back within this ends a joined worker
# how soon the receiver thread takes the socket over once the default stream starts a
# command (and with it answers interrupts, pings and requests for other streams)
TAKE_OVER = 0.02
# an idle worker (no command running, no output buffered) for QUIET_AFTER s: its holder
# polls every QUIET_POLL s (ticks: health, the controller's silence; output or a command
# ends the poll at once), and past PARK_AFTER s the receiver thread waits to be woken
# by the next command instead of looking every TAKE_OVER s (~15 ms of CPU a second)
QUIET_AFTER, QUIET_POLL, PARK_AFTER, PARK_MAX = 0.2, 0.25, 0.5, 1.0
_sleep = time.sleep  # the real one (streams get an interruptible one)


class Connection:
    """The socket's part of Worker (the receiver thread, and the idle default stream's
    thread): Worker sets the address, signer, rank, streams and handlers this uses."""

    def _init_connection(self) -> None:
        self.peers = PeerTable()  # of the controller's socket: its rank, its sequence
        self.peers.allow(CONTROLLER)
        self._sock: zmq.Socket | None = None
        self._sealer: Sealer | None = None
        self._last_heard = time.monotonic()
        self._lost_at: float | None = None
        self.reconnects = 0  # times a controller came back: the store's channels follow
        self._sent_progress: dict = {}
        # the socket's lease: the receiver thread holds it, except while the default
        # stream's thread is idle and receives itself (``receive_while_idle``)
        self._lease = threading.Lock()
        self._idle_wants = False  # the default stream's thread waits for the lease
        self.quiet = False  # the idle holder polls QUIET_POLL s (an output write wakes it)
        self._idle_since: float | None = None  # the default stream's thread receives since
        self._parked = threading.Event()  # the receiver thread waits for a command
        self._receiver_parked = False
        self._wake_r, self._wake_w = os.pipe()  # ends the holder's poll early
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._polled: list | None = None
        self._monitor = None

    @property
    def controller_gone(self) -> bool:
        """The connection to the controller dropped and is not back (a kept-alive
        mesh's ranks live on): what they send is dropped once their queues are full,
        and their reports wait."""
        return self._lost_at is not None

    @property
    def bad_messages(self) -> int:
        """Messages this worker dropped, of any kind (``peers.rejections``)."""
        return self.peers.total

    def connect_socket(self, sndhwm: int = 0) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.SNDHWM, sndhwm)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(self.address)
        return s

    def _send(self, msg) -> None:
        """Send on the receiver's socket (the lease holder only)."""
        assert self._sock is not None and self._sealer is not None
        send_frames(self._sock, self._sealer.seal(encode(msg, self.signer)))

    def _receive_loop(self) -> None:
        try:
            self._sock = sock = self.connect_socket()
            self._sealer = Sealer(self.signer, self.rank)
            self._send(
                m.WorkerReady(
                    self.rank,
                    self.world,
                    os.getpid(),
                    socket.gethostname(),
                    self.cuda,
                    {"python": sys.version.split()[0], "torch": _torch_version()},
                )
            )
            self._health = HealthSampler(self.cuda)
            self._next_progress = self._next_health = 0.0
            # whether the controller is there: a worker that is not its child exits when
            # it goes; a kept-alive one goes on, its output bounded (controller_gone)
            self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            # zmq_poll on plain ints: sock.poll builds a Poller (and enums) per call
            polled = [(sock, int(zmq.POLLIN)), (self._wake_r, int(zmq.POLLIN))]
            if self._monitor is not None:
                polled.append((self._monitor, int(zmq.POLLIN)))
            self._polled = polled
            while not self._exiting:
                # the lease is free while the default stream runs a command: drive the
                # socket until its thread, idle again, wants it back. Checked on a timer,
                # not by waiting on the lease: a short command wakes nobody.
                if not self._idle_wants and self._lease.acquire(blocking=False):
                    try:
                        while not self._idle_wants and not self._exiting:
                            self._receive_step(20)
                    finally:
                        self._lease.release()
                else:
                    idle = self._idle_since
                    if idle is not None and time.monotonic() - idle >= PARK_AFTER:
                        self._park()
                    else:
                        _sleep(TAKE_OVER)
            with self._lease:
                self._tick(final=True)
        except Exception as e:
            self._die(e, "receiver thread")
        finally:
            if self._sock is not None:
                self._sock.close(linger=2000)

    def _receive_step(self, timeout_ms: int, queue=None) -> None:
        """One turn of the lease holder: wait up to ``timeout_ms`` for a message, handle
        what came, then the tick (unless one is due, left to a later turn when ``queue``,
        the idle stream's, has a command now: it starts first)."""
        sock, monitor = self._sock, self._monitor
        ready = [s for s, _ in zmq_poll(self._polled, timeout_ms)]
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        if monitor is not None and any(s is monitor for s in ready):
            self._watch_connection(monitor)
        if any(s is sock for s in ready):
            self._last_heard = time.monotonic()
            for _ in range(256):
                frames = recv_ready(sock)
                if frames is None:
                    break
                self._dispatch(frames)
                del frames  # a pushed tensor must not outlive its command here
                if self._exiting:
                    break
        if queue is None or queue.empty() or time.monotonic() >= self._next_progress:
            self._tick()

    def receive_while_idle(self, stream) -> None:
        """The default stream's thread, its queue empty: take the socket's lease and
        receive here until a command for it (or the end) comes, so that a command to an
        idle worker starts without a hand-over between threads."""
        if self._polled is None or self._exiting:
            return
        lease = self._lease
        if not lease.acquire(blocking=False):  # the receiver thread drives: ask for it
            self._idle_wants = True
            self.wake_holder()
            lease.acquire()
            self._idle_wants = False
        try:
            stream.receiving = True
            self._idle_since = since = time.monotonic()
            q = stream.q
            while q.empty() and not self._exiting:
                if time.monotonic() - since < QUIET_AFTER:  # a busy worker's idle moment
                    self._receive_step(20, q)
                    continue
                self.quiet = True  # first: an output written from now on wakes us
                self.quiet = not any(
                    s.running is not None or s.outbox.pending for s in self.streams.values()
                )
                wait = min(QUIET_POLL, self._next_health - time.monotonic()) if self.quiet else 0.02
                self._receive_step(max(1, int(wait * 1000)), q)  # health keeps its beat
        except Exception as e:
            self._die(e, "default stream's receiving")
        finally:
            self.quiet = False
            self._idle_since = None  # first: a receiver that parks from now on sees it
            if self._receiver_parked:
                self._parked.set()
            stream.receiving = False
            lease.release()

    def _park(self) -> None:
        """The receiver thread, the worker idle a while: wait until the default stream
        starts a command (at most PARK_MAX s) instead of looking every TAKE_OVER s."""
        self._parked.clear()
        self._receiver_parked = True  # first: a stream leaving idle from now on wakes us
        if self._idle_since is not None:
            self._parked.wait(PARK_MAX)
        self._receiver_parked = False

    def _die(self, e: Exception, where: str) -> None:
        """A bug in the worker's own receiving: tell the controller (which breaks the
        mesh, naming it) and exit."""
        logger.exception("%s failed", where)
        try:
            self._send(m.InternalException(self.rank, internal_failure(e, where)))
        except Exception:
            pass
        os._exit(3)

    def wake_holder(self) -> None:
        """End the lease holder's poll now."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _dispatch(self, frames) -> None:
        try:
            missed, parts = open_from_controller(frames, self.signer, self.peers)
        except VersionMismatch as e:
            self._wrong_version(e.version)
            return
        except BadMessage as e:
            self._drop(e.kind, e)
            return
        if missed:
            self._drop("gap", f"{missed} message(s) of the controller never arrived")
        for msg in decode_each(parts, self.signer):
            if isinstance(msg, BadMessage):
                self._drop(msg.kind, msg)
            else:
                self._handle(msg)

    def _wrong_version(self, version: int) -> None:
        print(
            f"[monarch worker {self.rank}] the controller speaks protocol {version}, this "
            f"worker {PROTOCOL_VERSION}: run the same monarch_nb version on both sides; exiting",
            file=sys.__stderr__,
            flush=True,
        )
        os._exit(2)

    def _drop(self, kind: str, why) -> None:
        self.peers.count(kind)
        logger.warning(
            "dropped a message (%s: %s); %d dropped so far", kind, why, self.bad_messages
        )

    def _handle(self, msg) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._drop("malformed", f"a message of unknown type {type(msg).__name__}")
            return
        try:
            handler(msg)
        except Exception as e:
            logger.exception("handler %s failed", type(msg).__name__)
            self._send(
                m.InternalException(self.rank, internal_failure(e, f"{type(msg).__name__} handler"))
            )

    def _tick(self, final: bool = False) -> None:
        now = time.monotonic()
        for s in list(self.streams.values()):
            s.outbox.flush_if_stale(now, OUTPUT_AGE)
        gone = self._lost_at is not None  # reports would pile up in the socket's queue
        if now >= self._next_progress or final:
            self._next_progress = now + PROGRESS_PERIOD
            streams = list(self.streams.values())
            timings = take_timings(self.rank, streams)
            if timings is not None and not gone:  # before the progress that says they finished
                self._send(timings)
            progress = {s.id: (s.started, s.finished, s.done) for s in streams}
            if progress != self._sent_progress and not gone:
                self._sent_progress = progress
                self._send(m.Progress(self.rank, progress))
        if now >= self._next_health and not gone:
            self._next_health = now + HEALTH_PERIOD
            rss, cpu, gpu = self._health.sample()
            self._send(
                m.Health(
                    self.rank,
                    os.getpid(),
                    rss,
                    cpu,
                    gpu,
                    self.bad_messages,
                    len(self.env),
                    dict(self.peers.rejections),
                )
            )
            check_stalls(self.streams, self.rank, self._send)
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.error("controller (pid %d) is gone; exiting", self.parent_pid)
            os._exit(1)
        if self.heartbeat_timeout is not None:
            quiet = now - self._last_heard
            lost = self._lost_at is not None and now - self._lost_at > LOST_CONNECTION_GRACE
            if quiet > self.heartbeat_timeout or lost:
                why = "connection lost" if lost else f"not heard of for {quiet:.0f} s"
                print(
                    f"[monarch worker {self.rank}] the controller is gone ({why}); exiting",
                    file=sys.__stderr__,
                    flush=True,
                )
                os._exit(1)

    def _watch_connection(self, monitor) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._lost_at = time.monotonic()
            elif event == zmq.EVENT_CONNECTED and self._lost_at is not None:
                # back: the same controller, or (a kept-alive mesh) one that attached,
                # whose socket is new to this connection and who needs to hear from us
                self._lost_at = None
                self.peers.release(b"")
                self.reconnects += 1
                self._sent_progress = {}
                self._send(self._rejoined())

    def _rejoined(self) -> m.WorkerRejoined:
        streams = list(self.streams.values())
        held = (self.env, self.streams, self.meshes, self.borrows, self.recordings, self.ops)
        ids = [
            max(list(d), default=0) for d in (*held, self.pipes, getattr(self._comms, "groups", {}))
        ]
        torch = sys.modules.get("torch")
        dist = getattr(torch, "distributed", None)
        backend = dist.get_backend() if dist is not None and dist.is_initialized() else None
        return m.WorkerRejoined(
            self.rank,
            self.world,
            os.getpid(),
            socket.gethostname(),
            self.cuda,
            {s.id: s.name for s in streams},
            max(ids),
            max(max(s.started, s.queued) for s in streams),
            backend,
            tuple(list(self.env)),
            getattr(self._comms, "store_generation", None),
        )


def internal_failure(e: BaseException, where: str) -> m.RemoteFailure:
    """A failure of the worker's own machinery: its frames are the point, keep them."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return m.RemoteFailure(type(e).__name__, f"in the worker's {where}: {e}", tb)


def _torch_version() -> str | None:
    """A plain str: torch's TorchVersion would make the controller import torch."""
    version = getattr(sys.modules.get("torch"), "__version__", None)
    return None if version is None else str(version)
