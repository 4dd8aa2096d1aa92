"""ipywidgets made on the ranks, live in the notebook: each rank's widget comm
(worker/widget_comm.py) gets a twin in this kernel with the same ``comm_id``.

A rank's ``comm_open`` is published to the frontend under the cell that made the
widget, then its view where the cell ``display()``s it ("display": at once, so that
a progress bar moves while its cell runs; a widget that is the cell's value comes
with the result), its ``comm_msg`` and ``comm_close`` follow; the twin is registered with the kernel's comm manager,
so what the frontend sends to it (a slider moved, a button clicked, the view
closed) goes back to the rank (``mesh.send_widget_event``), whose widget thread
runs the widget's handlers. A comm the frontend closed is forgotten on both sides:
later changes of that widget on the rank go nowhere. Progress bars of more than
FOLD ranks in one cell fold into one (widget_fold.py).
"""

from __future__ import annotations

import logging

from .widget_fold import Folds

logger = logging.getLogger("monarch_nb.notebook")


class WidgetBridge:
    """The ``widget_handler`` of one mesh: its ranks' comms <-> the frontend's."""

    def __init__(self, publisher, mesh, parent_of, ticker):
        self.publisher = publisher
        self.mesh = mesh
        self.parent_of = parent_of  # ident -> the parent header of its cell (or None)
        self.twins: dict[str, object] = {}  # comm_id -> its KernelComm
        self.folds = Folds(publisher)  # progress bars of many ranks, folded
        self.ticker = ticker
        self._token = ticker.add(self.folds.tick)
        mesh.widget_handler = self.on_widget

    def on_widget(self, msg) -> None:
        """A WidgetMessage from a rank (IO thread)."""
        if not self.publisher.in_kernel:
            return
        parent = self.parent_of(msg.ident)
        if msg.msg_type == "display":  # display(widget) in a cell: its view, now
            if not self.folds.show(parent, msg.ident, msg.rank, msg.comm_id, msg.data, msg.metadata):
                self.publisher.display(parent, msg.data, msg.metadata)
            return
        content = {"comm_id": msg.comm_id, "data": msg.data}
        if msg.msg_type == "comm_open":
            content.update(target_name=msg.target_name, target_module=None)
            self.twins[msg.comm_id] = _twin(self, msg.rank, msg.comm_id, msg.target_name)
            self.folds.on_open(msg.rank, msg.comm_id, msg.data)
        elif msg.comm_id not in self.twins:
            return  # its frontend closed it
        elif msg.msg_type == "comm_close":
            self._forget(msg.comm_id)
            self.folds.on_close(msg.comm_id)
        elif self.folds.on_update(msg.comm_id, msg.data):
            return  # a bar folded into its cell's aggregate
        self.publisher.comm(parent, msg.msg_type, content, msg.metadata, msg.buffers)

    def to_rank(self, rank: int, comm_id: str, msg_type: str, msg: dict) -> None:
        """The frontend spoke to a twin (the kernel's shell thread): on to its rank."""
        if msg_type == "comm_close":
            self.twins.pop(comm_id, None)
        content = msg.get("content", {})
        try:
            self.mesh.send_widget_event(
                rank, comm_id, msg_type, content.get("data"), msg.get("metadata"),
                msg.get("buffers") or (),
            )
        except Exception:  # the mesh is gone or restarting: the widget is dead
            logger.debug("widget message to rank %s dropped", rank, exc_info=True)

    def _forget(self, comm_id: str) -> None:
        twin = self.twins.pop(comm_id, None)
        if twin is not None:
            twin._closed = True
            _manager().comms.pop(comm_id, None)

    def close(self) -> None:
        """The mesh is forgotten: its widgets die with it."""
        self.ticker.remove(self._token)
        for comm_id in list(self.twins):
            self._forget(comm_id)
        if self.mesh.widget_handler == self.on_widget:
            self.mesh.widget_handler = None


def _manager():
    import comm

    return comm.get_comm_manager()


_KernelComm = None


def _twin(bridge: WidgetBridge, rank: int, comm_id: str, target_name):
    """The kernel's end of comm ``comm_id`` of ``rank``, registered with the kernel's
    comm manager (which hands it the frontend's messages)."""
    global _KernelComm
    if _KernelComm is None:
        from comm.base_comm import BaseComm

        class KernelComm(BaseComm):
            """A rank's comm as the kernel's comm manager sees it."""

            def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
                pass  # what the rank's comm says is published by the bridge

            def handle_msg(self, msg):
                self.bridge.to_rank(self.rank, self.comm_id, "comm_msg", msg)

            def handle_close(self, msg):
                self.bridge.to_rank(self.rank, self.comm_id, "comm_close", msg)

        _KernelComm = KernelComm
    twin = _KernelComm(comm_id=comm_id, primary=False, target_name=target_name)
    twin.bridge, twin.rank = bridge, rank
    _manager().register_comm(twin)
    return twin
