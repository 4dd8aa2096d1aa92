"""What a ``%%monarch`` cell shows at its end: displays, values and figures per group of
ranks, and failures once per distinct traceback."""

from __future__ import annotations

import html
import json

from ..controller import RemoteError, format_ranks
from ..controller.errors import group_failures
from ..controller.frames import relabel, set_file_labeler

RED, BOLD, RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"


def cell_label(filename: str) -> str | None:
    """``Cell In[n]`` for the file of a kernel cell (as IPython names it), else None."""
    from IPython import get_ipython

    ip = get_ipython()
    fmt = getattr(getattr(ip, "compile", None), "format_code_name", None)
    got = fmt(filename) if fmt is not None else None
    return f"{got[0]} {got[1]}" if got else None


set_file_labeler(cell_label)  # rendered RemoteErrors name kernel cells as IPython does


class RemoteCellError(RemoteError):
    """A ``%%monarch`` cell failed on some ranks. IPython shows it through
    ``_render_traceback_``: one block per distinct traceback, naming its ranks,
    with the cell's own line numbers and source lines (``brief``: the first
    line only, for a mesh that needs a restart)."""

    def _render_traceback_(self) -> list[str]:
        return render_failures({} if self.brief else self.failures, self.context)


class CellSyntaxError(Exception):
    """The cell does not compile (found in the kernel, before anything is sent).
    Shown like IPython shows a SyntaxError, without the magic's own frames."""

    def __init__(self, error: SyntaxError, lines: list[str]):
        super().__init__(f"{error.msg} ({error.filename}, line {error.lineno})")
        self.error = error
        self.lines = lines

    def _render_traceback_(self) -> list[str]:
        return self.lines


def render_failures(failures: dict, context: str = "") -> list[str]:
    """Structured traceback lines (ANSI-coloured, as IPython's): the context (its
    first line in bold), then each distinct traceback once, naming its ranks."""
    lines: list[str] = []
    if context:
        first, *rest = context.split("\n")
        lines.append(f"{RED}{BOLD}{first}{RESET}")
        lines.extend(rest)
    for ranks, (etype, msg, tb) in group_failures(failures):
        head = f"{etype}: {msg}" if msg else etype
        lines.append(f"{RED}{BOLD}[{format_ranks(ranks)}]{RESET} {RED}{head}{RESET}")
        body = relabel((tb or head).rstrip("\n"))
        lines.extend(body.split("\n"))
    return lines


def _key(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def _grouped(per_rank: dict) -> list[tuple[list, object]]:
    """rank -> value  ==>  [(ranks, value)] for equal values, in rank order."""
    groups: dict = {}
    for r in sorted(per_rank):
        v = per_rank[r]
        groups.setdefault(_key(v), (v, []))[1].append(r)
    return [(rs, v) for v, rs in groups.values()]


def _labelled(label: str, data: dict) -> list[dict]:
    """One display (two when the value is an image or other rich-only data)."""
    out = dict(data)
    text = str(out.get("text/plain", ""))
    out["text/plain"] = f"{label}{chr(10) if chr(10) in text else ' '}{text}"
    if "text/html" in out:
        out["text/html"] = (
            f'<div class="mnb-result"><div style="font-family:monospace;font-size:smaller;'
            f'opacity:0.6">{html.escape(label)}</div>{out["text/html"]}</div>'
        )
        return [out]
    if set(out) == {"text/plain"}:
        return [out]
    return [{"text/plain": label}, out]


def result_displays(results: dict) -> list[dict]:
    """rank -> {"data": bundle or None, "figures": [bundles], "displays": [bundles]}
    ==> display bundles: what the cell ``display()``ed, then the values, then the
    figures, each folded over the ranks that showed the same."""
    values = {r: res["data"] for r, res in results.items() if res and res.get("data")}
    figures = {r: res["figures"] for r, res in results.items() if res and res.get("figures")}
    shown = {r: res["displays"] for r, res in results.items() if res and res.get("displays")}
    out: list[dict] = []
    for ranks, bundles in _grouped(shown):
        for bundle in bundles:
            out.extend(_labelled(f"[{format_ranks(ranks)}]", bundle))
    for ranks, data in _grouped(values):
        out.extend(_labelled(f"[{format_ranks(ranks)}]", data))
    for ranks, figs in _grouped(figures):
        for fig in figs:
            out.extend(_labelled(f"[{format_ranks(ranks)}]", fig))
    return out
