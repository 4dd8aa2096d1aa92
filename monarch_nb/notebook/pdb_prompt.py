"""The remote pdb prompt in the notebook, through the kernel's stdin (as local pdb
in Jupyter): ``(Pdb r1)`` when one session is paused, ``(monarch-dbg)`` when
several are.

At ``(monarch-dbg)``: ``list``, ``attach R``, ``cast RANKS CMD`` (``*`` = every
paused rank; identical outputs folded), ``continue`` (all), ``detach``,
``help``. In an attached session every pdb command works; ``detach`` returns
to ``(monarch-dbg)``.
"""

from __future__ import annotations

from IPython.core.error import StdinNotImplementedError

from ..controller import format_ranks
from ..controller.debug_sessions import DebugSessions, Session
from ..ui.debugger_panel import cast, strip_prompt
from .args import parse_ranks

MENU_PROMPT = "(monarch-dbg) "
HELP = """monarch-dbg commands:
  list              paused sessions: rank, stream, file:line, function
  attach R          talk to the pdb paused on rank R (detach: back here)
  cast RANKS CMD    send CMD to the sessions on RANKS (0,2 or 0-3; * = all)
  continue          continue every paused session
  detach            stop prompting; sessions keep waiting (%monarch_debug, the dashboard)
  help              this text"""


class NoStdin(Exception):
    """The front end cannot answer input requests."""


FOLD = 4  # more ranks than this paused at one place share one row


def _by_place(sessions: list[Session]) -> list[tuple[list[int], Session]]:
    """Sessions paused at one place (stream, file, line, function) folded when more
    than FOLD: their ranks and the first of them, in rank order (1,024 ranks at one
    breakpoint: one row); a few ranks keep a row each."""
    groups: dict = {}
    for s in sorted(sessions, key=lambda s: s.rank):
        loc = s.location
        key = (s.stream_name, loc.get("file"), loc.get("line"), loc.get("function"))
        groups.setdefault(key, ([], []))[0].append(s.rank)
        groups[key][1].append(s)
    rows = []
    for ranks, ss in groups.values():
        if len(ranks) > FOLD:
            rows.append((ranks, ss[0]))
        else:
            rows.extend(([s.rank], s) for s in ss)
    return sorted(rows, key=lambda row: row[0][0])


def describe(sessions: list[Session]) -> str:
    rows = []
    for ranks, s in _by_place(sessions):
        who = format_ranks(ranks)
        rows.append(
            f"  {who:<8} {s.stream_name:<10} {s.location.get('file')}:{s.location.get('line')}"
            f"  {s.location.get('function')}"
        )
    return (
        "\n".join(["paused debugger sessions:", *rows]) if rows else "no paused debugger sessions"
    )


def notice(sessions: list[Session]) -> str:
    where = "; ".join(
        f"{format_ranks(ranks)} ({s.stream_name}) at {s.location.get('file')}:"
        f"{s.location.get('line')}"
        for ranks, s in _by_place(sessions)
    )
    return f"monarch_nb: paused in the debugger: {where}"


class Prompt:
    """Serves paused sessions with ``read`` (input) and ``write`` (print)."""

    def __init__(
        self,
        sessions: DebugSessions,
        read=input,
        write=print,
        timeout: float = 600.0,
        only=None,
    ):
        self.dbg = sessions.only(only) if only is not None else sessions
        self._read = read
        self._write = write
        self.timeout = timeout
        self.detached = False

    def read(self, prompt: str) -> str:
        try:
            return self._read(prompt)
        except StdinNotImplementedError:
            raise NoStdin() from None
        except EOFError:
            return "detach"

    def serve(self, attach: int | None = None) -> None:
        """Prompt until no session waits (all continued) or the user detaches."""
        menu = False
        if attach is not None:
            menu = self._attach(str(attach))
        while not self.detached:
            sessions = self.dbg.waiting()
            if not sessions:
                # a session between two stops (n, s, c to a breakpoint) comes back soon
                if not self.dbg.sessions() or not self.dbg.wait_any(1.0):
                    return
                continue
            if len(sessions) == 1 and len(self.dbg.sessions()) == 1 and not menu:
                menu = self._attached_loop(sessions[0])
            else:
                menu = True
                self._menu()

    def _send(self, s: Session, line: str) -> tuple[str, str | None]:
        self.dbg.send(s, line)
        return self.dbg.wait_reply(s, self.timeout)

    def _show(self, text: str) -> None:
        if text:
            self._write(text.rstrip("\n"))

    def _menu(self) -> None:
        line = self.read(MENU_PROMPT).strip()
        if not line:
            return
        cmd, _, rest = line.partition(" ")
        rest = rest.strip()
        if cmd in ("list", "l", "ls"):
            self._write(describe(self.dbg.sessions()))
        elif cmd in ("help", "h", "?"):
            self._write(HELP)
        elif cmd in ("continue", "c", "cont"):
            self.dbg.continue_all()
        elif cmd == "detach":
            self.detached = True
            self._write(
                "detached: the sessions keep waiting (%monarch_debug or the dashboard serves "
                "them; interrupting the cell ends them)"
            )
        elif cmd == "attach":
            self._attach(rest)
        elif cmd == "cast":
            self._cast(rest)
        else:
            self._write(f"unknown command {cmd!r}; type help")

    def _attach(self, arg: str) -> bool:
        try:
            s = self.dbg.find(int(arg))
        except (ValueError, KeyError):
            self._write(f"attach: no paused session on rank {arg!r}; type list")
            return True
        return self._attached_loop(s)

    def _attached_loop(self, s: Session) -> bool:
        """Talk to one session until it ends (False) or the user detaches (True)."""
        while not s.ended and not self.detached:
            if s.prompt is None:
                text, _ = self.dbg.wait_reply(s, self.timeout)
                self._show(strip_prompt(text, s.prompt))
                continue
            self._show(strip_prompt(self.dbg.take_output(s), s.prompt))
            line = self.read(s.prompt)
            if line.strip() == "detach":
                return True
            text, prompt = self._send(s, line)
            self._show(strip_prompt(text, prompt))
        return False

    def _cast(self, arg: str) -> None:
        spec, _, cmd = arg.partition(" ")
        if not spec or not cmd.strip():
            self._write("usage: cast RANKS CMD   (e.g. cast * p x, cast 0,2 where)")
            return
        ranks = None
        if spec != "*":
            try:
                ranks = parse_ranks(spec)
            except Exception as e:
                self._write(f"cast: {e}")
                return
        folded = cast(self.dbg, ranks, cmd.strip(), self.timeout)
        self._write(f"cast: no paused session on {spec}" if folded is None else folded)
