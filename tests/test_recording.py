"""mnb.compile: commands recorded once, replayed per call with new inputs."""

import gc

import pytest
import torch
from worker_probes import env_sizes

import monarch_nb as mnb


def scaled(t, k):
    if float(t.sum()) < 0:
        raise ValueError("negative input")
    return t * k


def test_replay_with_new_inputs_collectives_and_streams(mesh):
    side = mesh.stream("rec-side")

    @mnb.compile
    def step(x, w, s):
        y = mnb.remote(torch.mul)(x, w)
        z = y.reduce("dp", "sum")
        other = mnb.remote(torch.neg)(s, stream=side)  # a second stream in the same recording
        return mnb.remote(torch.add)(z, 1), other

    x = mnb.remote(lambda: torch.ones(3) * (mnb.current_rank() + 1))(mesh=mesh)
    w = mnb.remote(torch.full)((3,), 2.0, mesh=mesh)
    s = mnb.remote(torch.ones)(2, mesh=mesh, stream=side)
    first, neg = step(x, w, s)
    assert first.fetch(rank=0).tolist() == [7.0] * 3 and neg.fetch(rank=1).tolist() == [-1.0, -1.0]
    mesh.wait()
    before = mesh.status()["ranks"][0]["streams"]["default"]["done"]
    again, neg2 = step(x, w, s)
    assert again.fetch(rank=1).tolist() == [7.0] * 3
    x10 = mnb.remote(lambda: torch.ones(3) * 10)(mesh=mesh)
    third, _ = step(x10, w, s)
    assert third.fetch(rank=0).tolist() == [41.0] * 3
    assert neg2.fetch(rank=0).tolist() == [-1.0, -1.0]
    mesh.wait()
    # a replay is one command per stream, however many commands it holds
    after = mesh.status()["ranks"][0]["streams"]["default"]
    assert after["done"] - before <= 2 + 4  # two replays + the helper commands above


def test_failure_inside_a_replay_is_reported_once_without_cascade(mesh):
    @mnb.compile
    def step(x):
        y = mnb.remote(scaled)(x, 3)
        return mnb.remote(torch.add)(y, 1)

    good = mnb.remote(torch.ones)(2, mesh=mesh)
    assert step(good).fetch(rank=0).tolist() == [4.0, 4.0]
    n_errors = len(mesh.status()["errors"])
    bad = mnb.remote(lambda: -torch.ones(2))(mesh=mesh)
    out = step(bad)
    with pytest.raises(mnb.RemoteError, match="negative input") as ei:
        out.fetch()
    assert set(ei.value.failures) == {0, 1}
    # the result is the replay's own value: its failure, not "depends on command ..."
    assert str(ei.value).startswith("compiled step failed on ranks 0-1"), str(ei.value)
    mesh.wait()
    errors = mesh.status()["errors"]
    assert len(errors) == n_errors + 1 and errors[0]["ranks"] == [0, 1]
    assert step(good).fetch(rank=1).tolist() == [4.0, 4.0]  # the recording still works


def test_plain_arguments_are_guards_and_a_fetch_runs_op_by_op(mesh):
    calls = []

    @mnb.compile
    def mul(x, k):
        calls.append(k)
        return mnb.remote(torch.mul)(x, k)

    @mnb.compile(pure=True)
    def pure_mul(x, k):
        calls.append(-k)
        return mnb.remote(torch.mul)(x, k)

    x = mnb.remote(torch.ones)(2, mesh=mesh)
    for f in (mul, pure_mul):
        assert f(x, 2).fetch(rank=0).tolist() == [2.0, 2.0]
        assert f(x, 2).fetch(rank=0).tolist() == [2.0, 2.0]
        assert f(x, 5).fetch(rank=0).tolist() == [5.0, 5.0]  # a new constant records again
    # each call runs the Python (the second one held, then sent as one replay); a pure
    # function's replay does not
    assert calls == [2, 2, 5, -2, -5]

    @mnb.compile
    def peeks(x):
        return mnb.remote(torch.neg)(x).fetch()

    with pytest.warns(RuntimeWarning, match=r"fetch\(\), at test_recording.py:\d+ in peeks"):
        assert [v.tolist() for v in peeks(x)] == [[-1.0, -1.0]] * 2  # op by op
    assert mnb.remote(torch.neg)(x).fetch(rank=0).tolist() == [-1.0, -1.0]


def test_replayed_internals_do_not_grow_the_env(mesh):
    @mnb.compile
    def chain(x):
        for _ in range(20):
            x = mnb.remote(torch.add)(x, 1)
        return x

    x = mnb.remote(torch.zeros)(1, mesh=mesh)
    chain(x).fetch()  # recorded (and run) once
    gc.collect()  # Refs of earlier tests go now, not in the middle of this one
    base = env_sizes(mesh)
    results = [chain(x) for _ in range(5)]
    assert results[-1].fetch(rank=0).tolist() == [20.0]
    # only the five results stay: each replay's 19 intermediate values went with it
    assert env_sizes(mesh) == [b + 5 for b in base]


def broken_on_rank_1(rows: int):
    if mnb.current_rank() == 1:
        raise RuntimeError("input broke on rank 1")
    return torch.ones(rows, 3)


def negative_fails(t):
    if float(t.sum()) < 0:
        raise ValueError(f"negative input on rank {mnb.current_rank()}")
    return t * 2


def _fails_with(ref, match: str, ranks: set) -> None:
    # a rank left inside the collective would keep the fetch waiting: TimeoutError here
    with pytest.raises(mnb.RemoteError, match=match) as ei:
        ref.fetch(timeout=20)
    assert set(ei.value.failures) == ranks  # the original failure only, no cascade


def test_an_input_failed_on_one_rank_fails_a_replayed_collective_on_every_rank(mesh):
    """Every rank's replay learns, before the data collective, that an input
    failed somewhere: all results depend on the original failure, nobody hangs."""

    @mnb.compile
    def step(x, out):
        y = mnb.remote(torch.mul)(x, 2)
        total = y.reduce("dp", "sum")  # all_reduce: goes ahead once the group agreed
        rows = y.reduce("dp", "stack")  # all_gather
        into = y.reduce("dp", "max", out=out)
        return mnb.remote(torch.add)(total, 1), rows, into

    good = mnb.remote(torch.ones)(2, 3, mesh=mesh)
    out = mnb.remote(torch.zeros)(2, 3, mesh=mesh)
    total, rows, into = step(good, out)  # recorded
    assert total.fetch(rank=0).tolist() == [[5.0] * 3] * 2
    total, rows, into = step(good, out)  # replayed: the group agreed on (2, 3)
    assert rows.fetch(rank=1).shape == (2, 2, 3)
    n_errors = len(mesh.status()["errors"])
    broken = mnb.remote(broken_on_rank_1)(2, mesh=mesh)
    results = step(broken, out)
    for r in results:
        _fails_with(r, "input broke on rank 1", {1})
    mesh.wait()
    assert len(mesh.status()["errors"]) == n_errors + 1  # the input's failure, once
    # an out= that failed on one rank: the same, from the pre-check
    bad_out = mnb.remote(broken_on_rank_1)(2, mesh=mesh)
    _fails_with(step(good, bad_out)[2], "input broke on rank 1", {1})
    total, rows, into = step(good, out)  # the mesh and the recording still work
    assert total.fetch(rank=1, timeout=20).tolist() == [[5.0] * 3] * 2
    assert into.fetch(rank=0).tolist() == [[2.0] * 3] * 2


def test_a_step_failing_on_one_rank_inside_a_replay_does_not_strand_the_others(mesh):
    @mnb.compile
    def step(x):
        y = mnb.remote(negative_fails)(x)
        return y.reduce("dp", "sum"), y.reduce("dp", "stack", scatter=True)

    good = mnb.remote(torch.ones)(2, 3, mesh=mesh)
    assert step(good)[0].fetch(rank=0).tolist() == [[4.0] * 3] * 2
    assert step(good)[1].fetch(rank=1).tolist() == [[2.0] * 3] * 2
    n_errors = len(mesh.status()["errors"])
    one_negative = mnb.remote(lambda: torch.ones(2, 3) * (1 - 2 * mnb.current_rank()))(mesh=mesh)
    for r in step(one_negative):
        _fails_with(r, "negative input on rank 1", {1})
    mesh.wait()
    errors = mesh.status()["errors"]
    assert len(errors) == n_errors + 1 and errors[0]["ranks"] == [1]
    assert step(good)[0].fetch(rank=1, timeout=20).tolist() == [[4.0] * 3] * 2


def test_an_input_that_lives_on_some_ranks_only_does_not_strand_a_replayed_collective(mesh):
    """A recording over the whole mesh with an argument held by rank 0 alone:
    rank 1 has no value for it, yet its steps (the collective) still run."""
    rank0 = mesh.slice(dp=0)

    @mnb.compile
    def step(x, only0):
        return x.reduce("dp", "sum"), mnb.remote(torch.neg)(only0, mesh=rank0)

    x = mnb.remote(torch.ones)(2, mesh=mesh)
    only0 = mnb.remote(torch.ones)(1, mesh=rank0)
    total, neg = step(x, only0)
    assert total.fetch(rank=1, timeout=20).tolist() == [2.0, 2.0]
    total, neg = step(x, only0)  # replayed: rank 0 waits in the all_reduce for rank 1
    assert [t.tolist() for t in total.fetch(timeout=20)] == [[2.0, 2.0]] * 2
    assert neg.fetch(timeout=20)[0].tolist() == [-1.0]


def forget_on_rank_1(ref_id: int) -> None:
    """Drop a Ref's value on rank 1 only (as if it had never reached it)."""
    from monarch_nb.worker import current

    if mnb.current_rank() == 1:
        worker = current.worker
        del worker.env[ref_id]


def test_an_input_missing_on_one_rank_is_that_ranks_error_and_its_peers_do_not_hang(mesh):
    @mnb.compile
    def step(x):
        return x.reduce("dp", "sum"), mnb.remote(torch.neg)(x)

    x = mnb.remote(torch.ones)(2, mesh=mesh)
    step(x)[0].fetch(timeout=20)
    gone = mnb.remote(torch.ones)(2, mesh=mesh)
    mnb.remote(forget_on_rank_1)(gone.id, mesh=mesh).fetch(timeout=20)
    total, neg = step(gone)
    _fails_with(total, "not defined on this worker", {1})
    _fails_with(neg, "not defined on this worker", {1})
    assert neg.fetch(rank=0).tolist() == [-1.0, -1.0]  # rank 0 had the input
    assert [t.tolist() for t in step(x)[0].fetch(timeout=20)] == [[2.0, 2.0]] * 2


def grow(t):
    out = t + 1
    out.grown_in_a_replay = True  # a tag live_grown can find
    return out


def live_grown(t) -> int:
    import gc

    import torch

    tensors = (o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return sum(1 for o in tensors if getattr(o, "grown_in_a_replay", False))


def test_a_replay_frees_each_inner_value_after_its_last_use(mesh):
    @mnb.compile
    def chain(x):
        for _ in range(10):
            x = mnb.remote(grow)(x)
        return mnb.remote(live_grown)(x)

    x = mnb.remote(torch.zeros)(3, mesh=mesh)
    chain(x).fetch(timeout=20)  # recorded
    # only the value live_grown reads is alive then, not the nine before it
    assert chain(x).fetch(timeout=20) == [1, 1]


def test_commands_sent_from_another_thread_while_recording_are_recorded(mesh):
    # torch's autograd runs a CUDA tensor's backward on a device thread of its own
    import threading

    @mnb.compile
    def step(x):
        out = []
        t = threading.Thread(target=lambda: out.append(mnb.remote(torch.add)(x, 1)))
        t.start()
        t.join()
        return mnb.remote(torch.mul)(out[0], 2)

    x = mnb.remote(torch.ones)(2, mesh=mesh)
    assert step(x).fetch(rank=0).tolist() == [4.0, 4.0]
    mesh.wait()
    before = mesh.status()["ranks"][0]["streams"]["default"]["done"]
    y = mnb.remote(torch.zeros)(2, mesh=mesh)
    assert step(y).fetch(rank=1).tolist() == [2.0, 2.0]  # the replay ran the thread's add too
    mesh.wait()
    assert mesh.status()["ranks"][0]["streams"]["default"]["done"] - before <= 3
