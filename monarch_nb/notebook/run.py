"""Execute a notebook headlessly (nbclient) and print what it computed:
``python -m monarch_nb quickstart`` runs ``notebooks/01_quickstart.ipynb``."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
QUICKSTART = NOTEBOOKS / "01_quickstart.ipynb"
KERNEL = "monarch-nb-python3"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


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
    with tempfile.TemporaryDirectory(prefix="monarch-nb-") as tmp:
        _kernelspec(os.path.join(tmp, "share"))
        old = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(
            p for p in (os.path.join(tmp, "share"), old) if p
        )
        try:
            client = nbclient.NotebookClient(
                nb, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": tmp}}
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
    """The code cells and the text they printed or showed."""
    parts = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
        lines = [f"[{i}] {first}"]
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text = out.text
            elif out.output_type in ("display_data", "execute_result"):
                data = out.get("data", {})
                if "image/png" in data:
                    text = "(a figure)"
                else:
                    text = str(data.get("text/plain", ""))
                    if "application/vnd.jupyter.widget-view+json" in data:
                        text = text.splitlines()[0] if text else ""
            elif out.output_type == "error":
                text = _ANSI.sub("", "\n".join(out.traceback))
            else:
                continue
            lines.extend("    " + ln for ln in text.rstrip("\n").splitlines())
        parts.append("\n".join(lines))
    return "\n".join(parts)


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
    print(transcript(nb))
    print(
        f"done in {time.monotonic() - t0:.1f} s"
        + (f"; executed notebook: {output}" if output else "")
    )
    return 0
