"""The dashboard's cost, in a real IPython kernel.

* ``dashboard``  pipelined dispatch (N x ``mnb.remote(noop)(mesh=mesh)``, then
                 ``mesh.wait()``) on ``local_mesh(dp=2)`` with a dashboard
                 displayed and redrawing (its widget updates go out on the
                 kernel's IOPub and are received by the client), vs the same
                 with the dashboard not redrawing; target: ratio >= 0.95.
* ``dashboard_1024`` the CPU share of the redraw thread (its own ``thread_time``
                 over the wall time) while ``remote(noop)(mesh) + mesh.wait()``
                 loops on a simulated 32 x 32 mesh with a displayed dashboard (the
                 heat grid) in a real kernel; target: <= 0.05 of one core.

Both sides run in one kernel with one mesh, alternately after a warm-up; the
calls are timed inside the kernel; the numbers are medians of calls/s.
"""

from __future__ import annotations

import os

from ._report import Entry, interleaved
from .cell import _Kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = """
import sys, time
sys.path.insert(0, {root!r})
import monarch_nb as mnb
from monarch_nb.ui.dashboard import LOOP
from benchmarks.core import noop
_mesh = mnb.get_mesh()
_f = mnb.remote(noop)
_dash = _mesh.dashboard()
display(_dash)

def _rate(n, live):
    (LOOP.add if live else LOOP.remove)(_dash)
    before = _dash.redraws
    _mesh.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        _f(mesh=_mesh)
    _mesh.wait()
    rate = n / (time.perf_counter() - t0)
    LOOP.remove(_dash)
    print(rate, _dash.redraws - before)
"""


class _Rates:
    def __init__(self, k: _Kernel, n: int):
        self.k = k
        self.n = n
        self.redraws: list[int] = []

    def __call__(self, live: bool) -> float:
        out: list[str] = []

        def hook(msg):
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])

        reply = self.k.kc.execute_interactive(
            f"_rate({self.n}, {live})", timeout=120, output_hook=hook
        )
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the kernel failed: {reply['content']}")
        rate, redraws = "".join(out).split()
        if live:
            self.redraws.append(int(redraws))
        return float(rate)


def bench_dashboard(quick: bool) -> list[Entry]:
    n, reps = (10_000, 7) if quick else (30_000, 11)
    k = _Kernel()
    try:
        k.run("%load_ext monarch_nb")
        k.run("%monarch_mesh dp=2 --dashboard none")
        k.run(SETUP.format(root=ROOT))
        rates = _Rates(k, n)
        ours, base, _, _ = interleaved(lambda: rates(True), lambda: rates(False), reps)
    finally:
        k.close()
    redraws = sorted(rates.redraws[-reps:])
    return [
        Entry(
            "dashboard",
            ours,
            base,
            "calls/s",
            ">= 0.95",
            "the same pipelined dispatch in the same kernel with the dashboard not redrawing",
            note=(
                f"{n} x mnb.remote(noop)(mesh=mesh) then mesh.wait() on local_mesh(dp=2), inside "
                f"the kernel, with mesh.dashboard() displayed and redrawing (its updates sent on "
                f"IOPub, read by the client); median over {reps} reps; median "
                f"{redraws[len(redraws) // 2]} redraws with updates per rep"
            ),
        )
    ]


SETUP_1024 = """
import sys, time
sys.path.insert(0, {root!r})
import monarch_nb as mnb
from monarch_nb.ui.dashboard import Dashboard, LOOP
from benchmarks.core import noop
_mesh = mnb.local_mesh(host=32, gpu=32, simulate=True, name="bench-dashboard")
_f = mnb.remote(noop)
_f(mesh=_mesh)
_mesh.wait()

def _share(seconds, live):
    dash = None
    if live:
        dash = Dashboard(_mesh)
        display(dash)
    c0, p0, pc0, t0 = LOOP.cpu, LOOP.passes, time.process_time(), time.monotonic()
    u0 = dash.redraws if dash else 0
    while time.monotonic() - t0 < seconds:
        _f(mesh=_mesh)
        _mesh.wait()
    wall = time.monotonic() - t0
    out = ((LOOP.cpu - c0) / wall, (time.process_time() - pc0) / wall, LOOP.passes - p0,
           (dash.redraws - u0) if dash else 0)
    if dash is not None:
        dash.close()
    print(*out)
"""


def _share(k: _Kernel, seconds: float, live: bool) -> tuple[float, float, int, int]:
    """(redraw thread CPU / wall, kernel CPU / wall, passes, updates) of a broadcast loop."""
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])

    reply = k.kc.execute_interactive(f"_share({seconds}, {live})", timeout=120, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the kernel failed: {reply['content']}")
    share, cpu, passes, updates = "".join(out).split()
    return float(share), float(cpu), int(passes), int(updates)


def bench_dashboard_1024(quick: bool) -> list[Entry]:
    seconds, reps = (3.0, 2) if quick else (5.0, 3)
    k = _Kernel()
    try:
        k.run(SETUP_1024.format(root=ROOT), timeout=180)
        shares, with_cpu, without_cpu, passes, updates = [], [], [], 0, 0
        for _ in range(reps):
            without_cpu.append(_share(k, seconds, False)[1])
            share, cpu, n, u = _share(k, seconds, True)
            shares.append(share)
            with_cpu.append(cpu)
            passes += n
            updates += u
        k.run("_mesh.shutdown()")
    finally:
        k.close()
    med = sorted(shares)[len(shares) // 2]
    total = seconds * reps
    return [
        Entry(
            "dashboard_1024",
            med,
            1.0,
            "CPU share",
            "<= 0.05",
            "one core over the same wall time",
            note=(
                f"the redraw thread's own CPU time / wall time in a real kernel, a displayed "
                f"Dashboard (the heat grid; its updates sent on IOPub, read by the client) of "
                f"local_mesh(host=32, gpu=32, simulate=True) while remote(noop)(mesh) + "
                f"mesh.wait() loops, {seconds:.0f} s x {reps} (median); "
                f"{passes / total:.1f} redraw passes/s, {updates / total:.1f} with updates/s"
            ),
            extra={
                "passes_per_s": round(passes / total, 2),
                "pass_cpu_ms": round(med * total / max(passes, 1) * 1e3, 2),
                "kernel_cpu_with": round(sorted(with_cpu)[reps // 2], 3),
                "kernel_cpu_without": round(sorted(without_cpu)[reps // 2], 3),
            },
        )
    ]


BENCHMARKS = [("dashboard", bench_dashboard), ("dashboard_1024", bench_dashboard_1024)]
