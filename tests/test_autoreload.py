"""Code in files (issue 27 item 5): with autoreload on, each rank reloads the user's
changed modules before every command, remote functions included, with IPython's
autoreload (a changed class updates its instances); a syntax error, a file that is
gone and a changed compiled extension are each said in one line and the old code
serves on. Real workers, real files: an edit is a new file content and a later mtime."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sysconfig

import pytest

import monarch_nb as mnb


def call(module: str, fn: str = "f"):
    return getattr(importlib.import_module(module), fn)()


def write(path, text: str) -> None:
    """A new content with an mtime later than the last (no sleep: the clock's
    resolution must not hide an edit)."""
    before = path.stat().st_mtime if path.exists() else 0
    path.write_text(text)
    os.utime(path, (before + 2, before + 2))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = mnb.local_mesh(dp=2, name="autoreload")
    folder = tmp_path_factory.mktemp("user_code")
    m.exec(f"import sys\nsys.path.insert(0, {str(folder)!r})")
    m.autoreload()
    yield m, folder
    m.shutdown()


def test_a_changed_function_and_class_reach_the_next_remote_call(mesh):
    m, folder = mesh
    mod = folder / "ar_model.py"
    write(mod, "def f():\n    return 1\n\nclass Layer:\n    def scale(self):\n        return 10\n")
    assert mnb.remote(call)("ar_model", mesh=m).fetch() == [1, 1]
    m.exec("import ar_model\nlayer = ar_model.Layer()")
    m.wait()  # the cell before the edit has run (as a notebook's cells do)
    write(mod, "def f():\n    return 2\n\nclass Layer:\n    def scale(self):\n        return 20\n")
    assert mnb.remote(call)("ar_model", mesh=m).fetch() == [2, 2]  # no cell ran between
    m.exec("scaled = layer.scale()")  # the instance made before the edit has the new method
    assert m.pull("scaled", rank=1) == 20


def test_a_syntax_error_names_the_file_and_line_and_the_old_code_serves(mesh, capfd):
    m, folder = mesh
    mod = folder / "ar_broken.py"
    write(mod, "def f():\n    return 'old'\n")
    assert mnb.remote(call)("ar_broken", mesh=m).fetch() == ["old", "old"]
    write(mod, "def f():\n    return (\n")
    assert mnb.remote(call)("ar_broken", mesh=m).fetch() == ["old", "old"]
    m.wait()
    err = capfd.readouterr().err
    for r in (0, 1):
        assert f"[rank {r}] [autoreload] {mod}:2: SyntaxError" in err, err
    assert "keeps its old code" in err and err.count("SyntaxError") == 2  # once per rank
    write(mod, "def f():\n    return 'fixed'\n")
    assert mnb.remote(call)("ar_broken", mesh=m).fetch() == ["fixed", "fixed"]


def test_a_module_whose_file_is_gone_keeps_its_code_and_says_so(mesh, capfd):
    m, folder = mesh
    mod = folder / "ar_gone.py"
    write(mod, "def f():\n    return 'here'\n")
    assert mnb.remote(call)("ar_gone", mesh=m).fetch() == ["here", "here"]
    mod.unlink()
    assert mnb.remote(call)("ar_gone", mesh=m).fetch() == ["here", "here"]
    m.wait()
    assert f"[autoreload] {mod} is gone: ar_gone keeps its old code" in capfd.readouterr().err


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build an extension")
def test_a_changed_compiled_extension_is_refused_with_a_note(mesh, capfd, tmp_path):
    m, folder = mesh
    src = tmp_path / "ar_ext.c"
    src.write_text(
        "#include <Python.h>\n"
        "static PyObject *f(PyObject *s, PyObject *a) { return PyLong_FromLong(7); }\n"
        "static PyMethodDef M[] = {{\"f\", f, METH_NOARGS, 0}, {0}};\n"
        "static struct PyModuleDef D = {PyModuleDef_HEAD_INIT, \"ar_ext\", 0, -1, M};\n"
        "PyMODINIT_FUNC PyInit_ar_ext(void) { return PyModule_Create(&D); }\n"
    )
    so = folder / ("ar_ext" + sysconfig.get_config_var("EXT_SUFFIX"))
    include = sysconfig.get_paths()["include"]
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{include}", str(src), "-o", str(so)], check=True)
    assert mnb.remote(call)("ar_ext", mesh=m).fetch() == [7, 7]
    t = so.stat().st_mtime + 2
    os.utime(so, (t, t))
    assert mnb.remote(call)("ar_ext", mesh=m).fetch() == [7, 7]  # the loaded one serves on
    m.wait()
    err = capfd.readouterr().err
    assert f"[autoreload] {so} changed: a compiled extension module cannot be reloaded" in err


def test_autoreload_off_and_a_cells_own_autoreload_2(mesh):
    m, folder = mesh
    mod = folder / "ar_switch.py"
    write(mod, "def f():\n    return 'a'\n")
    m.autoreload(False)
    assert mnb.remote(call)("ar_switch", mesh=m).fetch() == ["a", "a"]
    write(mod, "def f():\n    return 'b'\n")
    assert mnb.remote(call)("ar_switch", mesh=m).fetch() == ["a", "a"]  # off: not reloaded
    m.run_cell("# %%monarch\n%autoreload 2").result(timeout=60)  # as a user types it
    # as in IPython, an edit made while it was off is not seen; the next one is
    assert mnb.remote(call)("ar_switch", mesh=m).fetch() == ["a", "a"]
    write(mod, "def f():\n    return 'c'\n")
    assert mnb.remote(call)("ar_switch", mesh=m).fetch() == ["c", "c"]


def test_ship_files_on_a_local_mesh_sends_the_kernels_modules(tmp_path):
    """``autoreload(ship_files=True)`` ships on any mesh, and the cell it runs (whose
    ``%autoreload 2`` would install the launcher's default, none here) does not undo it."""
    import sys

    m = mnb.local_mesh(dp=1, name="ship-local")  # its ranks' sys.path lacks the folder
    folder = tmp_path / "kernel_only"
    folder.mkdir()
    write(folder / "ship_local_mod.py", "def f():\n    return 'shipped'\n")
    sys.path.insert(0, str(folder))
    try:
        importlib.import_module("ship_local_mod")
        with pytest.raises(mnb.RemoteError, match="No module named 'ship_local_mod'"):
            mnb.remote(call)("ship_local_mod", mesh=m).fetch()
        m.autoreload(ship_files=True)
        assert mnb.remote(call)("ship_local_mod", mesh=m).fetch() == ["shipped"]
        write(folder / "ship_local_mod.py", "def f():\n    return 'edited'\n")
        assert mnb.remote(call)("ship_local_mod", mesh=m).fetch() == ["edited"]
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("ship_local_mod", None)
        m.shutdown()
