"""``recording``: a step of 100 small remote ops replayed with ``mnb.compile(pure=True)`` vs
the same step sent op by op, on ``local_mesh(dp=2)``. The JSON also holds the
limit a replay approaches: the same 100 ops run by local torch in this process
(``local_eager``), each rank's own work per step."""

from __future__ import annotations

import time

from ._report import Entry, interleaved

OPS = 100


def add_one(t):
    """The small remote op: module-level, so it goes by reference."""
    return t + 1


def bench_recording(quick: bool) -> list[Entry]:
    import torch

    import monarch_nb as mnb

    # enough steps that the closing mesh.wait() (a round trip) is no part of the rate
    steps, reps = (100, 5) if quick else (150, 7)
    mesh = mnb.local_mesh(dp=2)
    try:
        f = mnb.remote(add_one)
        x = mnb.remote(torch.zeros)(4, mesh=mesh)

        def step(t):
            for _ in range(OPS):
                t = f(t)
            return t

        compiled = mnb.compile(step, pure=True)  # its Python only sends the ops
        checked = mnb.compile(step)  # the default: each call runs it, held, then one message
        compiled(x)
        checked(x)
        mesh.wait()

        def run(fn) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                out = fn(x)
            mesh.wait()
            elapsed = time.perf_counter() - t0
            # checked outside the timing: a fetch's round trip is no part of a step
            assert out.fetch(rank=0)[0].item() == OPS
            return steps / elapsed

        ours, base, _, _ = interleaved(lambda: run(compiled), lambda: run(step), reps)
        checked_r, base2, _, _ = interleaved(lambda: run(checked), lambda: run(step), reps)
        local = _local_eager(torch, steps, reps)
    finally:
        mesh.shutdown()
    return [
        Entry(
            "recording",
            ours,
            base,
            "steps/s",
            ">= 10",
            f"the same step of {OPS} remote ops (t = add_one(t)) sent op by op",
            note=f"mnb.compile(pure=True) replays the recorded step with one CallRecording per "
            f"call, its Python not run; {steps} steps then mesh.wait() (the result's check "
            f"after the timing), dp=2; median of {reps}; checked_*: the default mnb.compile, "
            f"whose every call runs the step's Python with its sends held back",
            extra={
                "local_eager": round(local, 1),
                "ours_vs_local_eager": round(ours / local, 3),
                "checked_steps_per_s": round(checked_r, 1),
                "checked_ratio": round(checked_r / base2, 3),
            },
        )
    ]


def _local_eager(torch, steps: int, reps: int) -> float:
    """Steps/s of the same step in plain torch here (one thread, as a rank has)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.zeros(4)
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(steps):
                t = x
                for _ in range(OPS):
                    t = add_one(t)
            rates.append(steps / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(threads)
    return sorted(rates)[len(rates) // 2]


BENCHMARKS = [("recording", bench_recording)]
