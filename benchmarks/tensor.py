"""The tensor engine's dispatch rate on local_mesh(dp=2), against raw pyzmq.

* ``tensor_op_rate``  ``x = x + 1`` on a mesh tensor under ``mesh.activate()``,
  pipelined (one CallFunction per op to both ranks, layouts from the cache),
  then ``mesh.wait()``; the baseline is pickled tuples pipelined over raw pyzmq
  to one peer, in the same run. ``ours_dispatch_us`` is the controller's cost
  per op (submission only, median).
"""

from __future__ import annotations

import statistics
import time

from ._report import Entry, interleaved
from .raw import RawPeer


def bench_tensor_op_rate(quick: bool) -> list[Entry]:
    import torch

    import monarch_nb as mnb

    n, reps = (2_000, 7) if quick else (10_000, 9)
    submit: list[float] = []
    mesh = mnb.local_mesh(dp=2, name="bench-tensor")
    try:
        with RawPeer() as peer, mesh.activate():
            x = torch.ones(16)
            x = x + 1  # fill the layout cache
            mesh.wait()

            def ours() -> float:
                nonlocal x
                t0 = time.perf_counter()
                for _ in range(n):
                    x = x + 1
                t1 = time.perf_counter()
                mesh.wait()
                t2 = time.perf_counter()
                submit.append((t1 - t0) / n * 1e6)
                return n / (t2 - t0)

            ours_r, base_r, _, _ = interleaved(ours, lambda: n / peer.pipelined(n), reps)
            assert mnb.inspect(x).shape == (16,)
    finally:
        mesh.shutdown()
    per_op = statistics.median(submit[-reps:])
    return [
        Entry(
            "tensor_op_rate",
            ours_r,
            base_r,
            "ops/s",
            ">= 0.13",
            f"{n} pickled tuples pipelined over raw pyzmq ROUTER->DEALER to one peer; the peer "
            f"unpickles each and acknowledges only the last",
            note=(
                f"{n} x 'x = x + 1' on a 16-float mesh tensor under mesh.activate() on "
                f"local_mesh(dp=2) (each op one CallFunction to both ranks, its layout from "
                f"the FakeTensor cache), then mesh.wait(); median over {reps} reps; issue 16 "
                f"asks >= 20,000 ops/s (the target: 20,000 over the ~157,000 raw messages/s measured here) and <= 25 us of controller time per op on a quiet machine"
            ),
            extra={"ours_dispatch_us": round(per_op, 1)},
        )
    ]


BENCHMARKS = [("tensor_op_rate", bench_tensor_op_rate)]
