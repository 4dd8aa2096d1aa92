"""Workers tier: a real controller in this process, real worker processes, real ZeroMQ."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from wait_helpers import file_appears, wait_for, wait_running
from worker_probes import env_sizes, rank_pids

import monarch_nb as mnb
from monarch_nb.controller.io_items import Send
from monarch_nb.protocol import Signer, encode, new_secret
from monarch_nb.protocol import messages as m


def fail_on_rank(rank_to_fail):
    if mnb.current_rank() == rank_to_fail:
        raise ValueError(f"boom on {rank_to_fail}")
    return mnb.current_rank() * 10


def add(a, b):
    return a + b


def test_remote_call_and_fetch_tensor(mesh):
    x = mnb.remote(torch.ones)(4, 4, mesh=mesh)
    assert isinstance(x, mnb.Ref)
    assert torch.equal(x.fetch(rank=0), torch.ones(4, 4))
    both = x.fetch()
    assert len(both) == 2 and all(torch.equal(t, torch.ones(4, 4)) for t in both)
    with mesh.activate():
        y = mnb.remote(torch.add)(x, x)
    assert torch.equal(y.fetch(rank=1), 2 * torch.ones(4, 4))


def test_lambda_and_notebook_style_function(mesh):
    scale = 3
    r = mnb.remote(lambda: torch.full((2,), float(mnb.current_rank() * scale)))(mesh=mesh)
    assert [t.tolist() for t in r.fetch()] == [[0.0, 0.0], [3.0, 3.0]]

    @mnb.remote
    def coords():
        return mnb.current_coords(), mnb.current_size()

    assert coords(mesh=mesh).fetch() == [({"dp": 0}, 2), ({"dp": 1}, 2)]


def test_exec_pull_push(mesh):
    ref = mesh.exec("import torch\na = torch.ones(2) * rank\nrank + 100")
    assert ref.fetch() == [100, 101]
    assert [t.tolist() for t in mesh.pull("a")] == [[0.0, 0.0], [1.0, 1.0]]
    mesh.push(lr=0.5, t=torch.arange(3))
    assert mesh.pull("lr", rank=1) == 0.5
    assert mesh.exec("float(t.sum()) * lr").fetch() == [1.5, 1.5]
    # a value made by exec feeds a remote function through the namespace
    got = mnb.remote(lambda: __import__("monarch_nb").worker.current.namespace["a"] + 1)(mesh=mesh)
    assert got.fetch(rank=1).tolist() == [2.0, 2.0]


def test_failure_on_one_rank(mesh):
    r = mnb.remote(fail_on_rank)(1, mesh=mesh)
    assert r.fetch(rank=0) == 0  # the other rank's value still fetches
    with pytest.raises(mnb.RemoteError) as ei:
        r.fetch(rank=1)
    err = ei.value
    assert set(err.failures) == {1}
    etype, msg, tb = err.failures[1]
    assert etype == "ValueError" and msg == "boom on 1"
    assert "fail_on_rank" in tb and "raise ValueError" in tb  # real source lines
    mesh.wait()  # that failure was raised by the fetch already
    mnb.remote(fail_on_rank)(0, mesh=mesh)
    with pytest.raises(mnb.RemoteError, match="boom on 0"):
        mesh.wait()  # an unfetched failure is raised by wait(), once
    mesh.wait()


def test_dependent_value_names_original_failure_once(mesh):
    before = len(mesh.status()["errors"])
    bad = mnb.remote(fail_on_rank)(0, mesh=mesh)
    dep1 = mnb.remote(add)(bad, 1, mesh=mesh)
    dep2 = mnb.remote(add)(dep1, dep1, mesh=mesh)
    with pytest.raises(mnb.RemoteError) as ei:
        dep2.fetch(rank=0)
    assert set(ei.value.failures) == {0}
    text = str(ei.value)
    assert "boom on 0" in text and "depends on command" in text
    assert "ValueError" in text and "DependentOnError" not in text
    assert dep2.fetch(rank=1) == 22  # rank 1 never failed
    mesh.wait()  # the fetch above reported the failure already
    errors = mesh.status()["errors"]
    assert len(errors) == before + 1, errors  # exactly one failure report, no cascade
    assert errors[0]["ranks"] == [0] and errors[0]["type"] == "ValueError"


def test_output_is_forwarded_with_rank_prefix(mesh, capfd):
    mesh.exec("print('hello', rank)\nimport sys; print('warn', rank, file=sys.stderr)")
    mesh.wait()
    seen = ["", ""]

    def printed():
        out, err = capfd.readouterr()
        seen[0] += out
        seen[1] += err
        out, err = seen
        return "[rank 0] hello 0" in out and "[rank 1] hello 1" in out and "[rank 1] warn 1" in err

    wait_for(printed, 30, "both ranks' output with their prefixes", show=lambda: seen)


def test_streams_run_independently(mesh, tmp_path):
    """The default stream does its work while the side stream's command is held on a
    gate only the test opens: had the default stream waited for it, the fetches
    here would time out (the gate stays shut for 60 s)."""
    gate = tmp_path / "gate"
    side = mesh.stream("side")
    held = mnb.remote(file_appears)(str(gate), 60, mesh=mesh, stream=side)
    try:
        wait_running(mesh, [0, 1], "side")
        x = mnb.remote(torch.zeros)(2, mesh=mesh)
        for _ in range(3):
            x = mnb.remote(add)(x, 1, mesh=mesh)
        assert [t.tolist() for t in x.fetch(timeout=30)] == [[3.0, 3.0]] * 2
        assert mesh.exec("rank").fetch(timeout=30) == [0, 1]
    finally:
        gate.touch()
    assert held.fetch(timeout=30) == [True, True]  # it saw the gate open, not its bound
    with pytest.raises(mnb.RefUseError, match="borrow"):
        mnb.remote(add)(held, 1, mesh=mesh)


def test_status_shape(mesh):
    mesh.exec("1").fetch(timeout=30)  # a command done on each rank, whatever ran before
    mesh.wait()
    # a worker's first Health (rss, cpu) comes within a second of its start
    wait_for(lambda: mesh.status()["ranks"][0]["rss"] is not None, 30, "rank 0's first Health")
    st = mesh.status()
    assert st["dims"] == {"dp": 2} and st["backend"] == "gloo"
    r0 = st["ranks"][0]
    assert r0["alive"] and r0["pid"] > 0 and r0["rss"] > 0
    assert r0["streams"]["default"]["queued"] == 0 and r0["streams"]["default"]["done"] > 0
    import json

    json.dumps(st)


def _collector_state():
    import gc
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle a user's code makes: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    return gc.get_freeze_count(), len(gc.get_objects()), gone() is None


def test_start_up_objects_are_frozen_and_later_garbage_is_collected(mesh):
    """A worker freezes what start-up made (torch, its own modules), so a full
    collection does not walk it; what user code makes later is collected as usual."""
    for frozen, tracked, collected in mnb.remote(_collector_state)(mesh=mesh).fetch(timeout=30):
        assert frozen > 50_000, frozen  # torch alone is well over that
        assert tracked < frozen, (tracked, frozen)
        assert collected


def mark_then_sleep(path: str, seconds: float) -> None:
    open(f"{path}-{mnb.current_rank()}", "w").close()
    time.sleep(seconds)


def test_interrupt_from_the_api(mesh, tmp_path):
    """One interrupt stops what runs on every stream of every rank; it is sent once
    the commands are in user code (each leaves a marker file first)."""
    loop_mark, sleep_mark = tmp_path / "loop", tmp_path / "sleep"
    side = mesh.stream("side")
    looping = mesh.exec(f"open(f'{loop_mark}-{{rank}}', 'w').close()\nwhile True: pass")
    sleeping = mnb.remote(mark_then_sleep)(str(sleep_mark), 1000, mesh=mesh, stream=side)
    marks = [f"{m}-{r}" for m in (loop_mark, sleep_mark) for r in (0, 1)]
    wait_for(lambda: all(os.path.exists(p) for p in marks), 30, "both commands to start")
    mesh.interrupt()
    for ref in (looping, sleeping):
        with pytest.raises(mnb.RemoteError, match="KeyboardInterrupt") as ei:
            ref.fetch(timeout=30)
        assert set(ei.value.failures) == {0, 1}
    # both streams keep serving
    assert mesh.exec("1 + 1").fetch(timeout=10) == [2, 2]
    assert mnb.remote(add)(1, 1, mesh=mesh, stream=side).fetch(timeout=10) == [2, 2]


async def scaled_later(x, mark=None):
    import asyncio

    if mark is not None:
        open(f"{mark}-{mnb.current_rank()}", "w").close()
        await asyncio.sleep(1000)
    await asyncio.sleep(0)
    return x * (mnb.current_rank() + 1)


def test_an_async_function_runs_to_its_end_on_the_worker(mesh, tmp_path):
    """An ``async def`` remote function (as Dask takes one) is awaited on the worker:
    its result comes back, not "cannot pickle 'coroutine' object"; an interrupt
    stops one that waits, and the stream serves on."""
    assert mnb.remote(scaled_later)(5, mesh=mesh).fetch() == [5, 10]
    mark = tmp_path / "waiting"
    waiting = mnb.remote(scaled_later)(1, str(mark), mesh=mesh)
    wait_for(lambda: all(os.path.exists(f"{mark}-{r}") for r in (0, 1)), 30, "both to wait")
    mesh.interrupt()
    with pytest.raises(mnb.RemoteError, match="KeyboardInterrupt"):
        waiting.fetch(timeout=30)
    assert mnb.remote(scaled_later)(2, mesh=mesh).fetch(timeout=10) == [2, 4]


# ------------------------------------------------------------------ bad input


def test_bad_input_keeps_mesh_serving(mesh):
    import threading

    with pytest.raises(TypeError, match="cannot send"):
        mnb.remote(add)(threading.Lock(), 1, mesh=mesh)
    r = mnb.remote(torch.ones)(1, mesh=mesh)
    r.delete()
    with pytest.raises(mnb.RefUseError, match="deleted"):
        r.fetch()
    with pytest.raises(mnb.RefUseError, match="deleted"):
        mnb.remote(add)(r, 1, mesh=mesh)
    with pytest.raises(ValueError, match="rank 7"):
        mnb.remote(torch.ones)(1, mesh=mesh).fetch(rank=7)
    with pytest.raises(ValueError, match="'dp' must be a positive int"):
        mnb.local_mesh(dp=0)
    with pytest.raises(ValueError, match="'x'"):
        mnb.local_mesh(dp=2, x="3")
    with pytest.raises(TypeError, match="unexpected keyword"):
        mnb.remote(torch.ones)(1, mesh=mesh).fetch(rnk=0)
    with pytest.raises(SyntaxError):
        mesh.exec("def (")
    with pytest.raises(ValueError, match="no dim 'tp'"):
        mesh.slice(tp=0)
    assert mnb.remote(add)(1, 2, mesh=mesh).fetch() == [3, 3]


def test_unpicklable_result_is_a_clear_error(mesh):
    r = mnb.remote(lambda: __import__("threading").Lock())(mesh=mesh)
    with pytest.raises(mnb.RemoteError, match="cannot send the value back"):
        r.fetch(rank=0)
    assert mnb.remote(add)(2, 2, mesh=mesh).fetch(rank=0) == 4


def test_call_on_shut_down_mesh():
    with mnb.local_mesh(dp=1, name="short") as m1:
        r = mnb.remote(torch.ones)(1, mesh=m1)
        assert r.fetch(rank=0).item() == 1.0
    with pytest.raises(mnb.MeshClosedError, match="shut down"):
        mnb.remote(torch.ones)(1, mesh=m1)
    with pytest.raises(mnb.MeshClosedError):
        r.fetch()


# ------------------------------------------------------------------ security


def test_wrong_key_message_is_not_executed(mesh, tmp_path):
    marker = tmp_path / "pwned"
    ctrl = mesh._controller
    before = mesh.status()["ranks"][0]["bad_messages"]
    evil = m.RunCode(
        ctrl.next_ident(), ctrl.next_id(), f"open({str(marker)!r}, 'w')", "<x>", 0, 0, "x"
    )
    # signed by its builder with another key (a small message would go unsigned, for the
    # controller's envelope to cover: forgeries on the wire are test_wire_fuzz.py's)
    payload = encode(evil, ctrl.signer)[1]
    frames = [Signer(new_secret()).digest(payload, []), payload]
    ctrl.io.submit(Send([0], frames))
    assert mnb.remote(add)(1, 1, mesh=mesh).fetch(rank=0) == 2  # the worker keeps serving
    bad = wait_for(
        lambda: mesh.status()["ranks"][0]["bad_messages"] - before, 10, "the worker's count"
    )
    assert bad == 1
    assert not marker.exists()


def test_controller_drops_forged_messages(mesh, tmp_path):
    import pickle

    import zmq

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    before = mesh.status()["bad_messages"]
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(mesh._controller.address)
    s.send_multipart([b"\0" * 32, pickle.dumps(Evil())])
    s.send_multipart([b"garbage"])
    s.close(linger=1000)
    wait_for(lambda: mesh.status()["bad_messages"] >= before + 2, 10, "both drops counted")
    assert mesh.status()["bad_messages"] == before + 2
    assert not marker.exists()
    assert mesh.exec("2").fetch() == [2, 2]


def test_binds_to_loopback(mesh):
    assert mesh._controller.address.startswith("tcp://127.0.0.1:")
    assert mesh._controller._secret.hex() not in repr(mesh._controller)


# ------------------------------------------------------------------ crashes and lifetime


def test_sigkill_during_long_command_then_new_mesh(worker_children):
    m1 = mnb.local_mesh(dp=2, name="crashy")
    try:
        r = mnb.remote(time.sleep)(60, mesh=m1)
        fut = r.fetch_async(rank=0)
        wait_running(m1, [0, 1])  # killed in the middle of the command
        victim = rank_pids(m1)[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(mnb.WorkerCrashed) as ei:
            fut.result(timeout=5)
        e = ei.value
        assert e.rank == 1 and e.exit_code == -signal.SIGKILL
        assert "rank 1" in str(e) and "SIGKILL" in str(e)
        with pytest.raises(mnb.WorkerCrashed):
            mnb.remote(torch.ones)(1, mesh=m1)
        assert m1.status()["ranks"][1]["alive"] is False
    finally:
        m1.shutdown()
    with mnb.local_mesh(dp=2, name="after-crash") as m2:
        assert mnb.remote(add)(1, 2, mesh=m2).fetch() == [3, 3]


def test_crash_reports_stderr_tail():
    with mnb.local_mesh(dp=1, name="segv") as m1:
        r = mnb.remote(
            lambda: (
                print("last words", file=__import__("sys").__stderr__, flush=True),
                __import__("os")._exit(7),
            )
        )(mesh=m1)
        with pytest.raises(mnb.WorkerCrashed) as ei:
            r.fetch(rank=0, timeout=5)
        assert ei.value.exit_code == 7 and "last words" in str(ei.value)


def test_workers_die_with_a_sigkilled_controller(tmp_path):
    script = tmp_path / "ctl.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time, monarch_nb as mnb
        mesh = mnb.local_mesh(dp=2)
        print(*[i['pid'] for i in mesh.status()['ranks'].values()], flush=True)
        time.sleep(600)
    """)
    )
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(x) for x in pids)
        p.kill()
        p.wait()
        procs = [psutil.Process(x) for x in pids if psutil.pid_exists(x)]
        gone, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive, f"orphans: {alive}"
    finally:
        p.kill()


def test_restart_gives_fresh_workers():
    with mnb.local_mesh(dp=1, name="restartable") as m1:
        m1.exec("x = 41")
        old = m1.exec("x + 1")
        assert old.fetch(rank=0) == 42
        pids = rank_pids(m1)
        m1.restart()
        assert rank_pids(m1) != pids
        with pytest.raises(mnb.RefUseError, match="restarted"):
            old.fetch()
        with pytest.raises(mnb.RemoteError, match="NameError"):
            m1.exec("x").fetch(rank=0)


def test_fetching_2gb_does_not_grow_memory(mesh):
    big = mnb.remote(torch.ones)(25 * 2**20, mesh=mesh)  # 100 MB
    procs = [psutil.Process(os.getpid())] + [
        psutil.Process(p) for p in rank_pids(mesh).values()
    ]

    def settled_rss():
        # A fetch returns while the IO thread may still be inside the handler of
        # its reply, holding the received frames (the tensor's memory) for a few
        # microseconds more: a small round trip lets it finish first.
        mesh.exec("0").fetch(rank=0)
        return [p.memory_info().rss for p in procs]

    for _ in range(3):
        big.fetch(rank=0)
    base = settled_rss()
    for _ in range(20):
        t = big.fetch(rank=0)
        assert t.shape == (25 * 2**20,)
        del t
    after = settled_rss()
    for b, a in zip(base, after):
        assert a <= b * 1.10, (base, after)


def test_del_ref_frees_worker_memory(mesh):
    import gc

    gc.collect()  # Refs of earlier tests go now, not in the middle of this one
    base = env_sizes(mesh)
    refs = [mnb.remote(torch.ones)(1000, mesh=mesh) for _ in range(50)]
    assert env_sizes(mesh) == [b + 50 for b in base]
    del refs
    assert env_sizes(mesh) == base


def test_stall_monitor_logs_a_long_command(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_NB_STALL_SECONDS", "1")
    with mnb.local_mesh(dp=1, name="stally") as m1:
        m1.exec("import time\ntime.sleep(3)").fetch(timeout=30)
        tail = m1._controller.workers.procs[0].tail_text
        wait_for(lambda: "possible stall" in tail(), 10, "the stall log", show=tail)
        assert "time.sleep(3)" in tail()


def test_progress_bars_for_startup_and_large_transfers(capfd, monkeypatch):
    monkeypatch.setenv("MONARCH_NB_PROGRESS_DELAY", "0")
    with mnb.local_mesh(dp=1, name="bars") as m1:
        big = mnb.remote(torch.ones)(20 * 2**20, mesh=m1)  # 80 MB: over the 64 MB threshold
        assert big.fetch(rank=0).shape == (20 * 2**20,)
        n = mnb.remote(lambda t: t.numel())(torch.ones(20 * 2**20), mesh=m1).fetch(rank=0)
        assert n == 20 * 2**20
        small = mnb.remote(torch.ones)(10, mesh=m1).fetch(rank=0)
        assert small.shape == (10,)
    err = capfd.readouterr().err
    assert "starting mesh 'bars'" in err
    assert f"fetch of Ref {big.id} (rank 0)" in err and "80.0M" in err
    assert "sending" in err
    assert err.count("fetch of Ref") == err.count(f"fetch of Ref {big.id}")  # no bar for small ones
