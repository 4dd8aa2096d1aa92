"""A Jupyter server and Debian's chromium driven by Playwright (docs/testing.md, browser tier).

``jupyter_server(root, app)`` starts JupyterLab (``app="lab"``) or Jupyter
Notebook 7 (``app="notebook"``) on a free port with every Jupyter path in a temp
dir; ``Lab`` opens notebooks in a fresh Lab workspace, ``Notebook7`` in Notebook
7's notebook page; both run them and read the page. Never ``playwright install``:
the browser is /usr/bin/chromium.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
DOC_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
STDERR = "[data-mime-type='application/vnd.jupyter.stderr']"
# what runs each front end: its module, and its options beyond the server's own
APPS = {
    "lab": (
        "jupyterlab",
        [
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: tests run commands
        ],
    ),
    "notebook": ("notebook", ["--JupyterNotebookApp.expose_app_in_browser=True"]),
}


def missing(app: str = "lab") -> str | None:
    """Why the browser tier cannot run front end ``app`` here (None: it can)."""
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is not installed (apt-get install chromium)"
    for mod in (APPS[app][0], "playwright"):
        # found, not imported: importing jupyterlab costs every collecting process ~2 s
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install -e '.[browser]')"
    return None


# what keeps the elements matching a selector from showing whole inside a container:
# no size, content that overflows the element (a cut label), or a part outside the
# container or outside any ancestor on the way that clips (overflow other than visible)
_CLIPPED = """([container, selector]) => {
    const root = document.querySelector(container);
    if (!root) return [`nothing matches ${container}`];
    const found = [...root.querySelectorAll(selector)];
    if (!found.length) return [`nothing matches ${selector} in ${container}`];
    const out = [];
    for (const el of found) {
        const name = `${el.className} ${JSON.stringify(el.innerText.trim())}`;
        const r = el.getBoundingClientRect();
        if (r.width < 1 || r.height < 1) {
            out.push(`${name}: no size (${r.width}x${r.height})`);
            continue;
        }
        if (el.scrollWidth > el.clientWidth + 1 || el.scrollHeight > el.clientHeight + 1) {
            out.push(`${name}: its content (${el.scrollWidth}x${el.scrollHeight}) ` +
                     `overflows it (${el.clientWidth}x${el.clientHeight})`);
        }
        for (let a = el.parentElement; a; a = a.parentElement) {
            const s = getComputedStyle(a);
            if (a === root || s.overflowX !== 'visible' || s.overflowY !== 'visible') {
                const b = a.getBoundingClientRect();
                if (r.left < b.left - 0.5 || r.right > b.right + 0.5 ||
                    r.top < b.top - 0.5 || r.bottom > b.bottom + 0.5) {
                    out.push(`${name} [${r.left},${r.right}]x[${r.top},${r.bottom}] is cut by ` +
                             `${a.id || a.className} [${b.left},${b.right}]x[${b.top},${b.bottom}]`);
                    break;
                }
            }
            if (a === root) break;
        }
    }
    return out;
}"""


def clipped(page, container: str, selector: str) -> list[str]:
    """Why elements matching ``selector`` in ``container`` do not show whole (empty:
    each has a size, its label fits, and it lies inside the container and every
    clipping box on the way)."""
    return page.evaluate(_CLIPPED, [container, selector])


def outside_window(page, selector: str) -> list[str]:
    """The elements matching ``selector`` that reach outside the browser window."""
    vw, vh = page.viewport_size["width"], page.viewport_size["height"]
    out = []
    for el in page.locator(selector).all():
        b = el.bounding_box()
        if b is None or not (
            -0.5 <= b["x"] <= b["x"] + b["width"] <= vw + 0.5
            and -0.5 <= b["y"] <= b["y"] + b["height"] <= vh + 0.5
        ):
            out.append(f"{selector} at {b} (window {vw}x{vh})")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A Jupyter server of front end ``app`` (a key of APPS) rooted at ``root/nb``."""

    def __init__(self, root: Path, app: str = "lab"):
        if app not in APPS:
            raise ValueError(f"unknown Jupyter front end {app!r}: one of {sorted(APPS)}")
        self.app = app
        self.root = root
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nb = root / "nb"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        t = self.root
        for d in ("cfg", "data", "rt", "settings", "ws", "ipython", "nb"):
            (t / d).mkdir(parents=True, exist_ok=True)
        notes = t / "settings" / "@jupyterlab" / "apputils-extension"
        notes.mkdir(parents=True, exist_ok=True)
        (notes / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False})
        )
        # every cell stays in the page (windowing detaches cells scrolled out of view)
        nbext = t / "settings" / "@jupyterlab" / "notebook-extension"
        nbext.mkdir(parents=True, exist_ok=True)
        (nbext / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
        # no build check on each page load (it runs node: ~0.5 s of CPU a page)
        labconfig = t / "cfg" / "labconfig"
        labconfig.mkdir(parents=True, exist_ok=True)
        (labconfig / "page_config.json").write_text(
            json.dumps({"buildCheck": False, "buildAvailable": False})
        )
        env = dict(
            os.environ,
            JUPYTER_PLATFORM_DIRS="1",
            JUPYTER_CONFIG_DIR=str(t / "cfg"),
            JUPYTER_DATA_DIR=str(t / "data"),
            JUPYTER_RUNTIME_DIR=str(t / "rt"),
            JUPYTERLAB_SETTINGS_DIR=str(t / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(t / "ws"),
            IPYTHONDIR=str(t / "ipython"),
            PYDEVD_DISABLE_FILE_VALIDATION="1",
        )
        self.log = open(t / "server.log", "wb")
        module, options = APPS[self.app]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={self.port}",
                "--ServerApp.port_retries=0",
                "--allow-root",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.nb}",
                # kernels over IPC sockets in the runtime dir: no "running over TCP
                # without encryption" warning from ipykernel
                "--KernelManager.transport=ipc",
                *options,
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.api("GET", "/api/status")
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Jupyter {self.app} did not start: {(t / 'server.log').read_text()[-3000:]}"
                    ) from None
                time.sleep(0.2)

    def api(self, method: str, path: str):
        req = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def end_sessions(self) -> None:
        for s in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{s['id']}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


@contextlib.contextmanager
def jupyter_server(root: Path, app: str = "lab"):
    """A started ``Server`` of front end ``app``, stopped at the end."""
    server = Server(root, app)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def notebook(cells: list[str]) -> dict:
    return {
        "cells": [
            {
                "cell_type": "code",
                "id": f"cell-{i:02d}",
                "metadata": {},
                "source": src,
                "outputs": [],
                "execution_count": None,
            }
            for i, src in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


class _Page:
    """One page of a Jupyter front end with one notebook open: running cells and
    reading their outputs work alike in JupyterLab and Notebook 7."""

    def __init__(self, server: Server, page, name: str, cells: list[str] | Path):
        """``cells``: the sources of a new notebook, or the path of one to copy."""
        self.server = server
        self.page = page
        self.name = name
        target = server.nb / f"{name}.ipynb"
        if isinstance(cells, Path):
            shutil.copyfile(cells, target)
        else:
            target.write_text(json.dumps(notebook(cells)))

    def run_all(self) -> None:
        self.page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        self.page.locator(".lm-Menu [data-command='runmenu:run-all']").click()

    def cells(self):
        """The cells of the notebook shown now (other notebooks' tabs are hidden)."""
        return self.page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")

    def run_cell(self, index: int) -> None:
        cell = self.cells().nth(index)
        cell.locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Control+Enter")

    def add_cell(self, source: str) -> int:
        """Type a new cell at the end; its index."""
        cells = self.cells()
        n = cells.count()
        cells.nth(n - 1).locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("b")
        cells.nth(n).locator(".jp-InputArea-editor").click()
        self.page.keyboard.insert_text(source)
        return n

    def output_text(self, index: int) -> str:
        return self.cells().nth(index).locator(".jp-OutputArea").inner_text()

    def stderr_outputs(self) -> list[str]:
        return [e.inner_text() for e in self.page.locator(STDERR).all()]

    def shot(self, name: str, element=None, doc_image: str | None = None) -> Path:
        """A screenshot of the page (with ``element``, a selector's last match or a
        locator, scrolled into view), and of that element alone as ``NAME-element.png``;
        with ``MNB_TEST_DOC_IMAGES=1``, that element's picture also replaces
        ``docs/images/DOC_IMAGE`` (the README's pictures: docs/setup.md)."""
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        if element is not None:
            el = self.page.locator(element).last if isinstance(element, str) else element
            el.scroll_into_view_if_needed()
            el.screenshot(path=str(ARTIFACTS / f"{name}-element.png"))
            if doc_image and os.environ.get("MNB_TEST_DOC_IMAGES") == "1":
                shutil.copyfile(ARTIFACTS / f"{name}-element.png", DOC_IMAGES / doc_image)
        self.page.screenshot(path=str(path))
        return path


class Lab(_Page):
    """One page of JupyterLab with one notebook open (a fresh workspace each time)."""

    def open(self, timeout: float = 60_000) -> None:
        ws = uuid.uuid4().hex[:12]
        url = f"{self.server.url}/lab/workspaces/{ws}/tree/{self.name}.ipynb?token={self.server.token}"
        self.page.goto(url)
        self.page.locator(".jp-Notebook").first.wait_for(timeout=timeout)
        try:
            self.wait_idle(timeout)
        except Exception:
            dialog = self.page.locator(".jp-Dialog")  # e.g. "File Load Error ... Failed to fetch"
            if dialog.count():
                raise AssertionError(
                    f"JupyterLab showed a dialog instead of the notebook: "
                    f"{' '.join(dialog.first.inner_text().split())!r}"
                ) from None
            raise

    def wait_idle(self, timeout: float = 60_000) -> None:
        """The status bar names the kernel as idle (the toolbar says so too early)."""
        self.page.locator(
            "#jp-main-statusbar [role='button']", has_text=re.compile(r"\| Idle$")
        ).first.wait_for(timeout=timeout)


class Notebook7(_Page):
    """Jupyter Notebook 7's notebook page (``/notebooks/NAME.ipynb``): one notebook a
    page, no status bar."""

    def open(self, timeout: float = 60_000) -> None:
        self.page.goto(f"{self.server.url}/notebooks/{self.name}.ipynb?token={self.server.token}")
        self.page.locator(".jp-Notebook").first.wait_for(timeout=timeout)
        self.wait_idle(timeout)

    def wait_idle(self, timeout: float = 60_000) -> None:
        """The notebook's kernel exists and is idle (the toolbar's indicator says idle
        before the kernel exists: ask the app, exposed as window.jupyterapp)."""
        self.page.wait_for_function(
            """() => {
                const k = window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel;
                return !!k && k.status === 'idle';
            }""",
            timeout=timeout,
        )
