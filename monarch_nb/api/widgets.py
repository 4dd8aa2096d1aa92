"""DeviceMesh's bridge to the ipywidgets made on its ranks: their comms' messages
reach ``widget_handler`` (the notebook layer's ``WidgetBridge``), and the
frontend's go back to the rank with ``send_widget_event``."""

from __future__ import annotations

from ..protocol import messages as m


class MeshWidgets:
    """DeviceMesh's bridge to the comms of ipywidgets made on its ranks."""

    @property
    def widget_handler(self):
        """``fn(WidgetMessage)``, called on the IO thread with what a rank's widget comm
        sends (``rank``, ``ident``: the command that ran or None, ``comm_id``,
        ``msg_type``: "comm_open" / "comm_msg" / "comm_close", ``data``, ``metadata``,
        ``buffers``, ``target_name``); None (the default): dropped."""
        return self._controller.replies.on_widget

    @widget_handler.setter
    def widget_handler(self, fn) -> None:
        self._controller.replies.on_widget = fn

    def send_widget_event(
        self, rank: int, comm_id: str, msg_type: str, data=None, metadata=None, buffers=()
    ) -> None:
        """Hand the frontend's ``msg_type`` ("comm_msg" or "comm_close") to comm
        ``comm_id`` of global ``rank``; its widget thread runs the handlers."""
        if msg_type not in ("comm_msg", "comm_close"):
            raise ValueError(f"send_widget_event: msg_type is comm_msg or comm_close, got {msg_type!r}")
        event = m.WidgetEvent(
            comm_id, msg_type, data or {}, metadata or {}, [bytes(b) for b in buffers or ()]
        )
        self._controller.send(event, [rank], check=False)
