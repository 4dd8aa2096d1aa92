"""Notebook tier: every notebook in notebooks/ executed by nbclient in a real kernel."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest
from kernel_helpers import ANSI, kernel_env, wait_gone

pytestmark = pytest.mark.notebook

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(str(out.data.get("text/plain", "")))
        elif out.output_type == "error":
            parts.append(ANSI.sub("", "\n".join(out.traceback)))
    return "\n".join(parts)


def mesh_pids(nb) -> list[int]:
    for cell in nb.cells:
        m = re.search(r"\(pids ([\d, ]+)\)", outputs_text(cell))
        if m:
            return [int(p) for p in m.group(1).split(",")]
    raise AssertionError("no mesh status in the notebook")


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == [
        "01_quickstart.ipynb",
        "02_errors_and_interrupts.ipynb",
    ]


def test_quickstart_runs_headless_from_the_command_line(tmp_path):
    """``python -m monarch_nb quickstart`` (the README's main command) executes
    notebooks/01_quickstart.ipynb and prints the losses it computed."""
    executed = tmp_path / "quickstart.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_nb", "quickstart", "--output", str(executed)],
        capture_output=True,
        text=True,
        timeout=300,
        env=kernel_env(tmp_path),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    losses = [float(x) for x in re.findall(r"\[ranks 0-1\] step +\d+ +mean loss ([0-9.]+)", out)]
    assert len(losses) == 7, out
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 100
    assert "[ranks 0-1] (3.0, 1.0)" in out  # the model learned y = 3x + 1, the same on both ranks
    assert "[rank 0] hello from rank 0 of 2 (dp=0)" in out
    assert "[ranks 0-1] the same line on every rank" in out
    assert "[1000.0, 2000.0]" in out

    nb = nbformat.read(executed, as_version=4)
    nbformat.validate(nb)
    cells = {c.id: c for c in nb.cells}
    figure = [o for o in cells["cell-15"].outputs if "image/png" in o.get("data", {})]
    assert len(figure) == 1  # drawn on rank 0, shown in the notebook
    assert "application/vnd.jupyter.widget-view+json" in cells["cell-03"].outputs[0].data
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", outputs_text(cell)
            if o.output_type == "stream":
                assert o.name == "stdout", o.text
    assert wait_gone(mesh_pids(nb)) == []


def test_errors_and_interrupts_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "02_errors_and_interrupts.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute(env=kernel_env(tmp_path))
    nbformat.validate(nb)
    cells = {c.id: c for c in nb.cells}

    def text(cid: str) -> str:
        return outputs_text(cells[cid])

    def failed(cid: str) -> bool:
        return any(o.output_type == "error" for o in cells[cid].outputs)

    # one rank fails: its traceback with the cell's lines; the other rank's value
    t = text("cell-04")
    assert failed("cell-04") and "[rank 0] 'c'" in t
    assert (
        "[rank 1] IndexError: list index out of range" in t and "rank 0]" not in t.split("'c'")[1]
    )
    assert "line 7, in <module>" in t and "load_batch(rank + 2)" in t
    assert "line 4, in load_batch" in t and "return batches[i]" in t
    # the same failure on both ranks: shown once
    t = text("cell-06")
    assert t.count("[ranks 0-1] RuntimeError") == 1 and t.count("Traceback") == 1
    assert not failed("cell-08") and "'rank 1 still here'" in text("cell-08")
    assert "failed on ranks [1]" in text("cell-10") and "over the limit" in text("cell-10")
    # interrupts: every rank stopped where it was, the mesh serves on
    t = text("cell-13")
    assert failed("cell-13") and "[ranks 0-1] KeyboardInterrupt" in t and "while True:" in t
    t = text("cell-16")
    assert failed("cell-16") and "[ranks 0-1] KeyboardInterrupt" in t
    assert "time.sleep(1000)" in t
    assert not failed("cell-18") and "'rank 0 ready'" in text("cell-18")
    assert "mesh 'default' shut down" in text("cell-22")
    expected_failures = {"cell-04", "cell-06", "cell-13", "cell-16"}
    assert {c.id for c in nb.cells if c.cell_type == "code" and failed(c.id)} == expected_failures
    assert wait_gone(mesh_pids(nb)) == []
