"""The records of ipywidgets made on a rank (worker/widget_comm.py, notebook/widgets.py).

A widget's comm lives on the rank; the kernel opens its twin for the frontend and
forwards both ways. They are messages like those of ``messages`` (which imports
them, and whose name they carry).
"""

from __future__ import annotations

from typing import NamedTuple

from .receivers import CONTROLLER, WORKER, sent_to

_MESSAGES = "monarch_nb.protocol.messages"


@sent_to(CONTROLLER)
class WidgetMessage(NamedTuple):
    """A rank's comm spoke: ``msg_type`` "comm_open" (with ``target_name``),
    "comm_msg" or "comm_close"; or a cell ``display()``ed a widget: "display", its
    MIME bundle in ``data``. ``ident``: the command that ran (None: none)."""

    rank: int
    ident: int | None
    comm_id: str
    msg_type: str
    data: dict
    metadata: dict
    buffers: list  # bytes
    target_name: str | None = None


@sent_to(WORKER)
class WidgetEvent(NamedTuple):
    """The frontend spoke to comm ``comm_id`` of the rank: "comm_msg" or "comm_close"."""

    comm_id: str
    msg_type: str
    data: dict
    metadata: dict
    buffers: list  # bytes


WidgetMessage.__module__ = WidgetEvent.__module__ = _MESSAGES
