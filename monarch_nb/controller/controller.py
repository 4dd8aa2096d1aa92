"""The Controller: one ROUTER socket, one IO thread that owns it, and futures.

User threads encode messages (pickling and signing happen on the caller's
thread) and hand the frames to the IO thread through a deque plus a wake-up
pipe; they get futures back. The IO thread sends, receives, decodes replies,
resolves futures, updates MeshState and watches the worker processes.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import zmq

from ..protocol import BadMessage, Signer, decode, encode, new_secret
from ..protocol import messages as m
from ..protocol.envelope import (
    CONTROLLER,
    PROTOCOL_VERSION,
    PeerTable,
    Sealer,
    VersionMismatch,
    unseal,
)
from ..protocol.ndslice import NDSlice
from ..protocol.wire import recv_ready
from .debugger import DebugSessions
from .errors import (
    InterruptTimeout,
    MeshClosedError,
    RemoteError,
    WorkerCrashed,
    broken_again,
    format_ranks,
)
from .launcher import LocalLauncher, LocalProcess
from .liveness import Liveness
from .progress import PROGRESS_BYTES, Transfers, bar
from .rendezvous import Rendezvous, advertised_host
from .requests import Pending
from .state import MeshState

logger = logging.getLogger("monarch_nb.controller")

BIG_SEND = 1 << 20
RECV_HWM = 256  # messages queued per worker socket before ZeroMQ stops reading it
TICK = 0.1  # seconds between process checks and housekeeping
DEPENDENT_GRACE = 2.0
# seconds a worker may be silent before it is unresponsive (joined ones: presumed lost)
HEARTBEAT_TIMEOUT = float(os.environ.get("MONARCH_NB_HEARTBEAT_TIMEOUT", "10"))
MAX_FAILURES_KEPT = 10_000
INTERRUPT_WAIT = 5.0  # seconds interrupted commands get to stop before their ranks count as stuck

_live: weakref.WeakSet = weakref.WeakSet()


class _RecordingTrace(threading.local):
    active = None  # the _Trace of the mnb.compile recording running on this thread


recording_trace = _RecordingTrace()


@atexit.register
def _shutdown_all() -> None:
    for c in list(_live):
        try:
            c.shutdown(timeout=2.0)
        except Exception:
            pass


class Controller:
    """Drives the workers of one mesh. Scripts, tests and the notebook use it the same way."""

    def __init__(
        self,
        name: str,
        dims: dict,
        backend: str,
        interface: str = "127.0.0.1",
        launcher=None,
        startup_timeout: float = 180.0,
        advertise: str | None = None,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        liveness_timeout: float | None = None,
    ):
        self.name = name
        self.dims = dict(dims)
        self.world = 1
        for s in self.dims.values():
            self.world *= s
        self.state = MeshState(name, self.dims, backend)
        self.liveness = Liveness(name, self.state, self._break, heartbeat_timeout, liveness_timeout)
        self._secret = new_secret()
        self.signer = Signer(self._secret)
        # protocol v2: what arrives is checked against the peers' sockets (kept across
        # restarts); what leaves is sealed per destination, on the IO thread
        self.peers = PeerTable(self.state.rejections)
        self._sealer = Sealer(self.signer, CONTROLLER)
        self._version_refused: set[bytes] = set()
        self._launcher = launcher or LocalLauncher()
        self._startup_timeout = startup_timeout
        self._ids = itertools.count(1)  # ref, stream and mesh ids (0 is the root mesh)
        self._idents = itertools.count(1)  # command idents
        self._lifecycle = threading.Lock()
        self._lifecycle_groups = threading.Lock()
        self._interface = interface
        self._advertise = advertise or advertised_host(interface)
        self._rendezvous = Rendezvous(self._advertise)
        self._next_ping = 0.0
        self._ctx = zmq.Context()
        self._sockets_lock = threading.Lock()
        self._sockets_closed = False
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, 0)
        # per worker socket: a flood (a 1 GB print) waits in the worker, whose
        # stream blocks, instead of piling up here
        self._router.setsockopt(zmq.RCVHWM, RECV_HWM)
        self._router.setsockopt(zmq.LINGER, 0)
        port = self._router.bind_to_random_port(f"tcp://{interface}")
        self.bind_address = f"tcp://{interface}:{port}"
        self.address = f"tcp://{self._advertise}:{port}"  # what workers connect to
        self._outq: deque = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_pending = False
        self._stop = False
        self.on_output = print_output
        # (rank, missed): a socket of ``rank`` skipped ``missed`` sequence numbers
        self.on_gap = None
        self.debugger = DebugSessions(self)
        self.transfers = Transfers()
        self._begin_generation()
        self._io = threading.Thread(target=self._io_loop, name=f"monarch-io-{name}", daemon=True)
        self._io.start()
        _live.add(self)
        try:
            self._start_workers()
        except BaseException:
            self.shutdown(timeout=1.0)
            raise

    # ------------------------------------------------------------ generations

    def _begin_generation(self) -> None:
        self.generation = getattr(self, "generation", -1) + 1
        self.state.generation = self.generation
        self.state.reset(range(self.world))
        self._identities: dict[int, bytes] = {}
        self._worker_cuda: dict[int, bool] = {}
        self._procs: dict[int, LocalProcess] = {}
        self._pending: dict[int, Pending] = {}
        self._failures: dict[int, dict] = {}
        self._failure_what: dict[int, str] = {}
        self._awaiting_failure: dict[int, list] = {}
        self._unreported: list[int] = []
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._broken: BaseException | None = None
        self._closing = False
        self._closed = False
        self.streams: dict[str, int] = {"default": 0}
        self._groups: dict = {}  # (NDSlice, reduced dim indices, stream) -> process group key
        self._rendezvous.new_generation()
        self.peers.new_generation()

    def _start_workers(self) -> None:
        procs = self.call_in_io(
            lambda: self._launcher.launch(self.address, self._secret, self.world)
        ).result(timeout=60)
        self._procs = procs
        progress = bar(total=self.world, desc=f"starting mesh {self.name!r}", unit="worker")
        deadline = time.monotonic() + self._startup_timeout
        while not self._ready.wait(0.1) and time.monotonic() < deadline:
            if progress is not None and len(self._identities) != progress.n:
                progress.update(len(self._identities) - progress.n)
        if progress is not None:
            progress.update(len(self._identities) - progress.n)
            progress.close()
        if not self._ready.is_set() or self._startup_error is not None:
            missing = sorted(set(range(self.world)) - set(self._identities))
            err = self._startup_error or TimeoutError(
                f"mesh {self.name!r}: {len(missing)} of {self.world} workers did not join within "
                f"{self._startup_timeout:.0f} s: missing ranks {missing}"
            )
            raise err
        if self.state.backend is None:  # joined workers: nccl if every one has a GPU
            self.state.backend = "nccl" if all(self._worker_cuda.values()) else "gloo"
        sizes = tuple(self.dims.values())
        self.send(m.CreateDeviceMesh(0, tuple(self.dims), NDSlice.contiguous(sizes)), None)
        self._start_backend()

    def _start_backend(self) -> None:
        """Every worker joins the default process group through this generation's
        rendezvous (on its default stream, before user commands); the start fails
        with a rank's own error when one cannot."""
        address = self._rendezvous.address(self.generation)
        ident = self.next_ident()
        joined = self.expect(ident, range(self.world), what="torch.distributed start")
        self.send(m.InitBackend(address, self.state.backend, ident), None)
        try:
            joined.result(timeout=self._startup_timeout)
        except FutureTimeout:
            self.forget(ident)
            raise TimeoutError(
                f"mesh {self.name!r}: torch.distributed ({self.state.backend}) did not start "
                f"within {self._startup_timeout:.0f} s"
            ) from None
        except RemoteError as e:
            if isinstance(e, WorkerCrashed):
                raise
            raise RemoteError(
                e.failures,
                None,
                f"mesh {self.name!r}: torch.distributed ({self.state.backend}) failed to start "
                f"on {format_ranks(e.failures)}",
            ) from None

    @property
    def root_slice(self) -> NDSlice:
        return NDSlice.contiguous(tuple(self.dims.values()))

    def process_group(self, ranks: NDSlice, reduced: tuple, stream: int) -> int:
        """The key of the process groups over dims ``reduced`` of ``ranks`` for
        ``stream``; created on every world rank on first use."""
        k = (ranks, tuple(sorted(reduced)), stream)
        with self._lifecycle_groups:
            key = self._groups.get(k)
            if key is None:
                self.check_usable()
                key = self.next_id()
                self.send(m.CreateProcessGroup(key, tuple(ranks.groups(k[1]))), None)
                self._groups[k] = key
            return key

    # ------------------------------------------------------------ ids

    def next_ident(self) -> int:
        return next(self._idents)

    def next_id(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------ sending

    @property
    def usable(self) -> bool:
        return not self._closed and not self._closing and self._broken is None

    @property
    def closed(self) -> bool:
        """Shut down for good (``usable`` is also False while broken or restarting)."""
        return self._closed

    def check_usable(self) -> None:
        if self._closed or self._closing:
            raise MeshClosedError(f"mesh {self.name!r} is shut down")
        if self._broken is not None:
            raise broken_again(self._broken) from None

    def send(
        self, msg, ranks, stream: int | None = None, what: str = "", check: bool = True
    ) -> None:
        """Send ``msg`` to ``ranks`` (None: every rank). With ``stream``, it is a
        command whose progress MeshState tracks."""
        if check:
            self.check_usable()
        targets = range(self.world) if ranks is None else ranks
        if stream is not None and recording_trace.active is not None:
            recording_trace.active.observe(msg, targets)
        frames = encode(msg, self.signer)
        if stream is not None:
            self.state.record_sent(msg.ident, stream, tuple(targets), what)
        big = len(frames) > 2 and sum(memoryview(f).nbytes for f in frames[2:]) > BIG_SEND
        done = Future() if big else None
        self._enqueue(("msg", targets, frames, done))
        if done is not None:
            # the caller may mutate its tensor once this returns: wait until ZeroMQ is done
            nbytes = sum(memoryview(f).nbytes for f in frames[2:])
            progress = (
                bar(
                    total=nbytes,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    desc=f"sending {what or type(msg).__name__}",
                )
                if nbytes > PROGRESS_BYTES
                else None
            )
            tracker = done.result()
            if tracker is not None:
                tracker.wait()
            if progress is not None:
                progress.update(nbytes)
                progress.close()

    def _enqueue(self, item) -> None:
        self._outq.append(item)
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def call_in_io(self, fn) -> Future:
        """Run ``fn`` on the IO thread (e.g. spawning, so that workers' parent
        death signal is tied to a thread that lives as long as the controller)."""
        fut: Future = Future()
        self._enqueue(("call", fn, fut))
        return fut

    def delete_ref(self, ref_id: int) -> None:
        """Free a worker-side value (called from Ref.__del__, any thread): sent with
        the next batch, after every command already handed over."""
        if not self._closed:
            self._outq.append(("del", ref_id))

    def expect(
        self, ident: int, ranks, single: bool = False, what: str = "", source: int | None = None
    ) -> Future:
        """Register interest in the FetchResults of command ``ident`` before sending it
        (``source``: the command that produced the fetched value)."""
        p = Pending(ident, ranks, list(ranks), single, what, source)
        self._pending[ident] = p
        return p.future

    def forget(self, ident: int) -> None:
        """Stop waiting for the replies of ``ident`` (a caller gave up on them)."""
        self._pending.pop(ident, None)

    def expect_status(self, ident: int, ranks) -> Future:
        expected = [(r, sid) for r in ranks for sid in self.streams.values()]
        p = Pending(ident, expected, None, False, "wait")
        self._pending[ident] = p
        return p.future

    def interrupt(self, streams=(), ranks=None) -> None:
        """Raise KeyboardInterrupt in the running commands of these streams (all by
        default) on ``ranks`` (all by default). The live workers of a broken mesh
        are interrupted too."""
        if not (self._closed or self._closing):
            alive = [
                r
                for r, w in self.state.workers.items()
                if w.alive and (ranks is None or r in ranks)
            ]
            self.send(m.Interrupt(tuple(streams)), alive, check=False)

    def _running(self, streams=(), ranks=None) -> dict:
        """(rank, stream id) -> (ident, what) of the commands running now, as reported."""
        out = {}
        with self.state.lock:
            for r, w in self.state.workers.items():
                if not w.alive or (ranks is not None and r not in ranks):
                    continue
                for sid, (started, finished, _) in w.progress.items():
                    if started > finished and (not streams or sid in streams):
                        out[(r, sid)] = started
        return {k: (i, self._what_of(k[1], i)) for k, i in out.items()}

    def interrupt_and_wait(
        self, streams=(), timeout: float = INTERRUPT_WAIT, ranks=None
    ) -> None:
        """Interrupt (on ``ranks``, all by default), then wait up to ``timeout`` s for
        the commands that were running to end; raise InterruptTimeout naming the
        ranks (and commands) that did not: they are stuck outside Python code and
        only ``restart()`` frees them."""
        running = self._running(streams, ranks)
        self.interrupt(streams, ranks)
        deadline = time.monotonic() + timeout
        while running:
            with self.state.lock:
                for (r, sid), (ident, _) in list(running.items()):
                    w = self.state.workers.get(r)
                    if w is None or not w.alive or w.progress.get(sid, (0, 0, 0))[1] >= ident:
                        del running[(r, sid)]
            if not running or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if running:
            stuck: dict = {}
            for (r, sid), (ident, what) in sorted(running.items()):
                name = self.state.stream_names.get(sid, str(sid))
                stuck.setdefault(r, []).append((name, ident, what))
            raise InterruptTimeout(stuck, timeout, self.name)

    def wait_result(self, fut: Future, timeout: float | None = None):
        """Block for ``fut``; Ctrl-C interrupts the remote commands, waits up to
        INTERRUPT_WAIT s for them to stop, and re-raises (saying which ranks are
        stuck, if any)."""
        try:
            return fut.result(timeout)
        except KeyboardInterrupt:
            try:
                self.interrupt_and_wait(timeout=INTERRUPT_WAIT)
            except InterruptTimeout as e:
                raise KeyboardInterrupt(str(e)) from None
            raise

    # ------------------------------------------------------------ failures

    def take_unreported(self) -> RemoteError | None:
        """The failures not yet raised to the user, as one RemoteError (or None)."""
        if not self._unreported:
            return None
        idents, self._unreported = self._unreported, []
        first = idents[0]
        failures = {r: tuple(f) for r, f in self._failures.get(first, {}).items()}
        context = self._failed(self._failure_what.get(first, "?"), failures)
        if len(idents) > 1:
            context += f"; {len(idents) - 1} later command(s) failed too"
        return RemoteError(failures, first, context)

    def _failed(self, what: str, failures: dict) -> str:
        """The first line of a RemoteError: what failed, on which ranks of which mesh."""
        on = f" on {format_ranks(failures)}" if failures else ""
        return f"{what} failed{on} of mesh {self.name!r}"

    def mark_reported(self, ident: int) -> None:
        try:
            self._unreported.remove(ident)
        except ValueError:
            pass

    def failure_error(self, ident: int, context: str) -> RemoteError | None:
        failures = self._failures.get(ident)
        if not failures:
            return None
        self.mark_reported(ident)
        return RemoteError({r: tuple(f) for r, f in failures.items()}, ident, context)

    # ------------------------------------------------------------ IO thread

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        registered: dict[int, LocalProcess] = {}
        next_tick = 0.0
        while not self._stop:
            try:
                for p in list(self._procs.values()):
                    if p.fd is not None and p.fd not in registered:
                        registered[p.fd] = p
                        poller.register(p.fd, zmq.POLLIN)
                events = dict(poller.poll(int(TICK * 1000)))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                self._wake_pending = False
                self._drain_outq()
                if self._router in events:
                    self._receive()
                for fd in [fd for fd in events if fd in registered]:
                    p = registered[fd]
                    if not p.read_output():
                        poller.unregister(fd)
                        del registered[fd]
                        self._check_process(p, wait=0.5)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK
                    self._tick()
            except Exception:
                logger.exception("controller IO thread error (continuing)")
        try:
            self._drain_outq()
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        """Close the router, the context and the wake pipe: on the IO thread, their
        only user, once its loop is over (or by shutdown when that thread is gone)."""
        with self._sockets_lock:
            if self._sockets_closed:
                return
            self._sockets_closed = True
            self._router.close(linger=0)
            self._ctx.term()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _drain_outq(self) -> None:
        """Send what user threads handed over, in order. Small messages bound for
        the same worker leave as one batch (one ZeroMQ message)."""
        q = self._outq
        deletes: list[int] = []
        batches: dict[int, list] = {}
        while True:
            try:
                item = q.popleft()
            except IndexError:
                break
            kind = item[0]
            if kind == "del":
                # sent after the batch: a deleted Ref cannot be named by a later command
                deletes.append(item[1])
            elif kind == "msg":
                _, ranks, frames, done = item
                if done is None and len(frames) == 2:
                    for r in ranks:
                        b = batches.get(r)
                        if b is None:
                            batches[r] = [frames]
                        else:
                            b.append(frames)
                else:
                    self._flush_batches(batches)
                    self._route(ranks, frames, done)
            elif kind == "call":
                self._flush_batches(batches)
                fn, fut = item[1], item[2]
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
        if deletes and self._identities and not self._closed:
            frames = encode(m.DeleteRefs(tuple(deletes)), self.signer)
            for r in range(self.world):
                batches.setdefault(r, []).append(frames)
        self._flush_batches(batches)

    def _flush_batches(self, batches: dict) -> None:
        router, seal = self._router, self._sealer.seal
        for r, msgs in batches.items():
            ident = self._identities.get(r)
            if ident is None:
                continue
            if len(msgs) == 1:
                router.send_multipart([ident, *seal(msgs[0], 1, ident)])
            else:
                inner = [f for frames in msgs for f in frames]
                router.send_multipart([ident, *seal(inner, len(msgs), ident)])
        batches.clear()

    def _send_to(self, identity: bytes, frames: list) -> None:
        """One encoded message to one socket, sealed (IO thread)."""
        self._router.send_multipart([identity, *self._sealer.seal(frames, 1, identity)])

    def _route(self, ranks, frames, done: Future | None) -> None:
        router = self._router
        tracker = None
        try:
            for r in ranks:
                ident = self._identities.get(r)
                if ident is None:
                    continue
                sealed = self._sealer.seal(frames, 1, ident)
                if done is None:
                    router.send_multipart([ident, *sealed])
                else:
                    tracker = router.send_multipart([ident, *sealed], copy=False, track=True)
        finally:
            if done is not None:
                done.set_result(tracker)

    def _receive(self) -> None:
        router = self._router
        for _ in range(1000):
            frames = recv_ready(router)
            if frames is None:
                return
            self._handle(frames)

    def _handle(self, frames) -> None:
        identity = frames[0].bytes
        try:
            header, parts = unseal(frames[1:], self.signer)
            missed = self.peers.admit(identity, header)
        except VersionMismatch as e:
            self._refuse_version(identity, e.version)
            return
        except BadMessage as e:
            self._drop(e.kind, str(e))
            return
        if missed:
            self._drop("gap", f"{missed} message(s) of rank {header.rank} never arrived")
            if self.on_gap is not None:
                self.on_gap(header.rank, missed)
        for p in parts:
            try:
                msg = decode(p, self.signer)
            except BadMessage as e:
                self._drop(e.kind, str(e))
                continue
            self._dispatch(msg, identity, header, joined=missed is not None)

    def _dispatch(self, msg, identity: bytes, header, joined: bool) -> None:
        handler = getattr(self, "_on_" + type(msg).__name__, None)
        rank = getattr(msg, "rank", None)
        ready = type(msg) is m.WorkerReady  # its handler says why it refuses a bad rank
        if handler is None or not isinstance(rank, int):
            self._drop("malformed", f"an unexpected {type(msg).__name__}")
            return
        if rank != header.rank:
            why = f"a {type(msg).__name__} of rank {rank} sealed by rank {header.rank}"
            self._drop("rank", why)
            return
        if not (joined or ready):  # joined ranks are within the mesh
            self._drop("rank", f"a {type(msg).__name__} of rank {rank}, which has not joined")
            return
        if not ready:
            self.state.seen(rank)
        try:
            if ready:
                handler(msg, identity, header)
            else:
                handler(msg)
        except Exception:
            logger.exception("handling %s failed", type(msg).__name__)

    def _drop(self, kind: str, why: str) -> None:
        n = self.peers.count(kind)
        logger.warning(
            "mesh %r dropped a message (%s: %s); %d of that kind so far", self.name, kind, why, n
        )

    def _refuse_version(self, identity: bytes, version: int) -> None:
        """A peer of another protocol version: counted, logged, and told once."""
        reason = f"worker speaks protocol {version}, this mesh {PROTOCOL_VERSION}"
        self._drop("version", reason)
        if identity not in self._version_refused and len(self._version_refused) < 4096:
            self._version_refused.add(identity)
            self._send_to(identity, encode(m.Refused(reason), self.signer))

    # ------------------------------------------------------------ replies

    def _on_WorkerReady(self, msg: m.WorkerReady, identity: bytes, header) -> None:
        reason = None
        if msg.world != self.world:
            reason = f"world size {msg.world} differs from the mesh's {self.world}"
        elif not 0 <= msg.rank < self.world:
            reason = f"rank {msg.rank} is outside the mesh (world {self.world})"
        elif msg.rank in self._identities:
            reason = f"rank {msg.rank} has joined already (pid {self.state.workers[msg.rank].pid})"
        elif self._ready.is_set():
            reason = "the mesh is complete: late workers are not taken"
        if reason is not None:
            logger.warning(
                "mesh %r refused a worker (pid %s on %s): %s", self.name, msg.pid, msg.host, reason
            )
            self._send_to(identity, encode(m.Refused(reason), self.signer))
            self.peers.refuse(identity, header)
            return
        self.peers.join(identity, header)
        self._identities[msg.rank] = identity
        self._worker_cuda[msg.rank] = msg.cuda
        self.state.worker_ready(msg.rank, msg.pid, msg.host)
        if len(self._identities) == self.world:
            self._ready.set()

    def _on_TransferBegin(self, msg: m.TransferBegin) -> None:
        p = self._pending.get(msg.ident)
        self.transfers.begin(msg.ident, msg.rank, msg.nbytes, p.what if p is not None else "fetch")

    def _on_FetchResult(self, msg: m.FetchResult) -> None:
        self.transfers.end(msg.ident, msg.rank)
        p = self._pending.get(msg.ident)
        if p is None or msg.rank not in p.expected:
            return
        p.expected.discard(msg.rank)
        if msg.error is None:
            p.values[msg.rank] = msg.value
        elif type(msg.error) is m.DependentOn:
            p.dependent[msg.rank] = msg.error.ident
        else:
            p.failures[msg.rank] = tuple(msg.error)
        if not p.expected:
            self._finish(p)

    def _finish(self, p: Pending, deadline_passed: bool = False) -> None:
        if p.failures:
            self._pending.pop(p.ident, None)
            p.future.set_exception(
                RemoteError(p.failures, p.ident, self._failed(p.what, p.failures))
            )
            return
        if p.dependent:
            orig = min(p.dependent.values())
            what = self._failure_what.get(orig, "?")
            if orig == p.source:
                context = self._failed(what, self._failures.get(orig, {}))
            else:
                context = f"{p.what}: the value depends on command {what!r}, which failed"
            err = self.failure_error(orig, context)
            if err is None and not deadline_passed:
                # the original failure is still on its way (it may come through another socket)
                self._awaiting_failure.setdefault(orig, []).append((time.monotonic(), p))
                return
            self._pending.pop(p.ident, None)
            p.future.set_exception(
                err
                or RemoteError(
                    {}, orig, f"{p.what}: the value depends on command {what!r}, which failed"
                )
            )
            return
        self._pending.pop(p.ident, None)
        if p.order is None:
            p.future.set_result(None)
        elif p.single:
            p.future.set_result(p.values[p.order[0]])
        else:
            p.future.set_result([p.values[r] for r in p.order])

    def _on_RemoteFunctionFailed(self, msg: m.RemoteFunctionFailed) -> None:
        failures = self._failures.setdefault(msg.ident, {})
        if not failures:
            self._unreported.append(msg.ident)
            self._failure_what[msg.ident] = self._what_of(msg.stream, msg.ident)
            if len(self._failures) > MAX_FAILURES_KEPT:
                oldest = next(iter(self._failures))
                self._failures.pop(oldest)
                self._failure_what.pop(oldest, None)
        failures[msg.rank] = tuple(msg.failure)
        self.state.add_error(msg.ident, msg.rank, msg.stream, msg.failure)
        for _, p in self._awaiting_failure.pop(msg.ident, []):
            self._finish(p)

    def _what_of(self, sid: int, ident: int) -> str:
        with self.state.lock:
            for i, _, what, _ in self.state.sent.get(sid, ()):
                if i == ident:
                    return what
        return "?"

    def _on_Status(self, msg: m.Status) -> None:
        self.state.progress(msg.rank, {msg.stream: msg.progress})
        p = self._pending.get(msg.ident)
        if p is None:
            return
        p.expected.discard((msg.rank, msg.stream))
        if not p.expected:
            self._finish(p)

    def _on_Progress(self, msg: m.Progress) -> None:
        self.state.progress(msg.rank, msg.streams)

    def _on_Stalled(self, msg: m.Stalled) -> None:
        self.state.stalled(msg.rank, msg.stream, msg.ident, msg.what, msg.seconds, msg.stack)

    def _on_Health(self, msg: m.Health) -> None:
        self.state.health(
            msg.rank, msg.rss, msg.cpu, msg.gpu, msg.bad_messages, msg.env_size, msg.rejections
        )

    def _on_Output(self, msg: m.Output) -> None:
        try:
            self.on_output(msg)
        except Exception:
            logger.exception("output handler failed")

    def _on_DebuggerMessage(self, msg: m.DebuggerMessage) -> None:
        self.debugger.on_message(msg)

    def _on_InternalException(self, msg: m.InternalException) -> None:
        info = {"rank": msg.rank, **msg.failure._asdict()}
        self.state.internal_errors.append(info)
        err = RemoteError(
            {msg.rank: tuple(msg.failure)},
            None,
            f"mesh {self.name!r} is broken: an internal error on rank {msg.rank}; restart it",
        )
        self._break(err)

    # ------------------------------------------------------------ processes

    def _tick(self) -> None:
        for p in list(self._procs.values()):
            self._check_process(p)
        if not (self._closing or self._closed):
            if self._launcher.external and self._identities:
                self._ping()
            self.liveness.check()
        if self._awaiting_failure:
            now = time.monotonic()
            for orig, waiting in list(self._awaiting_failure.items()):
                keep = [(t, p) for t, p in waiting if now - t < DEPENDENT_GRACE]
                for t, p in waiting:
                    if now - t >= DEPENDENT_GRACE:
                        self._finish(p, deadline_passed=True)
                if keep:
                    self._awaiting_failure[orig] = keep
                else:
                    self._awaiting_failure.pop(orig, None)

    def _ping(self) -> None:
        """Workers that are not our children hear from us every second (they exit
        when the pings stop)."""
        now = time.monotonic()
        if now >= self._next_ping:
            self._next_ping = now + 1.0
            frames = encode(m.Ping(), self.signer)
            for ident in self._identities.values():
                self._send_to(ident, frames)

    def _check_process(self, p: LocalProcess, wait: float = 0.0) -> None:
        code = p.popen.poll()
        if code is None and wait:
            try:
                code = p.popen.wait(wait)
            except Exception:
                code = None
        if code is None:
            return
        if self._procs.get(p.rank) is not p:
            return  # a worker of an earlier generation (restart) whose pipe closed late
        w = self.state.workers.get(p.rank)
        if w is None or (not w.alive and w.exit is not None):
            return
        while p.fd is not None and p.read_output():
            pass
        self.state.worker_exited(p.rank, code)
        if self._closing or self._closed:
            return
        err = WorkerCrashed(p.rank, code, p.tail_text(), self.name)
        if not self._ready.is_set():
            self._startup_error = err
            self._ready.set()
        self._break(err)

    def _break(self, err: BaseException) -> None:
        """The mesh cannot go on: fail every pending future with ``err``."""
        pending, self._pending = self._pending, {}
        if self._broken is None:
            self._broken = err
            # said once: by the calls waiting for replies, else (nobody waits) by the log
            waiting = any(not p.future.done() for p in pending.values())
            logger.log(logging.INFO if waiting else logging.ERROR, "%s", str(err).splitlines()[0])
        self._awaiting_failure = {}
        self.debugger.clear()
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(err)

    # ------------------------------------------------------------ life cycle

    def _stop_workers(self, timeout: float) -> None:
        self._closing = True
        alive = [r for r, w in self.state.workers.items() if w.alive]
        if alive and self._identities:
            try:
                self.send(m.Exit(), alive, check=False)
            except Exception:
                pass
        deadline = time.monotonic() + timeout
        procs = list(self._procs.values())
        for p in procs:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        for sig, grace in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)):
            left = [p for p in procs if p.popen.poll() is None]
            if not left:
                break
            for p in left:
                p.kill(sig)
            end = time.monotonic() + grace
            for p in left:
                try:
                    p.popen.wait(max(0.0, end - time.monotonic()))
                except Exception:
                    pass
        for p in procs:
            if p.popen.stdout is not None:
                try:
                    p.popen.stdout.close()
                except OSError:
                    pass
            code = p.popen.poll()
            self.state.worker_exited(p.rank, code)
        err = MeshClosedError(f"mesh {self.name!r} was shut down")
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(err)

    def restart(self) -> None:
        """Stop every worker and start fresh ones (a new generation). The mesh's
        named streams exist again on the new workers, under the same ids, so that
        Stream handles taken before the restart stay usable."""
        with self._lifecycle:
            if self._closed:
                raise MeshClosedError(f"mesh {self.name!r} is shut down")
            streams = {n: sid for n, sid in self.streams.items() if sid != 0}
            self._stop_workers(timeout=3.0)
            # on the IO thread: a check of an old worker's exit that is under way there
            # must not see the new generation's state (and fail its start-up)
            self.call_in_io(self._begin_generation).result(timeout=30)
        try:
            self._start_workers()
        except BaseException as e:
            # broken with the reason until the next restart, never usable-looking
            why = e if isinstance(e, RemoteError) else RemoteError(
                {}, None, f"mesh {self.name!r}: the restart failed: {type(e).__name__}: {e}"
            )
            self.call_in_io(lambda: self._break(why)).result(timeout=30)
            raise
        for name, sid in streams.items():
            self.send(m.CreateStream(sid, name, False), None)
            self.streams[name] = sid
            self.state.add_stream(sid, name)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the workers (Exit, then SIGTERM, then SIGKILL) and the IO thread."""
        with self._lifecycle:
            if self._closed:
                return
            try:
                self._stop_workers(timeout)
            finally:
                self._closed = True
                self._stop = True
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass
                if threading.current_thread() is not self._io:
                    self._io.join(timeout=5)
                if self._io.is_alive():  # stuck in a handler: it closes them when it ends
                    logger.warning("mesh %r: the IO thread is still busy at shutdown", self.name)
                else:
                    self._close_sockets()
                self._rendezvous.close()
                self._launcher.close()  # an ExternalLauncher removes its connection file
                _live.discard(self)

    def worker_pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self._procs.items()}

    def __repr__(self) -> str:  # never shows the secret
        return f"<Controller {self.name!r} {self.address} world={self.world}>"


def print_output(msg: m.Output) -> None:
    """Default output handler (scripts, tests): each line prefixed ``[rank r]``."""
    out = sys.stdout if msg.name == "stdout" else sys.stderr
    text = msg.text
    lines = text.splitlines(keepends=True)
    out.write("".join(f"[rank {msg.rank}] {line}" for line in lines))
    if text and not text.endswith("\n"):
        out.write("\n")
    out.flush()
