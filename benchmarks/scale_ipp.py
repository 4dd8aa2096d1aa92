"""``broadcast_vs_ipyparallel``: a broadcast no-op + wait on N simulated light ranks against
ipyparallel's broadcast view on N engines, alternated in one run.

ipyparallel runs in its side venv (``scripts/peer_ipyparallel_venv.sh``;
``$MNB_IPP_VENV``, default ``~/.cache/monarch_nb/peer-ipyparallel``) as
``benchmarks/peer_ipyparallel.py --serve --engines N``, a subprocess that measures on command.
Ours is ``local_mesh(host=N // 32 or 1, gpu=min(N, 32), simulate=True)``: the same N, light
ranks in simulated host processes. N is 32 (``--quick``) or 64 (``$MNB_IPP_ENGINES``
sets it): an ipyparallel engine is a full IPython kernel process (~37 MiB, ~0.35 s of CPU to
start, measured each run), so 1,024 of them would not fit this machine's memory; the row's
note gives the numbers.

Without the side venv the row is skipped (not a miss); a peer that fails or stops answering
(bounded waits) fails the benchmark with the tail of its stderr.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import psutil

from ._peer import ServePeer
from ._report import Entry, Skipped, interleaved
from .core import noop

PEER_SCRIPT = Path(__file__).with_name("peer_ipyparallel.py")
ROW = "broadcast_vs_ipyparallel"
NOT_INSTALLED = "peer not installed: run scripts/peer_ipyparallel_venv.sh"
START_TIMEOUT = 600.0  # the peer's cluster start; seconds
COMMAND_TIMEOUT = 300.0  # one measurement of the peer
FULL = 1024  # the world of broadcast_1024


def engines(quick: bool) -> int:
    """N: ``$MNB_IPP_ENGINES`` (1 to 32, or a multiple of 32: whole simulated hosts),
    else 32 with ``--quick`` and 64 without."""
    text = os.environ.get("MNB_IPP_ENGINES", "").strip()
    if not text:
        return 32 if quick else 64
    n = int(text) if text.isdigit() else 0
    if n < 1 or (n > 32 and n % 32):
        raise ValueError(
            f"MNB_IPP_ENGINES={text!r}: expected a whole number from 1 to 32 or a "
            f"multiple of 32 (the simulated mesh's hosts hold 32 ranks each)"
        )
    return n


def peer_python() -> Path:
    """The side venv's python (it may not exist)."""
    venv = os.environ.get("MNB_IPP_VENV") or "~/.cache/monarch_nb/peer-ipyparallel"
    return Path(venv).expanduser() / "bin" / "python"


class IpyparallelPeer(ServePeer):
    """``peer_ipyparallel.py --serve`` in the side venv: one JSON line per command,
    bounded waits; closing kills its controller and engines too (each runs in a
    session of its own, so a process group would miss them)."""

    def __init__(self, python: Path, engines: int) -> None:
        cmd = [python, PEER_SCRIPT, "--serve", "--engines", engines]
        super().__init__("ipyparallel peer", cmd, START_TIMEOUT, COMMAND_TIMEOUT, 120.0)

    def measure(self, view: str, k: int) -> dict:
        return self.ask(f"{view} {k}")


def _ours(mesh, f, n: int, k: int) -> dict:
    """Median ms of ``f(mesh=mesh)`` + ``mesh.wait()`` over ``k``, this process's CPU per rank."""
    wall, cpu = [], []
    for _ in range(k):
        c0, t0 = time.process_time(), time.perf_counter()
        f(mesh=mesh)
        mesh.wait()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "ms": statistics.median(wall) * 1e3,
        "cpu_us_per_rank": statistics.median(cpu) * 1e6 / n,
    }


def _why_not_1024(info: dict) -> str:
    kb, cpu = info["engine_uss_kb"], info["start_cpu_s_per_engine"]
    total, cores = psutil.virtual_memory().total, psutil.cpu_count()
    return (
        f"{FULL:,} engines cannot run here: one engine measured {kb / 1024:.0f} MiB (USS) and "
        f"{cpu:.2f} s of CPU to start ({info['start_s_per_engine']:.2f} s of wall time per "
        f"engine for {info['engines']}), so {FULL:,} would need ~{kb * FULL / 2**20:.0f} GiB "
        f"of this machine's {total / 2**30:.0f} GiB and ~{cpu * FULL / cores:.0f} s of its "
        f"{cores} cores just to start"
    )


def bench_broadcast_vs_ipyparallel(quick: bool) -> list:
    python = peer_python()
    if not python.exists():
        return [Skipped(ROW, f"{NOT_INSTALLED} (no {python})")]
    import monarch_nb as mnb

    n = engines(quick)
    reps, k = (3, 5) if quick else (7, 10)
    peer = IpyparallelPeer(python, n)  # first: a peer that cannot start costs no mesh
    mesh = None
    try:
        mesh = mnb.local_mesh(
            host=max(1, n // 32), gpu=min(n, 32), simulate=True, name="bench-vs-ipp"
        )
        f = mnb.remote(noop)
        for _ in range(5):
            f(mesh=mesh)
            mesh.wait()
        got: dict = {"ours": [], "broadcast": [], "coalesced": [], "direct": []}

        def ours() -> float:
            got["ours"].append(_ours(mesh, f, n, k))
            return got["ours"][-1]["ms"]

        def theirs() -> float:
            for view in ("coalesced", "direct", "broadcast"):
                got[view].append(peer.measure(view, k))
            return got["broadcast"][-1]["ms"]

        ours_ms, ipp_ms, _, _ = interleaved(ours, theirs, reps)
    finally:
        if mesh is not None:
            mesh.shutdown()
        peer.close()

    def med(side: str, key: str) -> float:
        return round(statistics.median(d[key] for d in got[side][-reps:]), 2)

    info = peer.info
    where = f"local_mesh(host={max(1, n // 32)}, gpu={min(n, 32)}, simulate=True): {n} light ranks"
    return [
        Entry(
            ROW,
            ours_ms,
            ipp_ms,
            "ms",
            "<= 1.0",
            f"ipyparallel {info['ipyparallel']}: rc.broadcast_view().apply_sync(noop) on a "
            f"local ipp.Cluster(n={n}) (engine processes, no nannies) in the side venv",
            note=(
                f"remote(noop)(mesh) + mesh.wait() on {where}; median of {reps} rounds of "
                f"{k} calls each, alternating with ipyparallel's (both up at once); "
                f"ipyparallel's cluster took {info['start_s']:.1f} s to start; "
                + _why_not_1024(info)
            ),
            extra={
                "n": n,
                "ours_cpu_us_per_rank": med("ours", "cpu_us_per_rank"),
                "ipyparallel_client_cpu_us_per_engine": med("broadcast", "cpu_us_per_engine"),
                "ipyparallel_controller_cpu_us_per_engine": med(
                    "broadcast", "controller_cpu_us_per_engine"
                ),
                "ipyparallel_coalesced_ms": med("coalesced", "ms"),
                "ipyparallel_direct_ms": med("direct", "ms"),
                "ipyparallel_start_s": info["start_s"],
                "ipyparallel_engine_uss_kb": info["engine_uss_kb"],
                "ipyparallel_start_cpu_s_per_engine": info["start_cpu_s_per_engine"],
            },
        )
    ]


BENCHMARKS = [(ROW, bench_broadcast_vs_ipyparallel)]
