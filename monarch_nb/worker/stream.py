"""Streams: one queue and one thread each, executing commands in order."""

from __future__ import annotations

import bdb
import ctypes
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable

import zmq

from ..protocol import encode
from ..protocol.constants import BIG_SEND, PROGRESS_BYTES
from ..protocol.envelope import Sealer
from ..protocol.messages import FetchResult, Output, RemoteFunctionFailed, TransferBegin
from ..protocol.wire import send_frames
from . import autoreload, capture, remote_pdb
from .failure import describe
from .ref_cell import DependentOnError
from .timings import FinishedCommands

OUTPUT_CHUNK = 64 << 10  # flush buffered output at this size
# messages a stream may have on their way before its sends block: with the
# controller's receive limit, a flood of output (a 1 GB print) waits for the
# controller instead of piling up in either process's memory
SEND_HWM = 256
TIMES_KEPT = 20_000  # finished commands kept until reported (more: the newest are not kept)

_STOP = object()
_RUNNING = object()  # Outbox.write's default ident: the running command's
_real_sleep = time.sleep


def interruptible_sleep(seconds: float) -> None:
    """time.sleep for stream threads: sleeps in short slices so that an
    asynchronous KeyboardInterrupt (only delivered between bytecodes) lands."""
    if threading.current_thread() is threading.main_thread() or seconds <= 0.05:
        return _real_sleep(seconds)
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        _real_sleep(min(left, 0.05))


class Outbox:
    """A stream's own socket to the controller and its buffered output.

    Everything a stream sends (output, results, failures) leaves through this one
    socket, sealed with the socket's own sequence numbers, so the controller
    sees it in order (and would notice a gap). The receiver thread may flush
    stale output while a long command runs: the lock serialises use of the
    socket (ZeroMQ sockets may move between threads across a memory barrier).
    """

    def __init__(self, worker, stream_id: int):
        self._worker = worker
        self.stream_id = stream_id
        self.lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._sealer: Sealer | None = None
        self._pending: list = []  # [name, ident, text]
        self._pending_bytes = 0
        self._pending_since = 0.0
        self.ident: int | None = None  # command whose output is being written

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._worker.connect_socket(SEND_HWM)
            self._sealer = Sealer(self._worker.signer, self._worker.rank)
        return self._sock

    def write(self, name: str, text: str, ident=_RUNNING) -> None:
        """Buffer ``text`` as output of command ``ident`` (default: the one running)."""
        with self.lock:
            if ident is _RUNNING:
                ident = self.ident
            p = self._pending
            if p and p[-1][0] == name and p[-1][1] == ident and len(text) < OUTPUT_CHUNK:
                p[-1][2] += text  # coalesce small writes (a large text is not copied)
            else:
                if not p:
                    self._pending_since = time.monotonic()
                p.append([name, ident, text])
            self._pending_bytes += len(text)
            if self._pending_bytes >= OUTPUT_CHUNK:
                self._flush_locked()

    def _flush_locked(self, block: bool = True) -> None:
        """Send the buffered output. Not blocking (the receiver thread, which must
        keep answering): stop where the socket is full and keep the rest."""
        rank = self._worker.rank
        pending = self._pending
        while pending:
            entry = pending[0]
            name, ident, text = entry
            for i in range(0, len(text), OUTPUT_CHUNK):
                msg = Output(rank, self.stream_id, ident, name, text[i : i + OUTPUT_CHUNK])
                if not self._send_locked(msg, block):
                    entry[2] = text[i:]
                    self._pending_bytes = sum(len(e[2]) for e in pending)
                    return
            pending.pop(0)
        self._pending_bytes = 0

    def _send_locked(self, msg, block: bool = True, frames=None) -> bool:
        if frames is None:
            frames = encode(msg, self._worker.signer)
        sock = self._socket()
        sealer = self._sealer
        nbytes = sum(memoryview(f).nbytes for f in frames[2:]) if len(frames) > 2 else 0
        if nbytes > PROGRESS_BYTES and type(msg) is FetchResult:
            # the controller shows a progress bar for this transfer
            begin = TransferBegin(self._worker.rank, msg.ident, nbytes)
            sock.send_multipart(sealer.seal(encode(begin, self._worker.signer)))
        sealed = sealer.seal(frames)
        if nbytes > BIG_SEND:
            # zero-copy: wait until ZeroMQ no longer reads the value's memory
            tracker = sock.send_multipart(sealed, copy=False, track=True)
            tracker.wait()
        elif block:
            send_frames(sock, sealed)
        else:
            try:
                send_frames(sock, sealed, nowait=True)
            except zmq.Again:
                sealer.retract()  # not sent: the next message takes its number
                return False
        return True

    def send(self, msg, frames=None) -> None:
        """Send ``msg`` (``frames``: as ``encode`` made it already) after any output
        written before it."""
        with self.lock:
            if self._pending:
                self._flush_locked()
            self._send_locked(msg, frames=frames)

    def flush(self) -> None:
        if self._pending:
            with self.lock:
                if self._pending:
                    self._flush_locked()

    def flush_if_stale(self, now: float, age: float) -> None:
        """Called by the receiver thread: never waits for the stream (which may be
        sending) nor for a full socket."""
        if self._pending and now - self._pending_since >= age and self.lock.acquire(False):
            try:
                if self._pending:
                    self._flush_locked(block=False)
            finally:
                self.lock.release()

    def close(self) -> None:
        with self.lock:
            if self._sock is not None:
                self._sock.close(linger=2000)
                self._sock = None
                self._sealer = None


class CommandCancelled(Exception):
    """The controller cancelled this command (its caller gave up on it)."""


def _dropped(ident: int):
    def work():
        raise CommandCancelled(f"command {ident} was cancelled before it started")

    return work


class Stream:
    """A named queue of commands executed in order by one thread.

    The default stream runs on the worker process's main thread, so that
    SIGINT interrupts blocking calls (``time.sleep``) in it; other streams run
    on threads of their own and are interrupted with an asynchronous exception.
    """

    def __init__(self, worker, stream_id: int, name: str, main_thread: bool = False):
        self.worker = worker
        self.id = stream_id
        self.name = name
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox = Outbox(worker, stream_id)
        self.started = 0  # last ident started
        self.finished = 0  # last ident finished
        self.done = 0  # commands finished
        self.running: tuple | None = None  # (ident, what, since)
        self.times = FinishedCommands(TIMES_KEPT)  # until the receiver reports them
        self.in_user_code = False
        self.stall_logged: int | None = None  # ident whose stall was logged
        self.debugger_queue: queue.SimpleQueue = queue.SimpleQueue()  # lines for a paused pdb
        self.paused: dict | None = None  # where pdb waits, while it does
        self.debug_session = None  # the RemotePdb tracing the running command, if any
        self.interrupted_in_debugger = False
        self.cancelled: set[int] = set()  # idents to drop before they start (Cancel)
        self._cancelled_running: int | None = None
        self.last_failure: BaseException | None = None  # kept for post-mortem
        self._lock = threading.Lock()
        self._interrupt_sent = False
        self.main_thread = main_thread
        self.cuda_stream = None
        if worker.cuda and not main_thread:
            import torch

            self.cuda_stream = torch.cuda.Stream()
        self.thread_id: int | None = threading.main_thread().ident if main_thread else None
        self.thread: threading.Thread | None = None
        if not main_thread:
            self.thread = threading.Thread(
                target=self.run_forever, name=f"monarch-stream-{name}", daemon=True
            )
            self.thread.start()

    def schedule(
        self,
        ident: int,
        what: str,
        work: Callable[[], object],
        results: tuple = (),
        report: bool = True,
        replies: bool = False,
    ) -> None:
        """Queue ``work``; its value goes into ``results`` (cells), its failure into
        the same cells and (when ``report``) one RemoteFunctionFailed. A work that
        ``replies`` marks its own user part (``enter_user_code`` ... ``leave_user_code``),
        so that no interrupt can land before it starts and lose its reply."""
        self.q.put((ident, what, work, results, report, replies))

    def schedule_many(self, commands: list) -> None:
        """Queue commands given as ``schedule``'s arguments, in order, as one item: a
        RunOps of hundreds of tensor ops wakes the stream once, not once per op. Each
        still runs as a command of its own (ident, progress, failure, cancel)."""
        self.q.put(commands)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Queue bookkeeping that runs in order with commands (markers, borrows)."""
        self.q.put((None, "", fn, (), False))

    def stop(self) -> None:
        self.q.put(_STOP)
        if self.paused is not None:
            self.debugger_queue.put(remote_pdb.INTERRUPT)

    def run_forever(self) -> None:
        if not self.main_thread:
            self.thread_id = threading.get_ident()
        capture.set_outbox(self.outbox)
        remote_pdb.set_current_stream(self)
        if self.cuda_stream is not None:
            import torch

            with torch.cuda.stream(self.cuda_stream):
                self._loop()
        else:
            self._loop()
        self.outbox.flush()
        self.outbox.close()

    def _loop(self) -> None:
        while True:
            try:
                item = self.q.get()
                if item is _STOP:
                    break
                if type(item) is list:
                    self._execute_many(item)
                else:
                    self._execute(*item)
            except KeyboardInterrupt:
                continue  # an interrupt that arrived just after its command ended

    def _execute_many(self, commands: list) -> None:
        for i, command in enumerate(commands):
            try:
                self._execute(*command)
            except KeyboardInterrupt:  # after its command ended: the next ones still run
                self._execute_many(commands[i + 1 :])
                return

    def cancel(self, idents) -> None:
        """Receiver thread: drop these commands before they start; interrupt the
        running one if it is among them."""
        for i in idents:
            if i > self.finished:
                self.cancelled.add(i)
        running = self.running
        if running is not None and running[0] in idents:
            self._cancelled_running = running[0]
            self.interrupt()

    def _execute(self, ident, what, work, results, report, replies=False) -> None:
        if ident is None:
            work()
            return
        if self.cancelled:
            if ident in self.cancelled:
                work = _dropped(ident)
            for i in list(self.cancelled):  # a C-level copy: the receiver may add meanwhile
                if i <= ident:
                    self.cancelled.discard(i)
        outbox = self.outbox
        self.started = ident
        outbox.ident = ident
        start = time.time()
        self.running = (ident, what, start)
        try:
            try:
                self.in_user_code = not replies
                if autoreload.ACTIVE and not replies:
                    autoreload.before_command()  # the user's changed modules, reloaded
                value = work()
                if autoreload.ACTIVE:
                    autoreload.after_command()  # what it imported: the baseline of edits
            finally:
                self.in_user_code = False
                self._settle_interrupt()
            for c in results:
                c.set(value)
        except DependentOnError as e:
            for c in results:
                c.set(e)
        except BaseException as e:  # noqa: B036 - SystemExit, KeyboardInterrupt: user code failed
            if isinstance(e, KeyboardInterrupt) and self._cancelled_running == ident:
                e = CommandCancelled(f"command {ident} was cancelled while it ran")
            elif isinstance(e, bdb.BdbQuit) and self.interrupted_in_debugger:
                e = KeyboardInterrupt("interrupted while paused in the debugger")
            elif not isinstance(e, bdb.BdbQuit):
                self.last_failure = e
            self.interrupted_in_debugger = False
            failed = DependentOnError(ident)
            for c in results:
                c.set(failed)
            if report:
                outbox.send(RemoteFunctionFailed(ident, self.worker.rank, self.id, describe(e)))
            del e
        finally:
            if self.debug_session is not None:
                sys.settrace(None)  # a session tracing this command ends with it
                self.debug_session.end()
            outbox.flush()
            outbox.ident = None
            self._cancelled_running = None
            self.running = None
            t = self.times
            if t.room:  # the timeline's record: four appends, no allocation (timings.py)
                t.ident(ident)
                t.what(what)
                t.start(start)
                t.end(time.time())
            self.finished = ident
            self.done += 1
            if not self.done & 255:
                t.check(TIMES_KEPT)

    # ------------------------------------------------------------ interrupt

    def interrupt(self) -> bool:
        """Raise KeyboardInterrupt in the running command, if any; True if one runs."""
        with self._lock:
            if not self.in_user_code or self.thread_id is None:
                return False
            if self.paused is not None:  # pdb waits for a line: end the session instead
                self.debugger_queue.put(remote_pdb.INTERRUPT)
                return True
            self._interrupt_sent = True
            if self.main_thread:
                signal.pthread_kill(self.thread_id, signal.SIGINT)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread_id), ctypes.py_object(KeyboardInterrupt)
                )
            return True

    def enter_user_code(self) -> None:
        """A reply's user part begins: interrupts land in it from now on."""
        with self._lock:
            self.in_user_code = True

    def leave_user_code(self) -> None:
        """The running command's user part is over (what is left is the worker's own:
        sending its reply): an interrupt no longer lands in it."""
        with self._lock:
            self.in_user_code = False
        self._settle_interrupt()

    def _settle_interrupt(self) -> None:
        with self._lock:
            if self._interrupt_sent and not self.main_thread and self.thread_id is not None:
                # clear an asynchronous exception not yet delivered
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
            self._interrupt_sent = False
