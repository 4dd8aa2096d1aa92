"""Debugger sessions of paused worker streams, as the controller sees them.

The lease holder feeds ``on_message`` with DebuggerMessages from workers; user
threads (the notebook's inline prompt, ``%monarch_debug``, the dashboard's
debugger panel, JupyterLab's debugger through notebook/dap.py, tests) list
sessions, send lines and wait for the output up to the next prompt, or ask
structured questions (``inspect``: frames, scopes, variables, evaluate).

Listeners hear ``paused`` (once per session), ``running`` (it stepped or
continued but keeps tracing), ``repaused`` (it stopped again after running)
and ``resumed`` (the session is over, or its worker is gone).
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from dataclasses import dataclass, field

from ..protocol import messages as m


@dataclass
class Session:
    """One paused stream of one rank."""

    rank: int
    stream: int
    stream_name: str
    location: dict = field(default_factory=dict)
    ident: int | None = None  # the command that paused
    prompt: str | None = None  # set while pdb waits for a line
    output: list = field(default_factory=list)  # text since the last line sent, prompt excluded
    ended: bool = False
    announced: bool = False  # listeners heard of this pause
    requested: bool = False  # a post-mortem someone asked for (and so serves)
    told: bool = False  # the notebook told the user of this pause (once, see ``claim_notice``)
    stepping: bool = False  # it ran on ("running") and has not stopped again yet
    reason: str = "step"  # why it stopped last: "step", "breakpoint" or "pause"

    def describe(self) -> dict:
        return {"rank": self.rank, "stream": self.stream_name, **self.location}


class DebugSessions:
    def __init__(self, controller):
        self._ctrl = controller
        self._cond = threading.Condition()
        self._sessions: dict[tuple, Session] = {}
        self.listeners: list = []  # callables(event, session) on pause / resume (lease holder)
        self._requested: set[int] = set()  # idents of post-mortems asked for, not yet over
        self._rids = itertools.count(1)
        self._answers: dict[int, tuple] = {}  # rid -> (ok, body) of structured requests
        self._abandoned: set[int] = set()  # rids whose asker gave up: their answers are dropped

    # -------------------------------------------------------------- the lease holder

    def on_message(self, msg: m.DebuggerMessage) -> None:
        kind, payload = msg.action
        key = (msg.rank, msg.stream)
        state = self._ctrl.state
        event = None
        with self._cond:
            s = self._sessions.get(key)
            if s is None and kind != "resumed":
                name = state.stream_names.get(msg.stream, str(msg.stream))
                s = self._sessions[key] = Session(msg.rank, msg.stream, name)
            if kind == "paused":
                s.location = {k: v for k, v in payload.items() if k not in ("ident", "reason")}
                s.ident = payload.get("ident")
                s.reason = payload.get("reason") or "step"
                s.requested = s.ident in self._requested
                if not s.announced:  # once per session, with its location known
                    s.announced = True
                    event = "paused"
                elif s.stepping:
                    event = "repaused"
                s.stepping = False
                w = state.workers.get(msg.rank)
                if w is not None:
                    with state.lock:  # status() reads it under that lock
                        w.paused[msg.stream] = dict(s.location)
            elif kind == "output":
                s.output.append(payload)
            elif kind == "prompt":
                # pdb writes its prompt to its stdout first: the prompt is not output
                text = "".join(s.output)
                if payload and text.endswith(payload):
                    s.output[:] = [text[: -len(payload)]] if len(text) > len(payload) else []
                s.prompt = payload
            elif kind == "dap":
                rid, ok, body = payload
                if rid in self._abandoned:
                    self._abandoned.discard(rid)
                else:
                    self._answers[rid] = (ok, body)
            elif kind == "running" and s is not None:
                s.prompt = None
                s.stepping = True
                event = "running" if s.announced else None
                w = state.workers.get(msg.rank)
                if w is not None:
                    with state.lock:
                        w.paused.pop(msg.stream, None)
            elif kind == "resumed" and s is not None:
                s.ended = True
                s.prompt = None
                del self._sessions[key]
                w = state.workers.get(msg.rank)
                if w is not None:
                    with state.lock:
                        w.paused.pop(msg.stream, None)
                event = "resumed" if s.announced else None
            self._cond.notify_all()
        if event is not None:
            for fn in list(self.listeners):
                try:
                    fn(event, s)
                except Exception:
                    pass

    def clear(self) -> None:
        """Forget every session (the workers are gone)."""
        with self._cond:
            gone = [s for s in self._sessions.values() if s.announced]
            for s in self._sessions.values():
                s.ended = True
            self._sessions.clear()
            self._requested.clear()
            self._cond.notify_all()
        for s in gone:
            for fn in list(self.listeners):
                try:
                    fn("resumed", s)
                except Exception:
                    pass

    # -------------------------------------------------------------- user threads

    _keep = staticmethod(lambda s: True)  # which sessions this view sees (``only``)

    def only(self, keep) -> DebugSessions:
        """The same sessions seen through ``keep(session)`` (those of one cell): a view
        that shares their state and serves them as this does."""
        view = copy.copy(self)
        view._keep = keep
        return view

    def _seen(self) -> list[Session]:
        return [s for s in self._sessions.values() if self._keep(s)]  # (_cond held)

    def sessions(self) -> list[Session]:
        with self._cond:
            return sorted(self._seen(), key=lambda s: (s.rank, s.stream))

    def waiting(self) -> list[Session]:
        """The sessions whose pdb waits for a line now."""
        with self._cond:
            found = [s for s in self._seen() if s.prompt is not None]
        return sorted(found, key=lambda s: (s.rank, s.stream))

    def find(self, rank: int, stream: int | None = None) -> Session:
        with self._cond:
            for s in sorted(self._seen(), key=lambda s: s.stream):
                if s.rank == rank and (stream is None or s.stream == stream):
                    return s
        raise KeyError(f"no paused session on rank {rank}")

    def wait_any(self, timeout: float, count: int = 1) -> bool:
        """Wait until ``count`` sessions (at least) are paused at a prompt."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(s.prompt is not None for s in self._seen()) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def claim_notice(self, s: Session) -> bool:
        """True once per pause, and only while it is on: the caller tells the user of it."""
        with self._cond:
            if s.ended or s.told:
                return False
            s.told = True
            return True

    def take_output(self, s: Session) -> str:
        with self._cond:
            text = "".join(s.output)
            s.output.clear()
            return text

    def send(self, s: Session, line: str) -> None:
        """Send one line to the session's pdb."""
        with self._cond:
            if s.ended:
                raise KeyError(f"the session on rank {s.rank} has ended")
            s.prompt = None
            s.output.clear()
        self._ctrl.send(m.DebuggerMessage(s.rank, s.stream, line), [s.rank], check=False)

    def wait_reply(self, s: Session, timeout: float = 60.0) -> tuple[str, str | None]:
        """Output up to the next prompt (without it), and that prompt (None: the
        session ended or nothing came within ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while s.prompt is None and not s.ended:
                left = deadline - time.monotonic()
                if left <= 0 or not self._ctrl.usable:
                    break
                self._cond.wait(min(left, 0.5))
            text = "".join(s.output)
            s.output.clear()
            return text, s.prompt

    def worker_alive(self, s: Session) -> bool:
        """The worker of ``s`` is up (a dead one's session can never answer)."""
        w = self._ctrl.state.workers.get(s.rank)
        return w is not None and w.alive

    def inspect(self, s: Session, command: str, args: dict, timeout: float = 10.0):
        """A structured answer from the session's pdb (worker/inspect_frames.py):
        the reply body; LookupError when the session is not at its prompt or
        ends, TimeoutError past ``timeout``, ValueError with the worker's reason."""
        rid = next(self._rids)
        deadline = time.monotonic() + timeout
        with self._cond:
            # "paused" comes just before "prompt": wait for the prompt, unless it runs
            while s.prompt is None and not s.ended and not s.stepping:
                left = deadline - time.monotonic()
                if left <= 0 or not self._ctrl.usable:
                    break
                self._cond.wait(min(left, 0.5))
            if s.ended or s.prompt is None:
                raise LookupError(f"rank {s.rank} ({s.stream_name}) is not paused at its prompt")
        self._ctrl.send(
            m.DebuggerMessage(s.rank, s.stream, ("dap", rid, command, args)), [s.rank], check=False
        )
        with self._cond:
            while rid not in self._answers:
                left = deadline - time.monotonic()
                if s.ended or not self.worker_alive(s):
                    self._abandoned.add(rid)
                    raise LookupError(f"the session on rank {s.rank} has ended")
                if left <= 0 or not self._ctrl.usable:
                    self._abandoned.add(rid)
                    raise TimeoutError(f"rank {s.rank} did not answer {command!r} in {timeout} s")
                self._cond.wait(min(left, 0.5))
            ok, body = self._answers.pop(rid)
        if not ok:
            raise ValueError(body)
        return body

    def pause(self, s: Session) -> None:
        """Make the running session ``s`` (it continued, and its pdb still traces: a
        breakpoint is set) stop at its next traced line; a ``repaused`` follows."""
        if s.ended:
            raise KeyError(f"the session on rank {s.rank} has ended")
        self._ctrl.send(m.DebuggerMessage(s.rank, s.stream, ("pause",)), [s.rank], check=False)

    def command(self, s: Session, line: str, timeout: float = 60.0) -> str:
        self.send(s, line)
        return self.wait_reply(s, timeout)[0]

    # -------------------------------------------------------------- conveniences

    def run(self, rank: int, line: str, stream: int | None = None, timeout: float = 60.0) -> str:
        """Send ``line`` to the session paused on ``rank``; its output up to the next
        prompt (the prompt itself left out)."""
        return self.command(self.find(rank, stream), line, timeout)

    def cast(self, ranks, line: str, timeout: float = 60.0) -> dict:
        """Send ``line`` to the sessions on ``ranks`` (None: every paused one);
        rank -> output. Lines go out first, then the replies are collected."""
        targets = [s for s in self.sessions() if ranks is None or s.rank in ranks]
        for s in targets:
            self.send(s, line)
        return {s.rank: self.wait_reply(s, timeout)[0] for s in targets}

    def continue_all(self) -> None:
        for s in self.sessions():
            if not s.ended:
                self.send(s, "continue")

    def set_breakpoints(self, table: dict) -> None:
        """Send every worker the breakpoint table (``protocol/breakpoints.py``: cells
        and notebook files -> lines and conditions), replacing the last one; their
        next commands stop there."""
        self._ctrl.send(m.DebuggerMessage(0, 0, ("breakpoints", table)), None, check=False)

    def post_mortem(self, rank: int, stream: int = 0):
        """Open pdb at the frame of the last failure on ``stream`` of ``rank``;
        returns the AsyncResult of that command (it ends when the session does)."""
        ctrl = self._ctrl
        ctrl.check_usable()
        ident = ctrl.next_ident()
        with self._cond:
            self._requested.add(ident)  # its caller serves it: no pause notice
        result = ctrl.request(
            m.PostMortem(ident, stream),
            [rank],
            f"post-mortem on rank {rank}",
            stream=stream,
            label="post-mortem",
            single=True,
        )
        result.add_done_callback(lambda _r: self._forget_request(ident))
        return result

    def _forget_request(self, ident: int) -> None:
        with self._cond:
            self._requested.discard(ident)

    def release(self, streams=()) -> None:
        """Forget the failures that workers keep for post-mortem."""
        self._ctrl.send(m.ReleaseFailures(tuple(streams)), None)
