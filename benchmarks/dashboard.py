"""The dashboard's cost, in a real IPython kernel.

* ``dashboard``  pipelined dispatch (N x ``mnb.remote(noop)(mesh=mesh)``, then
                 ``mesh.wait()``) on ``local_mesh(dp=2)`` with a dashboard
                 displayed and redrawing (its widget updates go out on the
                 kernel's IOPub and are received by the client), vs the same
                 with the dashboard not redrawing; target: ratio >= 0.95.

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


BENCHMARKS = [("dashboard", bench_dashboard)]
