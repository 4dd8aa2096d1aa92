"""The records of the process-group store (worker/store.py, controller/store_server.py).

They are messages like those of ``messages`` (which imports them, and whose name
they carry, so the wire's codes and the handler tables include them); they live
here to keep that module under 400 lines.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .receivers import CONTROLLER, STORE_CLIENT, sent_to

_MESSAGES = "monarch_nb.protocol.messages"


@sent_to(CONTROLLER)
class StoreRequest(NamedTuple):
    """One operation on the controller's torch.distributed store of ``generation``
    (worker -> controller, on the asking thread's own socket): ``op`` is a Store
    method ("set", "get", "add", "compare_set", "wait", "check", "delete_key",
    "num_keys", "multi_get", "multi_set"), ``args`` its arguments (keys str, values
    bytes); ``timeout`` (s) bounds a get or a wait."""

    rank: int
    generation: int
    request: int
    op: str
    args: tuple
    timeout: float


@sent_to(STORE_CLIENT)
class StoreReply(NamedTuple):
    """The answer to StoreRequest ``request``: its ``value``, or ``error`` (text)."""

    generation: int
    request: int
    value: Any
    error: str | None


StoreRequest.__module__ = StoreReply.__module__ = _MESSAGES
