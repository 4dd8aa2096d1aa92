import os

import psutil
import pytest
from keepalive_helpers import mesh_dir  # noqa: F401 - a fixture of kept-alive meshes' tests

import monarch_nb as mnb


def _worker_children():
    """Our worker processes: spawned ones (``monarch_nb.worker``) and the ranks the
    host agent forked (its children; the warm agent itself is not a worker)."""
    me = psutil.Process(os.getpid())
    out = []
    for p in me.children(recursive=True):
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


def pytest_collection_modifyitems(config, items):
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
    (a failed test: where it stopped); the server's kernels end with the test."""
    from browser_helpers import ARTIFACTS

    ctx = browser.new_context(viewport={"width": 1600, "height": 1100})
    pg = ctx.new_page()
    try:
        yield pg
    finally:
        try:
            ARTIFACTS.mkdir(exist_ok=True)
            pg.screenshot(path=str(ARTIFACTS / f"{name}-end.png"), full_page=True)
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
