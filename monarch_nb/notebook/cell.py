"""One ``%%monarch`` cell on its ranks: send it, wait for it (or not), interrupt it,
and show its output, values, figures and failures under the cell that ran it.

A cell is one command, ``mesh.run_cell``, on the chosen stream of each target
rank: the worker runs the source in its namespace, reports a failure like any
command, then replies with the mimebundle of the last expression and the
figures. Everything a stream sends travels in order on one socket, so when
the replies are in, so are the cell's output and failures.
"""

from __future__ import annotations

import sys
import time

from IPython.core.error import UsageError

from .. import config
from ..controller import AsyncResult, MeshClosedError, RemoteError, WorkerCrashed, format_ranks
from ..protocol.wire import RefUseError
from .output import CellSink, OutputHub
from .pdb_prompt import NoStdin, Prompt, notice
from .results import RemoteCellError, render_failures, result_displays

POLL = 0.25


class _Detached(Exception):
    """The cell goes on in the background (paused sessions, no stdin to serve them)."""


class CellRun:
    def __init__(
        self,
        hub: OutputHub,
        mesh,
        ranks: list,
        stream,
        source: str,
        filename: str,
        names: tuple,
        parent,
        label: str,
        what: str | None = None,
    ):
        self.hub = hub
        self.mesh = mesh
        self.ranks = list(ranks)
        self.stream = stream
        self.source = source
        self.filename = filename
        self.names = names
        self.parent = parent
        self.label = label
        self.what = what or label
        self.ident: int | None = None
        self.future: AsyncResult | None = None
        self.sink: CellSink | None = None
        self.router = None
        self._finished = False
        self._debug_detached = False
        self._waited = False
        self._interrupt_wait = 0.0  # the setting interrupt_wait, read at the last Ctrl-C

    # ------------------------------------------------------------ sending

    @staticmethod
    def check_usable(mesh) -> None:
        """A shut down or broken mesh, said plainly, with what to do about it."""
        try:
            mesh.check_usable()
        except MeshClosedError as e:
            raise RemoteCellError({}, None, f"{e}: create it again with %monarch_mesh") from None
        except WorkerCrashed as e:
            context = (
                f"mesh {mesh.name!r} needs a restart: its worker rank {e.rank} died earlier "
                f"({e.how}); {restart_hint(mesh)}"
            )
            raise RemoteCellError(e.failures, e.ident, context, brief=True) from None
        except RemoteError as e:
            context = f"{e.head()}: {restart_hint(mesh)}"  # "mesh ... is broken: ..."
            raise RemoteCellError(e.failures, e.ident, context, brief=True) from None

    def send(self, waited: bool = True) -> None:
        """Send the cell. A ``waited`` cell serves its own pauses at the inline prompt
        from the start: a pause that comes before ``wait`` begins gets no notice."""
        self.check_usable(self.mesh)
        self._waited = waited
        names, auto = self.names
        self.router = self.hub.router(self.mesh)
        self.sink = CellSink(self.hub.publisher, self.parent, self.ranks)
        try:
            self.future = self.mesh.run_cell(
                self.source,
                stream=self.stream,
                ranks=self.ranks,
                names=names,
                auto=auto,
                filename=self.filename,
                what=self.what,
                before_send=self._registered,
            )
        except RefUseError as e:
            raise UsageError(f"%%monarch --push: {e}") from None

    def _registered(self, ident: int) -> None:
        """The cell's output goes to its sink from its first byte on."""
        self.ident = ident
        self.router.register(ident, self.sink)
        if self._waited:
            self.router.blocking.add(ident)

    def interrupt(self) -> None:
        """KeyboardInterrupt in whatever runs now on this cell's stream and ranks."""
        if self.mesh.alive:
            self.stream.interrupt(self.ranks)

    def interrupt_deadline(self) -> float:
        """When the ranks interrupted now count as stuck: the setting ``interrupt_wait``
        from now (read at each Ctrl-C, so ``%config`` takes effect at once)."""
        self._interrupt_wait = config.setting("interrupt_wait")
        return time.monotonic() + self._interrupt_wait

    # ------------------------------------------------------------ blocking

    def wait(self) -> None:
        """Block until the cell ends on every rank; show its output, values and
        figures; raise RemoteCellError when ranks failed. The notebook's interrupt
        (KeyboardInterrupt here) interrupts the ranks and shows where they stopped."""
        interrupted = False
        try:
            self._wait(None)
        except _Detached:
            self.detach()
            return
        except KeyboardInterrupt:
            interrupted = True
            if not self._wait_interrupted():
                self.detach()
                raise self.stuck() from None
        finally:
            self.router.blocking.discard(self.ident)
        err = self._finish(interrupted)
        if err is not None:
            raise err

    def stuck(self) -> KeyboardInterrupt:
        """What an interrupt that did not stop the ranks raises (blocking or awaited):
        it names the ranks still in the cell, not those that stopped."""
        return KeyboardInterrupt(
            f"{format_ranks(self.unfinished() or self.ranks)} did not stop within "
            f"{self._interrupt_wait:g} s "
            f"(stuck outside Python code?); their output still lands under this cell. "
            f"%monarch_mesh --restart gives fresh workers."
        )

    def unfinished(self) -> list:
        """The live ranks that have not finished this cell (its result included), as
        their last progress reports say."""
        ranks = self.mesh.status()["ranks"]
        return [
            r
            for r in self.ranks
            if (w := ranks.get(r)) is not None
            and w["alive"]
            and w["streams"].get(self.stream.name, {}).get("last", 0) < self.ident
        ]

    def _wait(self, timeout: float | None) -> bool:
        """Wait for the cell's end (in short slices, so that signals land); True if it
        ended. While it waits without a deadline, paused debugger sessions turn the
        cell into the debugger prompt."""
        fut = self.future
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            left = POLL if deadline is None else min(POLL, deadline - time.monotonic())
            if left <= 0:
                return False
            fut.wait(left)
            if deadline is None and not self._debug_detached and self._paused_here():
                self._debug()
        return True

    def _mine(self, session) -> bool:
        return session.ident == self.ident

    def _paused_here(self) -> bool:
        return any(self._mine(s) for s in self.mesh.debugger.waiting())

    def _debug(self) -> None:
        """Serve this cell's paused sessions at the kernel's stdin until they go on or
        the user detaches; with JupyterLab's debugger on, its panel serves them."""
        if _panel_open():  # a stdin prompt could not be taken back once they continue
            self._debug_detached = True
            print(
                "monarch_nb: paused in the debugger: the debugger panel shows the paused "
                "ranks (continue them there)",
                flush=True,
            )
            return
        prompt = Prompt(self.mesh.debugger, only=self._mine)
        try:
            prompt.serve()
        except NoStdin:
            dbg = self.mesh.debugger
            waiting = [s for s in dbg.waiting() if self._mine(s)]
            for s in waiting:
                dbg.claim_notice(s)  # said here: the router says nothing more of them
            print(
                notice(waiting) + ". This front end has no stdin: the cell goes on in the "
                "background; serve the sessions with %monarch_debug (or the dashboard).",
                flush=True,
            )
            raise _Detached() from None
        if prompt.detached:
            self._debug_detached = True

    def _wait_interrupted(self) -> bool:
        self.interrupt()
        deadline = self.interrupt_deadline()
        while True:
            try:
                return self._wait(max(0.0, deadline - time.monotonic()))
            except KeyboardInterrupt:
                self.interrupt()  # pressed again: interrupt again

    # ------------------------------------------------------------ not blocking

    def detach(self) -> None:
        """Let the cell finish in the background; its output, values and failures
        still go under its own cell."""
        if self.ident is not None:
            self.router.blocking.discard(self.ident)
        self.future.add_done_callback(lambda _f: self.hub.ticker.call_soon(self._finish_detached))

    def _finish_detached(self) -> None:
        err = self._finish(False)
        if err is not None:
            self.hub.publisher.error(
                self.parent, type(err).__name__, str(err), err._render_traceback_()
            )

    # ------------------------------------------------------------ the end

    def _finish(self, interrupted: bool) -> RemoteCellError | None:
        """Publish the rest of the output, the values and figures; the failure, if any."""
        if self._finished:
            return None
        self._finished = True
        fut = self.future
        try:
            self.sink.finish()
        finally:
            self.router.unregister(self.ident)
        results: list = []
        broken: BaseException | None = None
        failures = {}
        try:
            results = fut.result()  # done by now
        except RemoteError as e:
            if e.ident == self.ident:  # the cell failed on some ranks
                failures.update(e.failures)
                results = getattr(e, "results", [])
            else:
                broken = e
        except BaseException as e:  # noqa: B036 - a crash or shutdown ends the cell
            broken = e
        err = self.mesh.failure_of(self.ident)  # failures after a crash
        if err is not None:
            failures.update(err.failures)
        per_rank = dict(zip(self.ranks, results)) if results else {}
        for bundle in result_displays(per_rank):
            self.hub.publisher.display(self.parent, bundle)
        where = f"{self.label} on mesh {self.mesh.name!r}"
        if broken is not None:
            if isinstance(broken, WorkerCrashed):  # said once, with the way out
                context = f"{where}: {crash_line(broken, self.mesh)}"
            elif isinstance(broken, RemoteError):
                failures.update({r: f for r, f in broken.failures.items() if r not in failures})
                context = f"{where}: {broken.head()}"
            else:
                context = f"{where}: {type(broken).__name__}: {broken}"
            return RemoteCellError(failures, self.ident, context)
        if failures:
            what = "interrupted" if interrupted else "failed"
            return RemoteCellError(
                failures, self.ident, f"{where} {what} on {format_ranks(failures)}"
            )
        return None


def restart_hint(mesh) -> str:
    """The way out of a broken mesh, as typed in this notebook."""
    from ..api.mesh import get_mesh

    try:
        current = get_mesh() is mesh
    except Exception:
        current = False
    name = "" if current else f" --name {mesh.name}"
    return f"%monarch_mesh --restart{name} (or mesh.restart()) gives fresh workers"


def crash_line(e: WorkerCrashed, mesh) -> str:
    """A crash, once: rank, exit, the way out, then what it wrote to stderr last."""
    text = f"worker rank {e.rank} died ({e.how}); {restart_hint(mesh)}"
    tail = e.stderr_tail.rstrip()
    return f"{text}\nlast lines of its stderr:\n{tail}" if tail else text


__all__ = ["CellRun", "RemoteCellError", "render_failures"]


def _panel_open() -> bool:
    dap = sys.modules.get(f"{__package__}.dap")  # loaded only where the adapter is
    return dap is not None and dap.PANEL.attached
