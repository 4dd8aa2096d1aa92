"""One entry of the controller's table of requests: the replies a user call waits for."""

from __future__ import annotations

from concurrent.futures import Future


class Pending:
    """Replies that one user call waits for."""

    __slots__ = (
        "ident",
        "order",
        "expected",
        "values",
        "failures",
        "dependent",
        "future",
        "single",
        "what",
        "source",
    )

    def __init__(
        self, ident: int, expected, order, single: bool, what: str, source: int | None = None
    ):
        self.source = source
        self.ident = ident
        self.order = order
        self.expected = set(expected)
        self.values: dict = {}
        self.failures: dict = {}
        self.dependent: dict = {}
        self.future: Future = Future()
        self.single = single
        self.what = what
