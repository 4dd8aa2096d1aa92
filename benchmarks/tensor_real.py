"""The tensor engine on a real training step, against local eager torch.

``tensor_real_step``: the transformer LM step of ``benchmarks/lm.py`` (AdamW,
clip_grad_norm_, LambdaLR, 2 accumulated micro-batches, dropout) written in
plain torch under ``mesh.activate()`` on local_mesh(dp=2), op by op, against the
same step in local eager torch in this process on as many threads as each rank
has, in the same run, alternating. ``tensor_real_step_compiled``: the step under
``mnb.compile``, against the same local eager baseline; ``messages_per_step``
says whether it replays (1) or runs op by op (the step's command count).
The compiled row also gives the replay's own ratio on this machine
(``pure_replay_vs_local_eager``): ``lm.constant_step`` (SGD at a constant rate, no
scheduler: no Python value changes between calls) under ``mnb.compile(pure=True)``,
which replays without running the step's Python, against that step in local eager
torch. The gap between the two compiled ratios is the checked call's Python on the
controller. ``split_vs_local_eager``: the LM step itself with its gradients compiled
pure and AdamW and the scheduler stepping op by op (``lm.split_step``).
``tensor_no_mesh_step``: the same local step inside ``mesh.activate()`` +
``mnb.no_mesh()`` against outside any mesh block (issue 26: as fast).

Each row also says where a step's time goes: the controller's and a rank's CPU ms per
step, and the steps/s those allow here (the controller and the ranks share the cores)
and with a core each: on a machine with fewer cores than ranks + 1 the controller's
Python competes with the ranks for them.
"""

from __future__ import annotations

import os
import time

from ._report import Entry, interleaved


def _threads(world: int) -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // world))


def _cpu_per_step(mesh, fn, n: int) -> dict:
    """Where one step's time goes: CPU ms per step of this process (the controller, all
    its threads) and of each rank (mean), measured over ``n`` steps, and the most steps/s
    those costs allow on this machine's cores (all three busy at once) or with a core
    each (the slowest of them)."""
    import psutil

    ranks = [psutil.Process(mesh.status()["ranks"][r]["pid"]) for r in mesh.ranks]

    def cpu(p) -> float:
        t = p.cpu_times()
        return t.user + t.system

    mesh.wait()
    w0, c0 = [cpu(p) for p in ranks], time.process_time()
    for _ in range(n):
        fn()
    mesh.wait()
    c1, w1 = time.process_time(), [cpu(p) for p in ranks]
    ctrl = (c1 - c0) / n * 1e3
    rank = sum(b - a for a, b in zip(w0, w1)) / len(ranks) / n * 1e3
    cores = os.cpu_count() or 1
    return {
        "controller_cpu_ms_per_step": round(ctrl, 2),
        "rank_cpu_ms_per_step": round(rank, 2),
        "cores": cores,
        "steps_per_s_cpu_bound_here": round(
            1e3 * min(cores, 1 + len(ranks)) / (ctrl + rank * len(ranks)), 1
        ),
        "steps_per_s_core_each": round(1e3 / max(ctrl, rank), 1),
    }


def commands_per_call(mesh, fn) -> int:
    """The commands one call of ``fn`` runs on the mesh's first rank."""

    def done() -> int:
        mesh.wait()
        return mesh.status()["ranks"][mesh.ranks[0]]["streams"]["default"]["done"]

    before = done()
    fn()
    return done() - before


def _rate(fn, n: int, mesh=None) -> float:
    """Calls of ``fn`` per second over ``n`` calls (and, with ``mesh``, its wait)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if mesh is not None:
        mesh.wait()
    return n / (time.perf_counter() - t0)


def _vs_eager(mesh, fn, local_fn, n: int, reps: int) -> tuple[float, float]:
    """(calls/s of ``fn`` on ``mesh``, of ``local_fn``), interleaved, medians."""
    ours, base, _, _ = interleaved(lambda: _rate(fn, n, mesh), lambda: _rate(local_fn, n), reps)
    return ours, base


def bench_tensor_real_step(quick: bool) -> list[Entry]:
    import torch

    import monarch_nb as mnb

    from . import lm

    n, reps = (10, 3) if quick else (40, 7)
    saved = torch.get_num_threads()
    torch.set_num_threads(_threads(2))  # the ranks' count: the same kernels, the same work
    local = lm.make()
    mesh = mnb.local_mesh(dp=2, name="bench-tensor-real")
    try:
        with mesh.activate():
            state = lm.make()
            compiled_state = lm.make()
        step = mnb.compile(lambda: lm.step(*compiled_state))

        for _ in range(4):  # settle the layouts, and let compile record
            lm.step(*local)
            lm.step(*state)
            step()
        mesh.wait()
        op_commands = commands_per_call(mesh, lambda: lm.step(*state))
        compiled_messages = commands_per_call(mesh, step)
        op_cpu = _cpu_per_step(mesh, lambda: lm.step(*state), n)
        compiled_cpu = _cpu_per_step(mesh, step, n)
        ours, base = _vs_eager(mesh, lambda: lm.step(*state), lambda: lm.step(*local), n, reps)
        comp, base2 = _vs_eager(mesh, step, lambda: lm.step(*local), n, reps)
        pure = _pure_replay(mesh, max(n, 30), reps)
        split = _split(mesh, max(n, 30), reps)
        dynamo = _dynamo(mesh, max(n, 30), reps)
    finally:
        mesh.shutdown()
        torch.set_num_threads(saved)
    what = (
        "the same step in local eager torch in this process "
        f"({_threads(2)} thread(s), as each rank), steps/s in the same run"
    )
    model = (
        f"the transformer LM step of benchmarks/lm.py (2 blocks, causal SDPA, GELU MLP, dropout, "
        f"AdamW, clip_grad_norm_, LambdaLR, {lm.MICRO} accumulated micro-batches) on "
        f"local_mesh(dp=2), {n} steps then mesh.wait(), median of {reps}"
    )
    return [
        Entry(
            "tensor_real_step",
            ours,
            base,
            "steps/s",
            ">= 0.25",
            what,
            note=f"{model}, op by op (each aten op one command); issue 26 asks >= 0.25x local eager",
            extra={"commands_per_step": op_commands, **op_cpu},
        ),
        Entry(
            "tensor_real_step_compiled",
            comp,
            base2,
            "steps/s",
            ">= 0.8",
            what,
            note=f"{model}, under mnb.compile; issue 26 asks >= 0.8x local eager at 1 message a step",
            extra={"messages_per_step": compiled_messages, **compiled_cpu, **pure, **split},
        ),
        Entry(
            "tensor_real_step_dynamo",
            dynamo.pop("steps_per_s"),
            dynamo.pop("local_eager_steps_per_s"),
            "steps/s",
            ">= 0.8",
            "the same step in local eager torch in this process "
            f"({_threads(2)} thread(s), as each rank), steps/s in the same run",
            note=(
                f"{model}, its gradients (forward, backward, accumulation, clipping) "
                f"under torch.compile(backend=mnb.mesh_backend) with dynamo's "
                f"trace_autograd_ops, zero_grad, AdamW and the scheduler eager "
                f"(lm.compiled_step); issue 26 asks >= 0.8x local eager"
            ),
            extra=dynamo,
        ),
    ]


def _dynamo(mesh, n: int, reps: int) -> dict:
    """``lm.compiled_step`` (the gradients one graph of dynamo's on the ranks) against
    ``lm.step`` in local eager torch: steps/s, its commands a step, CPU per step; and
    ``inside_activate_*``: the same step called under ``mesh.activate()``."""
    import torch

    import monarch_nb as mnb

    from . import lm

    local = lm.make()
    with mesh.activate():
        model, opt, sched, data = lm.make()
    grads = torch.compile(lm.accumulate, backend=mnb.mesh_backend)

    def fn():
        return lm.compiled_step(grads, model, opt, sched, data)

    def inside():  # the loop a notebook writes: the step under mesh.activate()
        with mesh.activate():
            return fn()

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        out = _variant("", mesh, fn, lambda: lm.step(*local), n, reps)
        out.update(_cpu_per_step(mesh, fn, n))
        out.update(_variant("inside_activate", mesh, inside, lambda: lm.step(*local), n, reps))
    del out["vs_local_eager"]  # the row's ratio
    return out


def _pure_replay(mesh, n: int, reps: int) -> dict:
    """``lm.constant_step`` replayed by ``mnb.compile(pure=True)`` against the same
    step in local eager torch: what a replay that skips the Python reaches here."""
    import monarch_nb as mnb

    from . import lm

    local = lm.make_constant()
    with mesh.activate():
        state = lm.make_constant()
    step = mnb.compile(lambda: lm.constant_step(*state), pure=True)
    return _variant("pure_replay", mesh, step, lambda: lm.constant_step(*local), n, reps)


def _split(mesh, n: int, reps: int) -> dict:
    """The LM step split (``lm.split_step``): its gradients replayed by
    ``mnb.compile(pure=True)``, AdamW and the scheduler stepping op by op, against
    ``lm.step`` in local eager torch."""
    import monarch_nb as mnb

    from . import lm

    local = lm.make()
    with mesh.activate():
        model, opt, sched, data = lm.make()
    grads = mnb.compile(lambda: lm.grads_step(model, opt, data), pure=True)
    return _variant(
        "split", mesh, lambda: lm.split_step(grads, opt, sched), lambda: lm.step(*local), n, reps
    )


def _variant(name: str, mesh, fn, local_fn, n: int, reps: int) -> dict:
    """A variant of the step (``fn`` on ``mesh``) against its local eager twin, as
    ``{name}_...`` fields of the compiled row (unprefixed for a ``name`` of ""): its
    commands a step, steps/s, ratio."""
    for _ in range(4):  # settled: SGD's momentum buffers and AdamW's state exist after one
        local_fn()
        fn()
    ours, base = _vs_eager(mesh, fn, local_fn, n, reps)
    prefix = f"{name}_" if name else ""
    return {
        f"{prefix}commands_per_step": commands_per_call(mesh, fn),
        f"{prefix}steps_per_s": round(ours, 1),
        f"{prefix}local_eager_steps_per_s": round(base, 1),
        f"{prefix}vs_local_eager": round(ours / base, 3),
    }


def bench_tensor_soak(quick: bool) -> list[Entry]:
    import monarch_nb as mnb

    from . import lm
    from .soak import RSS_LIMIT, _settled

    steps = 900 if quick else 3_000
    mesh = mnb.local_mesh(dp=2, name="bench-tensor-soak")
    rows = []
    try:
        with mesh.activate():
            state = lm.make()
        compiled = mnb.compile(lambda: lm.step(*state))
        for label, fn in (("op by op", lambda: lm.step(*state)), ("compiled", compiled)):
            t0 = time.perf_counter()
            for i in range(steps):
                loss = fn()
                if i == steps // 2:
                    base, _ = _settled(mesh)
                if i % 50 == 0:
                    mnb.inspect(loss)  # a real loop looks at its loss now and then
            final, _ = _settled(mesh)
            rate = steps / (time.perf_counter() - t0)
            rows.append((label, base, final, rate))
    finally:
        mesh.shutdown()
    out = []
    for kind in ("controller", "worker"):
        ratios = []
        for label, base, final, rate in rows:
            pids = list(base)[:1] if kind == "controller" else list(base)[1:]
            for p in pids:
                ratios.append((final[p] / base[p], final[p], base[p], label, rate))
        ratio, final_b, base_b, label, rate = max(ratios)
        out.append(
            Entry(
                f"tensor_soak_rss_{kind}",
                final_b / 2**20,
                base_b / 2**20,
                "MiB",
                f"<= {RSS_LIMIT}",
                f"the {kind}'s RSS halfway through the run (the run and process that grew most)",
                note=(
                    f"{steps} transformer LM steps (benchmarks/lm.py) op by op, then {steps} "
                    f"compiled, on local_mesh(dp=2); worst: {label} ({rate:.0f} steps/s); "
                    f"issue 26 asks RSS within 5 %"
                ),
            )
        )
    return out


def bench_tensor_no_mesh_step(quick: bool) -> list[Entry]:
    import torch

    import monarch_nb as mnb

    from . import lm

    n, reps = (20, 5) if quick else (60, 9)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    local = lm.make()
    mesh = mnb.local_mesh(dp=1, name="bench-no-mesh")

    def steps() -> float:
        return _rate(lambda: lm.step(*local), n)

    def inside() -> float:
        with mesh.activate(), mnb.no_mesh():
            return steps()

    try:
        for _ in range(3):
            lm.step(*local)
        ours, base, _, _ = interleaved(inside, steps, reps)
    finally:
        mesh.shutdown()
        torch.set_num_threads(saved)
    return [
        Entry(
            "tensor_no_mesh_step",
            ours,
            base,
            "steps/s",
            ">= 0.95",
            "the same local step outside any mesh block, steps/s in the same run",
            note=f"the transformer LM step of benchmarks/lm.py in local torch (1 thread) inside "
            f"mesh.activate() + mnb.no_mesh(); {n} steps, median of {reps}",
        )
    ]


BENCHMARKS = [
    ("tensor_real_step", bench_tensor_real_step),  # and _compiled, _dynamo
    ("tensor_no_mesh_step", bench_tensor_no_mesh_step),
    ("tensor_soak", bench_tensor_soak),
]
