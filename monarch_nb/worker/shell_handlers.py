"""The worker's handlers of Complete and Inspect (a part of Worker, which
dispatches each message to the handler of its name): Tab and Shift-Tab in a
``%%monarch`` cell, answered by the rank's IPython shell off the streams; of
WidgetEvent, a frontend's message to a widget of the rank (``widget_comm``); and of
SyncFiles, the user's changed sources (``synced_code``).

Completing reads user objects (``__dir__``, ``__getattr__``, properties), which
may raise or hang, so neither the receiver nor a stream runs it: one service
thread does, with a socket of its own. A request that finds it still busy is
refused at once (the kernel's own completer answers instead), and a request
that runs longer than ``LIMIT`` seconds is stopped by a KeyboardInterrupt raised
in the service thread (delivered between bytecodes: a ``__dir__`` that loops or
sleeps in Python), so the rank's completer serves again.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time

from ..protocol import messages as m
from ..protocol.envelope import Sealer
from ..protocol.wire import encode_result, send_frames
from . import synced_code, widget_comm
from .failure import describe

LIMIT = 2.0  # seconds one request may run on the rank before it is interrupted
BUSY = "the rank's completer is still busy with an earlier request (an object's __dir__ hangs?)"


class ShellHandlers:
    """Handlers of Complete and Inspect; one service thread per worker."""

    _service: _Service | None = None

    def Complete(self, msg: m.Complete) -> None:
        self._serve(msg.ident, _complete, msg.code, msg.cursor_pos)

    def Inspect(self, msg: m.Inspect) -> None:
        self._serve(msg.ident, _inspect, msg.code, msg.cursor_pos, msg.detail_level)

    def WidgetEvent(self, msg: m.WidgetEvent) -> None:
        widget_comm.deliver(msg)

    def SyncFiles(self, msg: m.SyncFiles) -> None:
        synced_code.write(msg.folder, msg.files, self.rank)

    def _serve(self, ident: int, fn, *args) -> None:
        if self._service is None:
            self._service = _Service(self)
        if not self._service.offer((ident, fn, args)):
            why = m.RemoteFailure("RuntimeError", f"rank {self.rank}: {BUSY}", "")
            self._send(m.FetchResult(ident, self.rank, None, why))


class _Service:
    """One daemon thread that answers requests in turn; none waits behind a busy one."""

    def __init__(self, worker):
        self.worker = worker
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = threading.Lock()  # orders the end of a request and its interrupt
        self.running: int | None = None  # the ident of the request that runs
        self.thread = threading.Thread(target=self._run, name="monarch-completer", daemon=True)
        self.thread.start()

    def offer(self, request) -> bool:
        """Queue ``request`` unless one runs or waits (False: refused); receiver only."""
        if self.running is not None:
            return False
        self.running = request[0]
        self.requests.put(request)
        return True

    def _run(self) -> None:
        w = self.worker
        sock, sealer = w.connect_socket(), Sealer(w.signer, w.rank)
        while True:
            try:
                self._answer(sock, sealer, *self.requests.get())
            except KeyboardInterrupt:  # the watchdog's, landing just as a request ended
                with self.busy:
                    self.running = None

    def _answer(self, sock, sealer, ident: int, fn, args) -> None:
        w = self.worker
        threading.Thread(target=self._watch, args=(ident,), daemon=True).start()
        try:
            value, error = fn(w.namespace, *args), None
        except KeyboardInterrupt:
            why = f"rank {w.rank}: stopped after {LIMIT} s (an object's __dir__ or __getattr__ hangs?)"
            value, error = None, m.RemoteFailure("TimeoutError", why, "")
        except BaseException as e:  # the request fails with why; the rank serves on
            value, error = None, describe(e)
        finally:
            with self.busy:
                self.running = None
        frames = encode_result(ident, w.rank, value, error, w.signer)
        send_frames(sock, sealer.seal(frames))

    def _watch(self, ident: int) -> None:
        """Interrupt request ``ident`` past LIMIT, and again every 0.2 s while it runs
        (IPython's completer catches an error in one matcher and goes on to the next)."""
        wait = LIMIT
        while True:
            time.sleep(wait)
            with self.busy:  # never into the next request, nor past the finally above
                if self.running != ident:
                    return
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread.ident), ctypes.py_object(KeyboardInterrupt)
                )
            wait = 0.2


def _complete(namespace: dict, code: str, cursor_pos: int) -> dict:
    """A complete_reply's content from the rank's Completer (as ipykernel makes it)."""
    from IPython.core.completer import provisionalcompleter, rectify_completions

    from .ipython_shell import shell

    completer = shell(namespace).Completer
    with provisionalcompleter():
        found = list(rectify_completions(code, completer.completions(code, cursor_pos)))
    comps = [
        {"start": c.start, "end": c.end, "text": c.text, "type": c.type, "signature": c.signature}
        for c in found
    ]
    start, end = (found[0].start, found[0].end) if found else (cursor_pos, cursor_pos)
    return {
        "matches": [c.text for c in found],
        "cursor_start": start,
        "cursor_end": end,
        "metadata": {"_jupyter_types_experimental": comps},
        "status": "ok",
    }


def _inspect(namespace: dict, code: str, cursor_pos: int, detail_level: int) -> dict:
    """An inspect_reply's content: the rank's ``object_inspect_mime`` of the name at
    the cursor (as ipykernel's ``do_inspect``)."""
    from IPython.utils.tokenutil import token_at_cursor

    from .ipython_shell import shell

    name = token_at_cursor(code, cursor_pos)
    try:
        data = shell(namespace).object_inspect_mime(name, detail_level=detail_level)
    except KeyError:
        return {"status": "ok", "found": False, "data": {}, "metadata": {}}
    return {"status": "ok", "found": True, "data": data, "metadata": {}}
