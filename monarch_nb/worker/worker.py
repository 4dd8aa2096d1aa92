"""The worker: a receiver thread (``connection.py``) that dispatches each message
to the handler of the same name (here and in ``comm_handlers.py``), and stream
threads that execute commands in order.

The default stream runs on the process's main thread (so SIGINT interrupts a
blocking call in it); the receiver runs on a thread of its own and never runs
user code, so the worker keeps answering whatever its streams do.
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
import threading
import time
from types import CoroutineType

import zmq

from ..protocol import Signer, encode
from ..protocol import messages as m
from ..protocol.constants import DEFAULT_STREAM
from ..protocol.pickling import resolve_function, unpack_args
from ..protocol.receivers import WORKER, handler_table
from . import breakpoints, capture, cell_runner, current, remote_pdb, widget_comm
from .code import run_source
from .comm_handlers import CommHandlers
from .connection import Connection
from .failure import describe, format_user_stack
from .forked import ChildOutputReader
from .insight_handlers import InsightHandlers
from .op_handlers import OpHandlers
from .ref_cell import AUTOGRAD, Cell, DependentOnError, MissingRef, get_value, without_graph
from .shell_handlers import ShellHandlers
from .stream import Stream, interruptible_sleep


def _awaited(coroutine):
    """An ``async def`` remote function's result: run to its end here, on a loop of its
    own (the stream's thread runs none), as Dask runs a coroutine function."""
    import asyncio

    return asyncio.run(coroutine)

class Worker(Connection, CommHandlers, OpHandlers, InsightHandlers, ShellHandlers):
    """One rank: its values (``env``), streams, namespace, and a handler per message."""

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
        self._init_connection()
        self.ctx = zmq.Context()
        self.env: dict[int, Cell] = {}
        self.streams: dict[int, Stream] = {}
        self.meshes: dict[int, tuple] = {}  # id -> (names, NDSlice, coords or None)
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        if "torch" in sys.modules:  # already imported by every worker: save users a line
            self.namespace["torch"] = sys.modules["torch"]
        self.cuda = _cuda_available()
        self._exiting = False
        self._handlers = handler_table(self, WORKER)  # fails here if one is missing
        widget_comm.attach(self)
        self.borrows: dict[int, tuple] = {}  # borrow id -> (Borrow, result cell)
        self.recordings: dict[int, object] = {}
        self.ops: dict[int, object] = {}  # DefineOp's templates
        self.pipes: dict[int, object] = {}
        self._comms = None

    # ------------------------------------------------------------ life cycle

    def serve(self) -> None:
        """Run until Exit: the receiver on a thread, the default stream here."""
        current.namespace, current.worker = self.namespace, self
        sys.stdout = capture.RoutedWriter("stdout", sys.__stdout__)
        sys.stderr = capture.RoutedWriter("stderr", sys.__stderr__)
        sys.stdin = capture.NoInput()
        default = Stream(self, DEFAULT_STREAM, "default", main_thread=True)
        self.streams[DEFAULT_STREAM] = default
        child_r, child_w = os.pipe()
        self._children = ChildOutputReader(child_r, self._child_output)
        capture.install(child_w)
        signal.signal(signal.SIGINT, self._on_sigint)
        remote_pdb.install()
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
            from ..protocol.pickling import GROUP_RESOLVER
            from .collectives import Comms

            self._comms = Comms(self.rank, self.world)
            GROUP_RESOLVER.install(lambda key: self._comms.group(key)[0])
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
            current._set(self.rank, len(msg.ranks), named)
            self.namespace.update(rank=self.rank, size=len(msg.ranks), **named)

    def CallFunction(self, msg: m.CallFunction) -> None:
        resolve = self._resolver(msg.args)
        result = self.env[msg.result] = Cell()
        function, args = msg.function, msg.args

        def work():
            fn = resolve_function(function)
            # a user's function sees shards without this rank's graph; ours build it
            raw = resolve is _no_refs or getattr(fn, "__module__", None) == AUTOGRAD
            a, kw = unpack_args(args, resolve if raw else without_graph(resolve))
            out = breakpoints.call(fn, a, kw)
            return _awaited(out) if type(out) is CoroutineType else out

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
            _, kw = unpack_args(msg.args, without_graph(resolve))
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
            cell_runner.run_cell(msg.source, msg.filename, key, kw.get("names"), kw.get("auto"))

        stream.schedule(msg.ident, msg.what, work)
        # bookkeeping after the cell (and its failure report): the reply always goes
        stream.call_soon(self._reply_work(key, stream, lambda: cell_runner.take_result(key)))

    def _reply_value(self, ident: int, stream_id: int, compute, what: str) -> None:
        """On the stream: send ``compute()`` (or why it failed) as a FetchResult."""
        stream = self._stream(stream_id)
        work = self._reply_work(ident, stream, compute)
        stream.schedule(ident, what, work, report=False, replies=True)

    def _reply_work(self, ident: int, stream, compute):
        rank, signer = self.rank, self.signer

        def work():
            # user code: computing the value and pickling it (its __reduce__ runs); an
            # interrupt landing before the stream left it is the reply's failure or retried
            outcome = late = None  # the reply, or the failure that stands for it
            while True:
                try:
                    if outcome is None and late is None:
                        pickling = False
                        try:
                            stream.enter_user_code()
                            reply = m.FetchResult(ident, rank, compute(), None)
                            pickling = True
                            outcome = (reply, encode(reply, signer))
                        except BaseException as e:  # noqa: B036 - reported to the fetcher
                            late = (e, pickling)
                    stream.leave_user_code()
                    break
                except KeyboardInterrupt as e:
                    if outcome is None and late is None:
                        late = (e, False)
            if outcome is None:  # out of user code: described without being interrupted
                outcome = (m.FetchResult(ident, rank, None, _fetch_failure(*late)), None)
            stream.outbox.send(*outcome)  # the worker's own part: no interrupt lands here

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
                s.interrupt(msg.upto)

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
            s.stop_now()

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
        breakpoints.deliver(self._stream(msg.stream), msg.action)

    def PostMortem(self, msg: m.PostMortem) -> None:
        stream = self._stream(msg.stream)
        rank = self.rank

        def compute():
            failure = stream.last_failure
            if failure is None:
                raise RuntimeError(f"no failure to debug on stream {stream.name!r} of rank {rank}")
            remote_pdb.post_mortem(stream, failure.__traceback__)

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


def _no_refs(rid):
    raise KeyError(rid)


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False
