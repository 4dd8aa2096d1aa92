"""Every rank runs a real IPython cell (issue 27): IPython's own shell on the workers.

Workers tier (``mesh.run_cell``, the command ``%%monarch`` sends, on the module's
dp=2 mesh): magics, ``!cmd``, ``obj?``, extensions, ``get_ipython()`` and
``display()`` on every rank, controller and kernel magics refused by name. Kernel
tier (a real ipykernel): the same through ``%%monarch``, what IOPub carries, and
Ctrl-C of a shell command that never ends.
"""

from __future__ import annotations

import os

import pytest
from kernel_helpers import ANSI, displays, errors_text, mesh_kernel, plain, stream, text

import monarch_nb as mnb


class Output:
    """The mesh's output per rank while a block runs (its output_handler)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.text: dict[int, str] = {}

    def __call__(self, msg) -> None:
        self.text[msg.rank] = self.text.get(msg.rank, "") + msg.text

    def __enter__(self) -> Output:
        self._old, self.mesh.output_handler = self.mesh.output_handler, self
        return self

    def __exit__(self, *exc) -> None:
        self.mesh.output_handler = self._old


_count = [900]


def cell(mesh, body: str) -> list:
    """Run ``body`` as ``%%monarch`` sends it (its header line first); per-rank results."""
    _count[0] += 1
    source = "# %%monarch\n" + body
    return mesh.run_cell(source, filename=f"<monarch In[{_count[0]}]>").result(timeout=60)


def values(results) -> list:
    return [r["data"]["text/plain"] if r["data"] else None for r in results]


def failure(mesh, body: str) -> str:
    with pytest.raises(mnb.RemoteError) as info:
        cell(mesh, body)
    return str(info.value)


# ------------------------------------------------------------------ workers tier


def test_get_ipython_is_the_workers_shell_over_its_namespace(mesh):
    got = cell(
        mesh,
        "ip = get_ipython()\n(type(ip).__name__, ip.user_ns['rank'], 'display' in dir(__builtins__))",
    )
    assert values(got) == ["('WorkerShell', 0, True)", "('WorkerShell', 1, True)"]
    # names persist from cell to cell, and the shell's own stay out of %who
    cell(mesh, "kept = rank * 7")
    with Output(mesh) as out:
        cell(mesh, "%who")
    for r in (0, 1):
        assert "kept" in out.text[r] and "rank" in out.text[r] and "get_ipython" not in out.text[r]


def test_line_and_cell_magics_run_on_every_rank(mesh):
    with Output(mesh) as out:
        got = cell(mesh, "%time y = rank + 40\n%timeit -n1 -r1 y + 1\ny")
    assert values(got) == ["40", "41"]
    for r in (0, 1):
        assert "Wall time" in out.text[r] and "per loop" in out.text[r], out.text[r]
    # a cell magic on the cell's first line (after the header)
    with Output(mesh) as out:
        cell(mesh, "%%timeit -n1 -r1\nz = rank * 2")
    assert all("per loop" in out.text[r] for r in (0, 1)), out.text


def test_shell_commands_and_their_captured_output(mesh):
    with Output(mesh) as out:
        got = cell(mesh, "!echo hi from $rank\nlines = !echo r$rank; echo two\nlines")
    assert [out.text[r].replace("\r\n", "\n") for r in (0, 1)] == ["hi from 0\n", "hi from 1\n"]
    assert values(got) == ["['r0', 'two']", "['r1', 'two']"]


def test_help_of_an_object_is_the_ranks_output(mesh):
    cell(mesh, "def scaled(v):\n    '''Scales v by the rank, mostly.'''\n    return v * rank")
    with Output(mesh) as out:
        got = cell(mesh, "scaled?")
    assert values(got) == [None, None]
    for r in (0, 1):
        assert "Scales v by the rank, mostly." in out.text[r], out.text[r]
        assert "\x1b[" not in out.text[r]
    with Output(mesh) as out:
        cell(mesh, "scaled??")
    assert "return v * rank" in out.text[0]


def test_an_extension_loads_and_its_events_fire(mesh, tmp_path):
    mod = tmp_path / "ipy27_reloaded.py"
    mod.write_text("VALUE = 1\n")
    cell(
        mesh,
        f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n%load_ext autoreload\n%autoreload 2",
    )
    assert values(cell(mesh, "import ipy27_reloaded\nipy27_reloaded.VALUE")) == ["1", "1"]
    mod.write_text("VALUE = 22\n")
    later = mod.stat().st_mtime + 2  # a newer file for autoreload and the bytecode cache
    os.utime(mod, (later, later))
    assert values(cell(mesh, "ipy27_reloaded.VALUE")) == ["22", "22"]
    cell(mesh, "%autoreload 0\nsys.path.remove(" + repr(str(tmp_path)) + ")")


def test_controller_and_kernel_magics_are_refused_by_name(mesh):
    err = failure(mesh, "%monarch_mesh dp=4")
    assert "%monarch_mesh cannot run in a %%monarch cell: it is a controller magic" in err, err
    assert "interactiveshell.py" not in err  # IPython's own frames are not the user's
    err = failure(mesh, "%%monarch\nprint(1)")
    assert "%monarch cannot run in a %%monarch cell" in err, err
    err = failure(mesh, "%qtconsole")
    assert "%qtconsole cannot run in a %%monarch cell: it needs the Jupyter kernel" in err
    err = failure(mesh, "%connect_info")
    assert "%connect_info cannot run" in err
    err = failure(mesh, "%no_such_magic")
    assert "Line magic function `%no_such_magic` not found" in err
    assert values(cell(mesh, "rank")) == ["0", "1"]  # the mesh serves on


def test_display_publishes_the_mime_bundle(mesh):
    got = cell(
        mesh,
        "from IPython.display import HTML, Markdown\n"
        "display(HTML(f'<b>rank {rank}</b>'))\n"
        "display(Markdown('*md*'), {'a': 1})\n"
        "rank",
    )
    for r, res in enumerate(got):
        html, md, obj = res["displays"]
        assert html["text/html"] == f"<b>rank {r}</b>"
        assert md["text/markdown"] == "*md*"
        assert obj == {"text/plain": "{'a': 1}"}
        assert res["data"] == {"text/plain": str(r)}
    # clear_output drops what the cell displayed so far; update_display replaces
    got = cell(
        mesh,
        "from IPython.display import clear_output, update_display\n"
        "display('old')\nclear_output(wait=True)\n"
        "display('first', display_id='d')\ndisplay('kept')\nupdate_display('second', display_id='d')",
    )
    assert [d["text/plain"] for d in got[0]["displays"]] == ["'second'", "'kept'"]


def test_a_50_mb_display_is_a_notice_and_the_cell_goes_on(mesh):
    got = cell(
        mesh,
        "from IPython.display import Image, JSON\n"
        "display(Image(data=b'\\x89PNG' + bytes(50 << 20), format='png'))\n"
        "display(JSON({'a': 'z' * (50 << 20)}))\n"
        "display('small')\n"
        "rank",
    )
    for r, res in enumerate(got):
        image, big_json, small = res["displays"]
        assert list(image) == ["text/plain"] and "image/png is 69,905,0" in image["text/plain"]
        assert "was not shown" in image["text/plain"] and "8,388,608" in image["text/plain"]
        assert list(big_json) == ["text/plain"] and "application/json" in big_json["text/plain"]
        assert small == {"text/plain": "'small'"} and res["data"] == {"text/plain": str(r)}
    assert values(cell(mesh, "rank + 1")) == ["1", "2"]  # the mesh serves on


def test_a_clear_in_a_script_prints_nothing(mesh, capfd):
    cell(mesh, "from IPython.display import clear_output\nprint('one')\nclear_output(wait=True)\nprint('two')")
    mesh.wait()
    out = capfd.readouterr()
    assert "wait" not in out.out + out.err and "[rank 1] two" in out.out, out


def test_matplotlib_inline_and_figures_through_display(mesh):
    got = cell(
        mesh,
        "import matplotlib.pyplot as plt\nfig = plt.figure()\nplt.plot([1, rank])\ndisplay(fig)",
    )
    for res in got:
        (shown,) = res["displays"]
        assert shown["image/png"] and "Figure" in shown["text/plain"]
    try:
        got = cell(mesh, "%matplotlib inline\nplt.plot([2, rank])\nplt.show()")
        assert all("image/png" in res["displays"][0] for res in got), got
        err = failure(mesh, "%matplotlib qt")
        assert "%matplotlib qt cannot run in a %%monarch cell: a worker runs no GUI" in err, err
    finally:
        cell(mesh, "plt.switch_backend('module://monarch_nb.worker.mpl_backend')")


def test_tracebacks_keep_the_cells_lines_around_magics(mesh):
    err = failure(mesh, "%time a = 1\n!true\nb = 1 / (rank - rank)")
    assert "ZeroDivisionError" in err
    assert f'File "<monarch In[{_count[0]}]>", line 4, in <module>' in err, err
    assert "b = 1 / (rank - rank)" in err


def test_plain_python_is_not_transformed(mesh):
    # a cell that compiles as Python runs as it is (IPython's transformers would
    # make nothing else of it); a SyntaxError after the transform names the line
    assert values(cell(mesh, "x = {'a': 1}\nx['a'] % 2 ")) == ["1", "1"]
    err = failure(mesh, "%time x = 1\nx +* 2")
    assert "SyntaxError" in err and "line 3" in err, err


# ------------------------------------------------------------------ kernel tier


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("worker-ipython")) as kern:
        yield kern


def monarch(k, body: str, args: str = "", timeout: float = 60, output_hook=None):
    return k.run(f"%%monarch {args}".rstrip() + "\n" + body, timeout, output_hook=output_hook)


@pytest.mark.kernel
def test_magics_shell_and_help_in_a_notebook_cell(k):
    reply, msgs = monarch(k, "%time v = rank * 3\n!echo shell $rank\nv?\nget_ipython() is not None")
    assert reply["content"]["status"] == "ok", text(msgs)
    out = stream(msgs).replace("\r\n", "\n")
    assert "[rank 0] shell 0" in out and "[rank 1] shell 1" in out, out
    assert "Wall time" in out and "Docstring" in out, out
    assert plain(msgs) == ["[ranks 0-1] True"]
    reply, msgs = monarch(k, "%%timeit -n1 -r1\nw = rank")
    assert reply["content"]["status"] == "ok" and "per loop" in stream(msgs), text(msgs)


@pytest.mark.kernel
def test_display_html_arrives_as_display_data(k):
    reply, msgs = monarch(k, "from IPython.display import HTML\ndisplay(HTML('<b>hi</b>'))")
    assert reply["content"]["status"] == "ok", text(msgs)
    html = [d["text/html"] for d in displays(msgs) if "text/html" in d]
    assert len(html) == 1 and "<b>hi</b>" in html[0], displays(msgs)  # folded: same on 0-1
    assert "[ranks 0-1]" in html[0]
    assert "HTML object" not in stream(msgs)  # not printed as its repr, as before


@pytest.mark.kernel
def test_a_controller_magic_in_a_cell_is_a_clear_error_and_the_mesh_serves(k):
    reply, msgs = monarch(k, "%monarch_mesh dp=4")
    assert reply["content"]["status"] == "error"
    tb = errors_text(msgs)
    assert "[ranks 0-1] UsageError: %monarch_mesh cannot run in a %%monarch cell" in tb, tb
    assert f"<monarch In[{reply['content']['execution_count']}]>" in tb
    reply, msgs = monarch(k, "rank")
    assert reply["content"]["status"] == "ok" and plain(msgs) == ["[rank 0] 0", "[rank 1] 1"]


@pytest.mark.kernel
def test_syntax_is_checked_in_the_kernel_after_ipythons_transform(k):
    reply, msgs = monarch(k, "%time x = 1\nx +* 2")
    assert reply["content"]["status"] == "error"
    assert "CellSyntaxError" in [
        m["content"].get("ename") for m in msgs if m["msg_type"] == "error"
    ]
    assert "x +* 2" in errors_text(msgs)


@pytest.mark.kernel
@pytest.mark.parametrize("args", ["", "--stream side"])
def test_a_shell_command_that_never_ends_stops_on_interrupt(k, args):
    fired = []

    def hook(msg):
        if not fired and msg["msg_type"] == "stream" and "started" in msg["content"]["text"]:
            fired.append(True)
            k.km.interrupt_kernel()

    reply, msgs = monarch(
        k, "!echo started; sleep 1027\nprint('after the command')", args, output_hook=hook
    )
    assert fired, "the command never started"
    # as in IPython: Ctrl-C ends the command, and the cell goes on after it
    assert reply["content"]["status"] == "ok", text(msgs) + errors_text(msgs)
    assert "after the command" in stream(msgs)
    reply, msgs = monarch(k, "!pgrep -f 'sleep 102[7]' || echo none left", args)
    assert "none left" in ANSI.sub("", stream(msgs)), text(msgs)


def _frontend(msgs) -> str:
    """What a Jupyter output area shows after ``msgs``: streams appended, displays
    shown and updated by id, clear_output (wait: at the next output) honoured."""
    area: list = []  # [display id or None, text]
    wait = False
    for m in msgs:
        kind, c = m["msg_type"], m["content"]
        if kind == "clear_output":
            if c["wait"]:
                wait = True
            else:
                area.clear()
            continue
        if kind not in ("stream", "display_data", "update_display_data", "execute_result"):
            continue
        if wait and kind != "update_display_data":
            area.clear()
            wait = False
        did = c.get("transient", {}).get("display_id") if kind != "stream" else None
        text = c["text"] if kind == "stream" else c["data"].get("text/plain", "") + "\n"
        if kind == "update_display_data":
            for entry in area:
                if entry[0] == did:
                    entry[1] = text
        else:
            area.append([did, text])
    return "".join(t for _, t in area)


@pytest.mark.kernel
def test_clear_output_wait_in_a_loop_keeps_only_each_ranks_latest_lines(k):
    body = (
        "from IPython.display import clear_output\nimport time\nprint('before')\n"
        "for i in range(6):\n    clear_output(wait=True)\n    print(f'step {i} of rank {rank}')\n"
        "    time.sleep(0.15)"
    )
    reply, msgs = monarch(k, body)
    assert reply["content"]["status"] == "ok", text(msgs)
    shown = _frontend(msgs)
    assert "[rank 0] step 5 of rank 0" in shown and "[rank 1] step 5 of rank 1" in shown, shown
    assert "step 4" not in shown and "before" not in shown, shown
    assert sum(m["msg_type"] == "clear_output" for m in msgs) == 1  # once; the rest is redrawn


@pytest.mark.kernel
def test_clear_output_clears_only_its_own_ranks_lines(k):
    body = (
        "from IPython.display import clear_output\nprint('first', flush=True)\n"
        "if rank == 0:\n    clear_output()\nprint('second')"
    )
    reply, msgs = monarch(k, body)
    assert reply["content"]["status"] == "ok", text(msgs)
    shown = _frontend(msgs)
    assert "[rank 1] first" in shown and "second" in shown, shown
    assert "[rank 0] first" not in shown and "[ranks 0-1] first" not in shown, shown
    # the next cell starts clean: no clear carries over
    reply, msgs = monarch(k, "print('third')")
    assert stream(msgs) == "[ranks 0-1] third\n", text(msgs)


@pytest.mark.kernel
def test_monarch_mesh_autoreload_reloads_before_each_remote_call(k, tmp_path):
    mod = tmp_path / "kernel_ar.py"
    mod.write_text("def f():\n    return 'v1'\n")
    os.utime(mod, (2, 2))
    monarch(k, f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport kernel_ar")
    k.ok("%monarch_mesh --autoreload")
    k.ok("import importlib\ndef ask():\n    return importlib.import_module('kernel_ar').f()")
    mod.write_text("def f():\n    return 'v2'\n")
    os.utime(mod, (4, 4))
    assert k.value("mnb.remote(ask)().fetch()") == ["v2", "v2"]
    monarch(k, "%autoreload 0")
