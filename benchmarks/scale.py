"""The controller at 1,024 ranks: simulated light ranks, 32 hosts x 32, each host
its own process (``local_mesh(host=32, gpu=32, simulate=True)``) with one signed
ZeroMQ connection to the controller: a command goes once per host, the ranks'
replies come back folded per host (docs/hosts.md, "Fan-out").

* ``broadcast_1024``: ``mnb.remote(noop)(mesh=mesh)`` + ``mesh.wait()``, ms per
  broadcast; ``broadcast_1024_cpu``: the controller process's CPU for it per rank
  (µs). Baseline: raw pyzmq in the same run (``raw_fanout.py``: a ROUTER sends
  one small signed message per peer to 1,024 DEALERs in 32 processes and
  collects one signed reply each), alternated with ours. ipyparallel's
  broadcast view is the row ``broadcast_vs_ipyparallel`` (``scale_ipp.py``,
  registered here): at the N engines this machine can hold, where its side
  venv is installed.
  ``raw_per_host_ms`` / ``raw_per_host_cpu_us_per_rank`` ride along: the same raw
  fan-out to 32 peers, one per host, the floor of the fan-out's design.
* ``status_1024``: ``mesh.status()`` at 1,024 ranks (ms).
* ``memory_per_rank_1024``: what the controller process grew by per rank (USS,
  KB), the raw ROUTER's growth per peer as baseline; the light rank's own cost
  per rank on its simulated host rides along.

The targets are the issue's bounds on ours itself.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import psutil

from ._report import Entry
from .core import noop
from .raw_fanout import RawFanout
from .scale_ipp import BENCHMARKS as IPP_BENCHMARKS
from .scale_ipp import NOT_INSTALLED, ROW, peer_python

HOSTS, PER_HOST = 32, 32
WORLD = HOSTS * PER_HOST


class BoundEntry(Entry):
    """An entry whose target bounds ours itself, in its unit: ``"<= 20 ms"``."""

    def __post_init__(self) -> None:
        parts = self.target.split()
        if len(parts) != 3 or parts[0] != "<=" or parts[2] != self.unit:
            raise ValueError(f"bad bound target {self.target!r}: expected '<= N {self.unit}'")

    @property
    def ratio(self) -> float | None:
        return self.ours / self.baseline if self.baseline else None

    @property
    def ok(self) -> bool:
        return self.ours == self.ours and self.ours <= float(self.target.split()[1])


def _uss(pid: int | None = None) -> int:
    return psutil.Process(pid).memory_full_info().uss


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _timed(fn) -> tuple[float, float]:
    """(wall s, this process's CPU s) of ``fn()``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def measure_memory(kind: str) -> None:
    """In a fresh process (``_memory_in_child``): print what this process grows by
    (USS, KB) per rank for a 1,024-rank simulated mesh after 5 broadcasts
    (``ours``), or per peer for the raw ROUTER's 1,024 connections (``raw``)."""
    import monarch_nb as mnb

    warm = mnb.local_mesh(host=1, gpu=2, simulate=True, name="warm")  # one-time costs
    mnb.remote(noop)(mesh=warm)
    warm.wait()
    warm.shutdown()
    gc.collect()
    before = _uss()
    if kind == "ours":
        mesh = mnb.local_mesh(host=HOSTS, gpu=PER_HOST, simulate=True, name="bench-memory")
        for _ in range(5):
            mnb.remote(noop)(mesh=mesh)
            mesh.wait()
        gc.collect()
        grown = _uss() - before
        mesh.shutdown()
    else:
        with RawFanout(WORLD, PER_HOST) as raw:
            for _ in range(5):
                raw.broadcast()
            gc.collect()
            grown = _uss() - before
    print(grown / 1024 / WORLD)


def _memory_in_child(kind: str) -> float:
    code = f"from benchmarks.scale import measure_memory; measure_memory({kind!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(f"the memory measurement ({kind}) failed: {out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def _cpu(pids: list[int]) -> float:
    """The CPU seconds these processes have used."""
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def _ipyparallel_note() -> str:
    if not peer_python().exists():
        return f"not run: {NOT_INSTALLED}"
    return f"runs at fewer engines than {WORLD:,}: see the {ROW} row"


def _host_pids(mesh) -> list[int]:
    """The simulated hosts' processes (each serves its light ranks: their pid)."""
    ranks = mesh.status()["ranks"]
    return sorted({ranks[r]["pid"] for r in mesh.ranks})


def bench_scale(quick: bool) -> list[Entry]:
    import monarch_nb as mnb

    reps = 7 if quick else 21
    one = mnb.local_mesh(host=1, gpu=1, simulate=True, name="bench-scale-1")
    try:
        base_host = _uss(_host_pids(one)[0])
    finally:
        one.shutdown()
    ours_kb, raw_kb = _memory_in_child("ours"), _memory_in_child("raw")
    mesh = mnb.local_mesh(host=HOSTS, gpu=PER_HOST, simulate=True, name="bench-scale")
    try:
        f = mnb.remote(noop)

        def ours() -> None:
            f(mesh=mesh)
            mesh.wait()

        for _ in range(5):
            ours()
        hosts = _host_pids(mesh)
        light_kb = (_median([_uss(p) for p in hosts]) - base_host) / 1024 / (PER_HOST - 1)
        with RawFanout(WORLD, PER_HOST) as raw:
            for _ in range(4):
                raw.broadcast()
            o_t, o_c, r_t, r_c, h_c = [], [], [], [], []
            for _ in range(reps):  # alternated: both feel the same machine
                h0 = _cpu(hosts)
                t, c = _timed(ours)
                h_c.append(_cpu(hosts) - h0)
                o_t.append(t)
                o_c.append(c)
                t, c = _timed(raw.broadcast)
                r_t.append(t)
                r_c.append(c)
        with RawFanout(HOSTS, PER_HOST) as per_host:  # the fan-out's floor: a message per host
            for _ in range(3):
                per_host.broadcast()
            h_t = [_timed(per_host.broadcast) for _ in range(reps)]
        status = []
        for _ in range(reps):
            t0 = time.perf_counter()
            snap = mesh.status()
            status.append(time.perf_counter() - t0)
        assert len(snap["ranks"]) == WORLD
    finally:
        mesh.shutdown()
    where = f"local_mesh(host={HOSTS}, gpu={PER_HOST}, simulate=True): {WORLD} light ranks"
    raw_is = (
        f"raw pyzmq: one ROUTER, one HMAC-signed message to each of {WORLD} DEALERs "
        f"({HOSTS} processes x {PER_HOST}) and one signed reply from each"
    )
    ipp = _ipyparallel_note()
    per_rank = 1e6 / WORLD
    return [
        BoundEntry(
            "broadcast_1024",
            _median(o_t) * 1e3,
            _median(r_t) * 1e3,
            "ms",
            "<= 20 ms",
            raw_is,
            note=f"remote(noop)(mesh) + mesh.wait() on {where}; median of {reps}, alternated "
            f"with the baseline; ipyparallel: {ipp}",
            extra={
                "ipyparallel": ipp,
                "raw_per_host_ms": round(_median([t for t, _ in h_t]) * 1e3, 3),
                "raw_per_host_cpu_us_per_rank": round(_median([c for _, c in h_t]) * per_rank, 2),
            },
        ),
        BoundEntry(
            "broadcast_1024_cpu",
            _median(o_c) * per_rank,
            _median(r_c) * per_rank,
            "us",
            "<= 5 us",
            raw_is + " (that process's CPU per peer)",
            note=f"the controller process's CPU (every thread) per rank for one broadcast + "
            f"wait on {where}; median of {reps}; the simulated hosts' CPU per rank rides "
            f"along (they share this machine's cores with the controller)",
            extra={"simulated_hosts_cpu_us_per_rank": round(_median(h_c) * per_rank, 1)},
        ),
        BoundEntry(
            "status_1024",
            _median(status) * 1e3,
            0.0,
            "ms",
            "<= 5 ms",
            "none: a bound of the issue",
            note=f"mesh.status() on {where} (after the broadcasts); median of {reps}",
        ),
        BoundEntry(
            "memory_per_rank_1024",
            ours_kb,
            raw_kb,
            "KB",
            "<= 50 KB",
            "a fresh raw ROUTER process's growth per peer (USS) for its 1,024 connections",
            note=f"a fresh controller process's growth (USS) per rank for {where}, after 5 "
            f"broadcasts; a light rank costs its simulated host {light_kb:.0f} KB",
            extra={"light_rank_kb_on_its_host": round(light_kb, 1)},
        ),
    ]


BENCHMARKS = [("scale", bench_scale), *IPP_BENCHMARKS]
