"""The Controller: the parts that drive the workers of one mesh, composed.

- ``IOLoop`` (io_loop.py): the ROUTER socket, driven under a lease (the IO thread's, or a waiter's);
- ``RequestTable`` (requests.py): every reply a caller waits for, with its lifetime;
- ``WorkerSet`` (workers.py): who joined, their processes, behind a ``Launcher``;
- ``Replies`` (replies.py): the handlers of what workers send;
- ``Rendezvous``, ``Liveness``, ``FailureLog``, ``DebugSessions`` and ``MeshState``.

User threads pickle and sign, and hand frames over (``io_items``; tensor ops: their
fields); the lease holder registers and sends a request, which returns an ``AsyncResult``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

from .. import config
from ..protocol import Signer, encode, new_secret
from ..protocol import messages as m
from ..protocol.constants import BIG_SEND
from ..protocol.envelope import CONTROLLER, PeerTable, Sealer
from ..protocol.ndslice import NDSlice
from .async_result import AsyncResult
from .cancels import Cancels
from .debug_sessions import DebugSessions
from .errors import MeshClosedError, RemoteError, WorkerCrashed, broken_again
from .failures import FailureLog
from .interrupts import Interrupts
from .io_items import CancelRequest, Delete, IOCallbacks, Send, SendRequest
from .io_items import op as io_op
from .io_loop import IOLoop
from .liveness import Liveness
from .rejoin import Rejoin, let_go, rejoin_generation
from .rendezvous import Rendezvous, advertised_host
from .replies import Replies, print_output
from .requests import Request, RequestTable, check_timeout
from .startup import start_generation
from .state import MeshState
from .trace import recording_trace
from .transfers import Transfers, wait_sent
from .workers import WorkerSet

logger = logging.getLogger("monarch_nb.controller")


_live: weakref.WeakSet = weakref.WeakSet()
_keys = itertools.count(1)  # Controller.key: never reused in a process


@atexit.register
def _shutdown_all() -> None:
    for c in list(_live):
        with contextlib.suppress(Exception):
            if c.workers.launcher.keep_alive is None:  # a kept-alive mesh lives on
                c.shutdown(timeout=2.0)


class Controller:
    """Drives the workers of one mesh. Scripts, tests and the notebook use it the same way."""

    def __init__(
        self,
        name: str,
        dims: dict,
        backend: str,
        launcher,
        interface: str = "127.0.0.1",
        startup_timeout: float = 180.0,
        advertise: str | None = None,
        heartbeat_timeout: float | None = None,
        liveness_timeout: float | None = None,
        settings: dict | None = None,
        rejoin: Rejoin | None = None,
    ):
        """``launcher`` starts the workers (``launchers/``). ``settings``: ``config.snapshot()``'s
        (default: taken now, with ``heartbeat_timeout``), read once: the launcher and workers
        get them. ``rejoin``: take over the running workers of a kept-alive mesh instead."""
        self.name = name
        self.key = next(_keys)  # the mesh's identity (mesh.key)
        self.dims = dict(dims)
        self.world = math.prod(self.dims.values())
        self.settings = settings = settings or config.snapshot(heartbeat_timeout=heartbeat_timeout)
        self.state = MeshState(name, self.dims, backend, settings["timeline_size"])
        self.state.count_requests = lambda: len(self.table)
        self.liveness = Liveness(
            name, self.state, self.break_mesh, settings["heartbeat_timeout"], liveness_timeout
        )
        self._secret = rejoin.secret if rejoin is not None else new_secret()
        self.signer = Signer(self._secret, full=settings["sign_full"])
        # arrivals checked against the peers' sockets; the lease holder seals what leaves
        self.peers = PeerTable(self.state.rejections)
        self.sealer = Sealer(self.signer, CONTROLLER)
        launcher.configure(config.process_env(settings))
        self.workers = WorkerSet(name, self.world, launcher, self.state)
        self._startup_timeout = startup_timeout
        self._ids = itertools.count(1)  # ref, stream and mesh ids (0 is the root mesh)
        self._idents = itertools.count(1)  # command idents
        self._lifecycle, self._lifecycle_groups = threading.Lock(), threading.Lock()
        self._advertise = advertise or advertised_host(interface)
        self.rendezvous = Rendezvous(self._advertise, settings["rendezvous"])
        self.replies = Replies(self)
        self.cancels = Cancels(self)
        port = rejoin.port if rejoin is not None else 0
        callbacks, switch = self._io_callbacks(), settings["switch_interval"]
        self.io = IOLoop(name, interface, self.workers.identities, callbacks, port, switch)
        self.bind_address = f"tcp://{interface}:{self.io.port}"
        self.address = f"tcp://{self._advertise}:{self.io.port}"  # what workers connect to
        self.workers.launcher.attach(self.io)  # agents on other hosts reach this ROUTER
        self.on_output = print_output
        self.debugger = DebugSessions(self)
        self.interrupts = Interrupts(self)
        self.transfers = Transfers()
        self.before_command: Callable[[], None] | None = None  # a hook (api/code_sync.py)
        self._begin_generation()
        if rejoin is not None:  # (a failure lets go of the mesh, its workers untouched)
            return rejoin_generation(self, rejoin, self._startup_timeout)
        self.io.start()
        _live.add(self)
        try:
            start_generation(self, self._secret, self._startup_timeout)
        except BaseException:
            self.shutdown(timeout=1.0)
            raise

    # ------------------------------------------------------------ generations

    def _begin_generation(self) -> None:
        self.generation = getattr(self, "generation", -1) + 1
        self.state.generation = self.generation
        self.state.reset(range(self.world))
        self.workers.reset()
        self.failures = FailureLog(self.name)
        self.table = RequestTable(self.failures)
        self._broken: BaseException | None = None
        self._lost: set | None = set()  # ranks lost when broken (None: the whole mesh)
        self._closing = self._closed = False
        self.closed_why: str | None = None  # a mesh let go of (detach) says why
        self.streams: dict[str, int] = {"default": 0}
        self._groups: dict = {}  # (NDSlice, reduced dim indices, stream) -> process group key
        self.rendezvous.new_generation()
        self.peers.new_generation()

    def process_group(self, ranks: NDSlice, reduced: tuple, stream: int) -> int:
        """The process groups' key over ``reduced`` dims of ``ranks`` for ``stream``."""
        k = (ranks, tuple(sorted(reduced)), stream)
        with self._lifecycle_groups:
            key = self._groups.get(k)
            if key is None:
                self.check_usable()
                key = self.next_id()
                self.send(m.CreateProcessGroup(key, tuple(ranks.groups(k[1]))), None)
                self._groups[k] = key
            return key

    @property
    def root_slice(self) -> NDSlice:
        return NDSlice.contiguous(tuple(self.dims.values()))

    # ------------------------------------------------------------ ids and state

    def next_ident(self) -> int:
        return next(self._idents)

    def next_id(self) -> int:
        return next(self._ids)

    @property
    def usable(self) -> bool:
        return not self._closed and not self._closing and self._broken is None

    @property
    def closed(self) -> bool:
        """Shut down for good (``usable`` is also False while broken or restarting)."""
        return self._closed

    def check_usable(self, ranks=None) -> None:
        """Raise unless ``ranks`` (default: all) can take commands: none of them lost."""
        if self._closed or self._closing:
            raise MeshClosedError(self.closed_why or f"mesh {self.name!r} is shut down")
        if self._broken is not None:
            lost = self._lost
            if ranks is None or lost is None or not lost.isdisjoint(ranks):
                raise broken_again(self._broken) from None

    def survivors(self):
        """Every rank not lost (all unless the mesh broke by losing some)."""
        if self._broken is None or not self._lost:
            return range(self.world)
        return tuple(r for r in range(self.world) if r not in self._lost)

    # ------------------------------------------------------------ sending

    def _frames(self, msg, targets, stream: int | None, what: str) -> list | None:
        trace = recording_trace.anyone and recording_trace.active  # a compiled call may hold it
        if stream is not None and trace is not None and trace.observe(msg, targets, what):
            return None
        if stream is not None and self.before_command is not None:
            self.before_command()  # (its own messages go first: they have no stream)
        frames = encode(msg, self.signer)
        if stream is not None:
            self.state.record_sent(msg.ident, stream, tuple(targets), what)
        return frames

    def send(
        self, msg, ranks, stream: int | None = None, what: str = "", check: bool = True
    ) -> None:
        """Send ``msg`` to ``ranks`` (None: all); with ``stream``, a tracked command."""
        # None: every rank (of a mesh broken by lost ranks: the others)
        targets = self.survivors() if ranks is None else ranks
        if check:
            self.check_usable(targets)
        frames = self._frames(msg, targets, stream, what)
        if frames is None:  # held back by a compiled call (recorded.Trace)
            return
        nbytes = sum(memoryview(f).nbytes for f in frames[2:]) if len(frames) > 2 else 0
        if nbytes <= BIG_SEND:
            self.io.submit(Send(targets, frames))
            return
        done: Future = Future()
        self.io.submit(Send(targets, frames, done))
        # the caller may mutate its tensor once this returns: wait until ZeroMQ is done
        wait_sent(done, nbytes, what or type(msg).__name__)

    def request(
        self,
        msg,
        ranks,
        what: str,
        *,
        stream: int | None = None,
        label: str = "",
        single: bool = False,
        source: int | None = None,
        timeout: float | None = None,
        statuses: bool = False,
        idents: tuple = (),
        failed_by: int | None = None,
    ) -> AsyncResult:
        """Send ``msg`` (with an ``ident``) to ``ranks``: the AsyncResult of a FetchResult
        per rank (``single``: one rank's value), or with ``statuses`` a Status per rank and
        stream. After ``timeout`` s it fails (TimeoutError) and its commands (``idents``,
        default the message's) are cancelled. With ``failed_by``, that command's failure
        fails it, its RemoteError keeping the replies as ``results``."""
        timeout = check_timeout(timeout)
        ranks = tuple(ranks)
        self.check_usable(ranks)
        expected = [(r, s) for r in ranks for s in self.streams.values()] if statuses else ranks
        order = None if statuses else list(ranks)
        req = Request(msg.ident, expected, order, single, what, source, timeout, idents, ranks)
        req.failed_by = failed_by
        frames = self._frames(msg, ranks, stream, label)
        self.io.submit(SendRequest(req, ranks, frames))
        return AsyncResult(self, req)

    def cancel_request(self, req: Request) -> None:
        """Drop ``req`` from the table and cancel its commands where they are."""
        self.io.submit(CancelRequest(req))

    def delete_ref(self, ref_id: int) -> None:
        """Free a worker-side value (called from Ref.__del__, any thread): sent with
        the next batch, after every command already handed over."""
        if recording_trace.anyone is not None and recording_trace.active.holds_delete(ref_id):
            return
        if not self._closed:
            self.io.submit_quiet(Delete(ref_id))

    def send_op(self, fields: tuple, ranks, what: str) -> None:
        """A tensor op (a RunOps entry) to ``ranks`` (checked usable by the caller)."""
        if recording_trace.anyone is not None and recording_trace.active.observe(fields, ranks, what):
            return
        self.state.record_sent(fields[0], fields[4], ranks, what)
        self.io.submit(io_op(ranks, fields))

    # ------------------------------------------------------------ interrupts and failures

    def interrupt(self, streams=(), ranks=None) -> None:
        """KeyboardInterrupt in the running commands of ``streams`` on ``ranks``."""
        self.interrupts.interrupt(streams, ranks)

    def break_mesh(self, err: BaseException) -> None:
        """The mesh cannot go on (the lease holder): fail every request with ``err``. A
        lost rank (``WorkerCrashed``) breaks it for the calls that involve it only."""
        first = self._broken is None
        if first:
            self._broken = err
        if isinstance(err, WorkerCrashed) and self._lost is not None:
            self._lost.add(err.rank)
        else:
            self._lost = None  # every rank
        waiting = self.table.fail_all(err)
        if first:  # said once: by the calls waiting for replies, else by the log
            logger.log(logging.INFO if waiting else logging.ERROR, "%s", str(err).splitlines()[0])
        self.debugger.clear()

    # ------------------------------------------------------------ the lease holder

    def _io_callbacks(self) -> IOCallbacks:
        signer = self.signer
        return IOCallbacks(  # what the IO loop calls, on the lease holder's thread
            on_frames=self.replies.on_frames,
            on_tick=self._tick,
            on_request=lambda req: self.table.add(req),  # the generation's table
            on_cancel=self.cancels.on_cancel,
            on_process_output_end=lambda p: self._check_process(p, wait=0.5),
            encode_deletes=lambda ids: None if self._closed else encode(m.DeleteRefs(ids), signer),
            encode_ops=lambda ops: encode(m.RunOps(ops), signer),
            encode_host_command=lambda t, n: encode(m.HostCommand(t, n), signer),
            seal=self.sealer.seal,
        )

    def _tick(self) -> None:
        closing = self._closing or self._closed
        for p in list(self.workers.procs.values()):
            self._check_process(p)
        if not closing:
            if self.workers.pings_due():
                frames = encode(m.Ping(), self.signer)
                for identity in set(self.workers.identities.values()):
                    self.io.send_now(identity, frames)
            self.liveness.check()
        for req in self.table.tick(time.monotonic()):
            self.cancels.cancel_remote(req)

    def _check_process(self, p, wait: float = 0.0) -> None:
        err = self.workers.exited(p, wait, closing=self._closing or self._closed)
        if err is not None:
            self.break_mesh(err)

    # ------------------------------------------------------------ life cycle

    def _stop_workers(self, timeout: float) -> None:
        self._closing = True
        alive = [r for r, w in self.state.workers.items() if w.alive]
        if alive and self.workers.identities:
            with contextlib.suppress(Exception):
                self.send(m.Exit(), alive, check=False)
        self.workers.stop(timeout)
        self.fail_requests(MeshClosedError(f"mesh {self.name!r} was shut down"))

    def fail_requests(self, err: BaseException) -> None:
        """Every waiting call fails with ``err`` (on the lease holder when it runs)."""
        if self.io.thread.is_alive() and not self.io.on_io_thread:
            with contextlib.suppress(Exception):
                self.io.call(lambda: self.table.fail_all(err)).result(timeout=10)
                return
        self.table.fail_all(err)

    def restart(self) -> None:
        """Fresh workers (a new generation); named streams keep their ids (and handles)."""
        with self._lifecycle:
            if self._closed:
                raise MeshClosedError(f"mesh {self.name!r} is shut down")
            streams = {n: sid for n, sid in self.streams.items() if sid != 0}
            self._stop_workers(timeout=3.0)
            # on the IO thread: a check of an old worker's exit that is under way there
            # must not see the new generation's state (and fail its start-up)
            self.io.call(self._begin_generation).result(timeout=30)
        try:
            start_generation(self, self._secret, self._startup_timeout)
        except BaseException as e:
            # broken with the reason until the next restart, never usable-looking
            text = f"mesh {self.name!r}: the restart failed: {type(e).__name__}: {e}"
            why = e if isinstance(e, RemoteError) else RemoteError({}, None, text)
            self.io.call(lambda: self.break_mesh(why)).result(timeout=30)
            raise
        for name, sid in streams.items():
            self.send(m.CreateStream(sid, name, False), None)
            self.streams[name] = sid
            self.state.add_stream(sid, name)

    detach = let_go  # stop driving the mesh, its workers left running (rejoin.py)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the workers (Exit, then SIGTERM, then SIGKILL) and the IO thread."""
        with self._lifecycle:
            if self._closed:
                return
            try:
                self._stop_workers(timeout)
            finally:
                self._closed = True
                self.workers.close()  # before the socket goes: relays read their Quit
                self.io.stop()
                self.rendezvous.close()
                _live.discard(self)

    def worker_pids(self) -> dict[int, int]:
        return self.workers.pids()

    def __repr__(self) -> str:  # never shows the secret
        return f"<Controller {self.name!r} {self.address} world={self.world}>"
