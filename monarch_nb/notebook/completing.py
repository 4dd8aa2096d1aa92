"""Tab and Shift-Tab in a ``%%monarch`` cell (and in every cell in auto mode),
answered by a rank: its IPython shell completes and inspects over its own
namespace (``DeviceMesh.complete`` / ``inspect_code``, served off the rank's
streams, so an answer comes while a cell runs there).

Completion hooks in through IPython's matcher API (a ``context_matcher`` in
``Completer.custom_matchers``, which sees the whole cell); inspection by wrapping
the kernel's ``do_inspect``, the one place that sees the cell (the shell's
``object_inspect_mime`` gets a name only). The rank asked is the cell's first:
that of ``--ranks``/``--slice``, else the mesh's first. When the rank does not
answer within ``TIMEOUT`` seconds, fails, or finds nothing, the kernel's own
completer and inspector answer (``last_fallback`` says why).
"""

from __future__ import annotations

import inspect

from IPython.core.completer import SimpleCompletion, context_matcher
from IPython.core.error import UsageError

from ..api import mesh as mesh_mod
from . import auto
from .args import HelpShown, cell_parser, parse_ranks
from .args import parse_slice as parse_slice_spec

TIMEOUT = 0.5  # seconds the rank has to answer before the kernel's own completer does
HEADER = "%%monarch"

last_fallback: str | None = None  # why the kernel answered the last request itself


def target(shell, code: str, cursor_pos: int):
    """``(mesh, rank, body_start)`` when the cursor is in the body of a cell that runs
    on a mesh (``%%monarch``, or any cell in auto mode); else None."""
    if code.startswith(HEADER) and code[len(HEADER) : len(HEADER) + 1] in ("", " ", "\n"):
        header, nl, _ = code.partition("\n")
        start = len(header) + 1
        if not nl or cursor_pos < start:
            return None  # on the magic's own line: its arguments are the kernel's
        line = header[len(HEADER) :]
    else:
        line = auto.line_of(shell)
        if line is None or auto.stays_in_kernel(code.lstrip().splitlines(True) or [""]):
            return None  # not on the mesh: the kernel's own cell
        start = 0
    mesh, rank = _resolve(line)
    if mesh is None:
        return None
    return mesh, rank, start


def _resolve(line: str):
    global last_fallback
    if {"-h", "--help"} & set(line.split()):
        return None, None
    try:
        a = cell_parser().parse_line(line)
        mesh = mesh_mod.get_mesh(a.mesh) if a.mesh else mesh_mod.get_mesh()
        if a.ranks is not None:
            rank = parse_ranks(a.ranks)[0]
        elif a.slice:
            rank = mesh.slice(**parse_slice_spec(a.slice)).ranks[0]
        else:
            rank = mesh.ranks[0]
    except (UsageError, HelpShown, KeyError, RuntimeError, ValueError, IndexError, TypeError) as e:
        last_fallback = f"the cell names no rank to ask: {e}"
        return None, None
    return mesh, rank


def _ask(shell, code: str, cursor_pos: int, what: str, **kw) -> dict | None:
    """The rank's reply, or None (``last_fallback`` says why)."""
    global last_fallback
    got = target(shell, code, cursor_pos)
    if got is None:
        return None
    mesh, rank, start = got
    body = code[start:]
    try:
        ask = mesh.complete if what == "complete" else mesh.inspect_code
        reply = ask(body, cursor_pos - start, rank=rank, timeout=TIMEOUT, **kw)
    except TimeoutError:
        last_fallback = f"rank {rank} did not answer within {TIMEOUT} s"
        return None
    except Exception as e:  # a failure on the rank, a broken mesh: the kernel answers
        said = (str(e).strip().splitlines() or [""])[-1]
        last_fallback = f"rank {rank}: {type(e).__name__}: {said}"
        return None
    last_fallback = None
    reply["_start"] = start
    return reply


class RankMatcher:
    """The matcher (API v2) of one shell: the rank's completions, or nothing (then the
    kernel's own matchers answer)."""

    def __init__(self, shell):
        self.shell = shell

        def matcher(context):
            return self.complete(context)

        matcher.monarch = self
        self.matcher = context_matcher(priority=1, identifier="monarch_nb.rank")(matcher)

    def complete(self, context) -> dict:
        global last_fallback
        none = {"completions": [], "suppress": False}
        text = context.full_text
        if not text.startswith(HEADER) and auto.line_of(self.shell) is None:
            return none  # the common case: a notebook cell, no time spent
        lines = text.split("\n")
        offset = sum(len(ln) + 1 for ln in lines[: context.cursor_line]) + context.cursor_position
        try:
            reply = _ask(self.shell, text, offset, "complete")
        except Exception as e:  # never the kernel's traceback on Tab
            last_fallback, reply = f"{type(e).__name__}: {e}", None
        if not reply or not reply["matches"]:
            return none
        start = reply["_start"]
        frm, to = start + reply["cursor_start"], start + reply["cursor_end"]
        if to != offset:  # the kernel replaces the text up to the cursor only
            last_fallback = "the rank's completions end past the cursor"
            return none
        comps = reply["metadata"].get("_jupyter_types_experimental") or [
            {"text": t, "type": None} for t in reply["matches"]
        ]
        return {
            "completions": [SimpleCompletion(c["text"], type=c.get("type")) for c in comps],
            "matched_fragment": text[frm:to],
            "suppress": True,
            "ordered": True,
        }


def install(shell, kernel=None) -> None:
    """Tab on the ranks in ``shell``; Shift-Tab too with ``kernel`` (ipykernel's)."""
    if any(hasattr(m, "monarch") for m in _matchers(shell)):
        return
    _matchers(shell).append(RankMatcher(shell).matcher)
    if kernel is None or "do_inspect" in vars(kernel):
        return
    original = kernel.do_inspect

    async def do_inspect(code, cursor_pos, detail_level=0, omit_sections=()):
        try:
            reply = _ask(shell, code, cursor_pos, "inspect", detail_level=detail_level)
        except Exception:
            reply = None
        if reply is None or not reply.get("found"):
            reply = original(code, cursor_pos, detail_level, omit_sections)
            return (await reply) if inspect.isawaitable(reply) else reply
        reply.pop("_start")
        if not getattr(shell, "enable_html_pager", True):
            reply["data"].pop("text/html", None)
        return reply

    do_inspect.monarch_original = original
    kernel.do_inspect = do_inspect


def uninstall(shell, kernel=None) -> None:
    matchers = _matchers(shell)
    matchers[:] = [m for m in matchers if not hasattr(m, "monarch")]
    if kernel is not None and hasattr(vars(kernel).get("do_inspect"), "monarch_original"):
        del kernel.do_inspect


def _matchers(shell) -> list:
    return shell.Completer.custom_matchers
