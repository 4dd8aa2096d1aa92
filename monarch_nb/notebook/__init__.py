"""The notebook layer: ``%load_ext monarch_nb`` registers ``%monarch_mesh`` and ``%%monarch``.

Modules: ``magics`` (the magics and their arguments' meaning), ``args``
(parsing), ``cell`` (running one ``%%monarch`` cell), ``output`` (worker
output to the right cell: folding, coalescing), ``publish`` (IOPub messages
under a chosen cell, the ticker thread), ``results`` (values, figures and
failures as displays), ``push`` (notebook names a cell takes along),
``display`` (the mesh status view), ``completing`` (Tab and Shift-Tab on a
rank), ``auto`` (``%monarch_auto``), ``dap`` (paused worker sessions as threads
of JupyterLab's debugger).
"""

from __future__ import annotations

from .. import config
from .results import RemoteCellError

_loaded: dict = {}


def load_ipython_extension(ipython) -> None:
    from . import completing
    from .auto import AutoMagics, line_of
    from .magics import DebugMagics, MonarchMagics

    if id(ipython) in _loaded:
        return
    settings = config.settings()  # %config MonarchNB.heartbeat_timeout = 30
    settings.update_config(ipython.config)
    if settings not in ipython.configurables:
        ipython.configurables.append(settings)
    magics = MonarchMagics(ipython)
    ipython.register_magics(magics)
    ipython.register_magics(DebugMagics(ipython, magics._mesh))
    ipython.register_magics(AutoMagics(ipython, magics._mesh))
    completing.install(ipython, getattr(ipython, "kernel", None))  # Tab on the ranks
    if magics.publisher.in_kernel:
        from ..api import launch
        from . import waiting

        launch.warm_local_agent()  # the first %monarch_mesh finds its ranks' agent ready

        waiting.install(ipython)  # waiting %%monarch cells keep the widgets live
        from .lab import LabChannel

        # the JupyterLab extension's comm (its status item shows auto mode)
        magics.lab = LabChannel(magics.views, auto_of=lambda: line_of(ipython))
        from . import dap

        adapter = dap.install(getattr(ipython, "kernel", None))  # JupyterLab's debugger
        if adapter is not None:
            ipython.events.register("post_run_cell", lambda *_: adapter.watch())
    _loaded[id(ipython)] = magics


def unload_ipython_extension(ipython) -> None:
    magics = _loaded.pop(id(ipython), None)
    if magics is not None:
        from . import auto, completing, waiting

        waiting.uninstall(ipython)
        auto.turn_off(ipython)
        completing.uninstall(ipython, getattr(ipython, "kernel", None))
        magics.close()


__all__ = ["RemoteCellError", "load_ipython_extension", "unload_ipython_extension"]
