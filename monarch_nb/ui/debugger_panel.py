"""The debugger front end: what every console does with a mesh's paused pdb
sessions (``mesh.debugger``): send a line and show the reply without its
prompt, cast one line to several sessions with identical outputs folded, let
every session go on. The dashboard's panel, the Lab extension's panel
(``notebook/lab.py``) and the notebook's inline prompt (``notebook/pdb_prompt.py``)
all use these; no widgets here.
"""

from __future__ import annotations

from ..controller import fold_by_rank

COMMAND_WAIT = 20.0  # seconds a panel's debugger command waits for the session's reply


def strip_prompt(text: str, prompt: str | None) -> str:
    """``text`` without the trailing pdb ``prompt`` (the console shows its own)."""
    if prompt and text.endswith(prompt):
        text = text[: -len(prompt)]
    return text


def cast(dbg, ranks, line: str, timeout: float) -> str | None:
    """Send ``line`` to the paused sessions on ``ranks`` (None: every one) of
    ``dbg`` and wait for the replies: their outputs, identical ones folded over
    ranks; None when no session was paused there."""
    replies = dbg.cast(ranks, line, timeout)
    if not replies:
        return None
    outputs = {}
    for rank, text in replies.items():
        s = next((x for x in dbg.sessions() if x.rank == rank), None)
        outputs[rank] = strip_prompt(text, s.prompt if s else None)
    return fold_by_rank(outputs)


def continue_all(mesh) -> str:
    """Let every paused session of ``mesh`` go on; the log line that says so."""
    n = len(mesh.debugger.sessions())
    mesh.debugger.continue_all()
    return f"continued {n} session(s)"


def debugger_command(mesh, target, line: str, emit, wait: float = COMMAND_WAIT) -> None:
    """Send ``line`` to a paused session of ``mesh`` and wait (at most ``wait`` s)
    for its reply; ``emit(text)`` gets each log line as it is known, the command
    first. ``target``: ``(rank, stream name)``, ``"*"`` (every paused session,
    outputs folded) or None (there is no session)."""
    dbg = mesh.debugger
    try:
        if target == "*":
            emit(f"(cast *) {line}")
            folded = cast(dbg, None, line, wait)
            emit(folded if folded is not None else "no paused session")
            return
        if not target:
            emit(f"{line}: no paused session")
            return
        rank, stream = target
        s = next((x for x in dbg.sessions() if x.rank == rank and x.stream_name == stream), None)
        if s is None:
            emit(f"{line}: no paused session on rank {rank} ({stream})")
            return
        emit(f"(Pdb r{rank}) {line}")
        dbg.send(s, line)
        text, prompt = dbg.wait_reply(s, wait)
        text = strip_prompt(text, prompt).rstrip("\n")
        if text:
            emit(text)
        if s.ended:
            emit(f"(rank {rank} went on)")
        elif prompt is None:
            emit(f"(no prompt within {wait:.0f} s: rank {rank} is running)")
    except Exception as e:
        emit(f"{line}: {type(e).__name__}: {e}")
