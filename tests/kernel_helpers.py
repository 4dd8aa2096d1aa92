"""A real IPython kernel driven through jupyter_client, for the kernel and notebook tiers."""

from __future__ import annotations

import contextlib
import os
import re
import time

from wait_helpers import pids_gone as wait_gone  # noqa: F401 - the kernel tests' name for it

from monarch_nb.headless import ipc_config, start_kernel

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def kernel_env(tmp) -> dict:
    env = dict(os.environ)
    env.update(
        IPYTHONDIR=os.path.join(str(tmp), "ipython"),
        JUPYTER_PLATFORM_DIRS="1",
        PYDEVD_DISABLE_FILE_VALIDATION="1",
    )
    return env


def notebook_client(nb, tmp, timeout: float = 120):
    """nbclient's NotebookClient for ``nb`` in a ``python3`` kernel whose cwd is ``tmp``,
    over IPC (sockets in ``tmp``), as every kernel our tools start."""
    import nbclient

    return nbclient.NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp)}},
        config=ipc_config(str(tmp)),
    )


class Kernel:
    """One kernel; ``run`` executes code and returns (reply, iopub messages of that request)."""

    def __init__(self, tmp):
        # over IPC, as every kernel our tools start: no TCP port, no encryption warning
        self.km, self.kc = start_kernel("python3", timeout=60, env=kernel_env(tmp), cwd=str(tmp))

    def run(self, code: str, timeout: float = 60, output_hook=None, **kw):
        msgs: list = []

        def hook(msg):
            msgs.append(msg)
            if output_hook is not None:
                output_hook(msg)

        kw.setdefault("allow_stdin", False)  # a front end without stdin, unless a test types
        reply = self.kc.execute_interactive(code, output_hook=hook, timeout=timeout, **kw)
        return reply, msgs

    def ok(self, code: str, timeout: float = 60, output_hook=None):
        """Run ``code``; fail with the kernel's traceback unless it succeeded
        (``output_hook`` sees every IOPub message read meanwhile)."""
        reply, msgs = self.run(code, timeout, output_hook=output_hook)
        status = reply["content"]["status"]
        assert status == "ok", f"{code!r} -> {status}:\n{text(msgs)}\n{errors_text(msgs)}"
        return msgs

    def value(self, expr: str, timeout: float = 60, output_hook=None):
        """``eval(expr)`` in the kernel, brought back through its repr."""
        msgs = self.ok(f"print(repr({expr}))", timeout, output_hook)
        import ast

        return ast.literal_eval(stream(msgs, "stdout").strip())

    def drain(self, msg_id: str, until, timeout: float = 30) -> list:
        """IOPub messages of request ``msg_id`` arriving until ``until(msgs)`` holds."""
        out: list = []
        deadline = time.monotonic() + timeout
        while not until(out):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout} s; got {[m['msg_type'] for m in out]}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except Exception:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                out.append(msg)
        return out

    def collect(self, until, timeout: float = 30) -> dict:
        """Every IOPub message, grouped by the msg_id of its request, until ``until(groups)``."""
        groups: dict = {}
        deadline = time.monotonic() + timeout
        while not until(groups):
            left = deadline - time.monotonic()
            if left <= 0:
                got = {k: [m["msg_type"] for m in v] for k, v in groups.items()}
                raise TimeoutError(f"waited {timeout} s; got {got}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except Exception:
                continue
            groups.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
        return groups

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=False)


@contextlib.contextmanager
def mesh_kernel(tmp, dims: str = "dp=2"):
    """A kernel with monarch_nb loaded (``mnb`` imported) and a mesh made by the magic."""
    kern = Kernel(tmp)
    try:
        kern.ok("%load_ext monarch_nb\nimport monarch_nb as mnb")
        kern.ok(f"%monarch_mesh {dims}", timeout=120)
        yield kern
    finally:
        kern.shutdown()


def idle(msgs) -> bool:
    """The kernel finished the request these messages belong to."""
    return any(
        m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in msgs
    )


def stream(msgs, name: str = "stdout") -> str:
    return "".join(
        m["content"]["text"]
        for m in msgs
        if m["msg_type"] == "stream" and m["content"]["name"] == name
    )


def text(msgs) -> str:
    return stream(msgs, "stdout") + stream(msgs, "stderr")


def _live_id(m) -> str | None:
    did = m["content"].get("transient", {}).get("display_id") or ""
    return did if did.startswith("mnb-live") else None


def displays(msgs) -> list[dict]:
    """Values, figures and widgets shown (not the live display of lines in progress)."""
    return [
        m["content"]["data"]
        for m in msgs
        if m["msg_type"] in ("display_data", "execute_result") and not _live_id(m)
    ]


def live(msgs) -> dict:
    """The cells' live displays (lines in progress, the latest lines past the cap):
    display id -> its text after every display and update among ``msgs``."""
    shown: dict = {}
    for m in msgs:
        if m["msg_type"] in ("display_data", "update_display_data") and _live_id(m):
            shown[_live_id(m)] = m["content"]["data"]["text/plain"]
    return shown


def plain(msgs) -> list[str]:
    return [d.get("text/plain", "") for d in displays(msgs)]


def errors(msgs) -> list[dict]:
    return [m["content"] for m in msgs if m["msg_type"] == "error"]


def errors_text(msgs) -> str:
    return "\n".join(ANSI.sub("", "\n".join(e["traceback"])) for e in errors(msgs))
