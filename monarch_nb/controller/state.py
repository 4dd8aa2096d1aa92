"""MeshState: the one model of what every worker and stream is doing.

The lease holder updates it from what workers report; user threads record what
they send. ``snapshot()`` is ``mesh.status()``, and everything the notebook
shows is drawn from it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..protocol.envelope import KINDS
from .errors import describe_exit
from .sent import SentGroups
from .timeline import DEFAULT_SIZE, Timeline

_ZERO = (0, 0, 0)  # a stream's progress before its first report


@dataclass
class WorkerState:
    rank: int
    pid: int | None = None
    host: str | None = None
    alive: bool = False
    exit: int | None = None
    rss: int | None = None
    cpu: float | None = None
    gpu: dict | None = None
    last_seen: float = 0.0
    unresponsive: bool = False  # silent for longer than the heartbeat timeout
    bad_messages: int = 0
    # kind -> messages this worker dropped
    rejections: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    env_size: int | None = None
    # stream id -> [last started ident, last finished ident, commands done]
    progress: dict = field(default_factory=dict)
    paused: dict = field(default_factory=dict)  # stream id -> {"file", "line", "function"}
    stalled: dict = field(default_factory=dict)  # stream id -> {"ident", "what", "stack", ...}


class MeshState:
    def __init__(self, name: str, dims: dict, backend: str, timeline_size: int = DEFAULT_SIZE):
        self.name = name
        self.dims = dict(dims)
        self.backend = backend
        self.lock = threading.Lock()
        self.workers: dict[int, WorkerState] = {}
        self.stream_names: dict[int, str] = {0: "default"}
        # stream id -> deque of (ident, ranks, what, time sent), oldest first
        self.sent: dict[int, deque] = {0: deque()}
        self._scan: dict[int, tuple] = {}  # stream id -> (oldest ident, ranks known done)
        self.errors: list[dict] = []
        # kind (envelope.KINDS) -> messages the controller dropped; the Controller's
        # PeerTable counts into this dict
        self.rejections: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.internal_errors: list[dict] = []
        self.generation = 0
        self.count_requests = lambda: 0  # entries in the controller's request table, now
        self.timeline = Timeline(timeline_size)  # every command's start and end (mesh.timeline())

    @property
    def bad_messages(self) -> int:
        """Every message the controller dropped, of any kind."""
        return sum(self.rejections.values())

    # -------------------------------------------------------------- updates

    def reset(self, ranks) -> None:
        with self.lock:
            self.workers = {r: WorkerState(r) for r in ranks}
            self.stream_names = {0: "default"}
            self.sent = {0: deque()}
            self._scan = {}
            self.errors = []
            self.internal_errors = []
        self.timeline.clear()  # new workers: their commands and clocks start afresh

    def add_stream(self, sid: int, name: str) -> None:
        with self.lock:
            self.stream_names[sid] = name
            self.sent.setdefault(sid, deque())

    def record_sent(self, ident: int, sid: int, ranks, what: str) -> None:
        # without the lock (once per command, on the sender's thread): a deque's append
        # is atomic, and whoever reads a queue copies it at C speed or pops its left end
        self.sent[sid].append((ident, ranks, what, time.time()))

    def what_of(self, sid: int, ident: int) -> str:
        """What command ``ident`` of stream ``sid`` is, while it is remembered."""
        with self.lock:
            for i, _, what, _ in tuple(self.sent.get(sid, ())):
                if i == ident:
                    return what
        return "?"

    def worker_ready(self, rank: int, pid: int, host: str) -> None:
        with self.lock:
            w = self.workers[rank]
            w.pid, w.host, w.alive, w.last_seen = pid, host, True, time.time()

    def seen(self, rank: int) -> None:
        w = self.workers.get(rank)
        if w is not None:
            w.last_seen = time.time()

    def seen_many(self, ranks, now: float) -> None:
        workers = self.workers
        for r in ranks:
            w = workers.get(r)
            if w is not None:
                w.last_seen = now

    def worker_exited(self, rank: int, code: int | None) -> None:
        with self.lock:
            w = self.workers[rank]
            w.alive, w.exit = False, code
            w.paused.clear()  # a dead worker pauses nothing

    def progress(self, rank: int, streams: dict) -> None:
        with self.lock:
            self._progress(self.workers[rank], streams)
            self._prune()

    def progress_many(self, ranks, streams: dict) -> None:
        """The same progress of several ranks (a host's folded report)."""
        with self.lock:
            workers = self.workers
            items = list(streams.items())
            for r in ranks:  # _progress, inlined: this runs per rank per broadcast
                w = workers[r]
                prog = w.progress
                for sid, v in items:
                    old = prog.get(sid)
                    if old is None or (old[0] <= v[0] and old[1] <= v[1] and old[2] <= v[2]):
                        prog[sid] = v
                    else:
                        prog[sid] = tuple(max(a, b) for a, b in zip(old, v))
                if w.stalled:
                    self._progress(w, {})
            self._prune()

    @staticmethod
    def _progress(w, streams: dict) -> None:
        for sid, v in streams.items():
            old = w.progress.get(sid)
            # reports travel on several sockets: never go backwards
            if old is None or (old[0] <= v[0] and old[1] <= v[1] and old[2] <= v[2]):
                w.progress[sid] = v  # a tuple, never changed in place: shared is fine
            elif old[0] < v[0] or old[1] < v[1] or old[2] < v[2]:
                w.progress[sid] = tuple(max(a, b) for a, b in zip(old, v))
        for sid, st in list(w.stalled.items()):
            if w.progress.get(sid, (0, 0, 0))[1] >= st["ident"]:
                del w.stalled[sid]  # the stalled command finished

    def stalled(self, rank: int, sid: int, ident: int, what: str, seconds: float, stack: str):
        with self.lock:
            w = self.workers.get(rank)
            if w is not None and w.progress.get(sid, (0, 0, 0))[1] < ident:
                w.stalled[sid] = {
                    "ident": ident,
                    "what": what,
                    "since": time.time() - seconds,
                    "stack": stack,
                }

    def health(
        self, rank: int, rss: int, cpu: float, gpu, bad: int, env_size: int, rejections=None
    ) -> None:
        w = self.workers[rank]
        w.rss, w.cpu, w.gpu, w.bad_messages, w.env_size = rss, cpu, gpu, bad, env_size
        if rejections:
            w.rejections = dict(rejections)

    def add_error(self, ident: int, rank: int, sid: int, failure) -> None:
        with self.lock:
            self.errors.append(
                {
                    "ident": ident,
                    "rank": rank,
                    "stream": self.stream_names.get(sid, str(sid)),
                    "type": failure.exc_type,
                    "message": failure.message,
                    "traceback": failure.traceback,
                    "time": time.time(),
                }
            )
            del self.errors[:-1000]

    def _prune(self) -> None:
        """Forget sent commands that every target rank has finished. A rank that has
        finished a command stays so (progress never goes back; a dead rank finishes
        everything), so the scan of the oldest command resumes where it stopped:
        linear in the ranks per command, not quadratic at 1,024 ranks."""
        for sid, q in self.sent.items():
            while q:
                ident, ranks, _, _ = q[0]
                at = self._scan.get(sid)
                pos = at[1] if at is not None and at[0] == ident else 0
                n = len(ranks)
                while pos < n and self._finished(ranks[pos], sid) >= ident:
                    pos += 1
                if pos < n:
                    self._scan[sid] = (ident, pos)
                    break
                q.popleft()

    def _finished(self, rank: int, sid: int) -> int:
        w = self.workers.get(rank)
        if w is None or not w.alive:
            return 1 << 62  # a dead worker finishes nothing: don't keep its queue
        return w.progress.get(sid, _ZERO)[1]

    # -------------------------------------------------------------- snapshot

    def snapshot(self) -> dict:
        """Plain, JSON-serialisable data: the shape of ``mesh.status()``."""
        now = time.time()
        with self.lock:  # copied at C speed: senders wait for this lock
            copies = {sid: list(q) for sid, q in self.sent.items()}
        # grouped by their ranks outside the lock: progress read later only finds more done
        sent = {sid: SentGroups(q) for sid, q in copies.items()}
        empty = SentGroups(())
        with self.lock:
            ranks = {}
            for r, w in sorted(self.workers.items()):
                streams = {}
                for sid, name in self.stream_names.items():
                    started, finished, _ = w.progress.get(sid, (0, 0, 0))
                    queued, run = sent.get(sid, empty).of(r, started, finished)
                    running = None
                    if run is not None:
                        running = {"ident": run[0], "what": run[2], "elapsed": now - run[3]}
                    streams[name] = {
                        "queued": queued,
                        "running": running,
                        "done": w.progress.get(sid, (0, 0, 0))[2],
                        "last": finished,  # ident of the last finished command
                        "paused": w.paused.get(sid),
                        "stalled": _stall(w.stalled.get(sid), now),
                    }
                ranks[r] = {
                    "pid": w.pid,
                    "host": w.host,
                    "alive": w.alive,
                    "exit": None if w.exit is None else describe_exit(w.exit),
                    "exit_code": w.exit,
                    "rss": w.rss,
                    "cpu": w.cpu,
                    "gpu": w.gpu,
                    "heartbeat_age": (now - w.last_seen) if w.last_seen else None,
                    "unresponsive": w.unresponsive and w.alive,
                    "bad_messages": w.bad_messages,
                    "rejections": dict(w.rejections),
                    "env_size": w.env_size,
                    "streams": streams,
                }
            errors = self._grouped_errors()
            debugger = [
                {"rank": r, "stream": self.stream_names.get(sid, str(sid)), **info}
                for r, w in sorted(self.workers.items())
                for sid, info in w.paused.items()
            ]
            return {
                "name": self.name,
                "dims": dict(self.dims),
                "backend": self.backend,
                "generation": self.generation,
                "ranks": ranks,
                "errors": errors,
                "debugger": debugger,
                "bad_messages": self.bad_messages,
                "requests": self.count_requests(),
                "rejections": dict(self.rejections),
                "internal_errors": list(self.internal_errors),
            }

    def _grouped_errors(self) -> list[dict]:
        groups: dict = {}
        for e in self.errors:
            key = (e["ident"], e["type"], e["traceback"])
            g = groups.get(key)
            if g is None:
                g = groups[key] = {
                    k: e[k] for k in ("ident", "type", "message", "traceback", "stream", "time")
                }
                g["ranks"] = []
            g["ranks"].append(e["rank"])
        out = sorted(groups.values(), key=lambda g: -g["time"])
        for g in out:
            g["ranks"].sort()
        return out


def _stall(info: dict | None, now: float) -> dict | None:
    """A stalled command as status() shows it: what, for how long, where."""
    if info is None:
        return None
    return {
        "ident": info["ident"],
        "what": info["what"],
        "for": now - info["since"],
        "stack": info["stack"],
    }
