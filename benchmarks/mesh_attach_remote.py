"""Attaching to a ``connect_mesh(..., keep_alive=...)`` mesh whose host agents are
relays (``monarch-nb-host --connection-file``, here on loopback, one rank each).

``mesh_attach_remote``: a process that started such a dp=2 mesh (a model in its
ranks' namespace) is SIGKILLed; once both relays say they keep their ranks (they
notice a closed connection after 2 s: a new kernel takes longer than that to
start), ``mnb.attach`` in this process until the first command's value is back.
The issue's bound: <= 2 s. ``from_kill_s`` in its extra: from the kill to that
value. The baseline is what a user without keep-alive does instead (the state
lost): a fresh ``connect_mesh(dp=2)`` and two fresh relays, to the first value.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from ._report import Entry
from .mesh_start import BoundEntry, _median

_KEPT = (
    "import sys, monarch_nb as mnb\n"
    "m = mnb.connect_mesh(2, connection_file=sys.argv[2], keep_alive='60s', name=sys.argv[1],\n"
    "                     timeout=120, heartbeat_timeout=5, dp=2)\n"
    "m.exec('import torch\\nmodel = torch.nn.Linear(256, 256)').fetch(timeout=120)\n"
    "print('READY', flush=True)\n"
    "import time; time.sleep(600)\n"
)


def _wait_file(path: str, bound: float = 60.0) -> None:
    deadline = time.monotonic() + bound
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no connection file at {path} within {bound:.0f} s")
        time.sleep(0.02)


def _relays(conn: str) -> list:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "monarch_nb.host", "--connection-file", conn,
             "--local-ranks", "1", "--node-rank", str(i), "--heartbeat-timeout", "5"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for i in (0, 1)
    ]


def _kept(relay, said: threading.Event) -> None:
    """Read a relay's log (to its end: the pipe never fills); ``said`` once it keeps
    its ranks."""
    for line in relay.stderr:
        if "for another controller" in line:
            said.set()


def _attach(name: str, tmp: str) -> tuple[float, float]:
    """(seconds from attach to the first value, seconds from the kill to it)."""
    import signal

    import monarch_nb as mnb

    conn = os.path.join(tmp, f"{name}.json")
    p = subprocess.Popen([sys.executable, "-c", _KEPT, name, conn], stdout=subprocess.PIPE, text=True)
    relays = []
    try:
        _wait_file(conn)
        relays = _relays(conn)
        said = [threading.Event() for _ in relays]
        for r, s in zip(relays, said):
            threading.Thread(target=_kept, args=(r, s), daemon=True).start()
        for line in p.stdout:
            if line.strip() == "READY":
                break
        os.kill(p.pid, signal.SIGKILL)
        killed = time.perf_counter()
        p.wait(30)
        for s in said:
            if not s.wait(30):
                raise TimeoutError("a relay did not keep its ranks within 30 s")
        t0 = time.perf_counter()
        mesh = mnb.attach(name)
        mesh.exec("model.weight.shape[0]").fetch(timeout=60)
        t1 = time.perf_counter()
        mesh.shutdown()
        return t1 - t0, t1 - killed
    finally:
        p.kill()
        for r in relays:
            r.kill()
            r.wait(30)


def _fresh(tmp: str, i: int) -> float:
    """Seconds from a fresh connect_mesh(dp=2) and its relays to the first value."""
    import monarch_nb as mnb

    conn = os.path.join(tmp, f"fresh-{i}.json")
    relays = []
    t0 = time.perf_counter()

    def start() -> None:
        _wait_file(conn)
        relays.extend(_relays(conn))

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    mesh = mnb.connect_mesh(2, connection_file=conn, timeout=120, name=f"bench-fresh-{i}", dp=2)
    try:
        mesh.exec("import torch\nmodel = torch.nn.Linear(256, 256)").fetch(timeout=120)
        return time.perf_counter() - t0
    finally:
        mesh.shutdown()
        starter.join(30)
        for r in relays:
            r.wait(30)


def bench_mesh_attach_remote(quick: bool) -> list[Entry]:
    reps = 1 if quick else 3
    tmp = tempfile.mkdtemp(prefix="mnb-bench-remote-")
    old = os.environ.get("MONARCH_NB_MESH_DIR")
    os.environ["MONARCH_NB_MESH_DIR"] = os.path.join(tmp, "meshes")
    try:
        got = [_attach(f"bench-remote-{i}", tmp) for i in range(reps)]
        base = [_fresh(tmp, i) for i in range(reps)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is None:
            os.environ.pop("MONARCH_NB_MESH_DIR", None)
        else:
            os.environ["MONARCH_NB_MESH_DIR"] = old
    return [
        BoundEntry(
            "mesh_attach_remote",
            _median([a for a, _ in got]),
            _median(base),
            "s",
            "<= 2.0 s",
            "a fresh connect_mesh(dp=2) and two fresh relays: starting over, the state lost",
            note=f"mnb.attach of a connect_mesh(dp=2, keep_alive=...) of two relays whose "
            f"controller was SIGKILLed, once the relays kept their ranks, until its first "
            f"value; median over {reps} reps",
            extra={"from_kill_s": round(_median([k for _, k in got]), 3)},
        )
    ]


BENCHMARKS = [("mesh_attach_remote", bench_mesh_attach_remote)]
