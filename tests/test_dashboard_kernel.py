"""Kernel tier: the dashboard in a real kernel, the test playing the browser's part of
the widget protocol (models from comm_open/comm_msg, updates and clicks sent back on
the shell channel). One kernel and one dp=2 mesh for the module."""

from __future__ import annotations

import ast
import datetime
import html
import time

import pytest
from kernel_helpers import Kernel, errors_text, idle, plain, stream
from wait_helpers import gated_code
from widget_helpers import Widgets

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kw(tmp_path_factory):
    kern = Kernel(tmp_path_factory.mktemp("dashkernel"))
    w = Widgets(kern)
    try:
        kern.ok("%load_ext monarch_nb\nimport monarch_nb as mnb")
        reply, msgs = kern.run("%monarch_mesh dp=2", timeout=120, output_hook=lambda m: w.feed([m]))
        assert reply["content"]["status"] == "ok", errors_text(msgs)
        yield kern, w
    finally:
        kern.shutdown()


def run(k, w, code: str, timeout: float = 60, ok: bool = True):
    """Execute ``code``, feeding every IOPub message to ``w`` (whatever its parent: the
    redraw thread's updates must not be lost); the reply and the request's messages."""
    msg_id = k.kc.execute(code)
    msgs = w.wait_msgs(msg_id, idle, timeout)
    deadline = time.monotonic() + timeout
    while True:
        reply = k.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    if ok:
        assert reply["content"]["status"] == "ok", f"{code!r}:\n{errors_text(msgs)}"
    return reply, msgs


def value(k, w, expr: str):
    _, msgs = run(k, w, f"print(repr({expr}))")
    return ast.literal_eval(stream(msgs).strip())


def test_mesh_magic_shows_the_dashboard(kw):
    k, w = kw
    dash = w.find("mnb-dashboard")
    shown = [
        m["content"]["data"]
        for m in w.msgs
        if m["msg_type"] == "display_data"
        and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]
    ]
    bundle = shown[-1]
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == dash
    assert "mnb-queues" in bundle["text/html"] and "mnb-health" in bundle["text/html"]
    assert "mesh 'default': dp=2, gloo, 2/2 alive" in bundle["text/plain"]
    # its children: the main view, buttons, errors, activity, debugger panel
    children = w.state[dash]["children"]
    assert len(children) == 5
    assert w.state[children[0].removeprefix("IPY_MODEL_")]["_dom_classes"] == ["mnb-dash-main"]
    main = w.wait_text("mnb-dash-main", "2/2 workers alive")
    assert main.count("<tr>") == 2 * 3  # queues and workers: a header and two ranks each
    # mesh.dashboard() gives another live dashboard of the same mesh
    _, msgs = run(k, w, "d = mnb.get_mesh().dashboard()\nd")
    assert len(w.all("mnb-dashboard")) == 2
    assert value(k, w, "(type(d).__name__, d.live, d.mesh.name)") == ("Dashboard", True, "default")
    (result,) = [m["content"]["data"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result["application/vnd.jupyter.widget-view+json"]["model_id"] == w.find("mnb-dashboard")
    run(k, w, "d.close()")
    # showing the mesh again: a new live view; the magic's previous one is frozen
    _, msgs = run(k, w, "%monarch_mesh")
    assert w.find("mnb-dashboard") != dash and len(w.all("mnb-dashboard")) == 2
    note = w.state[w.all("mnb-dash-note")[0]]["value"]
    assert "a newer view of this mesh replaced it" in note
    # --dashboard none: a status line, no widget
    _, msgs = run(k, w, "%monarch_mesh --dashboard none")
    assert stream(msgs).startswith("mesh 'default': dp=2, gloo, 2/2 alive (pids ")
    assert not [m for m in msgs if m["msg_type"] in ("comm_open", "display_data")]


def test_queues_on_two_streams_and_grouped_errors(kw, tmp_path):
    k, w = kw
    gate = tmp_path / "gate"  # holds the side stream's cell and the default stream's first
    run(k, w, "%%monarch --noblock --stream side\n" + gated_code(gate, "side", "side done"))
    run(k, w, "%%monarch --noblock\n" + gated_code(gate, "default", "default done"))
    run(k, w, "%%monarch --noblock\npass")  # queued behind the held one
    try:
        w.wait_text("mnb-dash-main", "1 queued")  # sent: the controller knows at once
        w.wait_text("mnb-dash-main", "▶ %%monarch")  # running: the workers' next report
        # one view showing both streams' work: each rank reports on its own beat, so a
        # view may show one stream's report before the other's (seen under -n 4)
        w.wait(
            w.find("mnb-dash-main"),
            lambda v: v is not None
            and all(s in html.unescape(v) for s in ("mnb-busy", "data-stream='side'", "1 queued")),
        )
    finally:
        gate.touch()
    reply, msgs = run(k, w, "%%monarch\nx = 1\n1 / (x - rank)", ok=False)  # rank 1 divides by zero
    assert reply["content"]["status"] == "error"
    errors = w.wait_text("mnb-dash-errors", "ZeroDivisionError")
    assert "rank 1" in errors and "1 failure" in errors and "<details" in errors
    assert "1 / (x - rank)" in errors  # the traceback, inside the expandable part
    # the same failure again on both ranks: a second group, newest first
    reply, msgs = run(k, w, "%%monarch\nraise ValueError('both')", ok=False)
    errors = w.wait_text("mnb-dash-errors", "ValueError")
    assert errors.index("ValueError") < errors.index("ZeroDivisionError")
    assert "ranks 0-1" in errors and "2 distinct" in errors
    main = w.wait_text("mnb-dash-main", "mnb-failed")
    assert "0 queued" in main
    run(k, w, "mnb.get_mesh().wait()")


def test_debugger_panel_prints_a_value_and_continues(kw):
    k, w = kw
    cell = k.kc.execute(
        "%%monarch --noblock --ranks 1\nx = 41 + rank\nbreakpoint()\nprint('after', x)"
    )
    sessions = w.wait_text("mnb-dbg-sessions", "1 paused session")
    assert "<monarch In[" in sessions and "<module>" in sessions
    select = w.find("mnb-dbg-select")
    w.wait(select, lambda v: v and "rank 1" in v[0], key="_options_labels")
    assert w.state[select]["index"] == 0
    inp = w.find("mnb-dbg-input")
    w.update(inp, value="p x")  # what the Text view sends on Enter
    out = w.wait_text("mnb-dbg-output", "(Pdb r1) p x")
    out = w.wait_text("mnb-dbg-output", "42")
    assert w.wait(inp, lambda v: v == "") == ""  # the input was cleared
    w.update(inp, value="ll")
    out = w.wait_text("mnb-dbg-output", "breakpoint()")
    assert "->" in out
    w.click(w.find("mnb-dbg-continue"))
    w.wait_text("mnb-dbg-sessions", "no paused sessions")
    w.wait_text("mnb-dbg-output", "continued 1 session")
    msgs = w.wait_msgs(cell, lambda ms: "after 42" in stream(ms))
    assert "[rank 1] after 42" in stream(msgs)


def test_debugger_panel_serves_a_waiting_cell_after_the_inline_prompt_detaches(kw):
    """A blocking %%monarch cell at a breakpoint: the inline prompt first (stdin); once
    the user detaches, the cell goes on waiting (awaited) and the panel serves it."""
    k, w = kw
    cell = k.kc.execute(
        "%%monarch --ranks 0\ny = 7 * 6\nbreakpoint()\nprint('done', y)", allow_stdin=True
    )
    prompts = []
    for answer in ("detach", "detach"):  # (Pdb r0): back to the menu; (monarch-dbg): stop
        req = k.kc.get_stdin_msg(timeout=30)
        prompts.append(req["content"]["prompt"])
        k.kc.input(answer)
    assert prompts == ["(Pdb r0) ", "(monarch-dbg) "]
    w.wait_msgs(cell, lambda ms: "detached" in stream(ms))
    w.wait_text("mnb-dbg-sessions", "1 paused session")
    w.update(w.find("mnb-dbg-input"), value="p y")
    w.wait_text("mnb-dbg-output", "(Pdb r0) p y\n42")
    assert not idle(w.of(cell))  # the cell still waits
    w.click(w.find("mnb-dbg-continue"))
    msgs = w.wait_msgs(cell, idle)
    assert "[rank 0] done 42" in stream(msgs) and not errors_text(msgs)


def test_interrupt_button_while_a_blocking_cell_waits(kw):
    """The waiting %%monarch cell is awaited, so the kernel handles the click."""
    k, w = kw
    cell = k.kc.execute("%%monarch\nprint('started', flush=True)\nwhile True:\n    pass")
    # an interrupt only reaches code that runs: wait until the ranks are in the loop
    w.wait_msgs(cell, lambda ms: stream(ms).count("started") == 1)
    w.wait_text("mnb-dash-main", "▶ %%monarch")
    w.click(w.find("mnb-dash-interrupt"))
    tb = errors_text(w.wait_msgs(cell, idle))
    assert "[ranks 0-1] KeyboardInterrupt" in tb and "while True:" in tb
    w.wait_text("mnb-dash-note", "interrupt sent")
    # and a looping --noblock cell: its failure lands under its own cell
    cell = k.kc.execute("%%monarch --noblock\nprint('spinning', flush=True)\nwhile True:\n    pass")
    w.wait_msgs(cell, lambda ms: "spinning" in stream(ms))
    w.click(w.find("mnb-dash-interrupt"))
    msgs = w.wait_msgs(cell, lambda ms: "KeyboardInterrupt" in errors_text(ms))
    assert "[ranks 0-1] KeyboardInterrupt" in errors_text(msgs)
    assert "while True:" in errors_text(msgs)
    run(k, w, "%%monarch\nrank")  # the mesh serves on


def test_awaited_cells_keep_the_magic_semantics(kw):
    k, w = kw
    assert "await" in value(k, w, "get_ipython().transform_cell('%%monarch\\nrank\\n')")
    run(k, w, "r = 1")
    _, msgs = run(k, w, "%%monarch --ranks {r}\nrank * 3")  # $/{} expansion, as run_cell_magic
    assert plain(msgs) == ["[rank 1] 3"]
    run(k, w, "%autoawait off")
    try:
        assert "await" not in value(k, w, "get_ipython().transform_cell('%%monarch\\nrank\\n')")
        _, msgs = run(k, w, "%%monarch\nrank + 5")  # the blocking wait
        assert plain(msgs) == ["[rank 0] 5", "[rank 1] 6"]
    finally:
        run(k, w, "%autoawait on")


def test_redraws_are_bounded_whatever_the_command_rate(kw):
    k, w = kw
    main = w.find("mnb-dash-main")
    first = len(w.updates)
    # every IOPub message is read (whatever its parent) while a burst of commands runs
    cell = k.kc.execute(
        "import time\nmesh = mnb.get_mesh()\nf = mnb.remote(abs)\nend = time.time() + 2\n"
        "while time.time() < end:\n    for _ in range(100):\n        f(-1, mesh=mesh)\n"
        "mesh.wait()"
    )
    msgs = w.wait_msgs(cell, idle, timeout=120)
    assert not errors_text(msgs)
    w.pump(0.5)
    times = sorted(
        datetime.datetime.fromisoformat(str(d).replace("Z", "+00:00"))
        for cid, delta, d in w.updates[first:]
        if cid == main and "value" in delta
    )
    assert len(times) >= 3, "the dashboard did not redraw during the burst"
    for i, t in enumerate(times):
        window = [u for u in times[i:] if (u - t).total_seconds() < 1.0]
        assert len(window) <= 11, len(window)


def test_restart_and_shutdown_buttons_and_the_docked_dashboard(kw):
    k, w = kw
    _, msgs = run(k, w, "%monarch_mesh dp=1 --name b --dashboard side", timeout=120)
    side = [
        m["content"]
        for m in msgs
        if m["msg_type"] == "comm_open"
        and m["content"]["data"]["state"].get("_model_name") == "SidecarModel"
    ]
    assert len(side) == 1
    dash = w.find("mnb-dashboard")
    outputs = w.wait(side[0]["comm_id"], lambda v: v, key="outputs")
    assert outputs[0]["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] == dash
    assert "docked in the side area" in "".join(
        m["content"]["data"].get("text/plain", "") for m in msgs if m["msg_type"] == "display_data"
    )
    before = value(k, w, "[i['pid'] for i in mnb.get_mesh('b').status()['ranks'].values()]")
    restart = w.find("mnb-dash-restart")
    w.click(restart)
    w.wait_text("mnb-dash-note", "click again")
    assert w.wait(restart, lambda v: v == "confirm restart?", key="description")
    w.click(restart)
    w.wait_text("mnb-dash-main", "generation 1", timeout=120)
    w.wait_text("mnb-dash-note", "restarted: generation 1", timeout=60)
    after = value(k, w, "[i['pid'] for i in mnb.get_mesh('b').status()['ranks'].values()]")
    assert not set(before) & set(after)
    reply, msgs = run(k, w, "%%monarch --mesh b\nrank + 10")
    assert "[rank 0] 10" in str(msgs)
    shutdown = w.find("mnb-dash-shutdown")
    w.click(shutdown)
    w.click(shutdown)
    w.wait_text("mnb-dash-main", "shut down", timeout=60)
    assert w.wait(shutdown, lambda v: v is True, key="disabled")
    assert w.wait(w.find("mnb-dash-interrupt"), lambda v: v is True, key="disabled")
    assert value(k, w, "'b' in mnb.api.mesh.all_meshes()") is False
    assert value(k, w, "mnb.get_mesh().name") == "default"
