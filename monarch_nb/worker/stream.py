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

from ..protocol.messages import RemoteFunctionFailed
from . import autoreload, capture, remote_pdb
from .failure import describe
from .outbox import Outbox
from .ref_cell import DependentOnError
from .timings import FinishedCommands

TIMES_KEPT = 20_000  # finished commands kept until reported (more: the newest are not kept)

_STOP = object()
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


class CommandCancelled(Exception):
    """The controller cancelled this command (its caller gave up on it)."""


def _dropped(ident: int):
    def work():
        raise CommandCancelled(f"command {ident} was cancelled before it started")

    return work


def _fail(results, ident: int) -> None:
    """A command that did not finish: its results hold the failure dependents see."""
    failed = DependentOnError(ident)
    for c in results:
        c.set(failed)


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
        self.queued = 0  # last ident queued (a controller that attaches counts on from there)
        self.running: tuple | None = None  # (ident, what, since)
        self.times = FinishedCommands(TIMES_KEPT)  # until the receiver reports them
        self.record = self.times.record
        self.in_user_code = False
        self.stall_logged: tuple | None = None  # (ident, stack, time) last looked at
        self.debugger_queue: queue.SimpleQueue = queue.SimpleQueue()  # lines for a paused pdb
        self.paused: dict | None = None  # where pdb waits, while it does
        self.debug_session = None  # the RemotePdb tracing the running command, if any
        self.interrupted_in_debugger = False
        self.cancelled: set[int] = set()  # idents to drop before they start (Cancel)
        self._cancelled_running: int | None = None
        self.exiting = False  # the worker exits: nothing queued starts (stop_now)
        self.last_failure: BaseException | None = None  # kept for post-mortem
        self._lock = threading.Lock()
        self._interrupt_sent = False
        # an interrupt that found no user code running: the first command older than
        # this ident to enter user code gets it (Interrupt.upto; 0: none)
        self._interrupt_upto = 0
        self.main_thread = main_thread
        self.receiving = False  # its (main) thread, idle, receives for the worker now
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
        self.queued = ident
        self._put((ident, what, work, results, report, replies))

    def schedule_many(self, commands: list) -> None:
        """Queue commands given as ``schedule``'s arguments, in order, as one item: a
        RunOps of hundreds of tensor ops wakes the stream once, not once per op. Each
        still runs as a command of its own (ident, progress, failure, cancel)."""
        if commands:
            self.queued = commands[-1][0]
            self._put(commands)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Queue bookkeeping that runs in order with commands (markers, borrows)."""
        self._put((None, "", fn, (), False))

    def _put(self, item) -> None:
        """Queue ``item``; put from another thread while this one receives for the
        worker (``Connection.receive_while_idle``), end its poll so that it runs now."""
        self.q.put(item)
        if self.receiving and threading.get_ident() != self.thread_id:
            self.worker.wake_holder()

    def stop(self) -> None:
        self._put(_STOP)
        if self.paused is not None:
            self.debugger_queue.put(remote_pdb.INTERRUPT)

    def stop_now(self) -> None:
        """The worker exits: interrupt the running command; queued ones do not start
        and, like it, report nothing (the controller fails its calls itself)."""
        self.exiting = True
        self.stop()
        self.interrupt()

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
        receive = self.worker.receive_while_idle if self.main_thread else None
        q = self.q
        while True:
            try:
                if receive is not None and q.empty():
                    receive(self)
                item = q.get()
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
        if self.exiting:
            _fail(results, ident)
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
                if self._interrupt_upto and not replies:
                    self._take_interrupt(ident)
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
            _fail(results, ident)
            if report and not self.exiting:
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
            ti, tw, ts, te = self.record  # the timeline's: four appends, no allocation
            ti(ident)
            tw(what)
            ts(start)
            te(time.time())
            self.finished = ident
            self.done += 1
            if not self.done & 255:
                self.record = self.times.check()

    # ------------------------------------------------------------ interrupt

    def interrupt(self, upto: int = 0) -> bool:
        """Raise KeyboardInterrupt in the running command, if any; True if one runs.
        Else, with ``upto``, the first command older than that ident (sent before the
        interrupt) to enter user code gets it there."""
        with self._lock:
            # set first, then look: a command entering user code meanwhile either sees
            # it (_take_interrupt) or is seen to run
            if upto > self._interrupt_upto:
                self._interrupt_upto = upto
            if not self.in_user_code or self.thread_id is None:
                return False
            self._interrupt_upto = 0  # it lands in the running command
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

    def _take_interrupt(self, ident: int) -> None:
        """Raise the interrupt waiting for a command older than it (``ident``'s, now in
        user code); a newer command clears one no command took."""
        with self._lock:
            upto, self._interrupt_upto = self._interrupt_upto, 0
        if ident < upto:
            raise KeyboardInterrupt

    def enter_user_code(self) -> None:
        """A reply's user part begins: interrupts land in it from now on."""
        with self._lock:
            self.in_user_code = True
        running = self.running
        if self._interrupt_upto and running is not None:
            self._take_interrupt(running[0])

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
