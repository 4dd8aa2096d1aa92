"""Where ``%monarch_mesh`` shows a mesh: its dashboard (``monarch_nb.ui.Dashboard``)
under the cell, docked in JupyterLab's side area (``--dashboard side``, the
``sidecar`` package), or a status line (``--dashboard none``, and outside a
kernel).

The magics keep one live dashboard per mesh: showing the mesh again (or
restarting it) draws the previous view one last time and freezes it. A
dashboard shown with ``mesh.dashboard()`` is the user's and stays live.
"""

from __future__ import annotations

from ..ui import Dashboard, dashboards_of
from ..ui.render import mesh_state, status_text

WHERE = ("cell", "side", "none")


def status_line(mesh) -> str:
    status = mesh.status()
    return status_text(status, mesh_state(status, mesh.alive, mesh.closed))


class MeshViews:
    """The magics' dashboards, one live per mesh."""

    def __init__(self, in_kernel: bool, on_restart=None, on_shutdown=None):
        self.in_kernel = in_kernel
        self._on_restart = on_restart
        self._on_shutdown = on_shutdown
        self._live: dict[int, tuple] = {}  # mesh.key -> (dashboard, sidecar or None)

    def show(self, mesh, where: str = "cell") -> Dashboard | None:
        from IPython.display import display

        if not self.in_kernel or where == "none":
            print(status_line(mesh))
            return None
        self._retire(mesh)
        d = Dashboard(mesh, on_restart=self._on_restart, on_shutdown=self._on_shutdown)
        side = None
        if where == "side":
            side = self._dock(mesh, d)
        if side is None:
            display(d)
        self._live[mesh.key] = (d, side)
        return d

    def extra(self, mesh, **kw) -> Dashboard:
        """A live dashboard shown elsewhere (the Lab extension's panel), with the
        magics' restart / shut down hooks; the magics never retire it."""
        return Dashboard(mesh, on_restart=self._on_restart, on_shutdown=self._on_shutdown, **kw)

    def _dock(self, mesh, d: Dashboard):
        """The dashboard in a sidecar panel; None (and a note) without the package."""
        from IPython.display import display

        try:
            from sidecar import Sidecar
        except ImportError:
            print("monarch_nb: the sidecar package is not installed: the dashboard shows here")
            return None
        side = Sidecar(title=f"mesh {mesh.name}", anchor="split-right")
        side.add_class("mnb-sidecar")
        side.append_display_data(d)
        display({"text/plain": f"{status_line(mesh)}; dashboard docked in the side area"}, raw=True)
        return side

    def _retire(self, mesh) -> None:
        old = self._live.pop(mesh.key, None)
        if old is None:
            return
        d, side = old
        if side is not None:
            d.close()
            side.close()
        else:
            d.freeze()

    def refresh(self, mesh, final: bool = False) -> None:
        """Redraw every live dashboard of ``mesh`` now (a shut down mesh: the last time)."""
        for d in dashboards_of(mesh):
            d.refresh()
        if final:
            entry = self._live.get(mesh.key)
            if entry is not None and not entry[0].live:
                del self._live[mesh.key]

    def close(self) -> None:
        """The extension unloads: the magics' dashboards stop redrawing."""
        live, self._live = list(self._live.values()), {}
        for d, _side in live:
            d.freeze("not live: the monarch_nb extension was unloaded")
