"""The tensor engine's dispatch rate on local_mesh(dp=2), against raw pyzmq.

* ``tensor_op_rate``  ``x = x + 1`` on a mesh tensor under ``mesh.activate()``,
  pipelined (one RunOps entry per op to both ranks, layouts from the cache),
  then ``mesh.wait()``; the baseline is pickled tuples pipelined over raw pyzmq
  to one peer, in the same run. ``ours_dispatch_us`` is the controller's cost
  per op (the wall time of submitting, median); ``ours_cpu_us`` the controller
  process's CPU time per op over the same stretch (its IO thread's included).
* ``tensor_step``  a small MLP's training step written in plain torch under the
  mesh (each op one command), against the same steps run in worker-local torch
  by one remote call (a ``%%monarch`` cell's way), in the same run.
* ``tensor_step_compiled``  that step under ``mnb.compile`` (one message a step)
  against the op-by-op step, dispatched steps/s, in the same run.
"""

from __future__ import annotations

import copy
import statistics
import time

from ._report import Entry, interleaved
from .raw import RawPeer
from .tensor_real import commands_per_call


def bench_tensor_op_rate(quick: bool) -> list[Entry]:
    import torch

    import monarch_nb as mnb

    n, reps = (2_000, 7) if quick else (10_000, 9)
    submit: list[float] = []
    cpu: list[float] = []
    mesh = mnb.local_mesh(dp=2, name="bench-tensor")
    try:
        with RawPeer() as peer, mesh.activate():
            x = torch.ones(16)
            x = x + 1  # fill the layout cache
            mesh.wait()

            def ours() -> float:
                nonlocal x
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(n):
                    x = x + 1
                t1, c1 = time.perf_counter(), time.process_time()
                mesh.wait()
                t2 = time.perf_counter()
                submit.append((t1 - t0) / n * 1e6)
                cpu.append((c1 - c0) / n * 1e6)
                return n / (t2 - t0)

            ours_r, base_r, _, _ = interleaved(ours, lambda: n / peer.pipelined(n), reps)
            assert mnb.inspect(x).shape == (16,)
    finally:
        mesh.shutdown()
    per_op = statistics.median(submit[-reps:])
    cpu_op = statistics.median(cpu[-reps:])
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
                f"local_mesh(dp=2) (each op one RunOps entry to both ranks, its layout from "
                f"the FakeTensor cache), then mesh.wait(); median over {reps} reps; issue 16 "
                f"asks >= 20,000 ops/s (the target: 20,000 over the ~157,000 raw messages/s measured here) and <= 25 us of controller time per op on a quiet machine"
            ),
            extra={"ours_dispatch_us": round(per_op, 1), "ours_cpu_us": round(cpu_op, 1)},
        )
    ]


def _mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _train_steps(model, opt, x, y, n: int):
    import torch

    for _ in range(n):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return loss


def worker_steps(state, n: int):
    """Remote: ``n`` steps of the same MLP in worker-local torch (a %%monarch cell's way)."""
    import torch

    if state is None:
        torch.manual_seed(0)
        model = _mlp()
        state = (model, torch.optim.SGD(model.parameters(), lr=0.01))
        state += (torch.randn(64, 16), torch.randn(64, 1))
    _train_steps(*state, n)
    return state


def bench_tensor_step(quick: bool) -> list[Entry]:
    import torch

    import monarch_nb as mnb

    n, reps = (50, 5) if quick else (200, 9)
    dispatched: list[float] = []
    mesh = mnb.local_mesh(dp=2, name="bench-tensor-step")
    try:
        with mesh.activate():
            model = _mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            x, y = torch.randn(64, 16), torch.randn(64, 1)
        _train_steps(model, opt, x, y, 2)
        state = mnb.remote(worker_steps)(None, 2, mesh=mesh)
        mesh.wait()
        ops = commands_per_call(mesh, lambda: _train_steps(model, opt, x, y, 1))

        def ours() -> float:
            t0 = time.perf_counter()
            _train_steps(model, opt, x, y, n)
            t1 = time.perf_counter()
            mesh.wait()
            dispatched.append(n / (t1 - t0))
            return n / (time.perf_counter() - t0)

        def local() -> float:
            t0 = time.perf_counter()
            mnb.remote(worker_steps)(state, n, mesh=mesh)
            mesh.wait()
            return n / (time.perf_counter() - t0)

        ours_r, base_r, _, _ = interleaved(ours, local, reps)

        twin = copy.deepcopy(model)
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
        # pure=True: this step's Python has no effect beyond its commands (no scheduler),
        # so a settled call replays without running it; by default it runs (checked)
        step = mnb.compile(lambda: _train_steps(twin, twin_opt, x, y, 1), pure=True)
        checked = mnb.compile(lambda: _train_steps(twin, twin_opt, x, y, 1))
        compiled_dispatched: list[float] = []
        checked_dispatched: list[float] = []

        def rate(fn, into: list) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            mesh.wait()
            into.append(n / (t1 - t0))
            return n / (time.perf_counter() - t0)

        for _ in range(3):  # recorded twice (a step has state), then replayed
            step()
            checked()
        comp_r, op_r, _, _ = interleaved(lambda: rate(step, compiled_dispatched), ours, reps)
        checked_r, _, _, _ = interleaved(lambda: rate(checked, checked_dispatched), ours, reps)
        comp_dispatched = statistics.median(compiled_dispatched[-reps:])
        checked_ratio = statistics.median(checked_dispatched[-reps:]) / statistics.median(
            dispatched[-2 * reps :]
        )
        op_dispatched = statistics.median(dispatched[-reps:])
    finally:
        mesh.shutdown()
    compiled_row = Entry(
        "tensor_step_compiled",
        comp_dispatched,
        op_dispatched,
        "steps/s",
        ">= 10",
        "the same step op by op (each op one command), dispatched steps/s in the same run",
        note=(
            f"the tensor_step training step wrapped in mnb.compile(pure=True) (recorded twice, "
            f"then one CallRecording per step, its Python not run), {n} steps dispatched; "
            f"ratio: dispatched steps/s compiled / op by op (the controller's cost; issue 16 "
            f"asks >= 10x); end to end (with mesh.wait()) in extra, bounded by the workers "
            f"running the same ops; checked_*: the default mnb.compile, whose every call of a "
            f"step with state runs its Python (with its sends held back)"
        ),
        extra={
            "checked_ratio": round(checked_ratio, 3),
            "checked_end_to_end_steps_per_s": round(checked_r),
            "ours_end_to_end_steps_per_s": round(comp_r),
            "op_by_op_end_to_end_steps_per_s": round(op_r),
            "worker_local_steps_per_s": round(base_r),
        },
    )
    return [
        compiled_row,
        Entry(
            "tensor_step",
            ours_r,
            base_r,
            "steps/s",
            ">= 0.1",
            f"the same {n} steps in worker-local torch, one mnb.remote call running them all "
            f"on each rank (what a %%monarch cell does)",
            note=(
                f"{n} training steps (Linear 16->32, ReLU, Linear 32->1, MSE, backward, SGD; "
                f"{ops} commands a step) of an nn.Module built under mesh.activate() on "
                f"local_mesh(dp=2), each op one command, then mesh.wait(); median over {reps} "
                f"reps; the target: op by op at least a tenth of the speed of no dispatch at all "
                f"for this tiny model; issue 16 asks >= 500 steps/s dispatched"
            ),
            extra={
                "ours_dispatched_steps_per_s": round(op_dispatched),
                "commands_per_step": ops,
            },
        ),
    ]


BENCHMARKS = [("tensor_op_rate", bench_tensor_op_rate), ("tensor_step", bench_tensor_step)]
# tensor_step also reports tensor_step_compiled
