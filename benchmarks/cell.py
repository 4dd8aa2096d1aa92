"""The cost of a ``%%monarch`` cell, through a real IPython kernel.

* ``cell``        ``%%monarch`` with ``pass`` on ``dp=2`` vs a plain ``pass`` cell in the
                  same kernel; target: at most 3 ms more per cell.
* ``cell_vs_px``  ``%%monarch`` vs ipyparallel's ``%%px`` on 2 engines, only when
                  ipyparallel is importable (it is not installed by this project).

Both sides are whole cells as a notebook front-end runs them: an execute_request
through jupyter_client and its reply, all IOPub messages of the cell received.
They alternate (after a warm-up) in one kernel with the mesh up; the numbers are
medians over the repetitions of the mean time per cell.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

from ._report import Entry, interleaved

EXTRA_MS = 3.0


class AdditiveEntry(Entry):
    """An entry whose target is an absolute margin over the baseline
    (``"<= baseline + 3 ms"``); ``ratio`` is still ours / baseline."""

    def __post_init__(self) -> None:
        if not self.target.startswith("<= baseline + "):
            raise ValueError(f"bad additive target {self.target!r}")

    @property
    def ok(self) -> bool:
        margin = float(self.target.removeprefix("<= baseline + ").split()[0])
        return self.ours == self.ours and self.ours <= self.baseline + margin


class _Kernel:
    def __init__(self):
        from monarch_nb.headless import start_kernel

        self._tmp = tempfile.TemporaryDirectory(prefix="monarch-bench-")
        env = dict(os.environ, IPYTHONDIR=os.path.join(self._tmp.name, "ipython"))
        env["JUPYTER_PLATFORM_DIRS"] = "1"
        self.km, self.kc = start_kernel("python3", timeout=60, env=env, cwd=self._tmp.name)

    def run(self, code: str, timeout: float = 120) -> None:
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=_ignore)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{code!r} failed in the kernel: {reply['content']}")

    def per_cell(self, code: str, n: int) -> float:
        """Mean seconds per cell over ``n`` executions of ``code``."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.run(code)
        return (time.perf_counter() - t0) / n

    def close(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
        finally:
            self._tmp.cleanup()


def _ignore(msg) -> None:
    pass


def bench_cell(quick: bool) -> list[Entry]:
    n, reps = (30, 5) if quick else (100, 9)
    k = _Kernel()
    try:
        k.run("%load_ext monarch_nb")
        k.run("%monarch_mesh dp=2")
        ours, base, _, _ = interleaved(
            lambda: k.per_cell("%%monarch\npass", n), lambda: k.per_cell("pass", n), reps
        )
    finally:
        k.close()
    return [
        AdditiveEntry(
            "cell",
            ours * 1e3,
            base * 1e3,
            "ms",
            f"<= baseline + {EXTRA_MS:g} ms",
            "a plain `pass` cell in the same kernel (execute_request -> reply, jupyter_client)",
            note=(
                f"`%%monarch` + `pass` on local_mesh(dp=2) (run_cell on both ranks, results "
                f"fetched, output flushed) per cell; median over {reps} reps of the mean of {n} "
                f"cells"
            ),
        )
    ]


def bench_cell_vs_px(quick: bool) -> list[Entry]:
    n, reps = (30, 5) if quick else (100, 9)
    k = _Kernel()
    try:
        k.run("%load_ext monarch_nb")
        k.run("%monarch_mesh dp=2")
        k.run(
            "import ipyparallel as ipp\n"
            "_px_cluster = ipp.Cluster(n=2)\n"
            "_px_client = _px_cluster.start_and_connect_sync()\n"
            "_px_client.wait_for_engines(2, timeout=120)\n"
            "_px_client[:].activate()",
            timeout=300,
        )
        try:
            ours, base, _, _ = interleaved(
                lambda: k.per_cell("%%monarch\npass", n), lambda: k.per_cell("%%px\npass", n), reps
            )
        finally:
            k.run("_px_cluster.stop_cluster_sync()", timeout=120)
    finally:
        k.close()
    return [
        Entry(
            "cell_vs_px",
            ours * 1e3,
            base * 1e3,
            "ms",
            "<= 1.0",
            "ipyparallel `%%px` + `pass` on 2 local engines, in the same kernel",
            note=f"`%%monarch` + `pass` on local_mesh(dp=2); median over {reps} reps of {n} cells",
        )
    ]


BENCHMARKS = [("cell", bench_cell)]
if importlib.util.find_spec("ipyparallel") is not None:
    BENCHMARKS.append(("cell_vs_px", bench_cell_vs_px))
