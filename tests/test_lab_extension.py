"""Browser tier: the JupyterLab extension (extension/), installed by ``pip install`` into
the environment, in a real JupyterLab driven with Debian's chromium. The status-bar item
follows the current notebook's mesh; the side panel docks its dashboard and a debugger
console; a kernel without monarch_nb leaves both quiet."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from browser_helpers import ARTIFACTS, Lab, clipped, missing, notebook, outside_window
from keepalive_helpers import cli

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]

T = 60_000  # ms: the longest any single wait in the page may take
ITEM = "#jp-main-statusbar .mnb-lab-status"
PANEL = "#monarch-nb-panel"


def installed() -> str | None:
    """Why the extension is not where JupyterLab looks (None: it is): a prebuilt
    extension's package.json in a labextensions folder of Jupyter's data path, what
    ``jupyter labextension list`` reads (which costs ~4 s of CPU: it runs yarn)."""
    from jupyter_core.paths import jupyter_path

    for folder in jupyter_path("labextensions"):
        if (Path(folder) / "monarch-nb" / "package.json").is_file():
            return None
    return "the monarch-nb labextension is not installed (pip install -e . builds it)"


@pytest.fixture(scope="module", autouse=True)
def extension_installed():
    why = installed()
    if why:
        pytest.fail(why)


def wait_text(page, selector: str, pattern: str) -> str:
    """Wait until the (first) element matching ``selector`` shows text matching ``pattern``."""
    page.wait_for_function(
        """([sel, pattern]) => {
            const el = document.querySelector(sel);
            return !!el && el.offsetParent !== null && new RegExp(pattern).test(el.innerText);
        }""",
        arg=[selector, pattern],
        timeout=T,
    )
    return page.locator(selector).first.inner_text()


def open_notebook(page, server, name: str, sources: list[str]) -> None:
    (server.nb / f"{name}.ipynb").write_text(json.dumps(notebook(sources)))
    page.evaluate(
        "path => window.jupyterapp.commands.execute('docmanager:open', {path})", f"{name}.ipynb"
    )
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current", has_text=name).wait_for(
        timeout=T
    )


def test_status_item_and_panel_follow_the_notebooks_mesh(page, server):
    # a notebook whose kernel has no monarch_nb: nothing shows, nothing is sent
    lab = Lab(server, page, "plain", ["print(1 + 1)"])
    lab.open()
    lab.run_cell(0)
    page.locator(".jp-OutputArea-output", has_text="2").first.wait_for(timeout=T)
    assert page.locator(ITEM).count() == 0 or not page.locator(ITEM).is_visible()

    open_notebook(
        page,
        server,
        "mesh",
        [
            "%load_ext monarch_nb\nimport monarch_nb as mnb",
            "%monarch_mesh dp=2 --dashboard none",
            "%%monarch --noblock --ranks 1\nx = 41 + rank\nbreakpoint()\nprint('after', x)",
            "import os, signal\nos.kill(mnb.get_mesh().status()['ranks'][1]['pid'], signal.SIGKILL)",
        ],
    )
    lab.wait_idle(T)
    lab.run_cell(0)
    lab.wait_idle(T)
    assert not page.locator(ITEM).is_visible()  # monarch_nb loaded, but no mesh yet
    lab.run_cell(1)
    # the status item appears with the mesh
    assert wait_text(page, ITEM, "2/2 alive") == "mesh dp=2 · 2/2 alive · idle"

    # a paused session shows as busy and paused
    lab.run_cell(2)
    text = wait_text(page, ITEM, "1 paused")
    assert text == "mesh dp=2 · 2/2 alive · busy r1 · 1 paused"
    assert page.locator(f"{ITEM} .mnb-lab-paused").inner_text() == "1 paused"

    # a click opens the panel: the notebook's dashboard, and the debugger console
    page.locator(ITEM).click()
    page.locator(PANEL).wait_for(state="visible", timeout=T)
    assert wait_text(page, f"{PANEL} .mnb-lab-head", "mesh 'default'") == (
        "mesh.ipynb: mesh 'default' dp=2 (gloo)"
    )
    wait_text(page, f"{PANEL} .mnb-lab-dashboard .mnb-dash-main", "2/2 workers alive")
    assert page.locator(f"{PANEL} .mnb-dbg").count() == 0  # the console replaces that part
    session = page.locator(f"{PANEL} .mnb-lab-session")
    assert re.fullmatch(
        r"rank 1 · default · <monarch In\[3\]>:3 <module>", session.inner_text().strip()
    )
    box = page.locator(f"{PANEL} .mnb-lab-console-input")
    box.fill("p x")
    box.press("Enter")
    log = f"{PANEL} .mnb-lab-console-log"
    wait_text(page, log, r"\(Pdb r1\) p x\n42")
    box.fill("p x * 2")
    box.press("Enter")
    wait_text(page, log, r"\(Pdb r1\) p x \* 2\n84")
    assert box.input_value() == ""
    # the arrow keys walk the history, and come back to the draft
    box.fill("draft")
    box.press("ArrowUp")
    assert box.input_value() == "p x * 2"
    box.press("ArrowUp")
    assert box.input_value() == "p x"
    box.press("ArrowUp")
    assert box.input_value() == "p x"
    box.press("ArrowDown")
    assert box.input_value() == "p x * 2"
    box.press("ArrowDown")
    assert box.input_value() == "draft"
    box.fill("")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "lab_extension_panel.png"))

    # continue from the console: the cell's output arrives, the item is no longer paused
    page.locator(f"{PANEL} .mnb-lab-continue").click()
    wait_text(page, log, "continued 1 session")
    page.locator(".jp-OutputArea-output", has_text="[rank 1] after 42").first.wait_for(timeout=T)
    assert wait_text(page, ITEM, "idle$") == "mesh dp=2 · 2/2 alive · idle"

    # a killed worker: the item turns red within seconds, the docked dashboard says so
    lab.run_cell(3)
    assert wait_text(page, ITEM, "1/2 alive") == "mesh dp=2 · broken · 1/2 alive · idle"
    assert page.locator(f"{ITEM} .mnb-lab-bad").all_inner_texts() == ["broken", "1/2 alive"]
    assert "rank 1: killed by signal SIGKILL" in page.locator(ITEM).get_attribute("title")
    wait_text(page, f"{PANEL} .mnb-lab-dashboard .mnb-dash-main", "1/2 workers alive")
    page.screenshot(path=str(ARTIFACTS / "lab_extension_dead_worker.png"))

    # the panel and the item follow the notebook tab
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="plain.ipynb").click()
    wait_text(page, f"{PANEL} .mnb-lab-head", "not loaded in this kernel")
    page.wait_for_function(
        f"() => {{ const e = document.querySelector('{ITEM}'); return !e || e.offsetParent === null; }}",
        timeout=T,
    )
    assert page.locator(f"{PANEL} .mnb-lab-dashboard").count() == 0
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="mesh.ipynb").click()
    wait_text(page, ITEM, "1/2 alive")
    wait_text(page, f"{PANEL} .mnb-lab-dashboard .mnb-dash-main", "1/2 workers alive")
    # a reloaded page finds the kernel's monarch_nb again (comm_info), with nothing run
    page.reload()
    wait_text(page, ITEM, "1/2 alive")

    # a new mesh of the same name: the panel asks for its dashboard
    page.locator(ITEM).click()
    wait_text(page, f"{PANEL} .mnb-lab-dashboard .mnb-dash-main", "1/2 workers alive")
    lab.run_cell(1)
    assert wait_text(page, ITEM, "2/2 alive") == "mesh dp=2 · 2/2 alive · idle"
    wait_text(page, f"{PANEL} .mnb-lab-dashboard .mnb-dash-main", "2/2 workers alive")

    # a restarted kernel: quiet until monarch_nb loads and a mesh comes again
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:restart-kernel'); }")
    page.locator(".jp-Dialog .jp-mod-accept").click()
    wait_text(page, f"{PANEL} .mnb-lab-head", "not loaded in this kernel")
    assert not page.locator(ITEM).is_visible()
    lab.wait_idle(T)
    lab.run_cell(0)
    wait_text(page, f"{PANEL} .mnb-lab-head", "no mesh yet")
    lab.run_cell(1)
    assert wait_text(page, ITEM, "2/2 alive") == "mesh dp=2 · 2/2 alive · idle"
    wait_text(page, f"{PANEL} .mnb-lab-dashboard .mnb-dash-main", "2/2 workers alive")
    assert page.locator(f"{PANEL} .mnb-lab-dashboard").count() == 1
    # the kernel without monarch_nb was never sent a comm it does not know
    log = (server.root / "server.log").read_text()
    assert "No such comm target" not in log
    assert "without encryption" not in log  # kernels over IPC


def test_panel_shows_every_button_at_its_default_width(page, server):
    lab = Lab(
        server, page, "width", ["%load_ext monarch_nb", "%monarch_mesh dp=2 --dashboard none"]
    )
    lab.open()
    lab.run_cell(0)
    lab.run_cell(1)
    wait_text(page, ITEM, "2/2 alive")
    page.evaluate("() => window.jupyterapp.commands.execute('monarch-nb:open-panel')")
    page.locator(PANEL).wait_for(state="visible", timeout=T)
    wait_text(page, f"{PANEL} .mnb-lab-dashboard .mnb-dash-main", "2/2 workers alive")
    for part in ("interrupt", "restart", "shut down"):
        page.locator(f"{PANEL} .mnb-dash-buttons button", has_text=part).wait_for(timeout=T)
    width = page.evaluate(f"() => document.querySelector('{PANEL}').getBoundingClientRect().width")
    page.screenshot(path=str(ARTIFACTS / "lab_panel_default_width.png"))
    # the dashboard's buttons (3, and the activity view's toggle and stacks: its zoom
    # shows once opened) and the console's, each whole inside the panel as it opens
    assert page.locator(f"{PANEL} button:visible").count() == 6
    assert clipped(page, PANEL, "button") == [], f"panel {width:.0f} px wide"
    assert outside_window(page, PANEL) == []  # nor is the panel cut


def test_a_kept_alive_mesh_comes_back_after_a_kernel_restart(page, server, tmp_path, monkeypatch):
    """Issue 29: a kernel restart, then ``%monarch_mesh --attach``: the mesh's workers
    with their state, its dashboard under the cell, the status item and the panel."""
    registry = tmp_path / "meshes"
    monkeypatch.setenv("MONARCH_NB_MESH_DIR", str(registry))  # for the cleanup's kill
    setup = f"import os\nos.environ['MONARCH_NB_MESH_DIR'] = {str(registry)!r}\n%load_ext monarch_nb"
    lab = Lab(
        server,
        page,
        "attach",
        [
            setup,
            "%monarch_mesh dp=2 --keep-alive 120s --name lab_att --dashboard none",
            "%%monarch\nanswer = 40 + rank",
            "%monarch_mesh --attach lab_att",
            "%%monarch\nprint('answer', answer)",
        ],
    )
    try:
        lab.open()
        lab.run_cell(0)
        lab.run_cell(1)
        wait_text(page, ITEM, "2/2 alive")
        lab.run_cell(2)
        lab.wait_idle(T)
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:restart-kernel'); }")
        page.locator(".jp-Dialog .jp-mod-accept").click()
        lab.wait_idle(T)
        assert not page.locator(ITEM).is_visible()  # a fresh kernel: no mesh
        lab.run_cell(0)
        lab.run_cell(3)
        assert wait_text(page, ITEM, "2/2 alive") == "mesh dp=2 · 2/2 alive · idle"
        out = lab.cells().nth(3).locator(".jp-OutputArea")
        out.locator(".mnb-dash-main", has_text="2/2 workers alive").wait_for(timeout=T)
        assert "attached to mesh 'lab_att': 2 ranks" in lab.output_text(3)
        lab.run_cell(4)
        lab.cells().nth(4).locator(".jp-OutputArea", has_text="answer 41").wait_for(timeout=T)
        assert "answer 40" in lab.output_text(4)
        page.locator(ITEM).click()
        page.locator(PANEL).wait_for(state="visible", timeout=T)
        assert "mesh 'lab_att' dp=2" in wait_text(page, f"{PANEL} .mnb-lab-head", "lab_att")
        lab.shot("lab_attached", out)
    finally:
        cli("kill", "lab_att")
