"""Browser tier: JupyterLab's own debugger on a ``%%monarch`` cell (docs/testing.md). The
debugger switched on from the notebook toolbar, a gutter breakpoint clicked, the cell run:
both ranks stop there and show in the call-stack panel in turn, with their variables; a
step, continues, and the cell completes. Screenshots: artifacts/dap-*.png."""

from __future__ import annotations

import re

import pytest
from browser_helpers import Lab, missing

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]

T = 60_000  # ms: the longest any single wait in the page may take
CELL = "%%monarch\nx = rank * 10 + 7\ny = x + 1\nz = y * 2\nprint('done', z)"
FRAME = ".jp-DebuggerCallstackFrame"


def shown_frame(page, pattern: str) -> str:
    """Wait until the call-stack panel's first frame reads like ``pattern``."""
    page.wait_for_function(
        """([sel, pattern]) => {
            const el = document.querySelector(sel);
            return !!el && new RegExp(pattern).test(el.innerText);
        }""",
        arg=[FRAME, pattern],
        timeout=T,
    )
    return page.locator(FRAME).first.inner_text()


def settled_frame(page, pattern: str, quiet_ms: int = 500) -> str:
    """Like ``shown_frame``, once the first frame has read the same for ``quiet_ms``."""
    page.wait_for_function(
        """([sel, pattern, quiet]) => {
            const el = document.querySelector(sel);
            const text = el ? el.innerText : null;
            const now = performance.now();
            if (window.__frameText !== text) {
                window.__frameText = text;
                window.__frameSince = now;
            }
            return !!el && new RegExp(pattern).test(text) && now - window.__frameSince >= quiet;
        }""",
        arg=[FRAME, pattern, quiet_ms],
        timeout=T,
        polling=100,
    )
    return page.locator(FRAME).first.inner_text()


def shown_variable(page, name: str, value: str) -> None:
    """Wait until the variables panel shows ``name: value``."""
    page.wait_for_function(
        """([name, value]) => {
            const el = document.querySelector('.jp-DebuggerVariables');
            return !!el && new RegExp(`(^|\\n)${name}\\s*:?\\s*\\n?${value}(\\n|$)`).test(el.innerText);
        }""",
        arg=[name, value],
        timeout=T,
    )


def toolbar(page, title: str):
    return page.locator(f"button[title^='{title}']").first


def test_a_gutter_breakpoint_in_a_monarch_cell_through_jupyterlabs_debugger(page, server):
    lab = Lab(
        server,
        page,
        "dap",
        ["%load_ext monarch_nb\nimport monarch_nb as mnb", "%monarch_mesh dp=2", CELL],
    )
    lab.open()
    lab.run_cell(0)
    lab.wait_idle()
    lab.run_cell(1)
    page.locator(".jp-NotebookPanel:visible .jp-OutputArea", has_text="2/2 workers alive").wait_for(
        timeout=T
    )
    lab.wait_idle()
    page.locator(".jp-NotebookPanel:visible .jp-DebuggerBugButton").first.click()
    page.locator(".jp-DebuggerBreakpoints").first.wait_for(timeout=T)
    # the gutter of the %%monarch cell's line 3 (y = x + 1)
    cell = lab.cells().nth(2)
    cell.locator(".cm-breakpoint-gutter .cm-gutterElement").nth(3).click()
    page.locator(".jp-DebuggerBreakpoints", has_text="3").first.wait_for(timeout=T)
    lab.run_cell(2)

    # each rank's stop is announced as it comes, and the panel shows the last one:
    # read which rank it shows once both have stopped and the panel has settled
    page.locator(
        ".jp-NotebookPanel:visible .jp-OutputArea", has_text="2 paused in the debugger"
    ).first.wait_for(timeout=T)
    first = settled_frame(page, r"<module> · rank [01]\s+Cell \[\*\]:3")
    rank = int(re.search(r"rank (\d)", first).group(1))
    shown_variable(page, "x", str(rank * 10 + 7))
    lab.shot("dap-paused", ".jp-DebuggerCallstack")
    # step once: the same rank, one line on
    toolbar(page, "Next").click()
    shown_frame(page, rf"<module> · rank {rank}\s+Cell \[\*\]:4")
    shown_variable(page, "y", str(rank * 10 + 8))
    lab.shot("dap-stepped", ".jp-DebuggerVariables")
    # continue it: the other paused rank comes into the panel, at the breakpoint
    toolbar(page, "Continue").click()
    other = 1 - rank
    shown_frame(page, rf"<module> · rank {other}\s+Cell \[\*\]:3")
    shown_variable(page, "x", str(other * 10 + 7))
    lab.shot("dap-other-rank", ".jp-DebuggerCallstack")
    toolbar(page, "Continue").click()
    out = cell.locator(".jp-OutputArea")
    out.filter(has_text="done 16").wait_for(timeout=T)
    out.filter(has_text="done 36").wait_for(timeout=T)
    lab.wait_idle()
    # with the panel on, the cell never asked the kernel's stdin (no inline prompt)
    assert page.locator(".jp-Stdin-input").count() == 0
    out.filter(has_text="the debugger panel shows the paused ranks").wait_for(timeout=T)
    assert page.locator(FRAME).count() == 0  # nothing paused any more
    lab.shot("dap-done", cell)
