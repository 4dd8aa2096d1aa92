import compileall
import os
import re
import sys

import psutil
import pytest
from keepalive_helpers import mesh_dir  # noqa: F401 - a fixture of kept-alive meshes' tests

import monarch_nb as mnb
from monarch_nb.launchers import host_agent


def _worker_children():
    """Our worker processes: spawned ones (``monarch_nb.worker``) and the ranks the
    host agent forked (its children; the warm agent itself is not a worker, and one
    the fork server forked is not ours: its children are)."""
    me = psutil.Process(os.getpid())
    out = []
    kids = me.children(recursive=True)
    agent = host_agent._agent
    if agent is not None and agent.alive and agent.pid not in {p.pid for p in kids}:
        try:
            out += psutil.Process(agent.pid).children()
        except psutil.Error:
            pass
    for p in kids:
        try:
            if "monarch_nb.worker" in " ".join(p.cmdline()):
                out.append(p)
            elif "monarch_nb.host" in " ".join(p.parent().cmdline()):
                out.append(p)
        except (psutil.Error, AttributeError):
            pass
    return out


@pytest.fixture(scope="session", autouse=True)
def no_worker_outlives_the_session():
    yield
    from monarch_nb.api.mesh import all_meshes

    for m in all_meshes().values():
        m.shutdown()
    left = _worker_children()
    gone, alive = psutil.wait_procs(left, timeout=10)
    assert not alive, f"worker processes left behind: {[p.pid for p in alive]}"


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2)
    yield m
    m.shutdown()


@pytest.fixture()
def worker_children():
    return _worker_children


# Under `-n N --dist loadfile` each process takes the next file as it frees up, so a
# long file collected late trails the run (test_slurm.py, 2.5 min, most of it waiting
# out Slurm's one-minute time limit, ended runs ~1 min after the rest). The longest
# files (their wall time under -n 4 here) go first; the rest keep their order. A
# serial run takes as long either way.
LONGEST_FIRST = (
    "test_slurm.py",
    "test_remote_keep_alive.py",
    "reliability/test_faults.py",
    "test_remote_agents.py",
    "test_lab_extension.py",
    "reliability/test_expiry.py",
    "test_tensor_opinfo.py",
    "test_notebooks.py",
    "test_connect.py",
    "test_attach.py",
    "test_browser.py",
    "test_browser_completion.py",
    "test_notebook7.py",
    "test_keep_alive.py",
    "test_host_agent.py",
)


_HERE = os.path.dirname(__file__)
_missing = [f for f in LONGEST_FIRST if not os.path.exists(os.path.join(_HERE, f))]
assert not _missing, f"LONGEST_FIRST names files that are not there: {_missing}"


def _compile_sources() -> None:
    """Write the bytecode of this checkout's Python (monarch_nb, the test helpers, the
    benchmarks) once, before the run. Several hundred processes of the run import it
    (a host agent per controller, kernels, controllers run as scripts); where
    PYTHONDONTWRITEBYTECODE is set (as on this machine) none of them writes what it
    compiled, so each compiled ~120 modules again (~0.25 s of CPU a process). An
    unchanged file is skipped (its cached mtime matches); test modules are left to
    pytest, which rewrites their asserts."""
    if not sys.dont_write_bytecode:
        return  # each process writes what it compiles
    root = os.path.dirname(_HERE)
    tests = re.compile(r"[/\\](test_[^/\\]*|conftest)\.py$")
    for folder, rx in (("monarch_nb", None), ("tests", tests), ("benchmarks", None)):
        try:
            compileall.compile_dir(os.path.join(root, folder), quiet=2, rx=rx)
        except OSError:
            pass  # a read-only checkout: each process compiles, as before


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once, in the process that runs the session
        _compile_sources()
    # xdist hands out files by their number of tests unless told not to (1,176 OpInfo
    # samples of 40 s went first, the 2.5-min Slurm file late): ours is the order above
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_rank(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    try:
        return LONGEST_FIRST.index(path)
    except ValueError:
        return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: a file's tests stay together, in order
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def browser():
    """Debian's chromium through Playwright (the browser tier; one for the session)."""
    from browser_helpers import CHROMIUM, LAUNCH_ARGS
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A JupyterLab server (the browser tier; one for the session)."""
    from browser_helpers import jupyter_server

    with jupyter_server(tmp_path_factory.mktemp("lab"), "lab") as s:
        yield s


@pytest.fixture(scope="session")
def nb7_server(tmp_path_factory):
    """A Jupyter Notebook 7 server (the browser tier; one for the session)."""
    from browser_helpers import jupyter_server

    with jupyter_server(tmp_path_factory.mktemp("nb7"), "notebook") as s:
        yield s


def _page(browser, server, name: str):
    """A fresh page; its screenshot as the test left it goes to artifacts/NAME-end.png
    (a failed test: where it stopped), and the requests the browser saw fail (with
    chromium's reason: net::ERR_...) to artifacts/NAME-requests.txt; the server's
    kernels end with the test."""
    from browser_helpers import ARTIFACTS

    ctx = browser.new_context(viewport={"width": 1600, "height": 1100})
    pg = ctx.new_page()
    failed: list[str] = []
    pg.on("requestfailed", lambda r: failed.append(f"{r.method} {r.url}: {r.failure}"))
    try:
        yield pg
    finally:
        try:
            ARTIFACTS.mkdir(exist_ok=True)
            pg.screenshot(path=str(ARTIFACTS / f"{name}-end.png"), full_page=True)
            if failed:
                (ARTIFACTS / f"{name}-requests.txt").write_text("\n".join(failed) + "\n")
        finally:
            ctx.close()
            server.end_sessions()


@pytest.fixture()
def page(browser, server, request):
    """A fresh JupyterLab page (``_page``)."""
    yield from _page(browser, server, request.node.name)


@pytest.fixture()
def nb7_page(browser, nb7_server, request):
    """A fresh Notebook 7 page (``_page``)."""
    yield from _page(browser, nb7_server, request.node.name)
