"""The build function of pyproject.toml's jupyter-builder hook.

It is hatch_jupyter_builder's ``npm_builder`` (``jlpm install``, then ``jlpm
build:prod`` in extension/), except for an editable install: there, on a machine
without Node.js, or when the build of the extension fails (no network, say), the
Python package installs without the JupyterLab extension and one line says so. A
wheel or sdist is never built without the extension: without Node.js it stops
with a one-line reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

HOW = "to get it, install Node.js (18 or newer) and run `pip install -e .` again"


def build(target_name: str, version: str, **kwargs) -> None:
    """Build the extension into ``build_dir`` (see ``[tool.hatch.build.hooks.jupyter-builder]``)."""
    if shutil.which("node") is None:
        if version == "editable":
            built = os.path.exists(os.path.join(kwargs.get("build_dir") or "", "package.json"))
            what = (
                "kept the JupyterLab extension built before"
                if built
                else ("skipped the JupyterLab extension (the side panel and status bar)")
            )
            _note(f"Node.js not found: {what}; {HOW}")
            return
        raise SystemExit(
            f"monarch_nb: building a {target_name} needs Node.js (18 or newer) for the "
            "JupyterLab extension in extension/: install it, or install editable "
            "(`pip install -e .`), which goes on without the extension"
        )
    from hatch_jupyter_builder import npm_builder

    try:
        npm_builder(target_name, version, **kwargs)
    except subprocess.CalledProcessError as e:
        if version != "editable":
            raise
        cmd = " ".join([os.path.basename(str(e.cmd[0])), *map(str, e.cmd[1:])])
        _note(
            f"`{cmd}` failed (exit {e.returncode}, output above): skipped the JupyterLab "
            f"extension; {HOW}"
        )


def _note(text: str) -> None:
    print(f"monarch_nb: {text}", file=sys.stderr, flush=True)
