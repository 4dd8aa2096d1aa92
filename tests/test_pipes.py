"""Pipes: side processes per rank that feed values to the workers."""

import os
import time

import psutil
import pytest

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
    for i in range(1000):
        pipe.send(i)
        with open(path, "w") as f:
            f.write(str(i + 1))


def test_pipe_feeds_values_per_rank(mesh):
    with mesh.pipe(loader, 3, 10, max_messages=5) as p:
        pids = p.recv().fetch()
        assert all(psutil.pid_exists(x) for x in pids)
        got = [p.recv().fetch() for _ in range(3)]
        assert got == [[0, 1], [10, 11], [20, 21]]
        with pytest.raises(mnb.RemoteError, match="returned"):
            p.recv().fetch(timeout=30)
    deadline = time.time() + 10
    while any(psutil.pid_exists(x) and psutil.Process(x).status() != "zombie" for x in pids):
        assert time.time() < deadline, "pipe processes outlived close()"
        time.sleep(0.1)


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
    path = tmp_path / "sent"
    p = mesh.pipe(flood, str(path), max_messages=4)
    first = p.recv().fetch(rank=0, timeout=30)
    assert first == 0
    time.sleep(1.5)  # the producer runs ahead only as far as the high-water marks allow
    sent = int(path.read_text())
    assert sent < 100, sent
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
    deadline = time.time() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie":
        assert time.time() < deadline, "a pipe process outlived its mesh"
        time.sleep(0.1)


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
