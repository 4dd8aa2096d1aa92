"""The controller: the request path (socket, IO thread, requests, replies) and MeshState.
How workers start is ``launchers/``'s; a Controller drives the launcher it is given."""

from .async_result import AsyncResult
from .controller import Controller
from .errors import (
    InterruptTimeout,
    IOThreadError,
    MeshClosedError,
    RemoteError,
    WorkerCrashed,
    WorkerUnresponsive,
    fold_by_rank,
    format_ranks,
)
from .sigint import (
    PENDING_INTERRUPT,
    hand_back_interrupts,
    keep_unraisable_hook,
    raise_pending_interrupt,
)
from .state import MeshState

__all__ = [
    "AsyncResult",
    "Controller",
    "IOThreadError",
    "InterruptTimeout",
    "MeshClosedError",
    "MeshState",
    "PENDING_INTERRUPT",
    "RemoteError",
    "WorkerCrashed",
    "WorkerUnresponsive",
    "fold_by_rank",
    "format_ranks",
    "hand_back_interrupts",
    "keep_unraisable_hook",
    "raise_pending_interrupt",
]
