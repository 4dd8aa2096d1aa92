"""Core runtime costs on a one-worker local mesh, each against raw pyzmq.

* ``rtt``      a no-op remote call and a fetch of its result, one at a time (and, as
  ``cold_*`` fields, one after the processes sat idle, as every notebook action starts)
* ``dispatch`` many no-op calls pipelined, then ``mesh.wait()``
* ``dispatch_notebook`` its twin with what a notebook sends: a function defined in
  ``__main__`` (pickled by value) that reads ``torch`` and a global
* ``fetch``    a 100 MB float32 tensor brought back from the worker

Ours and the baseline run alternately (after a warm-up) in the same process,
against a mesh and a raw peer that are both up for the whole benchmark; the
reported numbers are medians over the repetitions.
"""

from __future__ import annotations

import contextlib
import statistics
import time

from ._report import Entry, interleaved
from .raw import RawPeer


def noop():
    """The remote no-op: module-level and importable, so it goes by reference."""
    return None


@contextlib.contextmanager
def _mesh_and_peer():
    import monarch_nb as mnb

    mesh = mnb.local_mesh(dp=1)
    try:
        with RawPeer() as peer:
            yield mnb, mesh, peer
    finally:
        mesh.shutdown()


def bench_rtt(quick: bool) -> list[Entry]:
    n, reps = (200, 11) if quick else (500, 21)
    with _mesh_and_peer() as (mnb, mesh, peer):
        f = mnb.remote(noop)

        def ours() -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                f(mesh=mesh).fetch(rank=0)
            return (time.perf_counter() - t0) / n

        ours_s, base_s, _, _ = interleaved(ours, lambda: peer.rtt(n), reps)
        cold = max(10, n // 10)
        cold_s, cold_base_s, _, _ = interleaved(
            lambda: _after_idle(lambda: f(mesh=mesh).fetch(rank=0), cold),
            lambda: _after_idle(lambda: peer.rtt(1), cold),
            3,
        )
    return [
        Entry(
            "rtt",
            ours_s * 1e3,
            base_s * 1e3,
            "ms",
            "<= 1.5",
            "raw pyzmq ROUTER/DEALER pickle ping-pong (one small tuple each way, over tcp 127.0.0.1)",
            note=(
                f"mnb.remote(noop)(mesh=mesh).fetch(rank=0) on local_mesh(dp=1): CallFunction + "
                f"SendValue out, FetchResult back (the dropped Ref adds a DeleteRefs to the next "
                f"batch); median over {reps} reps of the mean of {n} round trips; cold_*: "
                f"one round trip after {COLD_GAP * 1e3:g} ms idle, median of {cold}, 3 reps"
            ),
            extra={
                "cold_ms": round(cold_s * 1e3, 4),
                "cold_baseline_ms": round(cold_base_s * 1e3, 4),
                "cold_ratio": round(cold_s / cold_base_s, 3),
            },
        )
    ]


COLD_GAP = 0.01  # s of idleness before a cold round trip: a person's pause is longer still


def _after_idle(round_trip, n: int) -> float:
    """Median seconds of ``round_trip()``, each after COLD_GAP s idle: the threads and
    processes it wakes have gone to sleep, as before any notebook action (the hot
    loop of the row keeps them all awake)."""
    times = []
    for _ in range(n):
        time.sleep(COLD_GAP)
        t0 = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


NOTEBOOK_CELL = """
import torch
SCALE = 2.0

def scaled(x=None):
    return None if x is None else torch.as_tensor(x) * SCALE
"""


def notebook_function():
    """``scaled`` as a notebook cell defines it: in ``__main__``, so pickled by value."""
    ns = {"__name__": "__main__"}
    exec(compile(NOTEBOOK_CELL, "<notebook cell>", "exec"), ns)
    return ns["scaled"]


def bench_dispatch(quick: bool) -> list[Entry]:
    return _dispatch(quick, "dispatch", noop, "mnb.remote(noop)(mesh=mesh), noop importable,")


def bench_dispatch_notebook(quick: bool) -> list[Entry]:
    return _dispatch(
        quick,
        "dispatch_notebook",
        notebook_function(),
        "mnb.remote(scaled)(mesh=mesh), scaled defined in __main__ as in a notebook (by "
        "value; it reads torch and a global),",
    )


def _dispatch(quick: bool, name: str, fn, what: str) -> list[Entry]:
    n, reps = (2_000, 7) if quick else (10_000, 9)
    submit: list[float] = []
    with _mesh_and_peer() as (mnb, mesh, peer):
        f = mnb.remote(fn)
        mesh.wait()

        def ours() -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                f(mesh=mesh)  # the Ref is dropped at once: a DeleteRefs follows, batched
            t1 = time.perf_counter()
            mesh.wait()
            t2 = time.perf_counter()
            submit.append(n / (t1 - t0))
            return n / (t2 - t0)

        ours_r, base_r, _, _ = interleaved(ours, lambda: n / peer.pipelined(n), reps)
    recorded = sorted(submit[-reps:])  # the recorded reps, not the warm-up
    return [
        Entry(
            name,
            ours_r,
            base_r,
            "calls/s",
            ">= 0.7",
            f"{n} pickled tuples pipelined over raw pyzmq ROUTER->DEALER; the peer unpickles "
            f"each and acknowledges only the last",
            note=(
                f"{n} x {what} with the Refs dropped (so DeleteRefs are sent too), then "
                f"mesh.wait(), on local_mesh(dp=1); median over {reps} reps"
            ),
            extra={"ours_submit_only": round(recorded[len(recorded) // 2])},
        )
    ]


def bench_fetch(quick: bool) -> list[Entry]:
    numel = 25 * 2**20  # float32: 100 MiB
    nbytes = numel * 4
    reps = 3 if quick else 9
    with _mesh_and_peer() as (mnb, mesh, peer):
        import torch

        ref = mnb.remote(torch.ones)(numel, mesh=mesh)
        mesh.wait()

        def ours() -> float:
            t0 = time.perf_counter()
            x = ref.fetch(rank=0)
            elapsed = time.perf_counter() - t0
            assert x.numel() == numel and x.dtype == torch.float32
            del x
            return nbytes / elapsed / 1e9

        ours_bw, base_bw, _, _ = interleaved(ours, lambda: nbytes / peer.fetch(nbytes) / 1e9, reps)
        ref.delete()
    return [
        Entry(
            "fetch",
            ours_bw,
            base_bw,
            "GB/s",
            ">= 0.8",
            "raw pyzmq zero-copy transfer of 100 MiB (peer sends copy=False, we recv copy=False)",
            note=(
                f"ref.fetch(rank=0) of mnb.remote(torch.ones)({numel}) (float32, {nbytes} bytes) "
                f"on local_mesh(dp=1); GB = 1e9 bytes; median over {reps} reps"
            ),
        )
    ]


BENCHMARKS = [
    ("rtt", bench_rtt),
    ("dispatch", bench_dispatch),
    ("dispatch_notebook", bench_dispatch_notebook),
    ("fetch", bench_fetch),
]
