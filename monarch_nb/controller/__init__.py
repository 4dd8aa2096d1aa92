"""The controller side: Controller (socket + IO thread + futures), MeshState, launchers."""

from .controller import Controller
from .errors import InterruptTimeout, MeshClosedError, RemoteError, WorkerCrashed, format_ranks
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
    "format_ranks",
]
