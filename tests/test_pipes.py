"""Pipes: side processes per rank that feed values to the workers."""

import os

import psutil
import pytest
from wait_helpers import pids_gone, wait_for

import monarch_nb as mnb


def loader(pipe, n, scale):
    import os

    pipe.send(os.getpid())
    for i in range(n):
        pipe.send(i * scale + pipe.ranks["dp"])


def broken(pipe):
    pipe.send(1)
    raise ValueError("the loader hit a bad file")


def crashing(pipe):
    os._exit(9)


def flood(pipe, path):
    """Send as fast as the pipe lets; after each value, say how many went."""
    path = f"{path}-{pipe.ranks['dp']}"
    for i in range(1000):
        pipe.send(i)
        with open(path + ".tmp", "w") as f:
            f.write(str(i + 1))
        os.replace(path + ".tmp", path)  # a reader never sees a half-written count


def test_pipe_feeds_values_per_rank(mesh):
    with mesh.pipe(loader, 3, 10, max_messages=5) as p:
        pids = p.recv().fetch()
        assert all(psutil.pid_exists(x) for x in pids)
        got = [p.recv().fetch() for _ in range(3)]
        assert got == [[0, 1], [10, 11], [20, 21]]
        with pytest.raises(mnb.RemoteError, match="returned"):
            p.recv().fetch(timeout=30)
    assert pids_gone(pids, 10) == [], "pipe processes outlived close()"


def test_pipe_exception_and_crash_reach_the_user(mesh):
    p = mesh.pipe(broken)
    assert p.recv().fetch() == [1, 1]
    with pytest.raises(mnb.RemoteError, match="the loader hit a bad file") as ei:
        p.recv().fetch(timeout=30)
    assert "broken" in str(ei.value)  # the pipe function's traceback
    p.close()
    c = mesh.pipe(crashing)
    with pytest.raises(mnb.RemoteError, match="exit code 9"):
        c.recv().fetch(timeout=30)
    c.close()
    assert mesh.exec("1").fetch() == [1, 1]


def test_pipe_back_pressure(mesh, tmp_path):
    """The producer runs ahead of the receiver by exactly max_messages values: after
    each receive it sends up to that bound, and the first count seen at or past the
    bound is the bound. Without back pressure the counts would race on to 1000."""
    path = tmp_path / "sent"
    p = mesh.pipe(flood, str(path), max_messages=4)

    def sent() -> list:  # per rank: how many values its producer has sent
        return [int(c.read_text()) if c.exists() else 0 for c in counts]

    counts = [tmp_path / f"sent-{r}" for r in (0, 1)]

    try:
        for received in range(1, 4):
            assert p.recv().fetch(timeout=30) == [received - 1] * 2
            bound = received + 4

            def reached(bound=bound):
                now = sent()
                return now if min(now) >= bound else None

            got = wait_for(reached, 30, f"both producers to send {bound} values", show=sent)
            assert got == [bound, bound]
    finally:
        p.close()


def test_pipe_bad_input(mesh):
    with pytest.raises(ValueError, match="max_messages"):
        mesh.pipe(loader, 1, 1, max_messages=0)
    r = mnb.remote(lambda: 1)(mesh=mesh)
    with pytest.raises(mnb.RefUseError, match="not Refs"):
        mesh.pipe(loader, r, 1)


def test_pipes_end_with_their_mesh():
    m1 = mnb.local_mesh(dp=1, name="piped")
    p = m1.pipe(loader, 100, 1, max_messages=2)
    pid = p.recv().fetch(rank=0)
    assert psutil.pid_exists(pid)
    m1.shutdown()
    assert pids_gone([pid], 10) == [], "a pipe process outlived its mesh"


def counter(pipe, n):
    for i in range(n):
        pipe.send(i)


def test_values_sent_before_the_function_returns_all_arrive(mesh):
    """The side process stays until the worker has read its last value (ZeroMQ
    drops unread messages of a closed connection)."""
    p = mesh.pipe(counter, 60, max_messages=50)
    refs = []
    for i in range(60):
        refs.append(p.recv())
        if i % 20 == 0:
            refs[-1].fetch(timeout=30)
    assert [r.fetch(rank=1, timeout=30) for r in refs] == list(range(60))
    with pytest.raises(mnb.RemoteError, match="returned"):
        p.recv().fetch(timeout=30)
    p.close()
