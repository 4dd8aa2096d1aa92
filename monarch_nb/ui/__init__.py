"""Widgets: the dashboard of a mesh (``mesh.dashboard()``, ``%monarch_mesh``).

Modules: ``render`` (``mesh.status()`` -> HTML, pure functions) and
``dashboard`` (the ``Dashboard`` widget and the one thread that redraws every
live dashboard at a bounded rate).
"""

from __future__ import annotations

from .dashboard import Dashboard, dashboards_of

__all__ = ["Dashboard", "dashboards_of"]
