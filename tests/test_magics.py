"""Kernel tier: %monarch_mesh and %%monarch through a real IPython kernel (jupyter_client),
real workers, real ZeroMQ. One kernel and one dp=2 mesh for the module."""

from __future__ import annotations

import re

import psutil
import pytest
from agent_helpers import started_for
from kernel_helpers import (
    ANSI,
    displays,
    errors,
    errors_text,
    idle,
    live,
    mesh_kernel,
    plain,
    stream,
    wait_gone,
)
from wait_helpers import gated_code

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("kernel")) as kern:
        yield kern


def pids(k, name="default") -> list[int]:
    return k.value(f"sorted(i['pid'] for i in mnb.get_mesh({name!r}).status()['ranks'].values())")


def usage_error(k, line: str) -> str:
    """Run a bad magic line: it must be a UsageError (stderr text, no iopub error)."""
    reply, msgs = k.run(line)
    assert reply["content"]["status"] == "error", line
    assert not errors(msgs), f"{line!r} raised more than a UsageError: {errors_text(msgs)}"
    err = stream(msgs, "stderr")
    assert err.startswith("UsageError"), (line, err)
    return err


def monarch(k, body: str, args: str = "", timeout: float = 60):
    return k.run(f"%%monarch {args}\n{body}".replace("%%monarch \n", "%%monarch\n"), timeout)


# ------------------------------------------------------------------ %monarch_mesh


def test_mesh_magic_shows_status(k):
    msgs = k.ok("%monarch_mesh")
    (d,) = displays(msgs)
    assert "application/vnd.jupyter.widget-view+json" in d
    assert re.match(r"mesh 'default': dp=2, gloo, 2/2 alive \(pids \d+, \d+\)", d["text/plain"])
    assert "<table" in d["text/html"] and "mnb-status" in d["text/html"]
    opened = [m for m in msgs if m["msg_type"] == "comm_open"]
    model_id = d["application/vnd.jupyter.widget-view+json"]["model_id"]
    assert any(m["content"]["comm_id"] == model_id for m in opened)
    assert k.value("mnb.get_mesh().name") == "default"
    assert k.value("mnb.get_mesh().dims") == {"dp": 2}


def test_named_meshes_coexist_and_replace_cleanly(k):
    k.ok("%monarch_mesh hosts=1 gpus=2 --name m2 --backend gloo", timeout=120)
    assert k.value("(mnb.get_mesh().name, mnb.get_mesh().dims)") == (
        "m2",
        {"hosts": 1, "gpus": 2},
    )
    first = pids(k, "m2")
    default = pids(k)
    reply, msgs = monarch(k, "(rank, size, hosts, gpus)", "--mesh m2")
    assert plain(msgs) == ["[rank 0] (0, 2, 0, 0)", "[rank 1] (1, 2, 0, 1)"]
    # re-running the cell replaces the mesh: the old workers are gone
    k.ok("%monarch_mesh hosts=1 gpus=2 --name m2", timeout=120)
    second = pids(k, "m2")
    assert not set(first) & set(second)
    assert wait_gone(first) == []
    assert pids(k) == default  # the other mesh is untouched
    msgs = k.ok("%monarch_mesh --shutdown --name m2")
    assert "mesh 'm2' shut down" in stream(msgs)
    # its live status view got its last update
    updates = [m for m in msgs if m["msg_type"] == "comm_msg"]
    assert any("shut down" in str(m["content"]["data"].get("state", {})) for m in updates)
    assert wait_gone(second) == []
    assert k.value("mnb.get_mesh().name") == "default"
    err = usage_error(k, "%%monarch --mesh m2\n1")
    assert "no mesh named 'm2'" in err


# ------------------------------------------------------------------ %%monarch output


def test_output_prefixed_and_folded(k):
    reply, msgs = monarch(
        k,
        "print('hello from', rank)\nprint('same on all')\n"
        "import sys\nprint('oops', rank, file=sys.stderr)",
    )
    assert reply["content"]["status"] == "ok"
    out = stream(msgs, "stdout").splitlines()
    assert out == ["[rank 0] hello from 0", "[rank 1] hello from 1", "[ranks 0-1] same on all"]
    err = stream(msgs, "stderr").splitlines()
    assert sorted(err) == ["[rank 0] oops 0", "[rank 1] oops 1"]


def test_output_is_live_while_the_cell_runs(k, tmp_path):
    """'first' reaches the notebook while the cell still waits for the test to open
    its gate: output held until the cell's end would time the wait out."""
    gate = tmp_path / "gate"
    msg_id = k.kc.execute("%%monarch\n" + gated_code(gate, "first", "second"))
    try:
        early = k.drain(msg_id, lambda ms: "first" in stream(ms), timeout=30)
        assert not idle(early) and "second" not in stream(early)
    finally:
        gate.touch()
    msgs = early + k.drain(msg_id, idle, timeout=60)
    chunks = [m["content"]["text"] for m in msgs if m["msg_type"] == "stream"]
    assert chunks == ["[ranks 0-1] first\n", "[ranks 0-1] second\n"], chunks


def test_values_per_rank_and_rich_repr(k):
    reply, msgs = monarch(k, "rank * 10")
    assert plain(msgs) == ["[rank 0] 0", "[rank 1] 10"]
    reply, msgs = monarch(k, "{'a': [1, 2]}")
    assert plain(msgs) == ["[ranks 0-1] {'a': [1, 2]}"]  # equal values fold too
    reply, msgs = monarch(
        k,
        "class Bold:\n    def _repr_html_(self):\n        return f'<b>r{rank}</b>'\nBold()",
    )
    html = [d["text/html"] for d in displays(msgs)]
    assert len(html) == 2 and "<b>r0</b>" in html[0] and "<b>r1</b>" in html[1]
    assert "[rank 0]" in html[0] and "[rank 1]" in html[1]
    reply, msgs = monarch(k, "x = 5")  # no trailing expression: nothing shown
    assert displays(msgs) == []


def test_matplotlib_figure_drawn_on_a_worker_appears(k):
    reply, msgs = monarch(
        k,
        "import matplotlib.pyplot as plt\nplt.plot([1, rank + 2])\nplt.title(f'rank {rank}')\n"
        "plt.show()\n'drawn'",
    )
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    pngs = [d for d in displays(msgs) if "image/png" in d]
    assert len(pngs) == 2  # one per rank: the plots differ
    assert {d["text/plain"].split("]")[0] + "]" for d in pngs} == {"[rank 0]", "[rank 1]"}
    import base64

    assert base64.b64decode(pngs[0]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[ranks 0-1] 'drawn'" in plain(msgs)
    assert stream(msgs, "stderr") == ""  # plt.show() does not warn on the workers
    # figures were closed: the next cell sends none
    reply, msgs = monarch(k, "len(plt.get_fignums())")
    assert plain(msgs) == ["[ranks 0-1] 0"]


def test_persistent_namespace_and_predefined_names(k):
    monarch(k, "counter = rank * 100")
    reply, msgs = monarch(k, "counter += 1\n(counter, rank, size, dp)")
    assert plain(msgs) == ["[rank 0] (1, 0, 2, 0)", "[rank 1] (101, 1, 2, 1)"]
    assert k.value("mnb.get_mesh().pull('counter')") == [1, 101]


def test_ranks_slice_and_stream(k):
    reply, msgs = monarch(k, "print('on', rank)\nrank", "--ranks 1")
    assert stream(msgs) == "[rank 1] on 1\n" and plain(msgs) == ["[rank 1] 1"]
    reply, msgs = monarch(k, "rank", "--ranks 0,1")
    assert plain(msgs) == ["[rank 0] 0", "[rank 1] 1"]
    reply, msgs = monarch(k, "rank", "--slice dp=0")
    assert plain(msgs) == ["[rank 0] 0"]
    reply, msgs = monarch(k, "rank", "--slice dp=1:2")
    assert plain(msgs) == ["[rank 1] 1"]
    reply, msgs = monarch(k, "import threading\nthreading.current_thread().name", "--stream side")
    assert plain(msgs) == ["[ranks 0-1] 'monarch-stream-side'"]
    reply, msgs = monarch(k, "import threading\nthreading.current_thread().name")
    assert plain(msgs) == ["[ranks 0-1] 'MainThread'"]


# ------------------------------------------------------------------ failures


def test_failure_once_per_distinct_traceback_with_real_lines(k):
    reply, msgs = monarch(k, "x = 1\ny = 2\nz = x / (y - 2)\n")
    assert reply["content"]["status"] == "error"
    (e,) = errors(msgs)
    tb = ANSI.sub("", "\n".join(e["traceback"]))
    assert tb.count("[ranks 0-1] ZeroDivisionError: division by zero") == 1
    assert tb.count("Traceback (most recent call last)") == 1  # identical: shown once
    count = reply["content"]["execution_count"]
    # line 4 of the notebook cell (line 1 is the magic), with its source text
    assert f'File "<monarch In[{count}]>", line 4, in <module>' in tb
    assert "z = x / (y - 2)" in tb
    assert "<string>" not in tb and "worker/" not in tb

    reply, msgs = monarch(
        k,
        "def check(v):\n    if v == 1:\n        raise ValueError(f'bad value on {v}')\n"
        "    return v\ncheck(rank)",
    )
    assert reply["content"]["status"] == "error"
    assert plain(msgs) == ["[rank 0] 0"]  # the rank that succeeded still shows its value
    tb = errors_text(msgs)
    assert "[rank 1] ValueError: bad value on 1" in tb and "rank 0]" not in tb
    assert "line 6, in <module>" in tb and "line 4, in check" in tb
    assert "raise ValueError(f'bad value on {v}')" in tb
    # the failure was shown: mesh.wait() does not raise it again, the mesh serves on
    k.ok("mnb.get_mesh().wait()")
    assert plain(monarch(k, "rank + 1")[1]) == ["[rank 0] 1", "[rank 1] 2"]


def test_syntax_error_is_shown_locally(k):
    reply, msgs = monarch(k, "x = 1\nx +* 2")
    assert reply["content"]["status"] == "error"
    (e,) = errors(msgs)
    assert e["ename"] == "CellSyntaxError"
    tb = errors_text(msgs)
    assert "<monarch In[" in tb and ":3" in tb and "x +* 2" in tb and "SyntaxError" in tb
    assert "magics.py" not in tb and "interactiveshell" not in tb


def test_bad_magic_arguments_are_usage_errors(k):
    before = pids(k)
    cases = {
        "%monarch_mesh dp=0": "dim 'dp' must be a positive integer",
        "%monarch_mesh dp=x": "got 'x'",
        "%monarch_mesh dp": "unexpected argument 'dp'",
        "%monarch_mesh dp=2 dp=2": "dim 'dp' is given twice",
        "%monarch_mesh name=a": "use --name",
        "%monarch_mesh 2x=1": "dim name '2x'",
        "%monarch_mesh dp=2 --backend foo": "argument --backend: invalid choice: 'foo'",
        "%monarch_mesh --restart dp=2": "--restart takes no dims",
        "%monarch_mesh --restart --shutdown": "argument --shutdown: not allowed with argument --restart",
        "%monarch_mesh --bogus": "unrecognized arguments: --bogus",
        "%monarch_mesh --shutdown --name nope": "no mesh named 'nope'",
        "%monarch_mesh --backend gloo": "--backend needs the dims",
        "%%monarch --ranks 7\n1": "--ranks '7': rank 7 is not in mesh 'default'",
        "%%monarch --ranks a\n1": "--ranks 'a': 'a' is not a rank",
        "%%monarch --ranks 0 --slice dp=0\n1": "argument --slice: not allowed with argument --ranks",
        "%%monarch --slice tp=0\n1": "--slice 'tp=0': mesh 'default' has no dim 'tp'",
        "%%monarch --slice dp=5\n1": "--slice 'dp=5': index 5 out of range",
        "%%monarch --slice dp=a\n1": "the index of dim 'dp' must be an integer",
        "%%monarch --slice dp\n1": "'dp' is not DIM=INDEX",
        "%%monarch --mesh nope\n1": "--mesh: no mesh named 'nope'",
        "%%monarch --push nope\n1": "--push 'nope': no such variable",
        "%%monarch --push 1x\n1": "'1x' is not a variable name",
        "%%monarch --frobnicate\n1": "unrecognized arguments: --frobnicate",
        "%%monarch --stream\n1": "argument --stream: expected one argument",
        "%%monarch --ranks '0\n1": "cannot split the arguments",
    }
    for line, expected in cases.items():
        err = usage_error(k, line)
        assert expected in err, (line, err)
    # the kernel and the mesh are unharmed
    assert pids(k) == before
    assert plain(monarch(k, "rank")[1]) == ["[rank 0] 0", "[rank 1] 1"]
    msgs = k.ok("%monarch_mesh -h")
    assert "--restart" in stream(msgs)


# ------------------------------------------------------------------ notebook-defined names


def test_notebook_functions_and_classes_reach_the_workers(k):
    k.ok(
        "def scale(v):\n    return v * factor()\n"
        "def factor():\n    return 100\n"
        "class Point:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __repr__(self):\n        return f'Point({self.x})'\n"
        "lr = 0.5"
    )
    reply, msgs = monarch(k, "Point(scale(rank))")
    assert plain(msgs) == ["[rank 0] Point(0)", "[rank 1] Point(100)"]
    # plain values go only when asked for
    reply, msgs = monarch(k, "lr")
    assert "NameError" in errors_text(msgs)
    reply, msgs = monarch(k, "lr * 2", "--push lr")
    assert plain(msgs) == ["[ranks 0-1] 1.0"]
    # the same functions in remote()
    assert k.value("mnb.remote(scale)(3).fetch()") == [300, 300]
    # a worker variable defined by worker code wins over a notebook function of that name
    monarch(k, "model = 'worker model'")
    k.ok("def model():\n    return 'notebook model'")
    assert plain(monarch(k, "model")[1]) == ["[ranks 0-1] 'worker model'"]
    # a Ref pushed by name becomes its value on each rank
    k.ok("t = mnb.remote(lambda: mnb.current_rank() + 40)()")
    assert plain(monarch(k, "t", "--push t")[1]) == ["[rank 0] 40", "[rank 1] 41"]
    err = usage_error(k, "%%monarch --push t --stream side\nt")  # t lives on the default stream
    assert "--push" in err and "borrow" in err


# ------------------------------------------------------------------ --noblock


def test_noblock_output_lands_under_its_own_cell(k, tmp_path):
    gate = tmp_path / "gate"
    first = k.kc.execute(
        "%%monarch --noblock\n" + gated_code(gate, "started", "finished") + "rank + 100"
    )
    # the next cell lets the background one go on and waits until it has finished: the
    # background output comes while it runs, yet none of it may land there
    second = k.kc.execute(
        f"open({str(gate)!r}, 'w').close()\nmnb.get_mesh().wait(timeout=60)\n'other'"
    )
    by = k.collect(
        lambda g: idle(g.get(second, [])) and len(plain(g.get(first, []))) >= 2, timeout=30
    )
    assert idle(by[first])  # the noblock cell returned at once ...
    text = stream(by[first])  # ... and its output still came under it
    assert "[ranks 0-1] started" in text and "[ranks 0-1] finished" in text
    assert plain(by[first]) == ["[rank 0] 100", "[rank 1] 101"]
    assert plain(by[second]) == ["'other'"] and stream(by[second]) == ""
    # the noblock cell's idle status came before its late output (the gate opened after it)
    kinds = [m["msg_type"] for m in by[first]]
    assert kinds.index("status", 1) < max(i for i, t in enumerate(kinds) if t == "display_data")
    # a failure of a background cell is shown under it too
    reply, msgs = k.run("%%monarch --noblock\nimport time\ntime.sleep(0.3)\n1 / 0")
    if not errors(msgs):  # it comes after the cell's reply (unless the workers were quicker)
        msgs += k.drain(reply["parent_header"]["msg_id"], errors, timeout=30)
    assert "[ranks 0-1] ZeroDivisionError" in errors_text(msgs)


# ------------------------------------------------------------------ interrupt


def _interrupt_when_started(k):
    fired = []

    def hook(msg):
        if not fired and msg["msg_type"] == "stream" and "started" in msg["content"]["text"]:
            fired.append(True)
            k.km.interrupt_kernel()

    return hook, fired


@pytest.mark.parametrize(
    "body,args,line",
    [
        ("while True: pass", "", "while True: pass"),
        ("import time\ntime.sleep(1000)", "", "time.sleep(1000)"),
        ("import time\ntime.sleep(1000)", "--stream side", "time.sleep(1000)"),
        ("while True: pass", "--stream side", "while True: pass"),
    ],
)
def test_interrupt_stops_ranks_and_mesh_stays_usable(k, body, args, line):
    hook, fired = _interrupt_when_started(k)
    reply, msgs = k.run(
        f"%%monarch {args}\nprint('started', flush=True)\n{body}", timeout=60, output_hook=hook
    )
    assert fired, "the cell never started"
    assert reply["content"]["status"] == "error"
    tb = errors_text(msgs)
    assert "[ranks 0-1] KeyboardInterrupt" in tb, tb
    assert line in tb and "interrupted" in tb
    assert plain(monarch(k, "rank", args)[1]) == ["[rank 0] 0", "[rank 1] 1"]


# ------------------------------------------------------------------ volume


def test_tight_print_loop_is_coalesced_and_capped(k):
    reply, msgs = monarch(k, "for i in range(300_000):\n    print(i)\n'done'", timeout=120)
    assert reply["content"]["status"] == "ok"
    out = [m for m in msgs if m["msg_type"] == "stream"]
    total = sum(len(m["content"]["text"]) for m in out)
    from monarch_nb.notebook.output import CELL_CAP

    assert total <= CELL_CAP + 4096, total  # ~2 MB printed per rank
    assert "this cell's output passed 512 KB" in stream(msgs)
    # the middle is elided, the latest lines of every rank stay visible
    (tail,) = live(msgs).values()
    assert re.search(r"\d+ lines \([\d.]+ [KM]B\) elided", tail), tail[:300]
    assert tail.endswith("[ranks 0-1] 299999"), tail[-200:]
    # the kernel's own timestamps: never more than ~10 stream messages a second
    import datetime

    times = sorted(
        datetime.datetime.fromisoformat(str(m["header"]["date"]).replace("Z", "+00:00"))
        for m in out
    )
    for i, t in enumerate(times):
        window = [u for u in times[i:] if (u - t).total_seconds() < 1.0]
        assert len(window) <= 15, len(window)
    assert plain(msgs) == ["[ranks 0-1] 'done'"]


# ------------------------------------------------------------------ crashes, restart


def test_worker_crash_in_a_cell_then_restart(k):
    k.ok("%monarch_mesh dp=2 --name crashy", timeout=120)
    old = pids(k, "crashy")
    reply, msgs = monarch(
        k, "import os, sys\nprint('bye', flush=True)\nos._exit(3)", "--mesh crashy --ranks 1"
    )
    assert reply["content"]["status"] == "error"
    tb = errors_text(msgs)
    assert "rank 1" in tb and "exit code 3" in tb
    err_reply, err_msgs = monarch(k, "1", "--mesh crashy")
    assert "--restart" in errors_text(err_msgs)
    k.ok("%monarch_mesh --restart --name crashy", timeout=120)
    assert plain(monarch(k, "rank", "--mesh crashy")[1]) == ["[rank 0] 0", "[rank 1] 1"]
    assert wait_gone(old) == []
    k.ok("%monarch_mesh --shutdown --name crashy")


def test_restart_gives_fresh_workers_and_namespace(k):
    monarch(k, "kept = 1")
    before = pids(k)
    k.ok("%monarch_mesh --restart", timeout=120)
    after = pids(k)
    assert not set(before) & set(after) and wait_gone(before) == []
    assert "NameError" in errors_text(monarch(k, "kept")[1])
    assert plain(monarch(k, "size")[1]) == ["[ranks 0-1] 2"]


def test_workers_are_forked_by_the_kernels_host_agent(k):
    kernel_pid = k.value("__import__('os').getpid()")
    agent = k.value(
        "__import__('monarch_nb.launchers.host_agent').launchers.host_agent"
        ".local_agent().pid"
    )
    assert started_for(agent, kernel_pid)
    for pid in pids(k):
        assert psutil.Process(pid).ppid() == agent


def test_unload_and_reload_the_extension(k):
    k.ok("%unload_ext monarch_nb")
    # worker output goes back to the mesh's plain printer, as in a script
    assert k.value("mnb.get_mesh().output_handler.__name__") == "print_output"
    k.ok("%load_ext monarch_nb")
    reply, msgs = monarch(k, "print('back')\nrank")
    assert stream(msgs) == "[ranks 0-1] back\n"
    assert plain(msgs) == ["[rank 0] 0", "[rank 1] 1"]


def test_output_option_binds_the_cells_async_result(k, tmp_path):
    gate = tmp_path / "gate-o"
    reply, _ = monarch(k, gated_code(gate, "started", "ended"), "--noblock -o held")
    assert reply["content"]["status"] == "ok"
    assert k.value("(held.done(), held.ranks_pending)") == (False, [0, 1])
    gate.touch()
    assert k.value("[r['data'] for r in held.result(timeout=60)]") == [None, None]
    k.ok("%%monarch -o six\n6 * 7")
    assert k.value("[r['data']['text/plain'] for r in six.result()]") == ["42", "42"]
    assert k.value("(await six)[1]['data']['text/plain']") == "42"
    assert "-o needs a variable name, got '1x'" in usage_error(k, "%%monarch -o 1x\n1")


# ------------------------------------------------------------------ %%monarch --profile


def test_profile_flag_traces_the_cell_on_every_rank_and_shows_a_summary(k, tmp_path):
    folder = tmp_path / "prof"
    body = "import torch\na = torch.ones(64, 64)\nfor _ in range(10 + 400 * rank):\n    a = a @ a / 64"
    reply, msgs = monarch(k, body, f"--profile {folder}", timeout=120)
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    out = stream(msgs)
    assert "slowest: rank 1" in out, out
    trace = (folder / "trace.json").read_text()
    assert '"rank 0"' in trace and '"rank 1"' in trace and "aten::mm" in trace


def test_profile_of_a_failing_cell_keeps_what_ran_and_shows_the_error_once(k, tmp_path):
    folder = tmp_path / "failed"
    body = "import torch\ntorch.ones(8, 8) @ torch.ones(8, 8)\nraise ValueError('boom ' + str(rank))"
    reply, msgs = monarch(k, body, f"--profile {folder}", timeout=120)
    assert reply["content"]["status"] == "error"
    assert len(errors(msgs)) == 1 and "boom 1" in errors_text(msgs), errors_text(msgs)
    assert "the profile of what ran before the failure" in stream(msgs)
    assert "aten::mm" in (folder / "trace.json").read_text()
    assert plain(monarch(k, "rank")[1]) == ["[rank 0] 0", "[rank 1] 1"]  # the mesh serves on


def test_profile_flag_bad_input(k, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "cannot make directory" in usage_error(k, f"%%monarch --profile {blocker}/sub\n1")
    assert "drop --noblock" in usage_error(k, f"%%monarch --profile {tmp_path} --noblock\n1")
    assert plain(monarch(k, "rank")[1]) == ["[rank 0] 0", "[rank 1] 1"]
