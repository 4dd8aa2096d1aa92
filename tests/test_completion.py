"""Tab and Shift-Tab from the workers, and auto mode (issue 27 items 4 and 6).

Workers tier: ``mesh.complete`` / ``mesh.inspect_code`` on the module's dp=2
mesh (bad arguments, a ``__dir__`` that hangs). Kernel tier: jupyter_client's
``complete_request`` and ``inspect_request`` in a real kernel on ``%%monarch``
cells (names only the workers have, ``--ranks``/``--slice``, while a cell runs
there, the kernel's fallback), and ``%monarch_auto``.
"""

from __future__ import annotations

import pytest
from kernel_helpers import errors_text, mesh_kernel, plain, stream, text
from wait_helpers import wait_for

import monarch_nb as mnb

HANG = (
    "class Hang:\n    def __dir__(self):\n        while True:\n            pass\n\nhang = Hang()\n"
)


def cell(mesh, body: str):
    return mesh.run_cell("# %%monarch\n" + body, filename="<monarch In[1]>").result(timeout=60)


# ------------------------------------------------------------------ workers tier


def test_mesh_complete_and_inspect_read_the_ranks_namespace(mesh):
    cell(mesh, "import os\nper_rank_table = {'alpha': rank, 'beta': 2}\n"
               "def on_ranks(a, b=2):\n    'Help written on the workers.'\n")  # fmt: skip
    got = mesh.complete("per_rank_t")
    assert got["matches"] == ["per_rank_table"] and (got["cursor_start"], got["cursor_end"]) == (
        0,
        10,
    )
    assert mesh.complete("per_rank_table['al")["matches"] == ["alpha"]
    code = "os.path.jo"
    got = mesh.complete(code, rank=1)
    assert [code[: got["cursor_start"]] + t for t in got["matches"]] == ["os.path.join"]
    info = mesh.inspect_code("x = on_ranks(", 12)
    assert info["found"] and "on_ranks(a, b=2)" in info["data"]["text/plain"]
    assert "Help written on the workers." in info["data"]["text/plain"]
    assert mesh.inspect_code("nowhere_at_all")["found"] is False


def test_bad_arguments_are_clear_errors(mesh):
    with pytest.raises(ValueError, match=r"rank 9 is not in mesh .* \(ranks \[0, 1\]\)"):
        mesh.complete("x", rank=9)
    with pytest.raises(ValueError, match="cursor_pos 5 is not within the code"):
        mesh.complete("abc", 5)
    with pytest.raises(TypeError, match="the code to complete is a str"):
        mesh.complete(b"abc")
    with pytest.raises(ValueError, match="detail_level is 0 or 1"):
        mesh.inspect_code("x", detail_level=2)


def test_a_dir_that_hangs_is_bounded_and_the_rank_serves_again(mesh):
    cell(mesh, HANG)
    with pytest.raises(TimeoutError) as info:
        mesh.complete("hang.", timeout=0.3)
    assert "mesh.complete on rank 0" in str(info.value), info.value
    # the rank stops it (after worker/shell_handlers.LIMIT s) and answers the next one
    wait_for(lambda: _answers(mesh), timeout=30, what="the rank's completer to serve again")
    assert [v["data"]["text/plain"] for v in cell(mesh, "rank")] == ["0", "1"]


def _answers(mesh) -> bool:
    try:
        return mesh.complete("per_rank_t", timeout=5)["matches"] == ["per_rank_table"]
    except mnb.RemoteError as e:
        assert "still busy" in str(e), e  # refused at once while the hung one runs
        return False


def test_a_simulated_rank_refuses_by_name_and_serves_on():
    sim = mnb.local_mesh(host=1, gpu=2, simulate=True, name="completion-sim")
    try:
        with pytest.raises(mnb.RemoteError, match="simulated light rank: it has no IPython shell"):
            sim.complete("x")
        with pytest.raises(mnb.RemoteError, match="simulated light rank"):
            sim.inspect_code("x", rank=1)
        sim.exec("y = 1")
        assert sim.pull("y") == [1, 1]
    finally:
        sim.shutdown()


# ------------------------------------------------------------------ kernel tier


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("completion")) as kern:
        kern.ok(
            "%%monarch\nimport os\nworker_only_table = {'alpha': 1, 'beta': 2}\n"
            "exec(f'only_on_rank_{rank} = rank')\n"
            "def worker_fn(a, b=2):\n    'Docstring on the workers.'\n    return a + b\n"
        )
        yield kern


def complete(k, code: str, cursor_pos: int | None = None) -> dict:
    reply = k.kc.complete(code, cursor_pos, reply=True, timeout=30)
    assert reply["content"]["status"] == "ok", reply
    return reply["content"]


def applied(code: str, reply: dict) -> list[str]:
    """The code after each completion, as a front end writes it."""
    s, e = reply["cursor_start"], reply["cursor_end"]
    return [code[:s] + m + code[e:] for m in reply["matches"]]


def inspect(k, code: str, cursor_pos: int | None = None, detail_level: int = 0) -> dict:
    pos = len(code) if cursor_pos is None else cursor_pos
    reply = k.kc.inspect(code, pos, detail_level, reply=True, timeout=30)
    assert reply["content"]["status"] == "ok", reply
    return reply["content"]


def fallback(k):
    return k.value("__import__('monarch_nb.notebook.completing').notebook.completing.last_fallback")


@pytest.mark.kernel
def test_tab_in_a_cell_completes_from_rank_0(k):
    code = "%%monarch\nx = 1\nworker_only_t"
    assert applied(code, complete(k, code)) == ["%%monarch\nx = 1\nworker_only_table"]
    code = "%%monarch\nworker_only_table['be"
    assert applied(code, complete(k, code)) == ["%%monarch\nworker_only_table['beta"]
    code = "%%monarch\nos.path.jo"
    assert "%%monarch\nos.path.join" in applied(code, complete(k, code))
    # the cursor in the middle of the cell
    code = "%%monarch\nworker_only_t\nprint(1)"
    assert applied(code, complete(k, code, 23)) == ["%%monarch\nworker_only_table\nprint(1)"]
    # the rank's own names, not the kernel's: the kernel has none of these
    assert "worker_only_table" not in complete(k, "worker_only_t")["matches"]
    assert complete(k, "%%monarch\nonly_on_ra")["matches"] == ["only_on_rank_0"]


@pytest.mark.kernel
@pytest.mark.parametrize("args", ["--ranks 1", "--slice dp=1"])
def test_tab_asks_the_cells_first_rank(k, args):
    assert complete(k, f"%%monarch {args}\nonly_on_ra")["matches"] == ["only_on_rank_1"]


@pytest.mark.kernel
def test_paths_complete_in_the_ranks_working_directory(k, tmp_path):
    (tmp_path / "only_here_dir").mkdir()
    k.ok(f"%%monarch --ranks 0\nwas_in = os.getcwd()\nos.chdir({str(tmp_path)!r})")
    try:
        code = "%%monarch\nopen('only_her"
        assert applied(code, complete(k, code)) == ["%%monarch\nopen('only_here_dir/"]
    finally:
        k.ok("%%monarch --ranks 0\nos.chdir(was_in)")


@pytest.mark.kernel
def test_shift_tab_shows_the_workers_signature_and_docstring(k):
    got = inspect(k, "%%monarch\ny = worker_fn(")
    assert got["found"], got
    assert "worker_fn(a, b=2)" in got["data"]["text/plain"]
    assert "Docstring on the workers." in got["data"]["text/plain"]
    assert (
        "return a + b" in inspect(k, "%%monarch\nworker_fn", detail_level=1)["data"]["text/plain"]
    )
    # in a kernel cell the kernel's inspector answers: it has no worker_fn
    assert inspect(k, "worker_fn")["found"] is False
    # a name the rank lacks: the kernel's answer (what the cell would push)
    k.ok("kernel_only_value = 12345")
    assert "12345" in inspect(k, "%%monarch\nkernel_only_value")["data"]["text/plain"]


@pytest.mark.kernel
def test_answers_come_while_a_cell_runs_on_the_workers(k, tmp_path):
    flag = tmp_path / "stop"
    k.ok(f"%%monarch --noblock\nwhile not os.path.exists({str(flag)!r}):\n    pass")
    try:
        code = "%%monarch\nworker_only_t"
        assert applied(code, complete(k, code)) == ["%%monarch\nworker_only_table"]
        assert fallback(k) is None
        assert (
            "Docstring on the workers." in inspect(k, "%%monarch\nworker_fn")["data"]["text/plain"]
        )
    finally:
        flag.touch()
    reply, msgs = k.run("%%monarch\nrank")  # after the busy cell, on the same stream
    assert plain(msgs) == ["[rank 0] 0", "[rank 1] 1"], text(msgs)


@pytest.mark.kernel
def test_a_hanging_or_raising_dir_falls_back_to_the_kernel(k):
    k.ok("%%monarch\n" + HANG + "class Bad:\n    def __dir__(self):\n        raise RuntimeError('no')\n"
         "bad = Bad()")  # fmt: skip
    k.ok("hang_kernel_side = 1")
    got = complete(k, "%%monarch\nhang")  # a plain name: the rank answers
    assert got["matches"] == ["hang"] and fallback(k) is None
    got = complete(k, "%%monarch\nhang.")
    assert got["matches"] == [], got
    assert "did not answer within" in fallback(k)
    # while the rank's completer is stuck, the next Tab is refused there at once, and
    # the kernel's completer answers (the name is the kernel's: the cell would push it)
    code = "%%monarch\nhang_kernel_side.bit_l"
    assert applied(code, complete(k, code)) == [code + "ength"]
    assert "still busy" in fallback(k)
    complete(k, "%%monarch\nbad.")  # dir raised: nothing on the rank, the kernel's own
    wait_for(
        lambda: complete(k, "%%monarch\nworker_only_t")["matches"] == ["worker_only_table"],
        timeout=30,
        what="the rank to complete again",
    )
    reply, msgs = k.run("%%monarch\nrank")
    assert plain(msgs) == ["[rank 0] 0", "[rank 1] 1"], text(msgs)


# ------------------------------------------------------------------ auto mode


@pytest.mark.kernel
def test_auto_mode_runs_every_cell_on_the_mesh_until_off(k):
    msgs = k.ok("%monarch_auto on")
    assert "auto mode on" in stream(msgs)
    try:
        msgs = k.ok("auto_value = rank * 10\nauto_value")
        assert plain(msgs) == ["[rank 0] 0", "[rank 1] 10"], text(msgs)
        msgs = k.ok("%time t = 1\n!echo from $rank")
        out = stream(msgs).replace("\r\n", "\n")
        assert "[rank 0] from 0" in out and "[rank 1] from 1" in out and "Wall time" in out, out
        code = "auto_val"  # Tab asks the rank in auto mode
        assert applied(code, complete(k, code)) == ["auto_value"]
        assert "Docstring on the workers." in inspect(k, "worker_fn")["data"]["text/plain"]
        msgs = k.ok("%monarch_auto")  # a %monarch magic runs in the kernel
        assert "auto mode on" in stream(msgs)
    finally:
        msgs = k.ok("# a comment first\n%monarch_auto off")
    assert "auto mode off" in stream(msgs)
    assert k.value("'auto_value' in globals()") is False
    assert complete(k, "auto_val")["matches"] == []


@pytest.mark.kernel
def test_auto_mode_on_some_ranks_and_off_after_its_mesh_is_gone(k):
    k.ok("%monarch_mesh dp=1 --name aux --dashboard none", timeout=120)
    k.ok("%monarch_auto on --mesh aux")
    try:
        msgs = k.ok("size_here = size\nsize_here")
        assert plain(msgs) == ["[rank 0] 1"], text(msgs)
        k.ok("%monarch_mesh --shutdown --name aux")  # a %monarch magic: the kernel's
        reply, msgs = k.run("1 + 1")
        assert reply["content"]["status"] == "error"
        assert "no mesh named 'aux'" in text(msgs) + errors_text(msgs)
    finally:
        msgs = k.ok("%monarch_auto off")  # always reaches the kernel
    assert "auto mode off" in stream(msgs)
    k.ok("%monarch_auto on --ranks 1")
    try:
        assert plain(k.ok("rank")) == ["[rank 1] 1"]
    finally:
        k.ok("%monarch_auto off")


@pytest.mark.kernel
@pytest.mark.parametrize(
    "line, said",
    [
        ("%monarch_auto maybe", "expected on or off, got 'maybe'"),
        ("%monarch_auto on --ranks 7", "rank 7 is not in mesh"),
        ("%monarch_auto on --mesh nope", "no mesh named 'nope'"),
        ("%monarch_auto on --noblock", "--noblock and -o are options of one cell"),
        ("%monarch_auto off now", "takes no arguments"),
    ],
)
def test_auto_mode_bad_input_is_a_clear_error(k, line, said):
    reply, msgs = k.run(line)
    shown = text(msgs) + errors_text(msgs)  # a UsageError is shown on stderr
    assert reply["content"]["status"] == "error" and said in shown, shown
    assert k.value("1 + 1") == 2  # still a kernel cell: auto mode stayed off
