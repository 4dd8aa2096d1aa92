"""The dashboard's cost, in a real IPython kernel.

* ``dashboard``  pipelined dispatch (N x ``mnb.remote(noop)(mesh=mesh)``, then
                 ``mesh.wait()``) on ``local_mesh(dp=2)`` with a dashboard
                 displayed and redrawing (its widget updates go out on the
                 kernel's IOPub and are received by the client), vs the same
                 with the dashboard not redrawing; target: ratio >= 0.95.
* ``dashboard_1024`` the CPU share of the redraw thread (its own ``thread_time``
                 over the wall time) while ``remote(noop)(mesh) + mesh.wait()``
                 loops on a simulated 32 x 32 mesh with a live dashboard (the heat
                 grid) in this process; target: <= 0.05 of one core.

Both sides run in one kernel with one mesh, alternately after a warm-up; the
calls are timed inside the kernel; the numbers are medians of calls/s.
"""

from __future__ import annotations

import os
import time

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


def _noop():
    return None


def _share(mesh, f, seconds: float, dash) -> tuple[float, float, int, int]:
    """(redraw thread CPU / wall, process CPU / wall, passes, updates) of a broadcast loop."""
    from monarch_nb.ui.redraw import LOOP

    c0, p0, u0 = LOOP.cpu, LOOP.passes, dash.redraws if dash else 0
    pc0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        f(mesh=mesh)
        mesh.wait()
    wall = time.monotonic() - t0
    updates = (dash.redraws - u0) if dash else 0
    return (LOOP.cpu - c0) / wall, (time.process_time() - pc0) / wall, LOOP.passes - p0, updates


def bench_dashboard_1024(quick: bool) -> list[Entry]:
    import monarch_nb as mnb
    from monarch_nb.ui.dashboard import Dashboard

    seconds, reps = (3.0, 2) if quick else (5.0, 3)
    mesh = mnb.local_mesh(host=32, gpu=32, simulate=True, name="bench-dashboard")
    try:
        f = mnb.remote(_noop)
        f(mesh=mesh)
        mesh.wait()
        shares, with_cpu, without_cpu, passes, updates = [], [], [], 0, 0
        for _ in range(reps):
            without_cpu.append(_share(mesh, f, seconds, None)[1])
            dash = Dashboard(mesh)
            share, cpu, n, u = _share(mesh, f, seconds, dash)
            dash.close()
            shares.append(share)
            with_cpu.append(cpu)
            passes += n
            updates += u
    finally:
        mesh.shutdown()
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
                f"the redraw thread's own CPU time / wall time, mesh.dashboard()'s heat grid "
                f"live on local_mesh(host=32, gpu=32, simulate=True) while remote(noop)(mesh) + "
                f"mesh.wait() loops, {seconds:.0f} s x {reps} (median); "
                f"{passes / total:.1f} redraw passes/s, {updates / total:.1f} with updates/s; "
                f"widget comms are dummies here (no kernel)"
            ),
            extra={
                "passes_per_s": round(passes / total, 2),
                "pass_cpu_ms": round(med * total / max(passes, 1) * 1e3, 2),
                "process_cpu_with": round(sorted(with_cpu)[reps // 2], 3),
                "process_cpu_without": round(sorted(without_cpu)[reps // 2], 3),
            },
        )
    ]


BENCHMARKS = [("dashboard", bench_dashboard), ("dashboard_1024", bench_dashboard_1024)]
