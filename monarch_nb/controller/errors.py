"""Exceptions the controller raises at the user's call sites."""

from __future__ import annotations


def format_ranks(ranks) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2,5"``; ``[3]`` -> ``"rank 3"``."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts, start, prev = [], None, None
    for r in rs:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = r
    parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return "ranks " + ",".join(parts)


def fold_by_rank(outputs: dict) -> str:
    """rank -> text; identical texts once, with their ranks."""
    groups: dict[str, list] = {}
    for rank, text in sorted(outputs.items()):
        groups.setdefault(text, []).append(rank)
    parts = []
    for text, ranks in groups.items():
        body = text.rstrip("\n")
        label = f"[{format_ranks(ranks)}]"
        parts.append(f"{label} {body}" if "\n" not in body else f"{label}\n{body}")
    return "\n".join(parts)


def group_failures(failures: dict) -> list[tuple[list, tuple]]:
    """Group rank -> (type, message, traceback) by identical traceback text."""
    groups: dict = {}
    for rank, f in sorted(failures.items()):
        groups.setdefault((f[0], f[2]), (f, []))[1].append(rank)
    return [(ranks, f) for f, ranks in groups.values()]


class RemoteError(Exception):
    """A command failed on one or more ranks.

    ``failures`` maps rank -> (exception type name, message, formatted remote
    traceback); ``ident`` is the failing command.
    """

    def __init__(self, failures: dict, ident: int | None = None, context: str = ""):
        self.failures = dict(failures)
        self.ident = ident
        self.context = context
        super().__init__(self._text())

    def _text(self) -> str:
        head = self.context or (
            f"command {self.ident} failed" if self.ident is not None else "remote failure"
        )
        parts = [head]
        for ranks, (etype, msg, tb) in group_failures(self.failures):
            body = tb.rstrip() if tb else f"{etype}: {msg}"
            parts.append(f"--- {format_ranks(ranks)} ---\n{body}")
        return "\n".join(parts)

    def __reduce__(self):
        return (type(self), (self.failures, self.ident, self.context))


class WorkerCrashed(RemoteError):
    """A worker process died. Names the rank, its exit code or signal, and the
    last lines it wrote to stderr."""

    def __init__(self, rank: int, exit_code: int | None, stderr_tail: str = "", mesh: str = ""):
        self.rank = rank
        self.exit_code = exit_code
        self.stderr_tail = stderr_tail
        self.mesh = mesh
        how = describe_exit(exit_code)
        text = f"worker rank {rank}{f' of mesh {mesh!r}' if mesh else ''} died ({how})"
        tail = stderr_tail.rstrip()
        tb = text + (f"\nlast lines of its stderr:\n{tail}" if tail else "\n(no stderr output)")
        super().__init__({rank: ("WorkerCrashed", text, tb)}, None, text)

    def __reduce__(self):
        return (type(self), (self.rank, self.exit_code, self.stderr_tail, self.mesh))


class InterruptTimeout(TimeoutError):
    """Interrupted commands did not stop within the bound: their ranks are stuck
    outside Python code (a collective whose peer is gone, a long native call).
    ``stuck`` maps rank -> [(stream name, ident, what)]; ``ranks`` lists them."""

    def __init__(self, stuck: dict, timeout: float, mesh: str = ""):
        self.stuck = {r: list(v) for r, v in stuck.items()}
        self.ranks = sorted(self.stuck)
        self.timeout = timeout
        self.mesh = mesh
        where = "; ".join(
            f"rank {r}: " + ", ".join(f"stream {s!r} command {i} ({w})" for s, i, w in v)
            for r, v in sorted(self.stuck.items())
        )
        super().__init__(
            f"{format_ranks(self.ranks)}{f' of mesh {mesh!r}' if mesh else ''} did not stop "
            f"within {timeout:g} s of the interrupt (stuck outside Python code: a collective "
            f"whose peer is gone, a long native call?) [{where}]; mesh.restart() "
            f"(%monarch_mesh --restart) gives fresh workers"
        )

    def __reduce__(self):
        return (type(self), (self.stuck, self.timeout, self.mesh))


class MeshClosedError(RuntimeError):
    """The mesh was shut down (or is broken) and cannot take commands."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"killed by signal {name}"
    return f"exit code {code}"
