"""The controller side: Controller (socket + IO thread + futures), MeshState, launchers."""

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
from .launcher import ExternalLauncher, LocalLauncher
from .sigint import hand_back_interrupts_of, keep_unraisable_hook
from .state import MeshState

__all__ = [
    "AsyncResult",
    "Controller",
    "ExternalLauncher",
    "IOThreadError",
    "InterruptTimeout",
    "LocalLauncher",
    "MeshClosedError",
    "MeshState",
    "RemoteError",
    "WorkerCrashed",
    "WorkerUnresponsive",
    "fold_by_rank",
    "format_ranks",
    "hand_back_interrupts_of",
    "keep_unraisable_hook",
]
