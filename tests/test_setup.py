"""Set-up as documented, anywhere: the build hook without Node.js, the kernels our tools
start (over IPC, without ipykernel's TCP warning) and a start-up bar that ends its line.
(The real editable install without Node.js is `.ci/check_editable_without_node.py`.)"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TCP_WARNING = "running over TCP without encryption"


def _build_hook():
    spec = importlib.util.spec_from_file_location(
        "build_hook", ROOT / "extension" / "build_hook.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pyproject_builds_the_extension_through_our_hook():
    tomllib = pytest.importorskip("tomllib")

    hook = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    hook = hook["hooks"]["jupyter-builder"]
    assert hook["build-function"] == "extension.build_hook.build"
    assert "monarch_nb/labextension/static/style.js" in hook["ensured-targets"]


def test_editable_build_without_node_goes_on_with_one_line(tmp_path, monkeypatch, capsys):
    """No node on PATH: an editable build skips the extension and says so in one line; a
    wheel refuses in one line (a wheel always carries the extension)."""
    hook = _build_hook()
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    kwargs = {"path": "extension", "npm": ["jlpm"], "build_dir": str(tmp_path / "labextension")}

    assert hook.build("wheel", "editable", **kwargs) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("monarch_nb: Node.js not found: skipped the JupyterLab extension")
    assert "install Node.js (18 or newer) and run `pip install -e .` again" in err

    (tmp_path / "labextension").mkdir()
    (tmp_path / "labextension" / "package.json").write_text("{}")
    hook.build("wheel", "editable", **kwargs)
    assert "kept the JupyterLab extension built before" in capsys.readouterr().err

    with pytest.raises(SystemExit) as e:
        hook.build("wheel", "standard", **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("monarch_nb: building a wheel needs Node.js")


KERNEL_SCRIPT = """
import json, os, sys
{start}
reply = kc.execute_interactive("print(6 * 7)", timeout=60, output_hook=lambda m: None)
info = {{"transport": km.transport, "status": reply["content"]["status"],
        "dir": os.path.dirname(km.connection_file)}}
kc.stop_channels()
km.shutdown_kernel(now=False)
print(json.dumps(info))
"""
OURS = "from monarch_nb.headless import start_kernel\nkm, kc = start_kernel('python3')"
JUPYTER_DEFAULT = "from jupyter_client.manager import start_new_kernel\nkm, kc = start_new_kernel()"


def _run_kernel(start: str, tmp_path) -> tuple[dict, str]:
    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"), JUPYTER_PLATFORM_DIRS="1")
    proc = subprocess.run(
        [sys.executable, "-c", KERNEL_SCRIPT.format(start=start)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.kernel
def test_our_kernels_use_ipc_and_print_no_transport_warning(tmp_path):
    info, err = _run_kernel(OURS, tmp_path)
    assert info["transport"] == "ipc" and info["status"] == "ok"
    assert TCP_WARNING not in err and "WARNING" not in err, err
    assert not os.path.exists(info["dir"]), "the socket directory outlived its manager"
    # the warning this guards against, from jupyter_client's defaults (TCP)
    info, err = _run_kernel(JUPYTER_DEFAULT, tmp_path)
    assert info["transport"] == "tcp" and TCP_WARNING in err


def test_startup_bar_ends_its_line_in_a_script(tmp_path):
    """On a terminal or in a log the finished start-up bar stays as one line: what the
    script prints next starts on a line of its own."""
    script = textwrap.dedent(
        """
        import sys
        import monarch_nb as mnb
        with mnb.local_mesh(dp=1, name="bar") as m:
            print("next line", file=sys.stderr, flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, MONARCH_NB_PROGRESS_DELAY="0"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"starting mesh 'bar': 100%[^\r\n]*1/1[^\r\n]*\nnext line\n", proc.stderr), (
        repr(proc.stderr)
    )
