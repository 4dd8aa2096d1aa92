"""Workers tier: the worker half of gutter breakpoints (worker/breakpoints.py), driven
through the controller without a kernel: the table a kernel sends, a cell that stops at
a breakpoint only on the rank whose condition holds, and nothing left tracing after."""

from __future__ import annotations

from monarch_nb.protocol.breakpoints import cell_key

BODY = "x = rank * 3\ny = x + 1\ny"
SOURCE = "# %%monarch\n" + BODY


def send_table(mesh, cells: dict) -> None:
    table = {"cells": cells, "files": {}}
    mesh.debugger.set_breakpoints(table)


def test_a_cell_stops_at_its_breakpoint_where_the_condition_holds(mesh):
    dbg = mesh.debugger
    send_table(mesh, {cell_key(BODY): [(3, "rank == 1")]})
    try:
        r = mesh.run_cell(SOURCE, filename="<monarch In[901]>")
        assert dbg.wait_any(20)
        (s,) = dbg.sessions()  # rank 0's condition does not hold: it ran through
        assert (s.rank, s.location["line"], s.reason) == (1, 3, "breakpoint")
        top = dbg.inspect(s, "stack", {})["frames"][0]
        assert (top["file"], top["line"]) == ("<monarch In[901]>", 3)
        assert dbg.inspect(s, "evaluate", {"frame": top["index"], "expression": "x"}) == {
            "result": "3",
            "type": "int",
            "variablesReference": 0,
        }
        dbg.continue_all()
        got = r.result(timeout=30)
        assert [g["data"]["text/plain"] for g in got] == ["1", "4"]
    finally:
        send_table(mesh, {})
    # no tracer is left behind, and without breakpoints the cell runs through
    assert mesh.exec("__import__('sys').gettrace() is None").fetch(timeout=20) == [True, True]
    again = mesh.run_cell(SOURCE, filename="<monarch In[902]>").result(timeout=30)
    assert [g["data"]["text/plain"] for g in again] == ["1", "4"]
    assert dbg.sessions() == []


def test_a_breakpoint_on_a_line_without_code_is_ignored_and_the_cell_runs(mesh):
    send_table(mesh, {cell_key(BODY): [(42, None)]})
    try:
        got = mesh.run_cell(SOURCE, filename="<monarch In[903]>").result(timeout=30)
        assert [g["data"]["text/plain"] for g in got] == ["1", "4"]
        assert mesh.debugger.sessions() == []
    finally:
        send_table(mesh, {})
