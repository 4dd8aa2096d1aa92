"""ipyparallel's broadcast of a no-op to N engines, for the ``broadcast_vs_ipyparallel`` row;
run INSIDE the side venv of ``scripts/peer_ipyparallel_venv.sh``, never with monarch_nb.

``python benchmarks/peer_ipyparallel.py [--engines N] [--quick]`` starts a local cluster
(``ipp.Cluster(n=N)``: one controller, N engine processes, no nannies) and prints one JSON
object: per view (``broadcast``: ``rc.broadcast_view().apply_sync(noop)``; ``coalesced``: the
same view with ``is_coalescing=True``; ``direct``: ``rc[:].apply_sync(noop)``) the median ms of
one call, this client process's CPU for it per engine and the controller's (µs), and what the
engines cost: ``start_s``, ``engine_uss_kb`` (median USS of one engine),
``start_cpu_s_per_engine``, ``controller_uss_kb``; or ``{"error": "..."}`` (exit 0 either way; a bad argument exits 2).

``--serve``: for ``benchmarks/scale_ipp.py``, which alternates these with its own measurements.
One JSON line once the engines are up (``{"ready": true, ...}``), then one JSON line per command
read from stdin: ``broadcast K``, ``coalesced K`` or ``direct K`` (K calls; ``{"ms": median,
"cpu_us_per_engine": ..., "controller_cpu_us_per_engine": ...}``); ``quit`` or EOF ends it.

Only the standard library, psutil and ipyparallel are imported. The JSON goes to a private
copy of stdout and fd 1 is pointed at stderr, so nothing the cluster prints mixes into it; the
IPython profile lives in a temporary ``IPYTHONDIR`` removed at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

VIEWS = ("broadcast", "coalesced", "direct")
CALLS = {"quick": 10, "full": 30}
ENGINE_MB = 40  # MiB; a measured engine's USS here is ~37 MiB (ipyparallel 9.2, python 3.11)
START_TIMEOUT = 900.0  # seconds for all engines to register


def noop():
    return None


class Peer:
    """A local ipyparallel cluster of ``n`` engines and its three views."""

    def __init__(self, n: int) -> None:
        import ipyparallel as ipp
        import psutil
        from traitlets.config import Config

        self.n = n
        cfg = Config()
        # the nanny is a second process per engine that no broadcast goes through
        cfg.LocalEngineSetLauncher.engine_args = ["--IPEngine.enable_nanny=False"]
        t0 = time.perf_counter()
        self.cluster = ipp.Cluster(n=n, log_level=40, config=cfg)
        self.rc = self.cluster.start_and_connect_sync()
        self.rc.wait_for_engines(n, timeout=START_TIMEOUT)
        self.views = {
            "broadcast": self.rc.broadcast_view(),
            "coalesced": self.rc.broadcast_view(is_coalescing=True),
            "direct": self.rc[:],
        }
        for view in self.views.values():
            view.apply_sync(noop)  # each view's first call
        self.start_s = time.perf_counter() - t0
        kids = psutil.Process().children(recursive=True)
        engines = [p for p in kids if "ipyparallel.engine" in p.cmdline()]
        # the controller: its hub and its schedulers, each a process
        self.controller = [p for p in kids if p not in engines]
        if len(engines) != n:
            raise RuntimeError(f"expected {n} engine processes, found {len(engines)}")
        self.info = {
            "engines": n,
            "start_s": round(self.start_s, 2),
            "start_s_per_engine": round(self.start_s / n, 3),
            "start_cpu_s_per_engine": round(sum(_cpu(p) for p in engines) / n, 3),
            "engine_uss_kb": round(statistics.median(_uss(p) for p in engines) / 1024),
            "controller_uss_kb": round(sum(_uss(p) for p in self.controller) / 1024),
            "ipyparallel": ipp.__version__,
            "python": sys.version.split()[0],
        }

    def measure(self, view: str, k: int) -> dict:
        """Median ms of one ``apply_sync(noop)`` on ``view`` over ``k`` calls, the median of
        this (client) process's CPU for one call per engine (µs), and the controller
        processes' CPU per call per engine (µs, the mean over the ``k`` calls)."""
        v = self.views[view]
        wall, cpu = [], []
        hub0 = sum(_cpu(p) for p in self.controller)
        for _ in range(k):
            c0, t0 = time.process_time(), time.perf_counter()
            v.apply_sync(noop)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        hub = sum(_cpu(p) for p in self.controller) - hub0
        return {
            "ms": round(statistics.median(wall) * 1e3, 3),
            "cpu_us_per_engine": round(statistics.median(cpu) * 1e6 / self.n, 2),
            "controller_cpu_us_per_engine": round(hub * 1e6 / k / self.n, 2),
        }

    def close(self) -> None:
        try:
            self.rc.close()
        finally:
            self.cluster.stop_cluster_sync()


def _uss(p) -> int:
    return p.memory_full_info().uss


def _cpu(p) -> float:
    return sum(p.cpu_times()[:2])


def _available_mb() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def _engines(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    avail = _available_mb()
    if avail is not None and n * ENGINE_MB > avail:
        raise argparse.ArgumentTypeError(
            f"{n} engines need about {n * ENGINE_MB:,} MiB ({ENGINE_MB} MiB each) and this "
            f"machine has {avail:,} MiB available: at most {avail // ENGINE_MB}"
        )
    return n


def _unshadow() -> None:
    """Drop this script's folder from the path: benchmarks/pdb.py would shadow the standard
    library's pdb, which IPython imports."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


def _emit(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _start(out, n: int) -> Peer | None:
    """The peer, or None after writing the error JSON (a missing module named as such)."""
    try:
        import ipyparallel  # noqa: F401
        import psutil  # noqa: F401
    except ImportError as e:
        _emit(
            out,
            {
                "error": f"ipyparallel is not importable here: {e} (python "
                f"{sys.executable}; run scripts/peer_ipyparallel_venv.sh)"
            },
        )
        return None
    try:
        return Peer(n)
    except Exception as e:
        traceback.print_exc()
        _emit(
            out, {"error": f"ipyparallel's cluster of {n} did not start: {type(e).__name__}: {e}"}
        )
        return None


def _serve(peer: Peer, out) -> None:
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            return
        try:
            calls = int(words[1]) if len(words) == 2 and words[1].isdigit() else 0
            if words[0] not in VIEWS or calls < 1:
                raise ValueError(
                    f"unknown command {line.strip()!r}: broadcast K | coalesced K | direct K "
                    f"| quit (K: a whole number of calls, at least 1)"
                )
            _emit(out, peer.measure(words[0], calls))
        except Exception as e:
            traceback.print_exc()
            _emit(out, {"error": f"{words[0]}: {type(e).__name__}: {e}"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=_engines, default=32, metavar="N", help="engine processes")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer calls")
    mode.add_argument("--serve", action="store_true", help="measure on commands from stdin")
    args = p.parse_args(argv)
    _unshadow()

    out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    ipython_dir = tempfile.mkdtemp(prefix="mnb-ipp-")
    os.environ["IPYTHONDIR"] = ipython_dir  # the engines inherit it
    peer = None
    try:
        peer = _start(out, args.engines)
        if peer is None:
            return 0
        if args.serve:
            _emit(out, {"ready": True, **peer.info})
            _serve(peer, out)
            return 0
        k = CALLS["quick" if args.quick else "full"]
        result = {view: peer.measure(view, k) for view in VIEWS}
        result.update(peer.info, calls=k)
        _emit(out, result)
    except Exception as e:
        traceback.print_exc()
        _emit(out, {"error": f"{type(e).__name__}: {e}"})
    finally:
        if peer is not None:
            peer.close()
        shutil.rmtree(ipython_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
