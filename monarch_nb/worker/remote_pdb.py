"""Remote pdb: a real Pdb on the stream that hit ``breakpoint()``.

Its input comes from that stream's debugger queue (fed by DebuggerMessage from
the controller); its output, prompts and pause state go to the controller as
DebuggerMessage. Only that stream of that rank pauses: the receiver thread and
the other streams keep running.

Actions sent to the controller: ("paused", location) when pdb stops,
("output", text), ("prompt", prompt) when it waits for a line, ("running",
None) when it leaves the prompt but keeps tracing (``n``, ``s``, ``c`` with
breakpoints), ("resumed", None) when the session is over (tracing stopped, or
the command ended), ("dap", (rid, ok, body)) answering a structured request.

A structured request arrives in the queue as ``("dap", rid, command, args)``
instead of a line: pdb answers it (inspect_frames.Inspector) and keeps waiting
for its line; the references it hands out last until the stream runs on.
Two actions never reach the queue (the receiver, worker/breakpoints.py
``deliver``): ``("breakpoints", table)``, the gutter breakpoints, and
``("pause",)``, which makes a session that still traces stop at its next line.
"""

from __future__ import annotations

import code
import io
import os
import pdb
import queue
import sys
import threading

from ..protocol.messages import DebuggerMessage
from .failure import is_machinery
from .inspect_frames import Inspector

_POLL = 0.05
_current = threading.local()  # .stream: the stream whose thread this is
INTERRUPT = object()  # put in a debugger queue: end the session as an interrupt
_SKIP = ("monarch_nb.worker.*", "monarch_nb.protocol.*")  # never stop in the worker's own code


def set_current_stream(stream) -> None:
    _current.stream = stream


def current_stream():
    """The stream whose thread this is (None off the stream threads)."""
    return getattr(_current, "stream", None)


def pause(stream) -> bool:
    """The receiver thread: make the session tracing ``stream``'s running command
    stop at its next traced line (DAP ``pause``); False when none traces it."""
    session = stream.debug_session
    if session is None:
        return False
    if stream.paused is not None:  # at its prompt, a "continue" maybe on its way: after it
        session.pause_asked = True
        return True
    session.reason = "pause"
    session.set_step()
    return True


def next_line(stream):
    """The next line (or INTERRUPT) from the stream's debugger queue; waits in
    slices so that an asynchronous exception can land."""
    q = stream.debugger_queue
    while True:
        try:
            return q.get(timeout=_POLL)
        except queue.Empty:
            continue


class _Input(io.TextIOBase):
    """Pdb's stdin: lines from the stream's debugger queue."""

    def __init__(self, session: RemotePdb):
        self._session = session

    def readable(self) -> bool:
        return True

    def readline(self, size: int = -1) -> str:
        return self._session.next_line()


class _Output(io.TextIOBase):
    """Pdb's stdout: text sent to the controller."""

    def __init__(self, session: RemotePdb):
        self._session = session

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._session.send("output", s)
        return len(s)

    def flush(self) -> None:
        pass


class RemotePdb(pdb.Pdb):
    """A Pdb whose terminal is the notebook."""

    def __init__(self, stream):
        self.stream = stream
        self.rank = stream.worker.rank
        super().__init__(
            stdin=_Input(self), stdout=_Output(self), nosigint=True, readrc=False, skip=_SKIP
        )
        self.use_rawinput = False
        self.prompt = f"(Pdb r{self.rank}) "
        self._paused_sent = False
        self.inspector = Inspector(self)
        self.reason: str | None = None  # why it stops now: "step", "breakpoint", "pause"
        self.pause_asked = False  # a pause that came while it waited at its prompt

    # -------------------------------------------------------------- wire

    def send(self, kind: str, payload) -> None:
        s = self.stream
        s.outbox.send(DebuggerMessage(self.rank, s.id, (kind, payload)))

    def location(self) -> dict:
        f = self.curframe
        if f is None:
            return {"file": None, "line": None, "function": None}
        return {
            "file": f.f_code.co_filename,
            "line": f.f_lineno,
            "function": f.f_code.co_name,
            "ident": self.stream.running[0] if self.stream.running else None,
            "reason": self.reason or "step",
        }

    def next_line(self) -> str:
        loc = self.location()
        self.stream.paused = loc
        self.send("paused", loc)
        self.send("prompt", self.prompt)
        line = next_line(self.stream)
        while isinstance(line, tuple) and line and line[0] == "dap":
            _, rid, command, args = line
            self.send("dap", (rid, *self.inspector.answer(command, args)))
            line = next_line(self.stream)
        self.inspector.reset()
        if line is INTERRUPT:
            self.stream.interrupted_in_debugger = True
            return "q\n"
        return line if line.endswith("\n") else line + "\n"

    # -------------------------------------------------------------- session

    def get_stack(self, f, t):
        """pdb's stack without the worker's own frames (which run the user's code)."""
        stack, index = super().get_stack(f, t)
        kept = [(fr, n) for fr, n in stack if not is_machinery(fr.f_code.co_filename)]
        if not kept:
            return stack, index
        current = stack[index][0] if 0 <= index < len(stack) else None
        new_index = next((i for i, (fr, _) in enumerate(kept) if fr is current), len(kept) - 1)
        return kept, new_index

    def user_line(self, frame):
        if self.reason is None:  # not a pause asked for: a step, or a breakpoint hit
            self.reason = "step" if self.stop_here(frame) else "breakpoint"
        super().user_line(frame)

    def interaction(self, frame, tb_or_exc):
        self.stream.debug_session = self
        try:
            super().interaction(frame, tb_or_exc)
        finally:
            self.reason = None
            self.stream.paused = None
            if self.pause_asked and not self.quitting:
                self.pause_asked = False
                self.reason = "pause"
                self.set_step()  # it left the prompt running: stop at the next line
            if sys.gettrace() is None or self.quitting:
                self.end()
            else:
                self.send("running", None)

    def end(self) -> None:
        """The session is over: say so once."""
        if self.stream.debug_session is self:
            self.stream.debug_session = None
            self.stream.paused = None
            self.send("resumed", None)

    def do_stepout(self, arg):
        """stepout: run until the current function has returned, and stop in its
        caller (DAP's stepOut; pdb's ``return`` stops before the return)."""
        caller = self.curframe.f_back if self.curframe is not None else None
        if caller is None or is_machinery(caller.f_code.co_filename):
            return self.do_return(arg)  # the cell itself: nothing of the user's calls it
        self.set_next(caller)
        return 1

    def do_interact(self, arg):
        """interact: an interactive interpreter in the current scope (input from the notebook)."""
        ns = {**self.curframe.f_globals, **self.curframe_locals}
        console = _Console(self, ns)
        console.interact("*interactive* (exit with Ctrl-D or exit())", exitmsg="")

    do_interact.__doc__ = pdb.Pdb.do_interact.__doc__


class _Console(code.InteractiveConsole):
    def __init__(self, session: RemotePdb, ns: dict):
        super().__init__(ns)
        self._session = session

    def write(self, data: str) -> None:
        self._session.send("output", data)

    def raw_input(self, prompt: str = "") -> str:
        s = self._session
        s.send("prompt", prompt)
        line = next_line(s.stream)
        while isinstance(line, tuple):  # a structured request: not while interact runs
            s.send("dap", (line[1], False, "pdb is in 'interact' mode: leave it first"))
            line = next_line(s.stream)
        if line is INTERRUPT:
            s.stream.interrupted_in_debugger = True
            raise EOFError
        line = line.rstrip("\n")
        if line in ("exit()", "quit()", "\x04", "EOF"):
            raise EOFError
        return line

    def runcode(self, code_obj):
        out = _Output(self._session)
        old_out, old_err = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = out
        try:
            super().runcode(code_obj)
        finally:
            sys.stdout, sys.stderr = old_out, old_err


def set_trace(frame=None) -> None:
    """``pdb.set_trace`` / ``breakpoint()`` on a worker: pause this stream only."""
    stream = getattr(_current, "stream", None)
    if stream is None:
        print(
            "monarch_nb: breakpoint() outside a stream thread is ignored (no notebook to talk to)",
            file=sys.__stderr__,
        )
        return
    if frame is None:
        frame = sys._getframe().f_back
    RemotePdb(stream).set_trace(frame)


def breakpointhook(*args, **kwargs) -> None:
    set_trace(sys._getframe().f_back)


def post_mortem(stream, tb) -> None:
    """Open the session at the frame that raised ``tb`` (on the stream's own thread)."""
    p = RemotePdb(stream)
    p.reset()
    try:
        p.interaction(None, tb)
    finally:
        p.end()


def install() -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` remote; a PYTHONBREAKPOINT set by the user wins."""
    if not os.environ.get("PYTHONBREAKPOINT"):
        sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace


__all__ = ["INTERRUPT", "RemotePdb", "install", "post_mortem", "set_trace"]
