"""monarch_nb: drive a mesh of GPU (or CPU) worker processes from a notebook.

The notebook kernel (or any Python process) is the single controller::

    import monarch_nb as mnb
    mesh = mnb.local_mesh(dp=2)
    x = mnb.remote(torch.ones)(4, mesh=mesh)
    x.fetch(rank=0)

In IPython, ``%load_ext monarch_nb`` adds ``%monarch_mesh`` and ``%%monarch``.
"""

from . import context
from ._version import __version__ as __version__
from .controller.async_result import AsyncResult
from .controller.errors import (
    InterruptTimeout,
    IOThreadError,
    MeshClosedError,
    RemoteError,
    WorkerCrashed,
    WorkerUnresponsive,
)
from .launch import connect_mesh, local_mesh
from .mesh import DeviceMesh, Stream, get_mesh
from .protocol.wire import RefUseError
from .recording import Compiled, RecordingError, compile
from .remote import ProcessGroup, Ref, RemoteFunction, remote
from .worker.context import current_coords, current_rank, current_size


def _dashboard(mesh, **kw):
    """``mesh.dashboard()``: the widget comes from ``ui``, which the API never imports."""
    from .ui import Dashboard

    return Dashboard(mesh, **kw)


context.set_dashboard(_dashboard)

__all__ = [
    "AsyncResult",
    "Compiled",
    "DeviceMesh",
    "RecordingError",
    "compile",
    "InterruptTimeout",
    "IOThreadError",
    "MeshClosedError",
    "ProcessGroup",
    "Ref",
    "RefUseError",
    "RemoteError",
    "RemoteFunction",
    "Stream",
    "WorkerCrashed",
    "WorkerUnresponsive",
    "connect_mesh",
    "current_coords",
    "current_rank",
    "current_size",
    "get_mesh",
    "local_mesh",
    "remote",
]


def _jupyter_labextension_paths():
    """Where the built JupyterLab extension lies (``jupyter labextension develop``)."""
    return [{"src": "labextension", "dest": "monarch-nb"}]


def load_ipython_extension(ipython):
    """``%load_ext monarch_nb``: register the magics."""
    from .notebook import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):
    from .notebook import unload_ipython_extension as unload

    unload(ipython)
