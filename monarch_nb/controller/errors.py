"""Exceptions the controller raises at the user's call sites."""

from __future__ import annotations

from .frames import relabel, user_frames
from .remote_types import combined_class, find_type

RESTART = "mesh.restart() (%monarch_mesh --restart) gives fresh workers"


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


def group_by_traceback(items) -> list[tuple[tuple, list]]:
    """``(type, message, traceback, x)`` items ==> ``[((type, message, traceback),
    [x, ...])]``: one group per distinct failure, in the order first seen. Every
    view that shows failures once per traceback (RemoteError, a cell's failures,
    the dashboard's errors) groups with this."""
    groups: dict = {}
    for etype, message, tb, x in items:
        groups.setdefault((etype, message, tb), []).append(x)
    return list(groups.items())


def group_failures(failures: dict) -> list[tuple[list, tuple]]:
    """rank -> (type, message, traceback) ==> [(ranks, failure)], one per distinct one."""
    items = ((*f[:3], rank) for rank, f in sorted(failures.items()))
    return [(ranks, f) for f, ranks in group_by_traceback(items)]


class RemoteError(Exception):
    """A command failed on one or more ranks.

    ``failures`` maps rank -> (exception type name, message, formatted remote
    traceback); ``ident`` is the failing command; ``context`` the first line.

    ``RemoteError(failures, ...)`` is also an instance of the remote exception's
    type (``except ValueError:`` catches it) when that type is found here: its
    module is imported, it derives from Exception and defines no ``__new__``.
    When ranks raised different types, the lowest failing rank's is taken (and the
    text says so); otherwise the error is a plain RemoteError whose text says why.
    ``remote_type`` is the type taken (None for a plain RemoteError), ``origins``
    maps rank -> (module, qualname) of each remote type.
    """

    remote_type: type | None = None

    def __new__(cls, *args, **kwargs):
        if cls is RemoteError:
            typed = _typed_class(args[0] if args else kwargs.get("failures"))
            if typed is not None:
                try:
                    return super(RemoteError, typed).__new__(typed)
                except Exception:
                    pass
        return super().__new__(cls)

    def __init__(
        self, failures: dict, ident: int | None = None, context: str = "", brief: bool = False
    ):
        failures = dict(failures)
        self.failures = {r: tuple(f[:3]) for r, f in failures.items()}
        self.origins = {r: tuple(f[3:5]) for r, f in failures.items() if len(f) >= 5 and f[3]}
        self.ident = ident
        self.context = context
        self.brief = brief
        Exception.__init__(self, self._text())  # not super(): never the remote type's

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    __repr__ = BaseException.__repr__

    # ------------------------------------------------------------ text

    def head(self) -> str:
        """The first line: what failed, where."""
        if self.context:
            return self.context
        if self.failures:
            return f"remote failure on {format_ranks(self.failures)}"
        return "remote failure"

    def notes(self) -> list[str]:
        """Lines on the type the error was raised as."""
        chosen = min(self.failures) if self.failures else None
        origin = self.origins.get(chosen)
        if origin is None:
            return []
        name = self.failures[chosen][0]
        lines = []
        if self.remote_type is None:
            why = _typed(name, origin)[1]
            if why:
                lines.append(f"(raised here as a plain mnb.RemoteError, not as {name}: {why})")
        others = sorted(
            r for r, f in self.failures.items() if (f[0], self.origins.get(r)) != (name, origin)
        )
        if others and self.remote_type is not None:
            got = ", ".join(f"rank {r}: {self.failures[r][0]}" for r in others[:4])
            more = ", ..." if len(others) > 4 else ""
            lines.append(
                f"(ranks raised different types: this error is rank {chosen}'s {name}; {got}{more})"
            )
        return lines

    def blocks(self) -> list[tuple[str, str]]:
        """(label, text) per distinct remote traceback."""
        if self.brief:
            return []
        return [
            (f"--- {format_ranks(ranks)} ---", (tb or f"{etype}: {msg}").rstrip())
            for ranks, (etype, msg, tb) in group_failures(self.failures)
        ]

    def _text(self) -> str:
        parts = [self.head(), *self.notes()]
        for label, body in self.blocks():
            parts.append(f"{label}\n{body}" if label else body)
        return "\n".join(parts)

    def _render_traceback_(self) -> list[str]:
        """How IPython shows it: the head, the user's own frames that led here, then
        the remote tracebacks (no frames of monarch_nb or concurrent.futures)."""
        try:
            lines = [f"{type(self).__name__}: {self.head()}", *self.notes()]
            lines.extend(user_frames(self.__traceback__))
            for label, body in self.blocks():
                if label:
                    lines.append(label)
                lines.extend(relabel(body).split("\n"))
            return lines
        except Exception:  # never lose the error to its rendering
            return str(self).split("\n")

    def __reduce__(self):
        failures = {r: f + self.origins.get(r, ()) for r, f in self.failures.items()}
        cls = RemoteError if self.remote_type is not None else type(self)
        return (cls, (failures, self.ident, self.context, self.brief))


def _typed(name: str, origin: tuple) -> tuple[type | None, str]:
    remote, why = find_type(name, *origin)
    if remote is None:
        return None, why
    return combined_class(RemoteError, remote)


def _typed_class(failures) -> type | None:
    """The combined class for the lowest failing rank's remote type, or None."""
    if not failures:
        return None
    try:
        f = failures[min(failures)]
        if len(f) < 5 or not f[3]:
            return None
        return _typed(f[0], (f[3], f[4]))[0]
    except Exception:
        return None


class WorkerCrashed(RemoteError):
    """A worker process died. Names the rank, its exit code or signal, what to do
    (restart the mesh), and the last lines it wrote to stderr. ``earlier``: raised
    by a later call, which only says that the mesh needs a restart."""

    def __init__(
        self,
        rank: int,
        exit_code: int | None,
        stderr_tail: str = "",
        mesh: str = "",
        earlier: bool = False,
    ):
        self.rank = rank
        self.exit_code = exit_code
        self.stderr_tail = stderr_tail
        self.mesh = mesh
        self.earlier = earlier
        text = f"worker rank {rank}{f' of mesh {mesh!r}' if mesh else ''} {self.state} ({self.how})"
        tail = stderr_tail.rstrip()
        tb = text + (f"\nlast lines of its stderr:\n{tail}" if tail else self.no_tail)
        super().__init__({rank: (type(self).__name__, text, tb)}, None, text, earlier)

    state = "died"  # what the worker is, as the error says it
    gone = "died"  # what happened to the worker, as a later call says it
    no_tail = "\n(no stderr output)"

    @property
    def how(self) -> str:
        return describe_exit(self.exit_code)

    def head(self) -> str:
        where = f"mesh {self.mesh!r}" if self.mesh else "the mesh"
        if self.earlier:
            return (
                f"{where} needs a restart: its worker rank {self.rank} {self.gone} earlier "
                f"({self.how}); {RESTART}"
            )
        return f"{self.context}; {RESTART}"

    def blocks(self) -> list[tuple[str, str]]:
        tail = self.stderr_tail.rstrip()
        if self.brief or not tail:
            return []
        return [("", f"last lines of its stderr:\n{tail}")]

    def again(self) -> WorkerCrashed:
        """The short error that each later call raises."""
        return WorkerCrashed(self.rank, self.exit_code, self.stderr_tail, self.mesh, True)

    def __reduce__(self):
        return (type(self), (self.rank, self.exit_code, self.stderr_tail, self.mesh, self.earlier))


class WorkerUnresponsive(WorkerCrashed):
    """A worker not heard of for longer than its mesh's ``liveness_timeout``
    (stopped, stuck in native code that holds the GIL, its host cut off): it is
    presumed lost, and every pending call fails with this. Names the rank, host,
    pid and how long it has been silent."""

    def __init__(
        self,
        rank: int,
        host: str | None,
        pid: int | None,
        silent_for: float,
        mesh: str = "",
        earlier: bool = False,
    ):
        self.host = host
        self.pid = pid
        self.silent_for = silent_for
        super().__init__(rank, None, "", mesh, earlier)

    state = "is unresponsive"
    no_tail = ""
    gone = "stopped answering"

    @property
    def how(self) -> str:
        return f"pid {self.pid} on {self.host}, not heard of for {self.silent_for:.0f} s"

    def again(self) -> WorkerUnresponsive:
        return WorkerUnresponsive(self.rank, self.host, self.pid, self.silent_for, self.mesh, True)

    def __reduce__(self):
        return (
            type(self),
            (self.rank, self.host, self.pid, self.silent_for, self.mesh, self.earlier),
        )


def sequence_gap(mesh: str, rank: int, missed: int) -> RemoteError:
    """What the calls waiting on ``rank`` fail with when its messages were lost."""
    return RemoteError(
        {},
        None,
        f"mesh {mesh!r}: {missed} message(s) from rank {rank} were lost on the way "
        f"(a sequence gap); the calls waiting on that rank fail rather than wait",
    )


def broken_again(err: BaseException) -> BaseException:
    """What a call on a broken mesh raises: a new, short error (no old traceback)."""
    if isinstance(err, WorkerCrashed):
        return err.again()
    if isinstance(err, RemoteError):
        return RemoteError(err.failures, err.ident, err.context, brief=True)
    return err


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


class IOThreadError(RuntimeError):
    """The controller failed handling a reply: the request it answers
    fails with that traceback instead of waiting forever."""


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
