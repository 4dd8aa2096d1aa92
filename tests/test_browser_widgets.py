"""Browser tier: ipywidgets made on the ranks are live widgets in JupyterLab (issue 27
item 3): an IntProgress per rank that a later cell moves, a Button whose click
runs its callback on the rank, and tqdm.notebook bars per rank. Screenshots: artifacts/."""

from __future__ import annotations

import pytest
from browser_helpers import Lab, missing

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]

T = 60_000  # ms: the longest any single wait in the page may take

# each bar's label -> how far it is filled, in whole percent
BARS_JS = """() => Object.fromEntries(
    [...document.querySelectorAll('.jp-Notebook .widget-hprogress')].map(b => [
        b.querySelector('.widget-label').innerText,
        Math.round(parseFloat(b.querySelector('.progress-bar').style.width)),
    ]))"""
BARS = (
    "(want) => { const got = (" + BARS_JS + ")(); const keys = Object.keys(got);"
    " return keys.length === Object.keys(want).length && keys.every(k => got[k] === want[k]); }"
)


def bars(rank0: int, rank1: int) -> dict:
    """What BARS_JS reads when the bars are filled so far (in percent)."""
    return {"rank 0": rank0, "rank 1": rank1}


def test_a_progress_bar_per_rank_moves_and_a_click_reaches_the_rank(page, server):
    lab = Lab(
        server,
        page,
        "widgets",
        [
            "%load_ext monarch_nb",
            "%monarch_mesh dp=2 --dashboard none",
            "%%monarch\nimport ipywidgets as widgets\n"
            "p = widgets.IntProgress(value=3, max=10, description=f'rank {rank}')\ndisplay(p)",
        ],
    )
    lab.open()
    lab.run_all()
    page.wait_for_function(BARS, arg=bars(30, 30), timeout=T)
    lab.wait_idle(T)
    # a later cell moves each rank's bar, in place
    n = lab.add_cell("%%monarch\np.value = 6 + 2 * rank")
    lab.run_cell(n)
    page.wait_for_function(BARS, arg=bars(60, 80), timeout=T)
    assert page.evaluate(BARS_JS) == {"rank 0": 60, "rank 1": 80}
    lab.shot("widgets_progress", lab.cells().nth(2))
    lab.wait_idle(T)
    # a click in the page runs the button's callback on its rank
    n = lab.add_cell(
        "%%monarch --ranks 0\nclicks = []\nb = widgets.Button(description='click rank 0')\n"
        "b.on_click(lambda _: clicks.append(1))\nb"
    )
    lab.run_cell(n)
    button = page.locator(".jp-Notebook button", has_text="click rank 0")
    button.wait_for(timeout=T)
    lab.wait_idle(T)
    button.click()
    n = lab.add_cell(
        "%%monarch --ranks 0\nimport time\nt = time.monotonic()\n"
        "while not clicks and time.monotonic() - t < 30:\n    time.sleep(0.02)\n"
        "print('clicks', len(clicks))"
    )
    lab.run_cell(n)
    page.wait_for_function(
        f"() => document.querySelectorAll('.jp-Notebook .jp-Cell')[{n}]"
        ".querySelector('.jp-OutputArea').innerText.includes('clicks')",
        timeout=T,
    )
    assert "[rank 0] clicks 1" in lab.output_text(n)
    lab.wait_idle(T)
    # tqdm.notebook: a bar per rank, each finished
    n = lab.add_cell(
        "%%monarch\nfrom tqdm.notebook import tqdm\nfor i in tqdm(range(10), desc=f'rank {rank}'):\n"
        "    pass"
    )
    lab.run_cell(n)
    page.wait_for_function(
        f"() => (document.querySelectorAll('.jp-Notebook .jp-Cell')[{n}]"
        ".querySelector('.jp-OutputArea').innerText.match(/10\\/10/g) || []).length === 2",
        timeout=T,
    )
    out = lab.output_text(n).replace("\u2007", " ")  # tqdm's figure spaces
    assert "rank 0" in out and "rank 1" in out, out
    lab.shot("widgets_tqdm", lab.cells().nth(n))
    assert lab.stderr_outputs() == []
