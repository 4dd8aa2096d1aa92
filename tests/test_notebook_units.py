"""Unit tier: the notebook layer's pure parts (output folding and caps, result
grouping, failure rendering, magic argument grammar) and the worker's display helpers."""

from __future__ import annotations

import re
import time

import pytest
from IPython.core.error import UsageError

from monarch_nb.notebook import output as out_mod
from monarch_nb.notebook import sink as sink_mod
from monarch_nb.notebook.args import (
    cell_parser,
    mesh_parser,
    parse_dims,
    parse_ranks,
    parse_slice,
)
from monarch_nb.notebook.output import CELL_CAP, HOLD, CellSink
from monarch_nb.notebook.results import render_failures, result_displays
from monarch_nb.worker import display as wd

pytestmark = pytest.mark.unit  # in-process: no worker, kernel or browser


class FakePublisher:
    def __init__(self):
        self.sent = []

    def stream(self, parent, name, text):
        self.sent.append((parent, name, text))


def sink(ranks=(0, 1), parent="cell-1"):
    pub = FakePublisher()
    return CellSink(pub, parent, ranks), pub


def lines(pub, name="stdout"):
    return "".join(t for _, n, t in pub.sent if n == name).splitlines()


# ------------------------------------------------------------------ folding


def test_lockstep_lines_fold_and_others_keep_rank_prefix():
    s, pub = sink()
    s.add(0, "stdout", "hello 0\nsame\n")
    s.add(1, "stdout", "hello 1\nsame\n")
    s.finish()
    assert lines(pub) == ["[rank 0] hello 0", "[rank 1] hello 1", "[ranks 0-1] same"]
    assert {p for p, _, _ in pub.sent} == {"cell-1"}


def test_a_rank_specific_line_does_not_break_later_folding():
    s, pub = sink((0, 1, 2, 3))
    s.add(0, "stdout", "header\n")
    for r in range(4):
        s.add(r, "stdout", "step 1\nstep 2\n")
    s.finish()
    assert lines(pub) == ["[rank 0] header", "[ranks 0-3] step 1", "[ranks 0-3] step 2"]


def test_streams_are_separate_messages():
    s, pub = sink()
    s.add(0, "stderr", "warn\n")
    s.add(1, "stdout", "out\n")
    s.finish()
    assert [(n, t) for _, n, t in pub.sent] == [
        ("stdout", "[rank 1] out\n"),
        ("stderr", "[rank 0] warn\n"),
    ]


def test_a_line_waits_for_the_other_ranks_then_goes_alone():
    s, pub = sink()
    s.add(0, "stdout", "only me\n")
    now = time.monotonic()
    s.tick(now, 1 << 20)
    assert pub.sent == []  # rank 1 may print the same line: wait
    s.tick(now + HOLD + 0.05, 1 << 20)
    assert lines(pub) == ["[rank 0] only me"]


def test_partial_lines_are_held_then_flushed():
    s, pub = sink((0,))
    s.add(0, "stdout", "progress 10%")
    s.tick(time.monotonic(), 1 << 20)
    assert pub.sent == []
    s.add(0, "stdout", " 20%\nnext")
    s.tick(time.monotonic(), 1 << 20)
    assert lines(pub) == ["[rank 0] progress 10% 20%"]
    s.finish()
    assert lines(pub)[-1] == "[rank 0] next"


def test_tick_budget_leaves_the_rest_for_later():
    s, pub = sink((0,))
    s.add(0, "stdout", "".join(f"line {i}\n" for i in range(1000)))
    s.tick(time.monotonic(), 1000)
    first = lines(pub)
    assert 0 < len(first) < 1000
    s.finish()
    assert lines(pub) == [f"[rank 0] line {i}" for i in range(1000)]


def test_volume_is_capped_and_the_latest_lines_still_show():
    s, pub = sink()
    chunk = "x" * 99 + "\n"
    for _ in range(2000):  # 4 MB in all
        s.add(0, "stdout", chunk * 10)
        s.add(1, "stdout", chunk * 10)
        before = len(pub.sent)
        s.tick(time.monotonic() + 1, out_mod.BYTES_PER_TICK)
        assert len(pub.sent) - before <= 1  # at most one message per tick and stream name
    s.add(0, "stdout", "final metrics 0\n")
    s.add(1, "stdout", "final metrics 1\n")
    s.finish()
    total = sum(len(t) for _, _, t in pub.sent)
    assert total <= CELL_CAP + 16384  # the cap, then (outside a kernel) the latest lines
    text = lines(pub)
    assert any("this cell's output passed 512 KB" in t for t in text)
    assert any(re.search(r"\d+ lines \(\d+\.\d MB\) elided", t) for t in text), text[-30:]
    # each rank's latest lines, as a block per rank: both end with their last line
    assert text[-21] == "[rank 0] final metrics 0" and text[-1] == "[rank 1] final metrics 1"
    assert s.published == total


def test_a_huge_backlog_is_shed_not_buffered():
    s, pub = sink((0,))
    for _ in range(100):
        s.add(0, "stdout", "y" * 9999 + "\n")  # 1 MB, nothing published in between
    assert s._pending <= sink_mod.PENDING_CAP
    s.finish()
    assert "[rank 0] [... " in "\n".join(lines(pub))


def test_ambient_sink_does_not_wait_and_uses_current_cell():
    s, pub = sink(None, None)
    s.add(3, "stdout", "from a remote function\n")
    s.tick(time.monotonic(), 1 << 20)
    assert pub.sent == [(None, "stdout", "[rank 3] from a remote function\n")]
    # it lives as long as its mesh: no per-cell cap, only the rate limit
    for i in range(3 * CELL_CAP // 1000):
        s.add(0, "stdout", f"{i:09d}" * 100 + "\n")
        s.tick(time.monotonic() + 1, 1 << 20)
    assert s.dropped == 0 and lines(pub)[-1].endswith("000" + str(3 * CELL_CAP // 1000 - 1))


# ------------------------------------------------------------------ results and failures


def test_result_displays_fold_equal_values_and_label_ranks():
    res = {
        0: {"data": {"text/plain": "1"}, "figures": []},
        1: {"data": {"text/plain": "1"}, "figures": []},
        2: {"data": {"text/plain": "2", "text/html": "<b>2</b>"}, "figures": []},
        3: None,
    }
    shown = result_displays(res)
    assert shown[0] == {"text/plain": "[ranks 0-1] 1"}
    assert shown[1]["text/plain"] == "[rank 2] 2" and "[rank 2]" in shown[1]["text/html"]
    assert "<b>2</b>" in shown[1]["text/html"]
    fig = {"image/png": "AAAA", "text/plain": "<Figure>"}
    shown = result_displays(
        {0: {"data": None, "figures": [fig]}, 1: {"data": None, "figures": [fig]}}
    )
    assert shown == [
        {"text/plain": "[ranks 0-1]"},
        {"image/png": "AAAA", "text/plain": "[ranks 0-1] <Figure>"},
    ]


def test_render_failures_groups_identical_tracebacks():
    tb = 'Traceback (most recent call last):\n  File "<monarch In[3]>", line 2\nValueError: x\n'
    lines_ = render_failures(
        {
            0: ("ValueError", "x", tb),
            1: ("ValueError", "x", tb),
            2: ("KeyError", "'k'", "KeyError: 'k'\n"),
        },
        "cell failed",
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines_))
    assert text.count("Traceback") == 1
    assert "[ranks 0-1]" in text and "[rank 2]" in text and "cell failed" in text


# ------------------------------------------------------------------ arguments


def test_dims_grammar():
    assert parse_dims(["hosts=1", "gpus=2"]) == {"hosts": 1, "gpus": 2}
    assert list(parse_dims(["b=1", "a=2"])) == ["b", "a"]  # order kept
    for bad, msg in [
        (["dp"], "unexpected argument 'dp'"),
        (["dp=0"], "positive integer"),
        (["dp=-1"], "positive integer"),
        (["dp=1.5"], "positive integer"),
        (["backend=2"], "use --backend"),
        (["1a=2"], "not an identifier"),
        (["dp=1", "dp=2"], "given twice"),
    ]:
        with pytest.raises(UsageError, match=msg):
            parse_dims(bad)


def test_ranks_and_slice_grammar():
    assert parse_ranks("0,2") == [0, 2]
    assert parse_ranks("0-2,5,1") == [0, 1, 2, 5]
    for bad in ("a", "3-1", "", "1,,2", "-1"):
        with pytest.raises(UsageError, match="--ranks"):
            parse_ranks(bad)
    assert parse_slice(["dp=0"]) == {"dp": 0}
    assert parse_slice(["dp=0,tp=1:3", "pp=::2"]) == {
        "dp": 0,
        "tp": slice(1, 3),
        "pp": slice(None, None, 2),
    }
    for bad in ("dp", "dp=x", "=1", "dp=1:2:3:4"):
        with pytest.raises(UsageError, match="--slice"):
            parse_slice([bad])


def test_parsers_raise_usage_errors_naming_the_argument():
    a = mesh_parser().parse_line("dp=2 --name m tp=2")  # options between dims
    assert a.dims == ["dp=2", "tp=2"] and a.name == "m"
    with pytest.raises(UsageError, match="--backend"):
        mesh_parser().parse_line("dp=2 --backend tcp")
    a = cell_parser().parse_line("--ranks 0,1 --stream side --noblock --push a,b")
    assert (a.ranks, a.stream, a.noblock, a.push) == ("0,1", "side", True, "a,b")
    with pytest.raises(UsageError, match="--what"):
        cell_parser().parse_line("--what")


# ------------------------------------------------------------------ worker display helpers


def test_mimebundle_of_values():
    class Rich:
        def _repr_html_(self):
            return "<i>r</i>"

        def _repr_png_(self):
            return b"\x89PNG"

        def __repr__(self):
            return "Rich()"

    b = wd.mimebundle(Rich())
    assert b == {"text/html": "<i>r</i>", "image/png": "iVBORw==", "text/plain": "Rich()"}
    assert wd.mimebundle({"a": 1}) == {"text/plain": "{'a': 1}"}
    assert wd.mimebundle(Rich) == {"text/plain": repr(Rich)}  # a class, not an instance

    class Broken:
        def _repr_html_(self):
            raise RuntimeError("no")

        def __repr__(self):
            raise RuntimeError("nope")

    class Json:
        def _repr_json_(self):
            return {"a": object()}  # not JSON: dropped, text/plain stays

    assert set(wd.mimebundle(Json())) == {"text/plain"}
    b = wd.mimebundle(Broken())
    assert b["text/plain"].startswith("<Broken object (repr failed")
    big = wd.mimebundle("x" * (wd.MAX_TEXT + 10))
    assert big["text/plain"].endswith("[... 12 bytes of output dropped ...]")


def test_the_inline_pdb_list_folds_ranks_paused_at_one_place():
    from monarch_nb.controller.debug_sessions import Session
    from monarch_nb.notebook.pdb_prompt import describe, notice

    at = {"file": "Cell In[3]", "line": 4, "function": "<module>"}
    sessions = [Session(r, 0, "default", dict(at)) for r in range(1024) if r != 512]
    sessions.append(Session(512, 0, "default", {**at, "line": 9}))
    sessions.append(Session(7, 1, "comms", dict(at)))
    text = describe(sessions)
    assert text.splitlines() == [
        "paused debugger sessions:",
        "  ranks 0-511,513-1023 default    Cell In[3]:4  <module>",
        "  rank 7   comms      Cell In[3]:4  <module>",
        "  rank 512 default    Cell In[3]:9  <module>",
    ]
    few = describe([Session(r, 0, "default", dict(at)) for r in (1, 0)]).splitlines()
    assert few[1:] == [  # a few ranks keep a row each
        "  rank 0   default    Cell In[3]:4  <module>",
        "  rank 1   default    Cell In[3]:4  <module>",
    ]
    assert notice(sessions) == (
        "monarch_nb: paused in the debugger: ranks 0-511,513-1023 (default) at Cell In[3]:4; "
        "rank 7 (comms) at Cell In[3]:4; rank 512 (default) at Cell In[3]:9"
    )
