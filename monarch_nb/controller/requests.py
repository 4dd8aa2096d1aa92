"""The request table: every reply a caller waits for, with its lifetime.

Only the lease holder reads or changes the table: a request is registered there
just before its message leaves (one step, so no reply can come first), and it
leaves the table when it completes, fails, passes its deadline, is cancelled,
or its mesh restarts or shuts down. Nothing stays behind.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, InvalidStateError

from .errors import RemoteError
from .failures import FailureLog

DEPENDENT_GRACE = 2.0  # seconds a dependent reply waits for the original failure to arrive


class Request:
    """Replies that one call waits for: FetchResults from ``ranks`` (``order``: the
    ranks whose values make the result; None: a status request, whose expected
    replies are (rank, stream) pairs)."""

    __slots__ = (
        "ident",
        "idents",
        "ranks",
        "order",
        "expected",
        "values",
        "failures",
        "dependent",
        "future",
        "single",
        "what",
        "source",
        "deadline",
        "timeout",
        "failed_by",
    )

    def __init__(
        self,
        ident: int,
        expected,
        order,
        single: bool,
        what: str,
        source: int | None = None,
        timeout: float | None = None,
        idents: tuple = (),
        ranks=(),
    ):
        self.ident = ident
        self.idents = idents or (ident,)  # the commands a cancel stops on the workers
        self.ranks = tuple(ranks)
        self.order = order
        self.expected = set(expected)
        self.values: dict = {}
        self.failures: dict = {}
        self.dependent: dict = {}
        self.future: Future = Future()
        self.single = single
        self.what = what
        self.source = source
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.failed_by: int | None = None  # a command whose failure fails this request

    def settle(self, value=None, error: BaseException | None = None) -> bool:
        """Complete the future unless a cancel came first; True if this settled it."""
        try:
            if error is None:
                self.future.set_result(value)
            else:
                self.future.set_exception(error)
        except InvalidStateError:
            return False
        return True


def check_timeout(timeout, what: str = "timeout") -> float | None:
    """``timeout`` as seconds (> 0) or None; anything else is a ValueError naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{what} must be a number of seconds or None, got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"{what} must be > 0 seconds (or None: no limit), got {timeout!r}")
    return float(timeout)


class RequestTable:
    """ident -> Request, read and changed by the lease holder."""

    def __init__(self, failures: FailureLog):
        self._failures = failures
        self._table: dict[int, Request] = {}
        self._awaiting: dict[int, list] = {}  # original ident -> [(since, request)]

    def __len__(self) -> int:
        return len(self._table)

    def add(self, req: Request) -> None:
        if req.future.done():  # cancelled before it left
            return
        self._table[req.ident] = req

    def get(self, ident: int) -> Request | None:
        return self._table.get(ident)

    def pop(self, ident: int) -> Request | None:
        return self._table.pop(ident, None)

    # ------------------------------------------------------------ replies

    def on_fetch(self, ident: int, rank: int, value, error, dependent_on: int | None) -> None:
        req = self._table.get(ident)
        if req is None or rank not in req.expected:
            return
        req.expected.discard(rank)
        if dependent_on is not None:
            req.dependent[rank] = dependent_on
        elif error is None:
            req.values[rank] = value
        else:
            req.failures[rank] = tuple(error)
        if not req.expected:
            self._finish(req)

    def on_status(self, ident: int, rank: int, stream: int) -> None:
        req = self._table.get(ident)
        if req is None:
            return
        req.expected.discard((rank, stream))
        if not req.expected:
            self._finish(req)

    def on_status_many(self, ident: int, ranks, stream: int) -> None:
        """``on_status`` of several ranks at once (a host's folded Status)."""
        req = self._table.get(ident)
        if req is None:
            return
        req.expected.difference_update([(r, stream) for r in ranks])
        if not req.expected:
            self._finish(req)

    def on_failure(self, ident: int) -> None:
        """Command ``ident`` failed: the replies that depend on it can finish now."""
        for _, req in self._awaiting.pop(ident, []):
            self._finish(req)

    def _finish(self, req: Request, grace_over: bool = False) -> None:
        log = self._failures
        if req.failures:
            self._table.pop(req.ident, None)
            req.settle(
                error=RemoteError(req.failures, req.ident, log.headline(req.what, req.failures))
            )
            return
        if req.dependent:
            orig = min(req.dependent.values())
            what = log.what(orig)
            if orig == req.source:
                context = log.headline(what, log.get(orig))
            else:
                context = f"{req.what}: the value depends on command {what!r}, which failed"
            err = log.error(orig, context)
            if err is None and not grace_over:
                # the original failure is still on its way (it may come through another socket)
                self._awaiting.setdefault(orig, []).append((time.monotonic(), req))
                return
            self._table.pop(req.ident, None)
            req.settle(
                error=err
                or RemoteError(
                    {}, orig, f"{req.what}: the value depends on command {what!r}, which failed"
                )
            )
            return
        self._table.pop(req.ident, None)
        if req.failed_by is not None and log.get(req.failed_by):
            err = log.error(req.failed_by, log.headline(req.what, log.get(req.failed_by)))
            err.results = [req.values.get(r) for r in req.order]
            req.settle(error=err)
        elif req.order is None:
            req.settle(None)
        elif req.single:
            req.settle(req.values[req.order[0]])
        else:
            req.settle([req.values[r] for r in req.order])

    # ------------------------------------------------------------ lifetimes

    def tick(self, now: float) -> list[Request]:
        """Finish dependents whose grace is over; fail requests past their deadline.
        Returns the expired ones (their commands are to be cancelled on the workers)."""
        for orig, waiting in list(self._awaiting.items()):
            keep = []
            for since, req in waiting:
                if now - since >= DEPENDENT_GRACE:
                    self._finish(req, grace_over=True)
                else:
                    keep.append((since, req))
            if keep:
                self._awaiting[orig] = keep
            else:
                del self._awaiting[orig]
        expired = [r for r in self._table.values() if r.deadline is not None and now >= r.deadline]
        for req in expired:
            self._table.pop(req.ident, None)
            pending = sorted({x if isinstance(x, int) else x[0] for x in req.expected})
            req.settle(
                error=TimeoutError(
                    f"{req.what} did not finish within {req.timeout:g} s "
                    f"(no reply yet from rank(s) {pending}); it was cancelled"
                )
            )
        return expired

    def fail(self, ident: int, err: BaseException) -> bool:
        req = self._table.pop(ident, None)
        if req is None:
            return False
        req.settle(error=err)
        return True

    def fail_rank(self, rank: int, err: BaseException) -> int:
        """Fail every request that waits for a reply from ``rank``."""
        hit = [
            r
            for r in self._table.values()
            if any((x if isinstance(x, int) else x[0]) == rank for x in r.expected)
        ]
        for req in hit:
            self._table.pop(req.ident, None)
            req.settle(error=err)
        return len(hit)

    def fail_all(self, err: BaseException) -> bool:
        """Fail every request (the mesh broke, restarts or shuts down); True if a
        caller was waiting."""
        table, self._table = self._table, {}
        awaiting, self._awaiting = self._awaiting, {}
        waiting = False
        for req in [*table.values(), *(r for w in awaiting.values() for _, r in w)]:
            waiting |= req.settle(error=err)
        return waiting
