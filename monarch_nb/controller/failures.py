"""The failures the workers reported, by command, and which the user has not seen."""

from __future__ import annotations

from .errors import RemoteError, format_ranks

MAX_FAILURES_KEPT = 10_000


class FailureLog:
    """Command ident -> {rank: failure}. A failure is *unreported* until a call
    raised it (a fetch of the value, ``mesh.wait()``, the cell that ran it)."""

    def __init__(self, mesh: str):
        self.mesh = mesh
        self._failures: dict[int, dict] = {}
        self._what: dict[int, str] = {}
        self._unreported: list[int] = []

    def record(self, ident: int, rank: int, failure: tuple, what: str) -> None:
        failures = self._failures.setdefault(ident, {})
        if not failures:
            self._unreported.append(ident)
            self._what[ident] = what
            if len(self._failures) > MAX_FAILURES_KEPT:
                oldest = next(iter(self._failures))
                self._failures.pop(oldest)
                self._what.pop(oldest, None)
        failures[rank] = tuple(failure)

    def get(self, ident: int) -> dict:
        return self._failures.get(ident, {})

    def what(self, ident: int) -> str:
        return self._what.get(ident, "?")

    def headline(self, what: str, failures: dict) -> str:
        """The first line of a RemoteError: what failed, on which ranks of which mesh."""
        on = f" on {format_ranks(failures)}" if failures else ""
        return f"{what} failed{on} of mesh {self.mesh!r}"

    def mark_reported(self, ident: int) -> None:
        try:
            self._unreported.remove(ident)
        except ValueError:
            pass

    def error(self, ident: int, context: str) -> RemoteError | None:
        """The failure of command ``ident`` as a RemoteError (now reported), or None."""
        failures = self._failures.get(ident)
        if not failures:
            return None
        self.mark_reported(ident)
        return RemoteError({r: tuple(f) for r, f in failures.items()}, ident, context)

    def take_unreported(self) -> RemoteError | None:
        """The failures not yet raised to the user, as one RemoteError (or None)."""
        if not self._unreported:
            return None
        idents, self._unreported = self._unreported, []
        first = idents[0]
        failures = {r: tuple(f) for r, f in self._failures.get(first, {}).items()}
        context = self.headline(self.what(first), failures)
        if len(idents) > 1:
            context += f"; {len(idents) - 1} later command(s) failed too"
        return RemoteError(failures, first, context)
