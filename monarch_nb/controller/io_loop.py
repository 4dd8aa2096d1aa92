"""The IO loop: one ROUTER socket and the one thread that touches it.

User threads encode (pickle and sign) on their own thread and hand frames over
through a deque plus a wake-up pipe. The loop sends what they handed over, in
order (small messages bound for one worker leave as one batch), receives and
hands each frame set to ``on_frames``, reads the output pipes of watched
processes and calls ``on_tick`` every TICK seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future

import zmq

from ..protocol.wire import BATCH, recv_ready

logger = logging.getLogger("monarch_nb.controller")

RECV_HWM = 256  # messages queued per worker socket before ZeroMQ stops reading it
TICK = 0.1  # seconds between process checks and housekeeping


class IOLoop:
    """The socket of one mesh and its thread.

    Items handed over with ``submit``:
    ``("msg", ranks, frames, done)``: send ``frames`` to ``ranks``; ``done`` (a Future
    or None) gets the ZeroMQ tracker of a big zero-copy send;
    ``("call", fn, future)``: run ``fn`` here;
    ``("del", ref_id)``: a freed value, announced after the batch it came with;
    ``("req", request, ranks, frames, done)``: ``on_item`` registers the request,
    then its frames leave as a "msg" does.
    Anything else goes to ``on_item`` too (the request table's cancels).
    """

    def __init__(self, name: str, interface: str, identities: dict):
        self.name = name
        self.identities = identities  # rank -> socket identity, filled by the worker set
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, 0)
        # per worker socket: a flood (a 1 GB print) waits in the worker, whose
        # stream blocks, instead of piling up here
        self._router.setsockopt(zmq.RCVHWM, RECV_HWM)
        self._router.setsockopt(zmq.LINGER, 0)
        self.port = self._router.bind_to_random_port(f"tcp://{interface}")
        self._outq: deque = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_pending = False
        self._stop = False
        self._lock = threading.Lock()
        self.sockets_closed = False
        self._watched: dict[int, object] = {}  # fd -> process (read_output)
        self.on_frames = lambda frames: None
        self.on_tick = lambda: None
        self.on_item = lambda item: None
        self.on_process_output_end = lambda proc: None
        self.encode_deletes = lambda ids: None  # -> frames of a DeleteRefs, or None
        self.thread = threading.Thread(target=self._run, name=f"monarch-io-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def on_io_thread(self) -> bool:
        return threading.current_thread() is self.thread

    # ------------------------------------------------------------ handing over

    def submit(self, item) -> None:
        self._outq.append(item)
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def submit_quiet(self, item) -> None:
        """Hand over without waking the loop (sent with the next batch)."""
        self._outq.append(item)

    def call(self, fn) -> Future:
        """Run ``fn`` on the IO thread."""
        fut: Future = Future()
        self.submit(("call", fn, fut))
        return fut

    def send_now(self, identity: bytes, frames) -> None:
        """Send on the IO thread itself (handlers: refusals, pings)."""
        self._router.send_multipart([identity, *frames])

    def send_to(self, ranks, frames) -> None:
        """Send to ``ranks`` on the IO thread itself."""
        self._route(ranks, frames, None)

    def watch(self, proc) -> None:
        """Read ``proc``'s output pipe here (``proc.fd``, ``proc.read_output()``)."""
        self.submit(("call", lambda: self._watched.setdefault(proc.fd, proc), Future()))

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        registered: set[int] = set()
        next_tick = 0.0
        while not self._stop:
            try:
                for fd in list(self._watched):
                    if fd is not None and fd not in registered:
                        registered.add(fd)
                        poller.register(fd, zmq.POLLIN)
                events = dict(poller.poll(int(TICK * 1000)))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                self._wake_pending = False
                self._drain()
                if self._router in events:
                    self._receive()
                for fd in [fd for fd in events if fd in registered]:
                    proc = self._watched[fd]
                    if not proc.read_output():
                        poller.unregister(fd)
                        registered.discard(fd)
                        del self._watched[fd]
                        self.on_process_output_end(proc)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK
                    self.on_tick()
            except Exception:
                logger.exception("mesh %r: IO thread error (continuing)", self.name)
        try:
            self._drain()
        finally:
            self.close_sockets()

    def stop(self, join: float = 5.0) -> None:
        """End the loop; its sockets close on its way out (or here once it is gone)."""
        self._stop = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if not self.on_io_thread and self.thread.is_alive():
            self.thread.join(timeout=join)
        if self.thread.is_alive():  # stuck in a handler: it closes them when it ends
            logger.warning("mesh %r: the IO thread is still busy at shutdown", self.name)
        else:
            self.close_sockets()

    def close_sockets(self) -> None:
        """Close the router, the context and the wake pipe: on the IO thread, their
        only user, once its loop is over (or by ``stop`` when that thread is gone)."""
        with self._lock:
            if self.sockets_closed:
                return
            self.sockets_closed = True
            self._router.close(linger=0)
            self._ctx.term()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _drain(self) -> None:
        q = self._outq
        deletes: list[int] = []
        batches: dict[int, list] = {}
        while True:
            try:
                item = q.popleft()
            except IndexError:
                break
            kind = item[0]
            if kind == "msg" or kind == "req":
                if kind == "req":  # a request: registered, then sent, in one step
                    try:
                        self.on_item(item)
                    except Exception:
                        logger.exception("mesh %r: registering a request failed", self.name)
                        continue
                    item = item[1:]
                _, ranks, frames, done = item
                if done is None and len(frames) == 2:
                    for r in ranks:
                        b = batches.get(r)
                        if b is None:
                            batches[r] = [frames]
                        else:
                            b.append(frames)
                else:
                    self._flush(batches)
                    self._route(ranks, frames, done)
            elif kind == "del":
                # sent after the batch: a deleted Ref cannot be named by a later command
                deletes.append(item[1])
            elif kind == "call":
                self._flush(batches)
                fn, fut = item[1], item[2]
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
            else:
                try:
                    self.on_item(item)
                except Exception:
                    logger.exception("mesh %r: IO thread error on %s", self.name, kind)
        if deletes and self.identities:
            frames = self.encode_deletes(deletes)
            if frames is not None:
                for r in self.identities:
                    batches.setdefault(r, []).append(frames)
        self._flush(batches)

    def _flush(self, batches: dict) -> None:
        router = self._router
        for r, msgs in batches.items():
            ident = self.identities.get(r)
            if ident is None:
                continue
            if len(msgs) == 1:
                router.send_multipart([ident, *msgs[0]])
            else:
                router.send_multipart([ident, BATCH, *(f for frames in msgs for f in frames)])
        batches.clear()

    def _route(self, ranks, frames, done: Future | None) -> None:
        router = self._router
        tracker = None
        try:
            for r in ranks:
                ident = self.identities.get(r)
                if ident is None:
                    continue
                if done is None:
                    router.send_multipart([ident, *frames])
                else:
                    tracker = router.send_multipart([ident, *frames], copy=False, track=True)
        finally:
            if done is not None:
                done.set_result(tracker)

    def _receive(self) -> None:
        router = self._router
        for _ in range(1000):
            frames = recv_ready(router)
            if frames is None:
                return
            self.on_frames(frames)
