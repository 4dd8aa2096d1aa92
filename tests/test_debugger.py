"""Remote pdb at the workers tier: real workers, real pdb, driven through the controller."""

import pytest

import monarch_nb as mnb


@pytest.fixture()
def dbg(mesh):
    yield mesh.debugger
    mesh.debugger.continue_all()
    mesh.wait(timeout=30)


def test_breakpoint_pauses_only_that_stream(mesh, dbg):
    r = mesh.exec("x = rank * 10\nbreakpoint()\ny = x + 1\ny")
    assert dbg.wait_any(20, count=2)
    sessions = {s.rank: s for s in dbg.sessions()}
    assert set(sessions) == {0, 1}
    assert sessions[1].location["file"].startswith("<monarch-exec-")
    assert sessions[1].location["line"] == 3
    # other streams and the worker itself keep answering
    side = mesh.stream("free")
    assert mnb.remote(lambda: 7)(mesh=mesh, stream=side).fetch(timeout=10) == [7, 7]
    st = mesh.status()
    assert st["ranks"][1]["streams"]["default"]["paused"]["line"] == 3
    assert {(d["rank"], d["stream"]) for d in st["debugger"]} == {(0, "default"), (1, "default")}
    assert dbg.cast(None, "p x") == {0: "0\n", 1: "10\n"}  # the prompts are not output
    listing = dbg.run(0, "ll")
    assert "->\ty = x + 1" in listing and "breakpoint()" in listing
    assert "11" in dbg.run(1, "p x + 1")
    dbg.run(1, "n")
    assert "11" in dbg.run(1, "p y")
    where = dbg.run(0, "w")
    assert "<monarch-exec-" in where
    dbg.continue_all()
    assert r.fetch(timeout=20) == [1, 11]
    assert mesh.status()["debugger"] == []


def test_breakpoint_in_remote_function_on_a_side_stream(mesh, dbg):
    side = mesh.stream("dbg-side")

    def work(a):
        b = a + 1
        breakpoint()
        return b * 2

    r = mnb.remote(work)(20, mesh=mesh.slice(dp=1), stream=side)
    assert dbg.wait_any(20)
    s = dbg.find(1)
    assert s.stream_name == "dbg-side" and s.location["function"] == "work"
    # the default stream keeps working meanwhile
    assert mesh.exec("rank + 5").fetch(timeout=10) == [5, 6]
    out = dbg.run(1, "pp (a, b)")
    assert "(20, 21)" in out
    assert "return b * 2" in dbg.run(1, "l")
    dbg.run(1, "c")
    assert r.fetch(rank=1, timeout=20) == 42


def test_post_mortem_and_interact(mesh, dbg):
    bad = mesh.exec("def f(a):\n    b = a * 2\n    raise ValueError(b)\nf(rank + 1)")
    with pytest.raises(mnb.RemoteError, match="ValueError"):
        bad.fetch()
    fut = dbg.post_mortem(1)
    assert dbg.wait_any(20)
    s = dbg.find(1)
    text, prompt = dbg.wait_reply(s, 10)
    assert "raise ValueError(b)" in text and prompt == "(Pdb r1) "
    assert not text.endswith(prompt), text
    assert dbg.run(1, "p b").startswith("4")
    banner = dbg.run(1, "interact")
    assert "*interactive*" in banner
    assert "1004" in dbg.run(1, "b + 1000")
    dbg.run(1, "exit()")
    dbg.run(1, "c")
    assert fut.result(timeout=20) is None
    # nothing left to debug on rank 0's side stream
    with pytest.raises(mnb.RemoteError, match="no failure to debug"):
        dbg.post_mortem(0, stream=mesh.stream("nothing-failed").id).result(timeout=20)


def test_interrupt_while_paused(mesh, dbg):
    r = mesh.exec("breakpoint()\n1")
    assert dbg.wait_any(20, count=2)
    mesh.interrupt()
    with pytest.raises(mnb.RemoteError, match="KeyboardInterrupt"):
        r.fetch(timeout=20)
    assert dbg.sessions() == []
    assert mesh.exec("2").fetch(timeout=10) == [2, 2]


def test_quit_ends_the_command(mesh, dbg):
    r = mesh.exec("breakpoint()\n1")
    assert dbg.wait_any(20, count=2)
    dbg.cast(None, "q")
    with pytest.raises(mnb.RemoteError, match="BdbQuit"):
        r.fetch(timeout=20)
    assert mesh.exec("3").fetch(timeout=10) == [3, 3]


def test_user_pythonbreakpoint_wins(monkeypatch):
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    with mnb.local_mesh(dp=1, name="nobreak") as m1:
        assert m1.exec("breakpoint()\n5").fetch(timeout=20) == [5]
        assert m1.debugger.sessions() == []


def test_pause_is_announced_once_with_its_location_and_stack_hides_machinery(mesh, dbg):
    events = []
    dbg.listeners.append(lambda event, s: events.append((event, s.rank, dict(s.location))))
    try:
        r = mesh.exec("def g():\n    v = 1\n    breakpoint()\n    return v\ng()")
        assert dbg.wait_any(20, count=2)
        where = dbg.run(0, "w")
        assert "<monarch-exec-" in where and "monarch_nb/worker" not in where
        dbg.run(0, "n")
        dbg.continue_all()
        assert r.fetch(timeout=20) == [1, 1]
    finally:
        dbg.listeners.pop()
    paused = [e for e in events if e[0] == "paused"]
    assert sorted(rank for _, rank, _ in paused) == [0, 1]  # once per session, after `n` too
    assert all(loc["function"] == "g" and loc["line"] for _, _, loc in paused)


def test_run_returns_output_without_the_prompt(mesh, dbg):
    r = mesh.exec("x = rank * 10\nbreakpoint()\ny = x + 1\ny")
    assert dbg.wait_any(20, count=2)
    s = dbg.find(1)
    stopped = dbg.take_output(s)  # what pdb printed as it stopped
    assert "-> y = x + 1" in stopped and "(Pdb" not in stopped, stopped
    assert dbg.run(1, "p x") == "10\n"
    for line in ("ll", "n", "w", "p y", "p 'a (Pdb r1) b'"):
        out = dbg.run(1, line)
        assert out and not out.endswith(s.prompt) and not out.endswith("(Pdb r1) "), (line, out)
    assert "'a (Pdb r1) b'" in dbg.run(1, "p 'a (Pdb r1) b'")  # a prompt-like value is output
    assert "*interactive*" in dbg.run(1, "interact")
    assert dbg.run(1, "y * 2") == "22\n"
    assert dbg.run(1, "exit()").strip() == ""
    dbg.continue_all()
    assert r.fetch(timeout=20) == [1, 11]
