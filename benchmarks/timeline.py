"""The timeline's cost per command against the cost of dispatching one.

* ``timeline_cost`` what recording one command's start and end costs: on the
  worker, the stream's append and the receiver's report (``take_timings``,
  encoding and sealing the Timings record); on the controller, opening and decoding it and adding it to
  the ring; run on the very functions the mesh runs, over as many records as a
  tenth of a second of dispatch brings, less the time of this harness's own empty
  loop over as many (the stream's loop runs whether it records or not). Baseline: the time per command of the
  ``dispatch`` benchmark's pipelined no-op calls (then ``mesh.wait()``) on a
  local_mesh(dp=1), in the same run. An end-to-end A/B of the same small cost
  drowns in the noise of a shared 2-core machine.
"""

from __future__ import annotations

import time

from ._report import Entry, interleaved
from .core import noop


class _Stream:
    """What take_timings reads of a stream."""

    def __init__(self):
        from monarch_nb.worker.stream import TIMES_KEPT
        from monarch_nb.worker.timings import FinishedCommands

        self.id = 0
        self.times = FinishedCommands(TIMES_KEPT)
        self.record = self.times.record


def _recording_cost(n: int) -> float:
    """Seconds per command that the timeline adds, worker and controller together."""
    from monarch_nb.controller.timeline import Timeline
    from monarch_nb.protocol import Signer, decode, encode
    from monarch_nb.protocol.envelope import Sealer, unseal
    from monarch_nb.worker.timings import take_timings

    signer, stream, ring, clock = Signer(b"k" * 32), _Stream(), Timeline(), time.time
    sealer = Sealer(signer, 0)
    t0 = time.perf_counter()
    for _i in range(n):  # this harness's own loop, taken off below: the stream loops anyway
        pass
    harness = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):  # the stream (stream.py's lines): a clock reading, four appends
        ti, tw, ts, te = stream.record
        ti(i)
        tw("noop")
        ts(0.0)
        te(clock())
    frames = sealer.seal(encode(take_timings(0, [stream]), signer))  # the receiver's report
    msg = decode(unseal(frames, signer)[1][0], signer)  # the controller's IO thread
    ring.add(msg.rank, msg.streams)
    return (time.perf_counter() - t0 - harness) / n


def bench_timeline_cost(quick: bool) -> list[Entry]:
    import monarch_nb as mnb

    n, reps = (2_000, 5) if quick else (6_000, 9)
    mesh = mnb.local_mesh(dp=1)
    try:
        f = mnb.remote(noop)
        mesh.wait()

        def dispatch() -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                f(mesh=mesh)
            mesh.wait()
            return (time.perf_counter() - t0) / n * 1e6

        ours_us, base_us, _, _ = interleaved(lambda: _recording_cost(n) * 1e6, dispatch, reps)
    finally:
        mesh.shutdown()
    return [
        Entry(
            "timeline_cost",
            ours_us,
            base_us,
            "us/command",
            "<= 0.02",
            "one pipelined no-op call's time (the dispatch benchmark's work: mnb.remote(noop), "
            "then mesh.wait(), on local_mesh(dp=1))",
            note=(
                f"recording {n} commands: the stream's append, the receiver's take_timings, encode and "
                f"seal, the controller's unseal, decode and Timeline.add; median over {reps} reps"
            ),
        )
    ]


BENCHMARKS = [("timeline_cost", bench_timeline_cost)]
