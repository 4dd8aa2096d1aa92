"""Widgets: the dashboard of a mesh (``mesh.dashboard()``, ``%monarch_mesh``).

Modules: ``render`` (``mesh.status()`` -> HTML, pure functions), ``redraw`` (the
one thread that redraws every live view at a bounded rate), ``debugger`` (the
debugger front end every console shares) and ``dashboard`` (the ``Dashboard``
widget).
"""

from __future__ import annotations

from .dashboard import Dashboard
from .redraw import dashboards_of

__all__ = ["Dashboard", "dashboards_of"]
