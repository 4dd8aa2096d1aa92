"""ipywidgets on a rank: the ``comm`` package's factory, pointed at the controller.

ipywidgets opens each widget's comm with ``comm.create_comm``; ``install`` (run when
the rank's IPython shell is made, never at start) replaces it with ``WorkerComm``,
whose messages go to the controller as WidgetMessage records: on the socket of the
command that runs (in order with its output), else on the widget thread's own; and
``display()`` of a widget in a cell is sent at once that way ("display"), not with
the cell's result, so that a progress bar is seen as it moves. The
kernel opens the comm's twin for the frontend (notebook/widgets.py) and sends back
what the frontend says (WidgetEvent), which the widget thread hands to the comm:
widget callbacks are user code, so neither the receiver nor a stream runs them;
what they print is the mesh's output (shown under the cell that runs).

This module imports ``comm`` only (in ``install``), never ipywidgets.
"""

from __future__ import annotations

import queue
import threading

from ..protocol import encode
from ..protocol import messages as m
from ..protocol.constants import DEFAULT_STREAM
from ..protocol.envelope import Sealer
from ..protocol.wire import send_frames
from . import capture, display

_worker = None  # the Worker of this process (``attach``)
_thread: _WidgetThread | None = None
_thread_lock = threading.Lock()
_installed = False


def attach(worker) -> None:
    """Remember the worker (its rank, signer and sockets); imports nothing."""
    global _worker
    _worker = worker


def install() -> bool:
    """``comm.create_comm`` makes WorkerComms from now on (False: no ``comm`` here)."""
    global _installed
    if _installed:
        return True
    try:
        import comm
        from comm.base_comm import BaseComm
    except ImportError:
        return False

    class WorkerComm(BaseComm):
        """A comm whose frontend is the notebook, reached through the controller."""

        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            if self._closed and msg_type != "comm_open":
                return  # its frontend closed it: state changes stay on the rank
            send(self.comm_id, msg_type, data, metadata, buffers, keys.get("target_name"))

        def __del__(self):
            pass  # never a send from the collector (it may run inside a send)

    comm.create_comm = WorkerComm
    display.show_widget = _show
    _installed = True
    return True


def send(comm_id: str, msg_type: str, data, metadata, buffers, target_name=None) -> None:
    """One WidgetMessage to the controller (dropped outside a worker)."""
    w = _worker
    if w is None or capture._child is not None:
        return  # not a worker, or a process forked from one (its sockets are the parent's)
    route = capture._route_here()
    ident = route[1] if route is not None else None
    msg = m.WidgetMessage(
        w.rank,
        ident,
        comm_id,
        msg_type,
        data or {},
        metadata or {},
        [bytes(b) for b in buffers or ()],
        target_name,
    )
    if route is not None:
        route[0].send(msg)
    else:
        _widget_thread().send(msg)


def _show(bundle: dict, metadata) -> None:
    """``display(widget)`` in a cell: its view is shown now (a "display" WidgetMessage),
    behind its comm_open on the same socket, not with the cell's result."""
    model = bundle[display.WIDGET_VIEW].get("model_id", "")
    send(model, "display", bundle, metadata, ())


def deliver(msg: m.WidgetEvent) -> None:
    """The frontend's message to a comm of this rank: handled on the widget thread."""
    _widget_thread().events.put(msg)


def _widget_thread() -> _WidgetThread:
    global _thread
    with _thread_lock:  # the receiver (an event) and a widget's own thread may both ask
        if _thread is None:
            _thread = _WidgetThread(_worker)
    return _thread


class _WidgetThread:
    """One daemon thread that runs the comms' handlers in turn, and a socket for
    what they send (an ipywidgets echo, a callback's state change)."""

    def __init__(self, worker):
        self.worker = worker
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.sock = self.sealer = None
        thread = threading.Thread(target=self._run, name="monarch-widgets", daemon=True)
        default = worker.streams.get(DEFAULT_STREAM)
        if default is not None:  # what callbacks print: the mesh's output, as a thread's
            setattr(thread, capture._ROUTE, (default.outbox, None))
        thread.start()

    def send(self, msg) -> None:
        w = self.worker
        with self.lock:
            if self.sock is None:
                self.sock, self.sealer = w.connect_socket(), Sealer(w.signer, w.rank)
            send_frames(self.sock, self.sealer.seal(encode(msg, w.signer)))

    def _run(self) -> None:
        while True:
            event = self.events.get()
            try:
                _handle(event)
            except BaseException:  # a callback failed: the comms serve on
                import traceback

                traceback.print_exc()


def _handle(event: m.WidgetEvent) -> None:
    import comm

    manager = comm.get_comm_manager()
    c = manager.comms.get(event.comm_id)
    if c is None:
        return  # closed on the rank meanwhile
    msg = {
        "header": {"msg_type": event.msg_type},
        "parent_header": {},
        "metadata": event.metadata,
        "content": {"comm_id": event.comm_id, "data": event.data},
        "buffers": [memoryview(b) for b in event.buffers],
    }
    if event.msg_type == "comm_close":
        c._closed = True
        manager.comms.pop(event.comm_id, None)
        c.handle_close(msg)
    else:
        c.handle_msg(msg)
