"""Browser tier: Tab and Shift-Tab in a ``%%monarch`` cell of JupyterLab come from
rank 0, while a cell runs on the ranks (issue 27 item 4); the status item shows
auto mode (item 6). Screenshots: artifacts/."""

from __future__ import annotations

import pytest
from browser_helpers import Lab, missing

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]

T = 60_000  # ms: the longest any single wait in the page may take


def editor_text(lab: Lab, index: int) -> str:
    return lab.cells().nth(index).locator(".jp-InputArea-editor .cm-content").inner_text()


def test_tab_and_shift_tab_in_a_monarch_cell_come_from_rank_0(page, server):
    lab = Lab(
        server,
        page,
        "completion",
        [
            "%load_ext monarch_nb",
            "%monarch_mesh dp=2 --dashboard none",
            "%%monarch\nworker_only_table = {'alpha': 1}\n"
            "def worker_fn(a, b=2):\n    'Docstring on the workers.'\n",
            "%%monarch --noblock\nimport time\nwhile True:\n    time.sleep(0.05)",
        ],
    )
    lab.open()
    lab.run_all()
    page.wait_for_function(
        "() => document.querySelectorAll('.jp-Notebook .jp-Cell')[2]"
        ".querySelector('.jp-InputPrompt').innerText.includes('[3]')",
        timeout=T,
    )
    lab.wait_idle(T)
    # Tab: rank 0's match offered (the kernel has no such name), Enter writes it in
    n = lab.add_cell("%%monarch\nx = worker_only_t")
    page.keyboard.press("Tab")
    item = page.locator(".jp-Completer .jp-Completer-item")
    item.first.wait_for(timeout=T)
    assert [i.inner_text().split()[-2:] for i in item.all()] == [["worker_only_table", "variable"]]
    lab.shot("completion_menu", ".jp-Completer")
    page.keyboard.press("Enter")
    page.wait_for_function(
        f"() => document.querySelectorAll('.jp-Notebook .jp-Cell')[{n}]"
        ".querySelector('.cm-content').innerText.includes('worker_only_table')",
        timeout=T,
    )
    assert editor_text(lab, n).endswith("x = worker_only_table")
    # Shift-Tab: rank 0's signature and docstring in the tooltip
    page.keyboard.insert_text("\ny = worker_fn(")
    page.keyboard.press("Shift+Tab")
    tooltip = page.locator(".jp-Tooltip")
    tooltip.wait_for(timeout=T)
    shown = tooltip.inner_text()
    assert "worker_fn(a, b=2)" in shown and "Docstring on the workers." in shown, shown
    lab.shot("completion_tooltip", ".jp-Tooltip")
    assert lab.stderr_outputs() == []


def test_the_status_item_shows_auto_mode(page, server):
    lab = Lab(
        server,
        page,
        "auto",
        [
            "%load_ext monarch_nb",
            "%monarch_mesh dp=2 --dashboard none",
            "%monarch_auto on --ranks 1",
        ],
    )
    lab.open()
    lab.run_all()
    item = page.locator("#jp-main-statusbar .mnb-lab-status")
    item.locator(".mnb-lab-auto", has_text="auto").wait_for(timeout=T)
    title = item.get_attribute("title")
    assert "auto mode: every cell runs as %%monarch --ranks 1" in title, title
    lab.shot("auto_status", "#jp-main-statusbar .mnb-lab-status")
    lab.wait_idle(T)
    n = lab.add_cell("rank")
    lab.run_cell(n)
    page.wait_for_function(
        f"() => document.querySelectorAll('.jp-Notebook .jp-Cell')[{n}]"
        ".innerText.includes('[rank 1] 1')",
        timeout=T,
    )
    lab.wait_idle(T)
    n = lab.add_cell("%monarch_auto off")
    lab.run_cell(n)
    item.locator(".mnb-lab-auto").wait_for(state="detached", timeout=T)
    assert "auto mode" not in item.get_attribute("title")
