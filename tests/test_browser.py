"""Browser tier: JupyterLab + Debian chromium + Playwright (docs/testing.md). The dashboard
renders in a real page and reacts to clicks and typing. Screenshots: artifacts/."""

from __future__ import annotations

import re

import pytest
from browser_helpers import Lab, missing

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]

T = 60_000  # ms: the longest any single wait in the page may take


def dash_text(page, cls: str) -> str:
    return page.locator(f".mnb-dashboard .{cls}").last.inner_text()


def wait_dash(page, cls: str, pattern: str) -> str:
    """Wait until the newest dashboard's ``cls`` part shows text matching ``pattern``."""
    page.wait_for_function(
        """([cls, pattern]) => {
            const all = document.querySelectorAll('.mnb-dashboard .' + cls);
            const el = all[all.length - 1];
            return !!el && new RegExp(pattern).test(el.innerText);
        }""",
        arg=[cls, pattern],
        timeout=T,
    )
    return dash_text(page, cls)


def queue_cell(page, rank: int, stream: str) -> str:
    cell = page.locator(f".mnb-dashboard td.mnb-cell[data-rank='{rank}'][data-stream='{stream}']")
    return cell.last.inner_text().strip()


def test_dashboard_shows_queues_errors_and_serves_the_debugger(page, server):
    lab = Lab(
        server,
        page,
        "dashboard",
        [
            "%load_ext monarch_nb\nimport monarch_nb as mnb",
            "%monarch_mesh dp=2",
            "%%monarch --noblock --stream side\nimport time\ntime.sleep(600)",
            "%%monarch --noblock --stream side\nprint('side 1')",
            "%%monarch --noblock --stream side\nprint('side 2')",
            "%%monarch --noblock --stream load\nimport time\ntime.sleep(600)",
            "%%monarch --noblock --stream load\nprint('load 1')",
            "_ = mnb.get_mesh().exec('1 / (1 - rank)')  # fails on rank 1, shown by the dashboard",
            "%%monarch --ranks 1\nx = 41 + rank\nbreakpoint()\nprint('after', x)",
        ],
    )
    lab.open()
    lab.run_all()
    # the breakpoint cell waits at the inline prompt (the kernel's stdin)
    stdin = page.locator(".jp-Stdin-input")
    stdin.wait_for(timeout=T)
    assert "(Pdb r1)" in page.locator(".jp-Stdin").last.inner_text()
    # queue depths count commands: a %%monarch cell is one (RunCell)
    wait_dash(page, "mnb-dash-main", r"2 queued[\s\S]*1 queued")
    for rank in (0, 1):
        side = queue_cell(page, rank, "side")
        assert re.fullmatch(r"▶ %%monarch In\[3\]: import time · \d+ s\s+2 queued · 0 done", side)
        load = queue_cell(page, rank, "load")
        assert re.fullmatch(r"▶ %%monarch In\[6\]: import time · \d+ s\s+1 queued · 0 done", load)
    assert page.locator(".mnb-dashboard td.mnb-busy").count() == 4  # 2 ranks x 2 streams
    errors = wait_dash(page, "mnb-dash-errors", "ZeroDivisionError")
    assert "rank 1 · 1 failure" in errors and "1 distinct" in errors
    # expand the traceback
    page.locator(".mnb-dashboard .mnb-error summary").first.click()
    assert "1 / (1 - rank)" in page.locator(".mnb-dashboard .mnb-error pre").first.inner_text()
    # leave the inline prompt (detach the session, then the menu): the cell goes on
    # waiting, awaited, and the dashboard's panel serves the session
    stdin.fill("detach")
    stdin.press("Enter")
    page.locator(".jp-Stdin", has_text="(monarch-dbg)").wait_for(timeout=T)
    stdin = page.locator(".jp-Stdin-input").last
    stdin.fill("detach")
    stdin.press("Enter")
    page.locator(".jp-OutputArea-output", has_text="detached: the sessions keep waiting").wait_for(
        timeout=T
    )
    sessions = wait_dash(page, "mnb-dbg-sessions", "1 paused session")
    assert "<monarch In[9]>:3" in sessions
    selected = page.locator(".mnb-dashboard .mnb-dbg-select select").last
    assert (
        selected.inner_text().replace("\xa0", " ")
        == "rank 1 · default · <monarch In[9]>:3 <module>"
    )
    box = page.locator(".mnb-dashboard .mnb-dbg-input input").last
    box.fill("p x")
    box.press("Enter")
    wait_dash(page, "mnb-dbg-output", r"\(Pdb r1\) p x\s+42")
    assert box.input_value() == ""
    lab.shot("dashboard_debugger", ".mnb-dashboard")
    assert lab.stderr_outputs() == []
    # continue from the panel: the waiting cell ends with its output
    page.locator(".mnb-dashboard .mnb-dbg-continue").last.click()
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-OutputArea-output')]"
        ".some(e => e.innerText.includes('[rank 1] after 42'))",
        timeout=T,
    )
    wait_dash(page, "mnb-dbg-sessions", "no paused sessions")
    wait_dash(page, "mnb-dbg-output", "continued 1 session")
    lab.wait_idle(T)
    assert lab.stderr_outputs() == []

    # the interrupt button stops a looping --noblock cell (and the sleeps of the streams)
    n = lab.add_cell("%%monarch --noblock\nprint('spinning', flush=True)\nwhile True:\n    pass")
    lab.run_cell(n)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-OutputArea-output')]"
        ".some(e => e.innerText.includes('spinning'))",
        timeout=T,
    )
    page.locator(".mnb-dashboard .mnb-dash-interrupt").last.click()
    page.wait_for_function(
        f"() => document.querySelectorAll('.jp-Notebook .jp-Cell')[{n}]"
        ".innerText.includes('KeyboardInterrupt')",
        timeout=T,
    )
    assert "while True:" in lab.output_text(n)
    wait_dash(page, "mnb-dash-note", "interrupt sent")
    wait_dash(page, "mnb-dash-main", r"^(?![\s\S]*▶)")  # nothing runs any more
    lab.shot("dashboard_interrupted", ".mnb-dashboard", doc_image="dashboard.png")
    stderr = lab.stderr_outputs()
    assert stderr and all("KeyboardInterrupt" in e for e in stderr), stderr


def test_docked_dashboard_in_the_side_area(page, server):
    lab = Lab(
        server,
        page,
        "docked",
        ["%load_ext monarch_nb", "%monarch_mesh dp=1 --dashboard side", "%monarch_mesh --shutdown"],
    )
    lab.open()
    lab.run_cell(0)
    lab.run_cell(1)
    # the dashboard lives outside the notebook's cells, in a sidecar panel
    page.locator(".mnb-dashboard").first.wait_for(timeout=T)
    assert page.locator(".jp-Notebook .mnb-dashboard").count() == 0
    assert page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="mesh default").count() == 1
    assert "docked in the side area" in lab.output_text(1)
    wait_dash(page, "mnb-dash-main", "1/1 workers alive")
    lab.shot("dashboard_docked", ".mnb-dashboard")
    lab.run_cell(2)
    wait_dash(page, "mnb-dash-main", "shut down")
    assert lab.stderr_outputs() == []


def test_activity_view_shows_a_straggler_and_the_stacks(page, server):
    lab = Lab(
        server,
        page,
        "activity",
        [
            "%load_ext monarch_nb\nimport monarch_nb as mnb",
            "%monarch_mesh dp=2",
            "%%monarch\nimport time\nfor _ in range(3):\n    time.sleep(0.05 + 0.4 * rank)",
            "%%monarch --noblock --stream side\nimport time\ntime.sleep(600)",
        ],
    )
    lab.open()
    lab.run_all()
    page.locator(".mnb-dashboard .mnb-ts-toggle").last.click()
    # a bar per command; rank 1's cell, 8x its peer's, is outlined as a straggler
    page.locator(".mnb-dashboard .mnb-ts-view rect.mnb-ts-straggler").last.wait_for(timeout=T)
    # rank 1's side row comes once that rank reports the --noblock cell's start
    rows = "".join(f"(?=[\\s\\S]*{row})" for row in ("rank 0 default", "rank 1 default", "rank 1 side"))
    view = wait_dash(page, "mnb-ts-view", rows)
    assert "rank 0 default" in view and "rank 1 default" in view and "rank 1 side" in view
    page.locator(".mnb-dashboard .mnb-ts-zoom button", has_text="1 min").last.click()
    lab.shot("dashboard_activity", ".mnb-dashboard .mnb-ts")
    page.locator(".mnb-dashboard .mnb-ts-stacks").last.click()
    text = wait_dash(page, "mnb-ts-stacks-out", "time.sleep")
    assert "rank 0 side" in text and "rank 1 side" in text
    page.locator(".mnb-dashboard .mnb-dash-interrupt").last.click()
    assert lab.stderr_outputs() == [] or all("KeyboardInterrupt" in e for e in lab.stderr_outputs())
