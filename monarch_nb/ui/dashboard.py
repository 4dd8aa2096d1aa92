"""The dashboard: an ipywidgets view of one mesh's ``MeshState`` (``mesh.status()``).

Layout (every widget has a stable ``mnb-...`` class)::

    Dashboard (VBox, mnb-dashboard)
      HTML  mnb-dash-main      header, queues (ranks x streams), workers' health; above
                               GRID_ABOVE ranks: the heat grid of hosts x ranks (grid.py)
      VBox  mnb-grid-controls  big meshes only (not a child otherwise): stream choice,
                               drill-down to a rank (grid_view.py)
      HBox  mnb-dash-buttons   interrupt, restart, shut down (the last two: click twice)
                               and a note (mnb-dash-note) saying what they did
      HTML  mnb-dash-errors    failures per distinct traceback, newest first, expandable
      VBox  mnb-ts             activity (task_stream.py): each rank's recent commands, stacks
      VBox  mnb-dbg            debugger: paused sessions (mnb-dbg-sessions), a selector
                               (mnb-dbg-select), a command line (mnb-dbg-input), continue
                               all (mnb-dbg-continue) and the sessions' output (mnb-dbg-output)

The one redraw thread (``redraw.py``) redraws every live dashboard at most 10
times a second, and a dashboard sends a widget update only for a part whose HTML
changed. Widget updates from that thread go out on the kernel's IOPub
(ipykernel's comms are thread-safe); without a kernel the widgets still work
(their comms are dummies), so scripts and benchmarks can run a dashboard.

Debugger commands (``debugger_panel.py``) never block a comm handler: they run on
the dashboard's own thread (the reply waited for ``COMMAND_WAIT`` s at most).
"""

from __future__ import annotations

import html
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import ipywidgets as W

from . import grid, render
from .debugger_panel import continue_all, debugger_command
from .grid_view import GridControls
from .redraw import LOOP, snapshot
from .task_stream import TaskStream

logger = logging.getLogger("monarch_nb.ui")

CONFIRM_WINDOW = 5.0  # seconds in which a second click confirms restart / shut down
LOG_CHARS = 20_000  # the debugger output kept (its end)


def _classed(kind, cls: str, **kw):  # a stable class at creation: its comm_open carries it
    return kind(_dom_classes=(cls,), **kw)


class Dashboard(W.VBox):
    """The live dashboard of ``mesh``; ``mesh.dashboard()`` makes one.

    ``on_restart(mesh)`` / ``on_shutdown(mesh)`` run after the buttons did their
    work (the notebook layer re-attaches or forgets the mesh's output routing).
    ``live=False``: draw once and leave redrawing to the caller (``redraw()``).
    ``debugger=False``: no debugger part (a view that has its own console).
    """

    def __init__(
        self, mesh, *, live: bool = True, on_restart=None, on_shutdown=None, debugger: bool = True
    ):
        self.mesh = mesh
        self._on_restart = on_restart
        self._on_shutdown = on_shutdown
        self._draw_lock = threading.RLock()
        self._last: dict = {}
        self._sessions_key = None
        self._generation = None
        self._frozen = False
        self._busy = False  # a restart or shutdown runs
        self._armed: tuple | None = None  # (action, when) of a first click
        self._log = ""
        self._log_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.redraws = 0  # redraws that sent at least one update

        self.main = _classed(W.HTML, "mnb-dash-main")
        self.grid = GridControls(on_change=self.redraw)
        self.errors = _classed(W.HTML, "mnb-dash-errors")
        self.b_interrupt = _classed(
            W.Button,
            "mnb-dash-interrupt",
            description="interrupt",
            icon="stop",
            button_style="warning",
            tooltip="KeyboardInterrupt in whatever runs on every rank and stream",
        )
        self.b_restart = _classed(
            W.Button,
            "mnb-dash-restart",
            description="restart",
            icon="refresh",
            tooltip="fresh workers (click twice)",
        )
        self.b_shutdown = _classed(
            W.Button,
            "mnb-dash-shutdown",
            description="shut down",
            icon="power-off",
            button_style="danger",
            tooltip="stop every worker of this mesh (click twice)",
        )
        self.note = _classed(W.HTML, "mnb-dash-note")
        self.buttons = buttons = _classed(
            W.HBox,
            "mnb-dash-buttons",
            children=[self.b_interrupt, self.b_restart, self.b_shutdown, self.note],
        )
        self.sessions = _classed(W.HTML, "mnb-dbg-sessions")
        self.select = _classed(
            W.Dropdown, "mnb-dbg-select", options=[], layout=W.Layout(width="380px")
        )
        self.input = _classed(
            W.Text,
            "mnb-dbg-input",
            placeholder="pdb command (p x, ll, n, c …); Enter sends",
            continuous_update=False,
            layout=W.Layout(width="320px"),
        )
        self.b_continue = _classed(
            W.Button,
            "mnb-dbg-continue",
            description="continue all",
            icon="play",
            tooltip="continue every paused session",
        )
        self.output = _classed(W.HTML, "mnb-dbg-output")
        self.command_row = _classed(
            W.HBox,
            "mnb-dbg-row",
            children=[self.select, self.input, self.b_continue],
            layout=W.Layout(display="none"),
        )
        self.debugger_panel = _classed(
            W.VBox, "mnb-dbg", children=[self.sessions, self.command_row, self.output]
        )
        # the grid's controls are a child only of a big mesh's dashboard (its size is fixed)
        big = grid.use_grid(snapshot(mesh)[0])
        self.activity = TaskStream(mesh, time.time)
        parts = [self.main] + ([self.grid] if big else []) + [buttons, self.errors, self.activity]
        parts += [self.debugger_panel] if debugger else []
        super().__init__(parts, _dom_classes=("mnb-dashboard",))

        self.b_interrupt.on_click(self._click_interrupt)
        self.b_restart.on_click(self._click_restart)
        self.b_shutdown.on_click(self._click_shutdown)
        self.b_continue.on_click(self._click_continue)
        self.input.observe(self._on_input, "value")

        self.redraw()
        if live and not self._frozen:
            LOOP.add(self)

    # ------------------------------------------------------------ drawing

    def _set(self, widget, part: str, value: str) -> bool:
        if self._last.get(part) == value:
            return False
        self._last[part] = value
        widget.value = value
        return True

    def redraw(self, cache: dict | None = None) -> None:
        """Draw the current status; send only the parts that changed. The redraw
        thread calls it; any thread may."""
        with self._draw_lock:
            if self._frozen:
                return
            status, state = snapshot(self.mesh, cache)
            changed = False
            if status.get("generation") != self._generation:
                if self._generation is not None:  # restarted: the old sessions are gone
                    with self._log_lock:
                        self._log = ""
                        self._set(self.output, "output", "")
                self._generation = status.get("generation")
            big = grid.use_grid(status)
            main = grid.main_html(status, state, self.grid.stream) if big else None
            changed |= self._set(self.main, "main", main or render.main_html(status, state))
            changed |= self.grid.draw(status, big)
            changed |= self._set(self.errors, "errors", render.errors_html(status))
            changed |= self._draw_sessions(status, state)
            changed |= self.activity.draw(status)
            if self._armed and time.monotonic() - self._armed[1] > CONFIRM_WINDOW:
                self._disarm()
            self._enable(state)
            if changed:
                self.redraws += 1
            if state == "shut down":
                self._freeze("shut down")

    def _draw_sessions(self, status: dict, state: str) -> bool:
        sessions = status.get("debugger") or []
        key = tuple(
            (s["rank"], s["stream"], s.get("file"), s.get("line"), s.get("function"))
            for s in sessions
        )
        if key == self._sessions_key:
            return False
        self._sessions_key = key
        self._set(self.sessions, "sessions", render.sessions_html(status))
        options = [(render.session_label(s), (s["rank"], s["stream"])) for s in sessions]
        if len(sessions) > 1:
            options.append(("every paused session (cast)", "*"))
        keep = self.select.value
        values = [v for _, v in options]
        with self.select.hold_sync():
            self.select.options = options
            # the session selected before stays selected; else the first one
            self.select.index = values.index(keep) if keep in values else 0 if values else None
        display = "flex" if sessions else "none"
        if self.command_row.layout.display != display:
            self.command_row.layout.display = display
        return True

    def _enable(self, state: str) -> None:
        usable = state == "ok" and not self._busy
        for b, on in (
            (self.b_interrupt, usable),
            (self.b_restart, state != "shut down" and not self._busy),
            (self.b_shutdown, state != "shut down" and not self._busy),
        ):
            if b.disabled == on:
                b.disabled = not on

    def refresh(self) -> None:
        """Redraw now (from the calling thread)."""
        self.redraw()

    def _freeze(self, why: str) -> None:
        """The last redraw: controls off, no more updates."""
        self._frozen = True
        LOOP.remove(self)
        for w in (self.b_interrupt, self.b_restart, self.b_shutdown, self.b_continue, self.input):
            w.disabled = True
        self.select.disabled = True
        self._set(self.note, "note", f"<i>{why}</i>")

    def freeze(self, why: str = "not live: a newer view of this mesh replaced it") -> None:
        """Stop redrawing this view (a newer one replaces it); draw it one last time."""
        with self._draw_lock:
            if self._frozen:
                return
            self.redraw()
            self._freeze(why)

    @property
    def live(self) -> bool:
        return not self._frozen

    def close(self) -> None:
        LOOP.remove(self)
        self._frozen = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        self.activity.close()
        for w in self._all_widgets():
            w.close()
        super().close()

    def _all_widgets(self) -> list:
        return [self.main, self.errors, self.b_interrupt, self.b_restart, self.b_shutdown] + [
            self.note, self.buttons, self.sessions, self.select, self.input, self.b_continue,
            self.output, self.command_row, self.debugger_panel, self.grid, *self.grid.widgets(),
            *self.activity.widgets(),
        ]  # fmt: skip

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        status, state = snapshot(self.mesh)
        data["text/plain"] = render.status_text(status, state)
        main = grid.main_html(status, state) if grid.use_grid(status) else None
        data["text/html"] = (main or render.main_html(status, state)) + render.errors_html(status)
        return data

    def __repr__(self) -> str:
        return f"<Dashboard of mesh {self.mesh.name!r}>"

    # ------------------------------------------------------------ buttons

    def _say(self, text: str) -> None:
        self._set(self.note, "note", f"<span>{html.escape(text)}</span>")

    def _click_interrupt(self, _b=None) -> None:
        try:
            self.mesh.interrupt()
            self._say("interrupt sent to every rank")
        except Exception as e:
            self._say(f"interrupt failed: {e}")

    def _confirmed(self, action: str, button) -> bool:
        """The second click within CONFIRM_WINDOW confirms."""
        now = time.monotonic()
        if self._armed and self._armed[0] == action and now - self._armed[1] <= CONFIRM_WINDOW:
            self._disarm()
            return True
        self._disarm()
        self._armed = (action, now, button, button.description)
        button.description = f"confirm {action}?"
        self._say(f"click again within {CONFIRM_WINDOW:.0f} s to {action} mesh {self.mesh.name!r}")
        return False

    def _disarm(self) -> None:
        if self._armed:
            _, _, button, description = self._armed
            button.description = description
            self._armed = None

    def _click_restart(self, _b=None) -> None:
        if self._confirmed("restart", self.b_restart):
            self._background("restart", self._restart)

    def _click_shutdown(self, _b=None) -> None:
        if self._confirmed("shut down", self.b_shutdown):
            self._background("shut down", self._shutdown)

    def _background(self, what: str, fn) -> threading.Thread:
        self._busy = True
        self._say(f"{what}: working …")
        self.redraw()

        def run():
            try:
                fn()
            except Exception as e:
                self._say(
                    f"{what} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                )
            finally:
                self._busy = False
                try:
                    self.redraw()
                except Exception:
                    logger.exception("dashboard redraw failed")

        t = threading.Thread(target=run, name=f"monarch-nb-ui-{what}", daemon=True)
        t.start()
        return t

    def _restart(self) -> None:
        self.mesh.restart()
        if self._on_restart is not None:
            self._on_restart(self.mesh)
        self._say(f"restarted: generation {self.mesh.generation}")

    def _shutdown(self) -> None:
        self.mesh.shutdown()
        if self._on_shutdown is not None:
            self._on_shutdown(self.mesh)
        self._say("shut down")

    def _click_continue(self, _b=None) -> None:
        self._submit_call(self._continue_all)

    def _continue_all(self) -> None:
        self._append(continue_all(self.mesh))

    # ------------------------------------------------------------ debugger

    def _on_input(self, change) -> None:
        line = change["new"]
        if not line or not line.strip():
            return
        self.input.value = ""
        self.submit(line)

    def _submit_call(self, fn, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="monarch-nb-ui-dbg")
        return self._pool.submit(fn, *args)

    def submit(self, line: str, target=None) -> Future:
        """Send ``line`` to the selected session (``target``: (rank, stream name) or
        ``"*"`` for every paused one) from the dashboard's thread; its output goes
        to the panel. The Future ends with the reply (or after COMMAND_WAIT)."""
        return self._submit_call(
            self._command, self.select.value if target is None else target, line
        )

    def _command(self, target, line: str) -> None:
        debugger_command(self.mesh, target, line, self._append)

    def _append(self, text: str) -> None:
        with self._log_lock:
            log = self._log + text + "\n"
            if len(log) > LOG_CHARS:
                log = log[-LOG_CHARS:]
            self._log = log
            self._set(self.output, "output", render.output_html(log))

    @property
    def log(self) -> str:
        """The debugger panel's output, as text."""
        return self._log
