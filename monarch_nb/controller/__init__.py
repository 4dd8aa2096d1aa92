"""The controller side: Controller (socket + IO thread + futures), MeshState, launchers."""

from .controller import Controller
from .errors import MeshClosedError, RemoteError, WorkerCrashed, format_ranks
from .launcher import ExternalLauncher, LocalLauncher
from .state import MeshState

__all__ = [
    "Controller",
    "ExternalLauncher",
    "LocalLauncher",
    "MeshClosedError",
    "MeshState",
    "RemoteError",
    "WorkerCrashed",
    "format_ranks",
]
