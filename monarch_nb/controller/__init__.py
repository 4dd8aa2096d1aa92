"""The controller side: Controller (socket + IO thread + futures), MeshState, launchers."""

from .controller import Controller
from .errors import (
    InterruptTimeout,
    MeshClosedError,
    RemoteError,
    WorkerCrashed,
    fold_by_rank,
    format_ranks,
)
from .launcher import ExternalLauncher, LocalLauncher
from .state import MeshState

__all__ = [
    "Controller",
    "ExternalLauncher",
    "InterruptTimeout",
    "LocalLauncher",
    "MeshClosedError",
    "MeshState",
    "RemoteError",
    "WorkerCrashed",
    "fold_by_rank",
    "format_ranks",
]
