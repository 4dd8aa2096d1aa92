"""The transcript ``python -m monarch_nb quickstart`` prints: headings, leads, cells, outputs."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from monarch_nb.headless import transcript

pytestmark = pytest.mark.unit  # in-process: no worker, kernel or browser


def _code(source: str, n: int, *outputs):
    cell = new_code_cell(source, execution_count=n)
    cell.outputs = list(outputs)
    return cell


def test_cells_under_their_section_with_the_lead_of_the_text_above():
    nb = new_notebook(
        cells=[
            new_markdown_cell("# Title\n\nThe first sentence. The second one.\nStill the second."),
            _code("x = 1\n\n\nprint(x)", 1, new_output("stream", name="stdout", text="1\n")),
            new_markdown_cell("## Part two\nNo full stop here"),
            _code("\n".join(f"line{i}" for i in range(9)), 2),
            _code("raise ValueError('bad')", 3),
        ]
    )
    nbformat.validate(nb)
    assert transcript(nb).split("\n\n") == [
        "# Title\nThe first sentence.\nIn [1]: x = 1\n   ...: print(x)\n    1",
        "## Part two\nNo full stop here\nIn [2]: line0\n   ...: line1\n   ...: line2\n"
        "   ...: ... (6 more lines)",
        "In [3]: raise ValueError('bad')",
    ]


def test_outputs_as_they_ended():
    bar = "\rwork:  50%|#####     | 1/2\rwork: 100%|##########| 2/2\n"
    error = new_output(
        "error", ename="ValueError", evalue="bad", traceback=["\x1b[31mValueError\x1b[0m: bad"]
    )
    figure = new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Fig>"})
    view = {"model_id": "box", "version_major": 2, "version_minor": 0}
    widget = new_output(
        "display_data",
        data={"application/vnd.jupyter.widget-view+json": view, "text/plain": "up:  0%|"},
    )
    nb = new_notebook(
        cells=[
            _code("run()", 1, new_output("stream", name="stderr", text=bar), figure, widget, error)
        ]
    )

    def model(name, **state):
        return {"model_name": name, "model_module": "@jupyter-widgets/controls", "state": state}

    nb.metadata["widgets"] = {
        "application/vnd.jupyter.widget-state+json": {
            "state": {
                "box": model("HBoxModel", children=["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]),
                "l": model("HTMLModel", value="up\u2007&#x27;x&#x27;:\u2007100%"),
                "p": model("FloatProgressModel", value=2.0, max=2.0),
                "r": model("HTMLModel", value="\u20072/2\u2007[00:01&lt;00:00]"),
            }
        }
    }
    assert transcript(nb).splitlines() == [
        "In [1]: run()",
        "    work: 100%|##########| 2/2",
        "    (a figure)",
        "    up 'x': 100%|##########| 2/2 [00:01<00:00]",
        "    ValueError: bad",
    ]
