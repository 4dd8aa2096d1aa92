"""The user's code travels to ranks on hosts that do not share the kernel's
filesystem (issue 27 item 5): joined workers run in mount namespaces of their own
where the kernel's code folder is an empty tmpfs, so they can import the user's
modules only from what travelled. With autoreload on, the kernel's own modules go
before the next command, and an edit, only that file, before the one after it."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pytest
from connect_helpers import TESTS_ENV, Waiting, wait_file

import monarch_nb as mnb
from monarch_nb.controller.errors import RemoteError

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mount namespaces need root and util-linux's unshare",
)

HIDE = 'mount -t tmpfs tmpfs "$1" && shift && exec "$@"'


def call(module: str, fn: str = "f"):
    return getattr(importlib.import_module(module), fn)()


def mtime_of(module: str) -> int:
    return os.stat(importlib.import_module(module).__file__).st_mtime_ns


def write(path, text: str) -> None:
    """A new content with a later mtime (no sleep: the clock's resolution must not hide it)."""
    before = path.stat().st_mtime if path.exists() else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (before + 2, before + 2))


@pytest.fixture(scope="module", params=["joined workers", "a host agent"])
def remote(request, tmp_path_factory):
    code = tmp_path_factory.mktemp("kernel_code")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    conn = elsewhere / "mesh.json"
    w = Waiting(world=2, dp=2, connection_file=str(conn), timeout=120, name="code-travel")
    wait_file(conn)
    hidden = ["unshare", "--mount", "--propagation", "private", "sh", "-c", HIDE, "sh", str(code)]
    if request.param == "joined workers":
        worker = [sys.executable, "-m", "monarch_nb.worker", "--connection-file", str(conn)]
        commands = [[*worker, "--rank", str(rank), "--world", "2"] for rank in range(2)]
    else:  # one host agent that forks both ranks
        commands = [[sys.executable, "-m", "monarch_nb.host", "--connection-file", str(conn),
                     "--local-ranks", "2"]]  # fmt: skip
    procs = [
        subprocess.Popen(
            hidden + command, env=TESTS_ENV, cwd=elsewhere, stderr=subprocess.DEVNULL
        )
        for command in commands
    ]
    sys.path.insert(0, str(code))
    mesh = w.mesh()
    try:
        yield mesh, code
        folders = {f for fs in mnb.remote(code_folders)(mesh=mesh).fetch() for f in fs}
        assert folders  # the ranks' code folder (one per host: here they share one)
    finally:
        mesh.shutdown()
        sys.path.remove(str(code))
        for name in [n for n in sys.modules if n.startswith("travel")]:
            del sys.modules[name]
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    assert [f for f in folders if os.path.exists(f)] == []  # the last rank out removed it


def code_folders() -> list:
    return [p for p in sys.path if os.path.basename(p).startswith("monarch_nb-code-")]


def test_the_kernels_modules_travel_and_an_edit_reaches_the_next_call(remote):
    m, code = remote
    write(code / "travel_mod.py", "def f():\n    return 1\n")
    write(code / "travel_pkg" / "__init__.py", "")
    write(
        code / "travel_pkg" / "layers.py", "class Layer:\n    def scale(self):\n        return 10\n"
    )
    importlib.import_module("travel_mod"), importlib.import_module("travel_pkg.layers")
    with pytest.raises(RemoteError, match="No module named 'travel_mod'"):
        mnb.remote(call)("travel_mod", mesh=m).fetch()  # the ranks cannot see the folder
    m.autoreload()
    assert mnb.remote(call)("travel_mod", mesh=m).fetch() == [1, 1]
    m.exec("import travel_pkg.layers as L\nlayer = L.Layer()")
    m.wait()
    write(code / "travel_mod.py", "def f():\n    return 2\n")
    write(
        code / "travel_pkg" / "layers.py", "class Layer:\n    def scale(self):\n        return 20\n"
    )
    assert mnb.remote(call)("travel_mod", mesh=m).fetch() == [2, 2]  # no cell ran between
    m.exec("scaled = layer.scale()")  # an instance made before the edit has the new method
    assert m.pull("scaled", rank=1) == 20


def test_only_a_changed_file_is_rewritten_on_the_ranks(remote):
    m, code = remote
    write(code / "travel_still.py", "def f():\n    return 'still'\n")
    write(code / "travel_moving.py", "def f():\n    return 'a'\n")
    importlib.import_module("travel_still"), importlib.import_module("travel_moving")
    m.autoreload()
    assert mnb.remote(call)("travel_still", mesh=m).fetch() == ["still"] * 2
    before = mnb.remote(mtime_of)("travel_still", mesh=m).fetch()
    write(code / "travel_moving.py", "def f():\n    return 'b'\n")
    assert mnb.remote(call)("travel_moving", mesh=m).fetch() == ["b", "b"]
    assert mnb.remote(mtime_of)("travel_still", mesh=m).fetch() == before  # not written again


def test_a_syntax_error_names_the_kernels_file_and_the_old_code_serves(remote, capfd):
    m, code = remote
    mod = code / "travel_bad.py"
    write(mod, "def f():\n    return 'old'\n")
    importlib.import_module("travel_bad")
    m.autoreload()
    assert mnb.remote(call)("travel_bad", mesh=m).fetch() == ["old", "old"]
    write(mod, "def f():\n    return (\n")
    assert mnb.remote(call)("travel_bad", mesh=m).fetch() == ["old", "old"]
    m.wait()
    err = capfd.readouterr()
    assert f"{mod}:2: SyntaxError" in err.out + err.err
    write(mod, "def f():\n    return 'fixed'\n")
    assert mnb.remote(call)("travel_bad", mesh=m).fetch() == ["fixed", "fixed"]


def test_autoreload_off_stops_the_travel(remote):
    m, code = remote
    write(code / "travel_off.py", "def f():\n    return 'on'\n")
    importlib.import_module("travel_off")
    m.autoreload()
    assert mnb.remote(call)("travel_off", mesh=m).fetch() == ["on", "on"]
    m.autoreload(False)
    write(code / "travel_off.py", "def f():\n    return 'edited'\n")
    assert mnb.remote(call)("travel_off", mesh=m).fetch() == ["on", "on"]
