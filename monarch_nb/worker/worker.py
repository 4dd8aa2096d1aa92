"""The worker: a receiver thread that dispatches each message to the handler of
the same name, and stream threads that execute commands in order.

The default stream runs on the process's main thread (so SIGINT interrupts a
blocking call in it); the receiver runs on a thread of its own and never runs
user code, so the worker keeps answering whatever its streams do.
"""

from __future__ import annotations

import builtins
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

import zmq

from ..protocol import BadMessage, Signer, decode, encode
from ..protocol import messages as m
from ..protocol.wire import recv_ready, resolve_function, split_batch, unpack_args
from . import capture, context, debugger, display
from .cell import Cell, DependentOnError, MissingRef, get_value
from .code import run_source
from .comm_handlers import CommHandlers
from .failure import describe, format_user_stack
from .forked import ChildOutputReader
from .health import HealthSampler
from .stream import Stream, interruptible_sleep

logger = logging.getLogger("monarch_nb.worker")

OUTPUT_AGE = 0.05  # flush output buffered longer than this
PROGRESS_PERIOD = 0.1
HEALTH_PERIOD = 1.0
LOST_CONNECTION_GRACE = 3.0  # a dropped connection not back within this ends a joined worker
STALL_AFTER = float(os.environ.get("MONARCH_NB_STALL_SECONDS", "30"))
DEFAULT_STREAM = 0


class Worker(CommHandlers):
    def __init__(
        self,
        address: str,
        key: bytes,
        rank: int,
        world: int,
        local_rank: int = 0,
        parent_pid: int | None = None,
        heartbeat_timeout: float | None = None,
    ):
        self.address = address
        self.signer = Signer(key)
        self.rank = rank
        self.world = world
        self.local_rank = local_rank
        self.parent_pid = parent_pid
        # a worker that is not the controller's child exits when the controller goes quiet
        self.heartbeat_timeout = heartbeat_timeout
        self._last_heard = time.monotonic()
        self._lost_at: float | None = None
        self.ctx = zmq.Context()
        self.env: dict[int, Cell] = {}
        self.streams: dict[int, Stream] = {}
        self.meshes: dict[int, tuple] = {}  # id -> (names, NDSlice, coords or None)
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        if "torch" in sys.modules:  # already imported by every worker: save users a line
            self.namespace["torch"] = sys.modules["torch"]
        self.bad_messages = 0
        self.cuda = _cuda_available()
        self._exiting = False
        self._sock: zmq.Socket | None = None
        self._handlers = {
            cls: getattr(self, cls.__name__)
            for cls in vars(m).values()
            if isinstance(cls, type)
            and hasattr(self, cls.__name__)
            and cls.__module__ == m.__name__
        }
        self._sent_progress: dict = {}
        self.borrows: dict[int, tuple] = {}  # borrow id -> (Borrow, result cell)
        self.recordings: dict[int, object] = {}
        self.pipes: dict[int, object] = {}
        self._comms = None

    # ------------------------------------------------------------ sockets

    def connect_socket(self, sndhwm: int = 0) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.SNDHWM, sndhwm)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(self.address)
        return s

    def _send(self, msg) -> None:
        """Send on the receiver's own socket (receiver thread only)."""
        assert self._sock is not None
        self._sock.send_multipart(encode(msg, self.signer))

    # ------------------------------------------------------------ life cycle

    def serve(self) -> None:
        """Run until Exit: the receiver on a thread, the default stream here."""
        context.namespace = self.namespace
        sys.stdout = capture.RoutedWriter("stdout", sys.__stdout__)
        sys.stderr = capture.RoutedWriter("stderr", sys.__stderr__)
        sys.stdin = capture.NoInput()
        default = Stream(self, DEFAULT_STREAM, "default", main_thread=True)
        self.streams[DEFAULT_STREAM] = default
        child_r, child_w = os.pipe()
        self._children = ChildOutputReader(child_r, self._child_output)
        capture.install(child_w)
        signal.signal(signal.SIGINT, self._on_sigint)
        debugger.install()
        time.sleep = interruptible_sleep
        receiver = threading.Thread(target=self._receive_loop, name="monarch-receiver", daemon=True)
        receiver.start()
        default.run_forever()
        for s in list(self.streams.values()):
            if s.thread is not None:
                s.thread.join(timeout=5)
        receiver.join(timeout=5)
        self.ctx.destroy(linger=1000)

    def _child_output(self, stream_id: int, ident: int | None, name: str, text: str) -> None:
        stream = self.streams.get(stream_id) or self.streams[DEFAULT_STREAM]
        stream.outbox.write(name, text, ident)

    def _on_sigint(self, signum, frame):
        if self.streams[DEFAULT_STREAM].in_user_code:
            raise KeyboardInterrupt

    def _receive_loop(self) -> None:
        try:
            self._sock = sock = self.connect_socket()
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
            monitor = None
            if self.heartbeat_timeout is not None:
                monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            while not self._exiting:
                if monitor is not None:
                    self._watch_connection(monitor)
                if sock.poll(20):
                    self._last_heard = time.monotonic()
                    for _ in range(256):
                        frames = recv_ready(sock)
                        if frames is None:
                            break
                        self._dispatch(frames)
                        del frames  # a pushed tensor must not outlive its command here
                        if self._exiting:
                            break
                self._tick()
            self._tick(final=True)
        except Exception as e:
            logger.exception("receiver thread failed")
            try:
                self._send(m.InternalException(self.rank, _internal(e, "receiver thread")))
            except Exception:
                pass
            os._exit(3)
        finally:
            if self._sock is not None:
                self._sock.close(linger=2000)

    def _dispatch(self, frames) -> None:
        try:
            parts = split_batch(frames) if len(frames[0]) == 1 else (frames,)
        except BadMessage as e:
            parts = ()
            self._drop(e)
        for p in parts:
            try:
                msg = decode(p, self.signer)
            except BadMessage as e:
                self._drop(e)
                continue
            self._handle(msg)

    def _drop(self, why) -> None:
        self.bad_messages += 1
        logger.warning("dropped a message (%s); %d dropped so far", why, self.bad_messages)

    def _handle(self, msg) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.bad_messages += 1
            logger.warning("dropped a message of unknown type %s", type(msg).__name__)
            return
        try:
            handler(msg)
        except Exception as e:
            logger.exception("handler %s failed", type(msg).__name__)
            self._send(
                m.InternalException(self.rank, _internal(e, f"{type(msg).__name__} handler"))
            )

    def _tick(self, final: bool = False) -> None:
        now = time.monotonic()
        for s in list(self.streams.values()):
            s.outbox.flush_if_stale(now, OUTPUT_AGE)
        if now >= self._next_progress or final:
            self._next_progress = now + PROGRESS_PERIOD
            progress = {s.id: (s.started, s.finished, s.done) for s in list(self.streams.values())}
            if progress != self._sent_progress:
                self._sent_progress = progress
                self._send(m.Progress(self.rank, progress))
        if now >= self._next_health:
            self._next_health = now + HEALTH_PERIOD
            rss, cpu, gpu = self._health.sample()
            self._send(
                m.Health(self.rank, os.getpid(), rss, cpu, gpu, self.bad_messages, len(self.env))
            )
            self._check_stalls()
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
            elif event == zmq.EVENT_CONNECTED:
                self._lost_at = None

    def _check_stalls(self) -> None:
        """Once a command runs longer than STALL_AFTER: log where its stream is and
        tell the controller (the dashboard shows it)."""
        now = time.time()
        for s in list(self.streams.values()):
            running = s.running
            if running is None or now - running[2] < STALL_AFTER or s.stall_logged == running[0]:
                continue
            s.stall_logged = running[0]
            frame = sys._current_frames().get(s.thread_id or -1)
            where = format_user_stack(frame) or "(in the worker's own code)"
            logger.warning(
                "possible stall: stream %r has run command %d (%s) for %.0f s; it is at:\n%s",
                s.name,
                running[0],
                running[1],
                now - running[2],
                where,
            )
            self._send(m.Stalled(self.rank, s.id, running[0], running[1], now - running[2], where))

    # ------------------------------------------------------------ helpers

    def _resolver(self, args: m.Args | None):
        """A function mapping the ref ids of ``args`` to their values at run time.

        Cells are looked up now (in message order); values are read when the
        command runs on its stream."""
        if args is None or not args.refs:
            return _no_refs
        cells = {}
        for rid in args.refs:
            c = self.env.get(rid)
            if c is None:
                c = Cell(MissingRef(rid))
            cells[rid] = c
        return lambda rid: get_value(cells[rid])

    @property
    def comms(self):
        if self._comms is None:
            from ..protocol.wire import set_group_resolver
            from .collectives import Comms

            self._comms = Comms(self.rank, self.world)
            set_group_resolver(lambda key: self._comms.group(key)[0])
        return self._comms

    def _cell(self, ref_id: int | None) -> Cell | None:
        if ref_id is None:
            return None
        c = self.env.get(ref_id)
        return c if c is not None else Cell(MissingRef(ref_id))

    def _stream(self, stream_id: int) -> Stream:
        s = self.streams.get(stream_id)
        if s is None:
            raise KeyError(f"stream {stream_id} does not exist on rank {self.rank}")
        return s

    # ------------------------------------------------------------ handlers

    def CreateStream(self, msg: m.CreateStream) -> None:
        if msg.result not in self.streams:
            self.streams[msg.result] = Stream(self, msg.result, msg.name)

    def CreateDeviceMesh(self, msg: m.CreateDeviceMesh) -> None:
        coords = msg.ranks.coordinates(self.rank)
        named = dict(zip(msg.names, coords)) if coords is not None else None
        self.meshes[msg.result] = (msg.names, msg.ranks, named)
        if msg.result == 0 and named is not None:
            context._set(self.rank, len(msg.ranks), named)
            self.namespace.update(rank=self.rank, size=len(msg.ranks), **named)

    def CallFunction(self, msg: m.CallFunction) -> None:
        resolve = self._resolver(msg.args)
        result = self.env[msg.result] = Cell()
        function, args = msg.function, msg.args

        def work():
            fn = resolve_function(function)
            a, kw = unpack_args(args, resolve)
            return fn(*a, **kw)

        self._stream(msg.stream).schedule(msg.ident, msg.what, work, (result,))

    def RunCode(self, msg: m.RunCode) -> None:
        result = self.env[msg.result] = Cell()
        ns = self.namespace
        self._stream(msg.stream).schedule(
            msg.ident, msg.what, lambda: run_source(msg.source, msg.filename, ns), (result,)
        )

    def SetNames(self, msg: m.SetNames) -> None:
        resolve = self._resolver(msg.args)
        ns = self.namespace

        def work():
            _, kw = unpack_args(msg.args, resolve)
            ns.update(kw)

        self._stream(msg.stream).schedule(msg.ident, "push", work)

    def SendValue(self, msg: m.SendValue) -> None:
        resolve = self._resolver(msg.args)

        def compute():
            a, kw = unpack_args(msg.args, resolve)
            return a[0] if msg.function is None else resolve_function(msg.function)(*a, **kw)

        self._reply_value(msg.ident, msg.stream, compute, "fetch")

    def Pull(self, msg: m.Pull) -> None:
        ns, name, rank = self.namespace, msg.name, self.rank

        def compute():
            if name not in ns:
                raise NameError(f"name {name!r} is not defined on rank {rank}")
            return ns[name]

        self._reply_value(msg.ident, msg.stream, compute, f"pull {name}")

    def RunCell(self, msg: m.RunCell) -> None:
        resolve = self._resolver(msg.args)
        stream = self._stream(msg.stream)
        key = msg.ident

        def work():
            _, kw = unpack_args(msg.args, resolve)
            display.run_cell(msg.source, msg.filename, key, kw.get("names"), kw.get("auto"))

        stream.schedule(msg.ident, msg.what, work)
        # bookkeeping after the cell (and its failure report): the reply always goes
        stream.call_soon(self._reply_work(key, stream, lambda: display.take_result(key)))

    def _reply_value(self, ident: int, stream_id: int, compute, what: str) -> None:
        """On the stream: send ``compute()`` (or why it failed) as a FetchResult."""
        stream = self._stream(stream_id)
        stream.schedule(ident, what, self._reply_work(ident, stream, compute), report=False)

    def _reply_work(self, ident: int, stream, compute):
        rank, signer = self.rank, self.signer

        def work():
            # user code: computing the value and pickling it (its __reduce__ runs)
            pickling = False
            try:
                reply = m.FetchResult(ident, rank, compute(), None)
                pickling = True
                frames = encode(reply, signer)
            except BaseException as e:  # noqa: B036 - reported to the fetcher
                stream.leave_user_code()  # a second interrupt must not lose the reply
                failure = _fetch_failure(e, pickling)
                reply, frames = m.FetchResult(ident, rank, None, failure), None
            # the worker's own part: an interrupt landing here would lose the reply
            stream.leave_user_code()
            stream.outbox.send(reply, frames)

        return work

    def RequestStatus(self, msg: m.RequestStatus) -> None:
        rank = self.rank
        for s in list(self.streams.values()):
            s.call_soon(
                lambda s=s: s.outbox.send(
                    m.Status(rank, s.id, msg.ident, (s.started, s.finished, s.done))
                )
            )

    def RequestStacks(self, msg: m.RequestStacks) -> None:
        frames = sys._current_frames()
        stacks = {
            s.name: {
                "running": None if s.running is None else s.running[1],
                "stack": format_user_stack(frames.get(s.thread_id or -1)),
            }
            for s in list(self.streams.values())
        }
        self._send(m.FetchResult(msg.ident, self.rank, stacks, None))

    def DeleteRefs(self, msg: m.DeleteRefs) -> None:
        env = self.env
        for rid in msg.refs:
            env.pop(rid, None)

    def CommandGroup(self, msg: m.CommandGroup) -> None:
        for c in msg.commands:
            self._handle(c)

    def Interrupt(self, msg: m.Interrupt) -> None:
        for s in list(self.streams.values()):
            if not msg.streams or s.id in msg.streams:
                s.interrupt()

    def Cancel(self, msg: m.Cancel) -> None:
        for s in list(self.streams.values()):
            s.cancel(msg.idents)

    def Ping(self, msg: m.Ping) -> None:
        pass  # hearing from the controller is the point

    def Refused(self, msg: m.Refused) -> None:
        print(
            f"[monarch worker {self.rank}] the controller refused this worker: {msg.reason}",
            file=sys.__stderr__,
            flush=True,
        )
        os._exit(2)

    def Exit(self, msg: m.Exit) -> None:
        self._exiting = True
        for pipe in self.pipes.values():
            pipe.close()
        self.pipes.clear()
        for s in list(self.streams.values()):
            s.stop()

    # ------------------------------------------------------------ recordings

    def DefineRecording(self, msg: m.DefineRecording) -> None:
        from .recording import Recording

        self.recordings[msg.recording] = Recording(msg)

    def CallRecording(self, msg: m.CallRecording) -> None:
        self.recordings[msg.recording].call(self, msg)

    # ------------------------------------------------------------ pipes

    def CreatePipe(self, msg: m.CreatePipe) -> None:
        from .pipe import WorkerPipe

        names, ranks, coords = self.meshes.get(0, ((), None, {}))
        sizes = dict(zip(names, ranks.sizes)) if ranks is not None else {}
        self.pipes[msg.pipe] = WorkerPipe(
            self.ctx, msg.function, msg.args, msg.max_messages, coords or {}, sizes
        )

    def PipeRecv(self, msg: m.PipeRecv) -> None:
        pipe = self.pipes.get(msg.pipe)
        result = self.env[msg.result] = Cell()

        def work():
            if pipe is None:
                raise RuntimeError(f"pipe {msg.pipe} is closed")
            return pipe.recv()

        self._stream(msg.stream).schedule(msg.ident, "pipe recv", work, (result,))

    def ClosePipe(self, msg: m.ClosePipe) -> None:
        pipe = self.pipes.pop(msg.pipe, None)
        if pipe is not None:
            pipe.close()

    # ------------------------------------------------------------ debugger

    def DebuggerMessage(self, msg: m.DebuggerMessage) -> None:
        self._stream(msg.stream).debugger_queue.put(msg.action)

    def PostMortem(self, msg: m.PostMortem) -> None:
        stream = self._stream(msg.stream)
        rank = self.rank

        def compute():
            failure = stream.last_failure
            if failure is None:
                raise RuntimeError(f"no failure to debug on stream {stream.name!r} of rank {rank}")
            debugger.post_mortem(stream, failure.__traceback__)

        self._reply_value(msg.ident, msg.stream, compute, "post-mortem")

    def ReleaseFailures(self, msg: m.ReleaseFailures) -> None:
        for s in list(self.streams.values()):
            if not msg.streams or s.id in msg.streams:
                s.last_failure = None



def _fetch_failure(e: BaseException, pickling: bool):
    """Why a fetched value does not come: it depends on a failure, computing it
    failed, or (``pickling``) it cannot be sent: unpicklable, too deep, a failing
    __reduce__ (an interrupt while pickling is an interrupt)."""
    if isinstance(e, DependentOnError):
        return m.DependentOn(e.ident)
    if pickling and isinstance(e, Exception):
        why = str(e) if isinstance(e, TypeError) else f"{type(e).__name__}: {e}"
        return m.RemoteFailure(type(e).__name__, f"cannot send the value back: {why}", "")
    return describe(e)


def _internal(e: BaseException, where: str) -> m.RemoteFailure:
    """A failure of the worker's own machinery: its frames are the point, keep them."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return m.RemoteFailure(type(e).__name__, f"in the worker's {where}: {e}", tb)


def _no_refs(rid):
    raise KeyError(rid)


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", None)
