"""The IO loop: one ROUTER socket, driven by one thread at a time.

User threads encode (pickle and sign) on their own thread and hand frames over
through a deque (tensor ops go unencoded: ``Routes`` packs neighbours into one).
Whoever holds the *lease* drives the socket: sends what was handed over, in order
(small messages bound for one worker leave as one batch), receives and hands each
frame set to ``on_frames``, reads watched processes' output pipes and calls
``on_tick`` every TICK seconds.

The IO thread drives by default. A caller that finds the lease free sends its
own message at once, and a caller waiting for a reply drives the socket itself
until the reply is in, so a round trip costs no thread hand-over; the IO thread
then keeps away for GRACE seconds (a caller in a loop keeps the lease) and
takes over when callers are gone. A Ctrl-C on the main thread while it drives
waits until the step it is in has finished, so no message is half-handled.
Functions handed over with ``call`` always run on the IO thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..protocol.wire import recv_ready, send_frames
from .io_items import Call, CancelRequest, Delete, IOCallbacks, Op, Raw, Send, SendRequest
from .routing import Routes, bind_router
from .sigint import held_interrupt
from .switch_interval import holding

logger = logging.getLogger("monarch_nb.controller")

TICK = 0.1  # seconds between process checks and housekeeping
GRACE = 0.005  # seconds the IO thread leaves the socket to a caller that just drove it
# ... to one that sent a request (likely driving for it now) or waits for the lease
SENT_GRACE = 0.0005  # (short: a caller that awaits instead never drives)
HOLD = 0.001  # seconds messages handed over after a wake wait for that wake's batch
# ... after a tensor op: a step op by op feeds the ranks a pipeline, where fewer wakes
# and larger batches cost less (a real LM's step: 22 % less controller CPU than at 1 ms)
HOLD_OPS = 0.005
MAX_QUEUED = 4096  # messages handed over and not sent before a producer must help send
MAX_DRAIN = 65536  # messages one drain sends at most


class IOLoop:
    """The socket of one mesh and its thread.

    Items handed over with ``submit`` are the records of ``io_items``; what the loop
    calls is given with ``callbacks`` (``io_items.IOCallbacks``).
    """

    def __init__(
        self,
        name: str,
        interface: str,
        identities: dict,
        callbacks: IOCallbacks,
        port: int = 0,
        switch_interval: float = 0.0,
    ):
        """``port``: the one to bind (a mesh's own, when attaching to it); 0: any free one.
        ``switch_interval``: the process's at most, while the thread runs (switch_interval.py)."""
        self.name = name
        self.callbacks = callbacks
        self.identities = identities  # rank -> socket identity, filled by the worker set
        self._ctx = zmq.Context()
        try:
            self._router, self.port = bind_router(self._ctx, name, interface, port)
        except OSError:
            self._ctx.term()
            raise
        self.routes = Routes(  # how a rank's message leaves
            self._router,
            identities,
            callbacks.seal,
            callbacks.encode_host_command,
            callbacks.encode_ops,
        )
        self._outq: deque = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_pending = False
        self._stop = False
        self._lock = threading.Lock()
        self.sockets_closed = False
        self._watched: dict[int, object] = {}  # fd -> process (read_output)
        self._lease = threading.Lock()  # held by whoever drives the socket
        self._callers_until = 0.0  # the IO thread keeps away until then
        self._io_needed = threading.Event()  # a "call" waits, or callers are gone
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        # connections that close (the agents' channel learns of a relay gone from it)
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.on_disconnect = lambda fd: None  # the launcher's (Launcher.attach)
        self._registered: set[int] = set()
        self._next_tick = 0.0
        run = holding(self._run, switch_interval)
        self.thread = threading.Thread(target=run, name=f"monarch-io-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def on_io_thread(self) -> bool:
        return threading.current_thread() is self.thread

    # ------------------------------------------------------------ handing over

    def submit(self, item) -> None:
        """Hand ``item`` over. A request (someone waits for its replies) leaves at
        once, with everything handed over before it, when the socket is free to
        drive; other messages go with the next batch: the lease holder's (woken),
        or, right after a caller drove, its next request's (or the IO thread's
        within GRACE s)."""
        self._outq.append(item)
        if len(self._outq) > MAX_QUEUED and not self.on_io_thread:
            self._help_drain()  # a producer faster than the socket: back-pressure
        request = type(item) is SendRequest
        if request and self._lease.acquire(blocking=False):
            try:
                if not self.sockets_closed:
                    held_interrupt(self._drain)
                    return
            finally:
                self._release_by_caller(SENT_GRACE)
        elif not request:
            now = time.monotonic()
            if now < self._callers_until:
                return  # a caller drove just now: its next request (or the IO thread) sends it
            if not self.on_io_thread:
                # what follows within the hold goes with this batch, unwoken: one wake a batch
                self._callers_until = now + (HOLD_OPS if type(item) is Op else HOLD)
        self._wake()

    def _help_drain(self) -> None:
        """Take the lease (waiting for the holder's step to end) and make one step
        without waiting: send the backlog, and receive, so that replies keep flowing
        while a producer holds the socket."""
        if self._lease.acquire(timeout=1.0):
            try:
                if not self.sockets_closed:
                    self._step(0)
            finally:
                self._lease.release()

    def _wake(self) -> None:
        """Whoever drives sends what was handed over: the pipe wakes its poll, and
        the event ends the IO thread's grace."""
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
            if not self._io_needed.is_set():
                self._io_needed.set()

    def _release_by_caller(self, grace: float = GRACE) -> None:
        self._callers_until = max(self._callers_until, time.monotonic() + grace)
        self._lease.release()
        if self._outq and not self._io_needed.is_set():
            self._io_needed.set()  # what another caller handed over meanwhile

    def drive_until(self, future, timeout: float | None) -> None:
        """Wait for ``future`` (up to ``timeout`` s), driving the socket meanwhile
        when nobody else does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not future.done():
            left = TICK if deadline is None else min(TICK, deadline - time.monotonic())
            if left <= 0:
                return
            if not self.on_io_thread and self._lease.acquire(blocking=False):
                try:
                    if self.sockets_closed:
                        return
                    self._step(left)
                finally:
                    self._release_by_caller()
            else:  # the IO thread drives: it leaves the lease to us after this step
                self._callers_until = max(self._callers_until, time.monotonic() + SENT_GRACE)
                try:
                    future.exception(left)
                except BaseException as e:  # noqa: B036 - a timeout here; Ctrl-C goes up
                    if isinstance(e, KeyboardInterrupt):
                        raise

    def submit_quiet(self, item) -> None:
        """Hand over without waking anyone (sent with the next batch)."""
        self._outq.append(item)

    def call(self, fn) -> Future:
        """Run ``fn`` on the IO thread."""
        fut: Future = Future()
        self._outq.append(Call(fn, fut))
        self._io_needed.set()
        self._wake()
        return fut

    def send_now(self, identity: bytes, frames) -> None:
        """Send one encoded message to one socket, sealed (the lease holder: handlers'
        refusals, pings)."""
        self.routes.send_now(identity, frames)

    def send_via_host(self, identity: bytes, ranks, frames) -> None:
        """Send one buffer-less message to ``ranks`` of the host socket ``identity``."""
        self.routes.to_host(identity, ranks, [frames])

    def send_to(self, ranks, frames) -> None:
        """Send to ``ranks`` on the IO thread itself."""
        self.routes.route(ranks, frames, None)

    def watch(self, proc) -> None:
        """Read ``proc``'s output pipe here (``proc.fd``, ``proc.read_output()``)."""
        self.call(lambda: self._watched.setdefault(proc.fd, proc))

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        while not self._stop:
            try:
                needed = self._io_needed.is_set()  # handed over: send it now
                wait = self._callers_until - time.monotonic()
                if wait > 0 and not needed:
                    self._io_needed.wait(wait)
                    continue
                self._io_needed.clear()
                if not self._lease.acquire(timeout=TICK):
                    continue
                try:
                    if not needed and time.monotonic() < self._callers_until:
                        continue  # a caller drove just now: let it keep the socket
                    self._step(0 if self._outq else TICK)
                finally:
                    self._lease.release()
            except Exception:
                logger.exception("mesh %r: IO thread error (continuing)", self.name)
        with self._lease:
            try:
                self._drain()
            finally:
                self.close_sockets()

    def _step(self, timeout: float) -> None:
        """One turn of the loop (by whoever holds the lease): wait up to ``timeout``
        s for something to do, then do it."""
        for fd in list(self._watched):
            if fd is not None and fd not in self._registered:
                self._registered.add(fd)
                self._poller.register(fd, zmq.POLLIN)
        events = dict(self._poller.poll(int(timeout * 1000)))
        try:
            held_interrupt(self._handle_events, events)
        except Exception:
            logger.exception("mesh %r: IO error (continuing)", self.name)

    def _handle_events(self, events: dict) -> None:
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 65536)
            except BlockingIOError:
                pass
        self._wake_pending = False
        self._drain()
        if self._router in events:
            self._receive()
        if self._monitor in events:
            self._disconnects()
        for fd in [fd for fd in events if fd in self._registered]:
            proc = self._watched[fd]
            if not proc.read_output():
                self._poller.unregister(fd)
                self._registered.discard(fd)
                del self._watched[fd]
                self.callbacks.on_process_output_end(proc)
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + TICK
            self.callbacks.on_tick()

    def stop(self, join: float = 5.0) -> None:
        """End the loop; its sockets close on its way out (or here once it is gone)."""
        self._stop = True
        self._io_needed.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if not self.on_io_thread and self.thread.is_alive():
            self.thread.join(timeout=join)
        if self.thread.is_alive():  # stuck in a handler: it closes them when it ends
            logger.warning("mesh %r: the IO thread is still busy at shutdown", self.name)
        elif self._lease.acquire(timeout=join):
            try:
                self.close_sockets()
            finally:
                self._lease.release()

    def close_sockets(self) -> None:
        """Close the router, the context and the wake pipe: on the IO thread, their
        only user, once its loop is over (or by ``stop`` when that thread is gone)."""
        with self._lock:
            if self.sockets_closed:
                return
            self.sockets_closed = True
            self._monitor.close(linger=0)
            self._router.close(linger=0)
            self._ctx.term()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _drain(self) -> None:
        """Send what was handed over before this call (what producers add meanwhile
        waits for the next: a producer faster than the socket cannot keep this
        loop, and its batches, growing)."""
        q = self._outq
        deletes: list[int] = []
        batches: dict[int, list] = {}
        for _ in range(min(len(q), MAX_DRAIN)):
            try:
                item = q.popleft()
            except IndexError:
                break
            kind = type(item)
            if kind is Op:  # a tensor op's fields: encoded with its neighbours
                self.routes.add_op(batches, item[0], item[1])
            elif kind is Send or kind is SendRequest:
                if kind is SendRequest:  # registered, then sent, in one step
                    try:
                        self.callbacks.on_request(item.request)
                    except Exception:
                        logger.exception("mesh %r: registering a request failed", self.name)
                        continue
                    ranks, frames, done = item.ranks, item.frames, None
                else:
                    ranks, frames, done = item
                if done is None and len(frames) == 2:
                    self.routes.add(batches, ranks, frames)
                else:
                    self.routes.flush(batches)
                    self.routes.route(ranks, frames, done)
            elif kind is Delete:
                # sent after the batch: a deleted Ref cannot be named by a later command
                deletes.append(item.ref_id)
            elif kind is Raw:
                self.routes.flush(batches)
                send_frames(self._router, [item.identity, *item.frames])
            elif kind is Call:
                if not self.on_io_thread:  # it runs on the IO thread only, in order
                    q.appendleft(item)
                    self._io_needed.set()
                    break
                self.routes.flush(batches)
                try:
                    item.future.set_result(item.fn())
                except BaseException as e:
                    item.future.set_exception(e)
            elif kind is CancelRequest:
                try:
                    self.callbacks.on_cancel(item.request)
                except Exception:
                    logger.exception("mesh %r: cancelling a request failed", self.name)
            else:
                logger.error("mesh %r: not an IO item: %r", self.name, item)
        if deletes and self.identities:
            frames = self.callbacks.encode_deletes(tuple(deletes))
            if frames is not None:
                self.routes.add(batches, tuple(self.identities), frames)
        self.routes.flush(batches)

    def _disconnects(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                try:
                    self.on_disconnect(event["value"])
                except Exception:
                    logger.exception("mesh %r: a disconnect handler failed", self.name)

    def _receive(self) -> None:
        router = self._router
        for _ in range(1000):
            frames = recv_ready(router)
            if frames is None:
                return
            self.callbacks.on_frames(frames)
