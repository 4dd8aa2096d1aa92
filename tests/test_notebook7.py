"""Browser tier: Jupyter Notebook 7 (``jupyter notebook``) with Debian's chromium. The
quickstart runs in Notebook 7's notebook page: the mesh's dashboard renders, a
``%%monarch`` cell's output streams in while it runs, the inline ``(Pdb r1)`` prompt
takes typed commands, and the JupyterLab extension (built for Lab's shell) activates
without an error. Screenshots: artifacts/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from browser_helpers import Notebook7, clipped, missing, outside_window

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(missing("notebook") is not None, reason=missing("notebook") or ""),
]

T = 60_000  # ms: the longest any single wait in the page may take
QUICKSTART = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"
PANEL = "#monarch-nb-panel"


def page_problems(page) -> list[str]:
    """Collect the page's console errors and uncaught exceptions (with their source)."""
    seen: list[str] = []

    def console(m) -> None:
        if m.type == "error":
            seen.append(f"console.error: {m.text} @ {m.location.get('url', '')}")

    page.on("console", console)
    page.on("pageerror", lambda e: seen.append(f"pageerror: {e.message}\n{e.stack or ''}"))
    return seen


def wait_cell_text(page, index: int, pattern: str) -> None:
    """Wait until cell ``index``'s outputs show text matching ``pattern``."""
    try:
        page.wait_for_function(
            """([i, pattern]) => {
                const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
                const out = cell && cell.querySelector('.jp-OutputArea');
                return !!out && new RegExp(pattern).test(out.innerText);
            }""",
            arg=[index, pattern],
            timeout=T,
        )
    except Exception as e:
        shown = page.locator(".jp-Notebook .jp-Cell").nth(index).inner_text()
        raise AssertionError(f"cell {index} never showed /{pattern}/; it shows {shown!r}") from e


def prompt(nb: Notebook7, index: int) -> str:
    return nb.cells().nth(index).locator(".jp-InputPrompt").inner_text().strip()


def wait_done(nb: Notebook7, index: int) -> None:
    """Cell ``index`` has run to its end (its prompt has a number, not ``*``)."""
    nb.cells().nth(index).locator(".jp-InputPrompt", has_text=re.compile(r"\[\d+\]")).wait_for(
        timeout=T
    )


def test_quickstart_in_notebook7(nb7_page, nb7_server, tmp_path):
    page = nb7_page
    problems = page_problems(page)
    nb = Notebook7(nb7_server, page, "quickstart", QUICKSTART)
    nb.open()
    # our Lab extension activated in Notebook 7's shell (no status bar here); its code
    # came from monarch-nb's own files, so an error it throws names them
    assert page.evaluate("() => window.jupyterapp.isPluginActivated('monarch-nb:plugin')")
    assert page.evaluate(
        "() => performance.getEntriesByType('resource').some(e => e.name.includes('/monarch-nb/'))"
    )

    # the quickstart, cell by cell, up to (not including) its last: the shutdown
    code = [
        i
        for i in range(nb.cells().count())
        if "jp-CodeCell" in (nb.cells().nth(i).get_attribute("class") or "")
    ]
    *run, shutdown = code
    assert "%monarch_mesh --shutdown" in nb.cells().nth(shutdown).inner_text()
    for i in run:
        nb.run_cell(i)
    for i in run:
        wait_done(nb, i)
    dash = ".jp-Notebook .mnb-dashboard"
    page.locator(f"{dash} .mnb-dash-main", has_text="2/2 workers alive").wait_for(timeout=T)
    assert page.locator(f"{dash} .mnb-dash-buttons button").count() == 3
    assert clipped(page, dash, ".mnb-dash-buttons button") == []
    hello = nb.output_text(code[2])
    assert "[rank 0] hello from rank 0 of 2 (dp=0)" in hello
    assert "[ranks 0-1] the same line on every rank" in hello
    train = nb.output_text(code[5])
    assert re.search(r"\[ranks 0-1\] step 59  mean loss 0\.000\d+\n", train), train
    assert "[ranks 0-1] (3.0, 1.0)" in train
    assert nb.cells().nth(code[7]).locator(".jp-OutputArea img").count() == 1  # the figure
    assert "[1000.0, 2000.0]" in nb.output_text(code[8])
    nb.shot("nb7_quickstart", dash)

    # a %%monarch cell streams: its first line shows while it still waits for us
    go = tmp_path / "go"
    n = nb.add_cell(
        "%%monarch\nimport os, time\nprint('waiting for the go file', flush=True)\n"
        "deadline = time.monotonic() + 120\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        f"print('go seen' if os.path.exists({str(go)!r}) else 'no go within 120 s')"
    )
    nb.run_cell(n)
    wait_cell_text(page, n, r"\[ranks 0-1\] waiting for the go file")
    assert prompt(nb, n) == "[*]:"
    assert "go seen" not in nb.output_text(n)
    nb.shot("nb7_streaming", nb.cells().nth(n))
    go.touch()
    wait_cell_text(page, n, r"\[ranks 0-1\] go seen")
    wait_done(nb, n)

    # the inline (Pdb r1) prompt: typed commands reach rank 1's pdb
    n = nb.add_cell("%%monarch --ranks 1\nx = 41 + rank\nbreakpoint()\nprint('after', x)")
    nb.run_cell(n)
    stdin = page.locator(".jp-Stdin-input")
    stdin.wait_for(timeout=T)
    assert "(Pdb r1)" in page.locator(".jp-Stdin").last.inner_text()
    stdin.press_sequentially("p x")
    stdin.press("Enter")
    wait_cell_text(page, n, r"\(Pdb r1\)\s+p x\s+42\s")
    stdin = page.locator(".jp-Stdin-input").last  # the new prompt (the answered one stays)
    stdin.wait_for(timeout=T)
    nb.shot("nb7_pdb", nb.cells().nth(n), doc_image="pdb.png")
    stdin.press_sequentially("c")
    stdin.press("Enter")
    wait_cell_text(page, n, r"\[rank 1\] after 42")
    wait_done(nb, n)

    # the extension's side panel works in Notebook 7's right area too
    page.evaluate("() => window.jupyterapp.commands.execute('monarch-nb:open-panel')")
    page.locator(PANEL).wait_for(state="visible", timeout=T)
    page.locator(f"{PANEL} .mnb-lab-head", has_text="quickstart.ipynb: mesh 'default'").wait_for(
        timeout=T
    )
    page.locator(f"{PANEL} .mnb-dash-main", has_text="2/2 workers alive").wait_for(timeout=T)
    # the dashboard's 3, the activity view's 2 (its zoom hidden until opened), the console's
    assert page.locator(f"{PANEL} button:visible").count() == 6
    assert clipped(page, PANEL, "button") == []
    assert outside_window(page, PANEL) == []  # nor is the panel cut
    nb.shot("nb7_panel")

    # the quickstart's last cell shuts the mesh down; the dashboard says so
    nb.run_cell(shutdown)
    wait_done(nb, shutdown)
    page.locator(f"{dash} .mnb-dash-main", has_text="shut down").wait_for(timeout=T)
    assert nb.stderr_outputs() == []
    ours = [p for p in problems if "monarch" in p.lower()]
    assert ours == [], ours
    # the extension never sent a comm to the kernel before monarch_nb was loaded in it
    log = (nb7_server.root / "server.log").read_text()
    assert "No such comm target" not in log
    assert "without encryption" not in log  # kernels over IPC
