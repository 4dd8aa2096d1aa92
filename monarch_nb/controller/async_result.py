"""AsyncResult: the handle of one request (a fetch, a pull, a wait, a cell).

Block on it (``result``), poll it (``done``, ``partial``, ``ranks_pending``),
cancel it, or ``await`` it in the kernel's asyncio loop: the controller's IO
thread resolves it, so awaiting needs no nested loop.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import TimeoutError as FutureTimeout

from .requests import Request, check_timeout


class AsyncResult:
    """The pending result of one request on a mesh."""

    def __init__(self, controller, request: Request):
        self._ctrl = controller
        self._req = request
        self._future = request.future
        self._lock = threading.Lock()
        self._waiter = None  # the asyncio future that wait_async awaits

    @property
    def ident(self) -> int:
        return self._req.ident

    @property
    def what(self) -> str:
        return self._req.what

    def done(self) -> bool:
        """True once it has a value or an error, or was cancelled."""
        return self._future.done()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def cancel(self) -> bool:
        """Give up on the result: the commands behind it are dropped on the workers
        before they start, or interrupted where they run. False if it was already
        done (a second cancel included)."""
        with self._lock:
            if self._future.done() or not self._future.cancel():
                return False
        self._ctrl.cancel_request(self._req)
        return True

    @property
    def partial(self) -> dict:
        """rank -> value of the ranks that have answered so far."""
        return dict(self._req.values)

    @property
    def ranks_pending(self) -> list[int]:
        """The ranks whose reply has not arrived (empty once done)."""
        if self._future.done():
            return []
        return sorted({x if isinstance(x, int) else x[0] for x in set(self._req.expected)})

    def result(self, timeout: float | None = None):
        """The value: one rank's, or the list of every rank's in rank order. Raises
        the remote error, TimeoutError after ``timeout`` s (the request goes on), or
        CancelledError. Ctrl-C interrupts the mesh's running commands, waits up to
        5 s for them to stop, and re-raises."""
        timeout = check_timeout(timeout)
        try:
            self.wait(timeout)
            return self._future.result(0 if timeout is not None else None)
        except FutureTimeout:
            if self._future.done():  # the request's own deadline passed
                raise
            raise TimeoutError(
                f"{self.what}: no result within {timeout:g} s "
                f"(waiting for rank(s) {self.ranks_pending}; the request goes on)"
            ) from None
        except KeyboardInterrupt:
            self._ctrl.interrupts.after_ctrl_c()
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error it failed with, or None (waits like ``result``)."""
        timeout = check_timeout(timeout)
        try:
            return self._future.exception(timeout)
        except FutureTimeout:
            if self._future.done():
                raise
            raise TimeoutError(f"{self.what}: not done within {timeout:g} s") from None

    def add_done_callback(self, fn) -> None:
        """Call ``fn(self)`` when done (on the lease holder's thread, or at once if done)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` s passed (driving the socket meanwhile
        when nobody else does); whether it is done. The one blocking wait."""
        if timeout is not None and timeout <= 0:
            return self._future.done()
        if not self._future.done():
            self._ctrl.io.drive_until(self._future, timeout)
        return self._future.done()

    async def wait_async(self, timeout: float | None = None) -> bool:
        """``wait`` in the running asyncio loop: other tasks (the kernel's comm
        handlers) run meanwhile; whether it is done. The one awaited wait."""
        if self._future.done():
            return True
        loop = asyncio.get_running_loop()
        waiter = self._waiter
        if waiter is None or waiter.get_loop() is not loop:
            waiter = self._waiter = loop.create_future()  # one per loop, however often awaited

            def wake(_f) -> None:
                try:
                    loop.call_soon_threadsafe(_set, waiter)
                except RuntimeError:  # the loop is closed: nobody awaits any more
                    pass

            self._future.add_done_callback(wake)
        await asyncio.wait([waiter], timeout=timeout)
        return self._future.done()

    def __await__(self):
        return self._awaited().__await__()

    async def _awaited(self):
        try:
            await self.wait_async()
        except asyncio.CancelledError:
            self.cancel()
            raise
        return self._future.result(0)

    def __repr__(self) -> str:
        if self._future.cancelled():
            state = "cancelled"
        elif self._future.done():
            state = "failed" if self._future.exception(0) is not None else "done"
        else:
            state = f"pending on rank(s) {self.ranks_pending}"
        return f"<AsyncResult {self.what!r}: {state}>"


def _set(waiter) -> None:
    if not waiter.done():
        waiter.set_result(None)
