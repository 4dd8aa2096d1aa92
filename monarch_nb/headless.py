"""Jupyter without a front end: kernels over IPC, a notebook executed by nbclient
and the transcript of what it computed (``python -m monarch_nb quickstart``).

Every kernel our tools start (this module, the benchmarks, the test helpers) talks
over the IPC transport, its connection file and sockets in a private temporary
directory: nothing listens on a TCP port, so ipykernel has no cause for its
"Kernel is running over TCP without encryption" warning.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
QUICKSTART = NOTEBOOKS / "01_quickstart.ipynb"
KERNEL = "monarch-nb-python3"
SOURCE_LINES = 4  # a longer cell shows its first lines and how many more it has
LINE_CHARS = 100
LEAD_CHARS = 160
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")
_TAG = re.compile(r"<[^>]*>")


def ipc_config(directory: str):
    """A traitlets Config under which a jupyter_client KernelManager (or nbclient's)
    starts its kernel over IPC, with the connection file and sockets in ``directory``
    (keep it short: a socket's path has at most 107 bytes)."""
    from traitlets.config import Config

    c = Config()
    c.KernelManager.transport = "ipc"
    c.KernelManager.connection_file = os.path.join(directory, "kernel.json")
    return c


def start_kernel(kernel_name: str = "python3", timeout: float = 60, **kwargs):
    """jupyter_client's ``start_new_kernel`` over IPC: ``(manager, blocking client)``.
    ``kwargs`` go to ``KernelManager.start_kernel`` (``env``, ``cwd``...). The socket
    directory goes away with the manager."""
    from jupyter_client.manager import KernelManager

    d = tempfile.mkdtemp(prefix="mnb-k-")
    km = KernelManager(kernel_name=kernel_name, config=ipc_config(d))
    weakref.finalize(km, shutil.rmtree, d, True)
    km.start_kernel(**kwargs)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=timeout)
    except RuntimeError:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        raise
    return km, kc


def _kernelspec(root: str) -> None:
    """A kernelspec for this very interpreter (whatever 'python3' means elsewhere)."""
    d = os.path.join(root, "kernels", KERNEL)
    os.makedirs(d, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (monarch_nb)",
        "language": "python",
        "interrupt_mode": "signal",
    }
    with open(os.path.join(d, "kernel.json"), "w") as f:
        json.dump(spec, f)


def execute(path: Path, output: Path | None = None, timeout: int = 600):
    """Run every cell of the notebook at ``path``; returns the executed notebook.
    Raises nbclient's CellExecutionError at the first unexpected error."""
    try:
        import nbclient
        import nbformat
    except ImportError as e:  # pragma: no cover - the test extra has them
        raise SystemExit(
            f"running a notebook needs nbclient and nbformat ({e}); pip install -e '.[test]'"
        ) from None
    nb = nbformat.read(str(path), as_version=4)
    with tempfile.TemporaryDirectory(prefix="mnb-nb-") as tmp:
        _kernelspec(os.path.join(tmp, "share"))
        old = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(
            p for p in (os.path.join(tmp, "share"), old) if p
        )
        try:
            client = nbclient.NotebookClient(
                nb,
                timeout=timeout,
                kernel_name=KERNEL,
                resources={"metadata": {"path": tmp}},
                config=ipc_config(tmp),
            )
            try:
                client.execute()
            finally:
                if output is not None:
                    nbformat.write(nb, str(output))
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = old
    return nb


def transcript(nb) -> str:
    """What a reader of the notebook sees, as text: the headings of each section, the
    lead sentence of the text above each code cell, the cell (its first lines) and
    the text it printed or showed."""
    parts: list[str] = []
    above: list[str] = []  # markdown since the previous code cell
    widgets = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    states = widgets.get("state", {})
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            above.append(cell.source)
            continue
        if cell.cell_type != "code":
            continue
        block: list[str] = []
        for md in above:
            heads, lead = _section(md)
            block.extend(heads)
            if lead:
                block.append(lead)
        above = []
        block.extend(_source(cell))
        block.extend("    " + ln for ln in _outputs(cell, states))
        parts.append("\n".join(block))
    return "\n\n".join(parts)


def _section(md: str) -> tuple[list[str], str]:
    """A markdown cell's heading lines and the first sentence of its first paragraph."""
    heads: list[str] = []
    para: list[str] = []
    for line in md.splitlines():
        s = line.strip()
        if s.startswith("#"):
            heads.append(s)
        elif s:
            para.append(s)
        elif para:
            break
    lead = " ".join(para)
    m = _SENTENCE_END.search(lead)
    if m:
        lead = lead[: m.start()]
    return heads, _clip(lead, LEAD_CHARS)


def _source(cell) -> list[str]:
    n = cell.get("execution_count")
    lines = [ln.rstrip() for ln in cell.source.strip().splitlines() if ln.strip()]
    if len(lines) > SOURCE_LINES:
        more = len(lines) - (SOURCE_LINES - 1)
        lines = [*lines[: SOURCE_LINES - 1], f"... ({more} more lines)"]
    prompt = f"In [{n if n is not None else ' '}]: "
    cont = " " * (len(prompt) - 5) + "...: "
    return [(cont if i else prompt) + _clip(ln, LINE_CHARS) for i, ln in enumerate(lines)]


_DEFAULT_REPR = re.compile(r"<[\w.]+ object(?: at 0x[0-9a-f]+)?>")  # an object without a text form
_TAG = re.compile(r"<[^>]+>")
_SPACES = re.compile(r"[ \t]+")


def _outputs(cell, states: dict) -> list[str]:
    lines: list[str] = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            text = out.text
        elif out.output_type in ("display_data", "execute_result"):
            data = out.get("data", {})
            view = data.get("application/vnd.jupyter.widget-view+json")
            if "image/png" in data:
                text = "(a figure)"
            elif view and _progress(states, view.get("model_id")) is not None:
                text = _progress(states, view["model_id"])
            else:
                text = str(data.get("text/plain", ""))
                if "text/html" in data and _DEFAULT_REPR.search(text):  # display(HTML(...))
                    text = html.unescape(_SPACES.sub(" ", _TAG.sub(" ", str(data["text/html"]))))
                    text = text.strip()
                if view:
                    text = text.splitlines()[0] if text else ""
        elif out.output_type == "error":
            text = _ANSI.sub("", "\n".join(out.traceback))
        else:
            continue
        # a line redrawn with carriage returns (a text progress bar) shows as it ended
        lines.extend(ln.rsplit("\r", 1)[-1] for ln in text.rstrip("\n").split("\n"))
    return lines


def _progress(states: dict, model_id) -> str | None:
    """A tqdm bar (label, progress, counts in an HBox) as it ended, from the saved widget
    state (its text/plain is the bar as first displayed); None for any other widget."""
    model = states.get(model_id) or {}
    if model.get("model_name") != "HBoxModel":
        return None
    kids = [
        states.get(c.removeprefix("IPY_MODEL_"), {}) for c in model["state"].get("children", [])
    ]
    names = [k.get("model_name") for k in kids]
    if len(kids) != 3 or names[0] != "HTMLModel" or not str(names[1]).endswith("ProgressModel"):
        return None

    def label(k) -> str:
        return html.unescape(_TAG.sub("", str(k["state"].get("value", "")))).replace("\u2007", " ")

    bar = kids[1]["state"]
    frac = bar.get("value", 0) / bar["max"] if bar.get("max") else 0
    filled = max(0, min(10, int(frac * 10)))
    return f"{label(kids[0])}|{'#' * filled}{' ' * (10 - filled)}|{label(kids[2])}"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def quickstart(output: str | None = None) -> int:
    """``python -m monarch_nb quickstart``: the quickstart notebook, headless."""
    from nbclient.exceptions import CellExecutionError

    t0 = time.monotonic()
    print(f"executing {QUICKSTART} ...", flush=True)
    try:
        nb = execute(QUICKSTART, Path(output) if output else None)
    except CellExecutionError as e:
        print(_ANSI.sub("", str(e)), file=sys.stderr)
        return 1
    print()
    print(transcript(nb))
    print()
    print(
        f"done in {time.monotonic() - t0:.1f} s"
        + (f"; executed notebook: {output}" if output else "")
    )
    return 0
