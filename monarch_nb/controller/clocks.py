"""The offset of each worker's wall clock from the controller's, measured by a round
trip (ReadClock): the worker's reading against the middle of the round trip, off by
at most half of it. Of several readings the one of the shortest round trip stays."""

from __future__ import annotations

import time

from ..protocol import messages as m

READ_TIMEOUT = 10.0


def measure_offsets(ctrl, ranks, offsets: dict, rounds: int = 3) -> dict:
    """Update ``offsets`` (rank -> (worker clock - controller clock, round trip s)) with
    ``rounds`` readings of every rank in ``ranks``; returns it. A ReadClock also makes
    each worker send the commands it finished first, so a timeline read after it holds
    them. The lease holder's handling of the Timings is over once the replies are in."""
    for _ in range(rounds):
        t0 = time.time()
        readings = ctrl.request(
            m.ReadClock(ctrl.next_ident()), ranks, "read clock", timeout=READ_TIMEOUT
        ).result()
        t1 = time.time()
        middle, rtt = (t0 + t1) / 2, t1 - t0
        for rank, worker_time in zip(ranks, readings):
            old = offsets.get(rank)
            if old is None or rtt < old[1]:
                offsets[rank] = (worker_time - middle, rtt)
    return offsets
