"""mesh.timeline(), mesh.memory() and mesh.profile(): where the time and the memory
go, on real workers (a dp=2 local mesh shared by the module)."""

from __future__ import annotations

import json
import os
import time
from array import array

import pytest
import torch
from wait_helpers import wait_for
from worker_probes import rank_pids

import monarch_nb as mnb
from monarch_nb.controller.timeline import kind_of, stragglers

_HELD: dict = {}  # on a worker: what hold() keeps alive


def nap(seconds_by_rank):
    """Sleep as long as this rank is told to (a list: by rank)."""
    if isinstance(seconds_by_rank, list):
        time.sleep(seconds_by_rank[mnb.current_rank()])


def busy(n):
    x = torch.ones(64, 64)
    for _ in range(n):
        x = torch.mm(x, x) / 64
    return float(x.sum())


def hold(mb):
    """Keep ``mb`` MiB alive on this rank."""
    _HELD["t"] = torch.ones(mb << 18)


def drop():
    _HELD.clear()


def hold_cuda(mb):
    _HELD["t"] = torch.ones(mb << 18, device="cuda")


# ---------------------------------------------------------------- the straggler rule


def _rec(rank, ident, took, stream="default"):
    return {"rank": rank, "stream": stream, "ident": ident, "start": 10.0, "end": 10.0 + took}


def test_straggler_is_over_one_and_a_half_the_peers_median():
    records = [_rec(0, 1, 1.0), _rec(1, 1, 1.0), _rec(2, 1, 1.6), _rec(3, 1, 1.4)]
    assert stragglers(records) == {2}
    # the same ident on another stream is another command
    records += [_rec(0, 1, 5.0, "side"), _rec(1, 1, 1.0, "side")]
    assert stragglers(records) == {2, 4}
    assert stragglers([_rec(0, 7, 9.0)]) == set()  # no peers: no straggler
    assert stragglers([_rec(0, 1, 0.0002), _rec(1, 1, 0.0009)], floor=0.001) == set()


def test_kind_of_names_what_a_command_is():
    assert kind_of("cell: x = 1") == "cell"
    assert kind_of("%%monarch In[3]: import time") == "cell"
    assert kind_of("aten.add.Tensor") == "op"
    assert kind_of("reduce dp sum") == "collective"
    assert kind_of("fetch") == "fetch"
    assert kind_of("nap") == "call"


# ---------------------------------------------------------------- timeline


def test_timeline_holds_each_ranks_commands_and_flags_the_straggler(mesh):
    mesh.wait()
    before = {r["ident"] for r in mesh.timeline()}
    f = mnb.remote(nap)
    t0 = time.time()
    f([0.05, 0.8], mesh=mesh)
    mnb.remote(nap)(0, mesh=mesh)
    mesh.wait()
    t1 = time.time()
    new = [r for r in mesh.timeline() if r["ident"] not in before and r["name"] == "nap"]
    assert sorted((r["rank"], r["ident"]) for r in new)[0][0] == 0
    assert {r["rank"] for r in new} == {0, 1}
    assert len(new) == 4
    for r in new:
        assert r["kind"] == "call" and r["stream"] == "default"
        assert t0 - 0.05 <= r["start"] < r["end"] <= t1 + 0.05, r
    starts = [r["start"] for r in new]
    assert starts == sorted(starts)
    first = min(r["ident"] for r in new)
    # the slow nap's record is flagged, its peer's not; the instant nap(0) after it is
    # left out: under load a rank preempted for a millisecond in it is a straggler too
    slow = {r["rank"] for r in new if r["straggler"] and r["ident"] == first}
    assert slow == {1}, new
    r1 = next(r for r in new if r["rank"] == 1 and r["ident"] == first)
    assert r1["end"] - r1["start"] >= 0.75  # its own nap (the window above bounds it)
    offsets = mesh._controller.state.timeline.offsets
    assert set(offsets) == {0, 1} and all(abs(o) < 0.05 for o, _ in offsets.values())


def test_timeline_last_and_bad_input(mesh):
    # 50 ms apart: instant calls left near-ties that a rank's clock offset ordered
    # either way, and the last two could be rank 1's two calls (failed CI once)
    for _ in range(3):
        mnb.remote(nap)([0.05, 0.05], mesh=mesh)
    mesh.wait()

    def keys(records):  # a later read may refine a rank's clock offset (and the order of
        return {(r["rank"], r["stream"], r["ident"]) for r in records}  # near-ties): sets

    everything = mesh.timeline()
    two = mesh.timeline(last=2)
    assert len(two) == 2 and keys(two) <= keys(everything[-4:])
    assert mesh.timeline(last=0) == []
    assert keys(mesh.timeline(last=len(everything) + 5)) == keys(everything)
    for bad in (-1, "3", 1.5, True):
        with pytest.raises(ValueError, match="timeline"):
            mesh.timeline(last=bad)
    with pytest.raises(ValueError, match="size"):
        mesh.timeline_size = 0
    assert mnb.remote(busy)(1, mesh=mesh).fetch(rank=0) > 0  # the mesh goes on


@pytest.mark.unit
def test_records_since_keep_only_what_ended_then_or_later():
    from monarch_nb.controller.timeline import Timeline

    ring = Timeline()
    ring.add(
        0,
        ((0, array("q", (1, 2)), ["f", "g"], array("d", (10.0, 12.0)), array("d", (11.0, 13.0))),),
    )
    ring.add(0, ((0, array("q", (3,)), ["h"], array("d", (20.0,)), array("d", (21.0,))),))
    ring.offsets = {0: (1.0, 0.0)}  # the rank's clock runs 1 s ahead of ours
    assert [r["ident"] for r in ring.records(since=11.5)] == [2, 3]  # ended at 12, 20
    assert [r["ident"] for r in ring.records(since=20.5)] == []
    assert [r["ident"] for r in ring.records()] == [1, 2, 3]


def test_timeline_since_and_without_asking_the_ranks(mesh, caplog):
    import signal
    import threading

    mnb.remote(nap)(0, mesh=mesh)
    mesh.wait()
    mesh.timeline()  # every rank's clock read once
    cut = time.time()
    mnb.remote(nap)([0.05, 0.05], mesh=mesh)
    mesh.wait()
    recent = mesh.timeline(since=cut)
    assert {r["rank"] for r in recent} == {0, 1} and all(r["end"] >= cut for r in recent)
    assert len(recent) < len(mesh.timeline())
    with pytest.raises(TypeError, match="since"):
        mesh.timeline(since="now")
    # measure=False reads what the controller holds: a stopped rank cannot hold it up
    pid = rank_pids(mesh)[1]
    got: list = []
    os.kill(pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: got.append(mesh.timeline(measure=False)))
        t.start()
        t.join(30)
        assert got and {r["rank"] for r in got[0]} == {0, 1}
        # asked, the stopped rank would not answer its ReadClock: that is logged
        assert "clocks were not read" not in caplog.text
    finally:
        os.kill(pid, signal.SIGCONT)
    assert mnb.remote(busy)(1, mesh=mesh).fetch(rank=1) > 0


def test_timeline_ring_is_bounded(mesh):
    old = mesh.timeline_size
    try:
        mesh.timeline_size = 10
        idents = [mnb.remote(nap)(0, mesh=mesh).ident for _ in range(12)]  # 24 records
        mesh.wait()
        records = mesh.timeline()
        assert len(records) == 10 and len(mesh._controller.state.timeline) == 10
        kept = {r["ident"] for r in records}
        assert idents[-1] in kept and idents[0] not in kept  # the oldest went
    finally:
        mesh.timeline_size = old


def test_timeline_names_cells_tensor_ops_and_fetches(mesh):
    with mesh.activate():
        x = torch.ones(4)
        y = x + x
    assert mnb.remote(busy)(1, mesh=mesh).fetch(rank=0) > 0
    mesh.run_cell("z = 1 + 1").result()
    mesh.wait()
    kinds = {(r["kind"], r["name"]) for r in mesh.timeline(last=20)}
    assert ("fetch", "fetch") in kinds
    assert ("call", "busy") in kinds
    assert ("cell", "cell: z = 1 + 1") in kinds
    assert any(k == "op" and n.startswith("aten.add") for k, n in kinds), kinds
    del x, y


# ---------------------------------------------------------------- memory


def test_memory_gives_each_ranks_rss_and_sees_an_allocation(mesh):
    before = mesh.memory()
    assert set(before) == {0, 1}
    assert all(v["rss"] > 0 and v["cuda"] is None for v in before.values())
    mnb.remote(hold)(256, mesh=mesh.slice(dp=1))
    mesh.wait()
    try:
        after = wait_for(
            lambda: (a := mesh.memory())[1]["rss"] > before[1]["rss"] + (200 << 20) and a,
            10,
            "rank 1's RSS to grow by 256 MiB",
        )
        assert after[0]["rss"] < before[0]["rss"] + (100 << 20)
    finally:
        mnb.remote(drop)(mesh=mesh)
        mesh.wait()


def test_memory_snapshot_needs_cuda(mesh, tmp_path):
    with pytest.raises(RuntimeError, match="snapshots need CUDA"):
        mesh.memory(snapshot=tmp_path)
    assert not os.listdir(tmp_path)
    assert mesh.memory()[0]["rss"] > 0


@pytest.mark.gpu
def test_memory_cuda_counters_and_snapshot(tmp_path):
    with mnb.local_mesh(gpu=2) as gmesh:
        mnb.remote(hold_cuda)(64, mesh=gmesh)
        gmesh.wait()
        mem = gmesh.memory(snapshot=tmp_path)
        for r, v in mem.items():
            dev = v["cuda"][0]
            assert dev["allocated"] >= 64 << 20 and dev["reserved"] >= dev["allocated"]
            assert dev["peak"] >= dev["allocated"]
            assert os.path.getsize(v["snapshot"]) > 0 and v["snapshot"].endswith(f"rank{r}.pickle")


def raise_oom():
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def oom_on_rank_1(gb):
    if mnb.current_rank() == 1:
        torch.empty(int(gb * 2**30), dtype=torch.uint8, device="cuda")
    return mnb.current_rank()


def test_an_out_of_memory_error_names_the_rank_and_tries_its_memory_summary(mesh):
    # on CPU the error itself is real (torch.cuda.OutOfMemoryError), the summary is not
    with pytest.raises(torch.cuda.OutOfMemoryError) as ei:
        mnb.remote(raise_oom)(mesh=mesh.slice(dp=1)).fetch(rank=1)
    text = str(ei.value)
    assert "rank 1" in text and "no memory summary of this rank's GPU" in text, text
    assert mnb.remote(busy)(1, mesh=mesh).fetch(rank=0) > 0  # the mesh serves on


@pytest.mark.gpu
def test_a_cuda_oom_shows_the_ranks_memory_summary():
    with mnb.local_mesh(gpu=2) as gmesh:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        with pytest.raises(torch.cuda.OutOfMemoryError) as ei:
            mnb.remote(oom_on_rank_1)(total * 2, mesh=gmesh).fetch()
        text = str(ei.value)
        assert "rank 1" in text and "when it ran out of memory" in text, text
        assert "memory summary" in text.lower()
        assert mnb.remote(oom_on_rank_1)(0, mesh=gmesh).fetch() == [0, 1]


# ---------------------------------------------------------------- profiler


def test_profile_merges_one_process_per_rank(mesh, tmp_path, capsys):
    mnb.remote(busy)(30000, mesh=mesh.slice(dp=1))  # sent before the block: not in its trace
    with mesh.profile(tmp_path / "prof") as prof:
        mnb.remote(busy)(20, mesh=mesh.slice(dp=0))
        mnb.remote(busy)(200, mesh=mesh.slice(dp=1))
    assert prof.path == str(tmp_path / "prof" / "trace.json")
    with open(prof.path) as f:
        trace = json.load(f)
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1"}
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == "aten::mm"]
    assert {e["pid"] for e in ops} == {0, 1}
    assert sum(1 for e in ops if e["pid"] == 1) == 200
    assert trace["otherData"]["monarch_nb"]["aligned"] == {"0": True, "1": True}
    s = prof.summary
    assert set(s["ranks"]) == {0, 1}
    assert s["slowest"]["rank"] == 1 and s["slowest"]["over_median_us"] > 0
    assert any(op["name"] == "aten::mm" for op in s["ranks"][1]["top_ops"])
    assert "slowest: rank 1" in capsys.readouterr().out
    # on the controller's clock: rank 1's mm ran within the block
    mm_ts = [e["ts"] / 1e6 for e in ops]
    assert abs(max(mm_ts) - time.time()) < 60


def test_a_profiled_block_that_fails_keeps_the_trace_of_what_ran(mesh, tmp_path, capsys):
    with pytest.raises(ZeroDivisionError):
        with mesh.profile(tmp_path / "failed") as prof:
            mnb.remote(busy)(30, mesh=mesh)
            mesh.wait()
            raise ZeroDivisionError("the block fails")
    out = capsys.readouterr().out
    assert "the profile of what ran before the failure" in out
    assert prof.summary is not None and set(prof.summary["ranks"]) == {0, 1}
    assert "aten::mm" in (tmp_path / "failed" / "trace.json").read_text()
    with mesh.profile(tmp_path / "again") as again:  # no profiler left running
        mnb.remote(busy)(1, mesh=mesh)
    assert again.summary is not None


def test_profile_of_a_tensor_engine_block(mesh, tmp_path):
    with mesh.profile(tmp_path / "engine") as prof:
        with mesh.activate():
            x = torch.ones(64, 64)
            for _ in range(5):
                x = x @ x / 64
    trace = (tmp_path / "engine" / "trace.json").read_text()
    assert "aten::mm" in trace and set(prof.summary["ranks"]) == {0, 1}


def test_profile_refuses_an_unwritable_dir(mesh, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot make directory"):
        with mesh.profile(blocker / "sub"):
            pass
    assert mnb.remote(busy)(1, mesh=mesh).fetch(rank=0) > 0


def test_a_simulated_mesh_has_a_timeline_and_refuses_memory_by_name(tmp_path):
    sim = mnb.local_mesh(host=1, gpu=2, simulate=True, name="insight-sim")
    try:
        mnb.remote(nap)(0, mesh=sim)
        sim.wait()
        t0 = time.monotonic()
        assert sim.timeline() == []  # light ranks keep no timeline, and answer at once
        assert time.monotonic() - t0 < 5
        assert set(sim._controller.state.timeline.offsets) == {0, 1}
        with pytest.raises(mnb.RemoteError, match="simulated light rank"):
            sim.memory()
        with pytest.raises(mnb.RemoteError) as ei:  # refused once for all ranks, folded
            with sim.profile(tmp_path / "sim"):
                pass
        assert str(ei.value).count("StartProfile needs torch") == 1, str(ei.value)
        assert not (tmp_path / "sim" / "trace.json").exists()
    finally:
        sim.shutdown()


def test_finished_commands_cut_while_a_stream_appends_keep_every_record_whole():
    """The columns a stream appends to and the receiver cuts, on two real threads:
    each command is taken once, with its own what, start and end."""
    import threading

    from monarch_nb.worker.timings import FinishedCommands

    t, n, taken = FinishedCommands(10**9), 200_000, []

    def stream():
        for i in range(n):
            ti, tw, ts, te = t.record
            ti(i)
            tw(f"w{i}")
            ts(float(i))
            te(float(i) + 0.5)

    th = threading.Thread(target=stream)
    th.start()
    while th.is_alive() or len(t):
        cut = t.take()
        if cut is not None:
            taken.append(cut)
    idents = [i for cut in taken for i in cut[0]]
    assert idents == list(range(n))
    for ids, whats, starts, ends in taken:
        assert len(ids) == len(whats) == len(starts) == len(ends)
        assert all(
            w == f"w{i}" and s == i and e == i + 0.5 for i, w, s, e in zip(ids, whats, starts, ends)
        )


def test_a_stream_whose_receiver_falls_behind_keeps_a_bounded_record():
    from monarch_nb.worker.timings import FinishedCommands

    t = FinishedCommands(100)
    record = t.record
    for i in range(1000):
        ti, tw, ts, te = record
        ti(i)
        tw("x")
        ts(0.0)
        te(1.0)
        if not (i + 1) % 50:
            record = t.check()
    assert len(t) == 100 and not t.room
    assert list(t.take()[0]) == list(range(100))
    t.check()
    assert t.room and t.take() is None
