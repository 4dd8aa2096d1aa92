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
    mesh.wait()
    errors = mesh.status()["errors"]
    assert len(errors) == n_errors + 1 and errors[0]["ranks"] == [0, 1]
    assert step(good).fetch(rank=1).tolist() == [4.0, 4.0]  # the recording still works


def test_plain_arguments_are_guards_and_fetch_is_refused(mesh):
    calls = []

    @mnb.compile
    def mul(x, k):
        calls.append(k)
        return mnb.remote(torch.mul)(x, k)

    x = mnb.remote(torch.ones)(2, mesh=mesh)
    assert mul(x, 2).fetch(rank=0).tolist() == [2.0, 2.0]
    assert mul(x, 2).fetch(rank=0).tolist() == [2.0, 2.0]
    assert mul(x, 5).fetch(rank=0).tolist() == [5.0, 5.0]  # a new constant records again
    assert calls == [2, 5]

    @mnb.compile
    def peeks(x):
        return mnb.remote(torch.neg)(x).fetch()

    with pytest.raises(mnb.RecordingError, match="fetch"):
        peeks(x)
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
