"""A waiting ``%%monarch`` cell that keeps the kernel's widgets live.

ipykernel runs a cell as a coroutine when its code has a top-level ``await``,
and while that coroutine awaits, the kernel goes on handling comm messages
(ipykernel >= 7 dispatches them beside the running cell): the dashboard's
buttons and debugger panel work while the cell waits. A blocking wait would
freeze them until the cell ends.

So, in a kernel, an input transformer rewrites a blocking ``%%monarch`` cell::

    %%monarch --ranks 1            await get_ipython().find_cell_magic('monarch')
    x = f(rank)              ->        .__self__.monarch_awaited('--ranks 1', 'x = f(rank)\\n')

and ``wait`` below is the asynchronous twin of ``CellRun.wait``: same
output, values, failures and inline debugger prompt. The differences that the
event loop brings:

* The notebook's interrupt (SIGINT) cancels an async cell (ipykernel turns it
  into ``CancelledError`` at the await); the wait treats that as the
  interrupt: KeyboardInterrupt on the cell's ranks, then the cell shows where
  they stopped.
* The inline debugger prompt reads the kernel's stdin, which blocks; while it
  reads, SIGINT raises KeyboardInterrupt again (as in a blocking cell) and the
  widgets wait for the prompt to return. A prompt left with ``detach`` lets the
  dashboard's panel serve the sessions while the cell goes on waiting.

``--noblock`` cells, ``-h`` and anything that is not a ``%%monarch`` cell are
left alone, and so is every cell under ``%autoawait off`` (or another loop
runner than asyncio); ``ASYNC_WAIT = False`` turns the rewrite off. With
ipykernel < 7 comm messages wait for the cell anyway: the rewrite changes
nothing visible there.
"""

from __future__ import annotations

import asyncio
import shlex
import signal
import time

from .cell import POLL, CellRun, _Detached

ASYNC_WAIT = True  # rewrite blocking %%monarch cells into awaited ones (in a kernel)


def _awaits(shell) -> bool:
    """Does ``shell`` run top-level ``await`` on asyncio (``%autoawait`` on, the default)?"""
    if shell is None:
        return True
    try:
        from IPython.core.interactiveshell import _asyncio_runner
    except ImportError:
        return False
    return bool(getattr(shell, "autoawait", False)) and shell.loop_runner is _asyncio_runner


def transform(lines: list[str], shell=None) -> list[str]:
    """IPython cleanup transformer: a blocking ``%%monarch`` cell -> an awaited call
    (unless ``shell`` does not run top-level await on asyncio: ``%autoawait off``)."""
    if not ASYNC_WAIT or not lines or not lines[0].startswith("%%"):
        return lines
    name, _, args = lines[0][2:].rstrip().partition(" ")
    if name != "monarch":
        return lines
    try:
        tokens = shlex.split(args)
    except ValueError:
        return lines  # the magic itself reports the bad arguments
    if any(t in ("--noblock", "-h", "--help") for t in tokens) or not _awaits(shell):
        return lines
    body = "".join(lines[1:])
    return [
        "await get_ipython().find_cell_magic('monarch').__self__"
        f".monarch_awaited({args!r}, {body!r})\n"
    ]


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


async def _wait(run: CellRun, timeout: float | None) -> bool:
    """Await the cell's end (True) or ``timeout`` (False). Without a timeout, this
    cell's paused debugger sessions are served at the inline prompt."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not run.future.done():
        left = POLL if deadline is None else min(POLL, deadline - time.monotonic())
        if left <= 0:
            return False
        await run.future.wait_async(left)
        if deadline is None and not run._debug_detached and run._paused_here():
            _prompt(run)
    return True


def _prompt(run: CellRun) -> None:
    """The inline debugger prompt (blocking stdin), with SIGINT raising
    KeyboardInterrupt while it reads, as in a blocking cell."""
    try:
        old = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread
        old = None
    try:
        run._debug()
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


async def _wait_interrupted(run: CellRun) -> bool:
    run.interrupt()
    deadline = run.interrupt_deadline()
    while True:
        try:
            return await _wait(run, max(0.0, deadline - time.monotonic()))
        except (asyncio.CancelledError, KeyboardInterrupt):
            _uncancel()
            run.interrupt()  # pressed again: interrupt again


async def wait(run: CellRun) -> None:
    """``CellRun.wait``, awaited: the kernel handles widget messages meanwhile."""
    interrupted = False
    try:
        await _wait(run, None)
    except _Detached:
        run.detach()
        return
    except (asyncio.CancelledError, KeyboardInterrupt):
        _uncancel()
        interrupted = True
        if not await _wait_interrupted(run):
            run.detach()
            raise run.stuck() from None
    finally:
        run.router.blocking.discard(run.ident)
    err = run._finish(interrupted)
    if err is not None:
        raise err


class Transformer:
    """``transform`` bound to one shell (an IPython cleanup transformer)."""

    def __init__(self, shell):
        self.shell = shell

    def __call__(self, lines: list[str]) -> list[str]:
        return transform(lines, self.shell)


def install(shell) -> None:
    if not any(isinstance(t, Transformer) for t in shell.input_transformers_cleanup):
        shell.input_transformers_cleanup.append(Transformer(shell))


def uninstall(shell) -> None:
    shell.input_transformers_cleanup[:] = [
        t for t in shell.input_transformers_cleanup if not isinstance(t, Transformer)
    ]
