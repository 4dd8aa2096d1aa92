"""Host agents: a local mesh's ranks are forked by this process's one warm agent
(``monarch-nb-host``), each with its own direct connection to the controller.

Real agent processes, real forked ranks, real gloo. A zombie counts as gone
(wait_helpers.alive): once an agent is killed, its ranks' reaper is init."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from agent_helpers import started_for
from cgroup_helpers import pids_cgroup
from wait_helpers import alive, pids_gone, wait_for
from worker_probes import rank_pids

import monarch_nb as mnb
from monarch_nb import config
from monarch_nb.api.mesh import DeviceMesh
from monarch_nb.controller import Controller
from monarch_nb.controller.errors import WorkerCrashed
from monarch_nb.launchers.host_agent import HostAgent, HostLauncher, local_agent
from monarch_nb.protocol import host_messages as hm
from monarch_nb.protocol.ndslice import NDSlice

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


@pytest.fixture(scope="module")
def hosted():
    m = mnb.local_mesh(dp=2, name="hosted")
    yield m
    m.shutdown()


def _mesh_on(agent: HostAgent, name: str, dp: int) -> DeviceMesh:
    """A mesh whose ranks ``agent`` forks (not this process's warm agent)."""
    ctrl = Controller(name, {"dp": dp}, "gloo", launcher=HostLauncher(agent))
    return DeviceMesh(ctrl, 0, ("dp",), NDSlice.contiguous((dp,)), name)


def _rank_info():
    import os as _os
    import sys as _sys

    import torch as _torch

    keys = (
        "PYTHONPATH OMP_NUM_THREADS GLOO_SOCKET_IFNAME MALLOC_MMAP_THRESHOLD_ "
        "MALLOC_TRIM_THRESHOLD_ PYTHONUNBUFFERED RANK WORLD_SIZE LOCAL_RANK "
        "LOCAL_WORLD_SIZE MPLBACKEND MNB_HOST_TEST MONARCH_NB_KEY"
    ).split()
    return {
        "pid": _os.getpid(),
        "ppid": _os.getppid(),
        "env": {k: _os.environ.get(k) for k in keys},
        "threads": _torch.get_num_threads(),
        "path": list(_sys.path),
        "cwd": _os.getcwd(),
        "tmp": __import__("tempfile").gettempdir(),
    }


def _stall_after():
    from monarch_nb.config import process_settings

    return process_settings()["stall_seconds"]


def test_a_variable_read_at_import_that_changed_starts_a_fresh_agent(monkeypatch):
    with mnb.local_mesh(dp=1, name="before-drift") as m:
        old = local_agent()
        monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # glibc reads it once, at start
        with mnb.local_mesh(dp=1, name="after-drift") as m2:
            new = local_agent()
            assert new is not old and new.alive
            assert psutil.Process(rank_pids(m2)[0]).ppid() == new.pid
            assert mnb.remote(_variable)("MALLOC_ARENA_MAX", mesh=m2).fetch(rank=0, timeout=60) == "2"
            assert old.alive  # retired: it serves its ranks until they end
            m.exec("a = 1")
            assert m.pull("a") == [1]
    assert old.retired
    # it ends with its last rank (a mesh another test left running may still hold one)
    wait_for(lambda: not old.alive or old.ranks, 15, "the retired agent gone with its last rank")


def test_a_changed_setting_reaches_ranks_forked_by_the_warm_agent(monkeypatch):
    """MONARCH_NB_* settings are each rank's own (read after the fork, from its Spawn's
    environment): changing one starts no agent."""
    with mnb.local_mesh(dp=1, name="before-setting"):
        agent = local_agent()
    monkeypatch.setenv("MONARCH_NB_STALL_SECONDS", "7")
    with mnb.local_mesh(dp=1, name="after-setting") as m:
        assert local_agent() is agent
        assert psutil.Process(rank_pids(m)[0]).ppid() == agent.pid
        assert mnb.remote(_stall_after)(mesh=m).fetch(rank=0, timeout=60) == 7.0
    monkeypatch.delenv("MONARCH_NB_STALL_SECONDS")
    with mnb.local_mesh(dp=1, name="setting-gone") as m:
        assert local_agent() is agent
        default = config.MonarchNB.class_traits()["stall_seconds"].default_value
        assert mnb.remote(_stall_after)(mesh=m).fetch(rank=0, timeout=60) == default


def _variable(name: str):
    import os as _os

    return _os.environ.get(name)


def test_ranks_are_forked_by_the_agent_and_run_cells_and_collectives(hosted):
    agent = local_agent()
    assert started_for(agent.pid, os.getpid())
    for pid in rank_pids(hosted).values():
        assert psutil.Process(pid).ppid() == agent.pid
    hosted.exec("import torch\nx = torch.full((3,), float(__import__('os').environ['RANK']))")
    assert hosted.pull("x", rank=1).tolist() == [1.0, 1.0, 1.0]
    ones = mnb.remote(torch.ones)(3, mesh=hosted)
    total = ones.reduce("dp", "sum").fetch(timeout=60)
    assert [t.tolist() for t in total] == [[2.0, 2.0, 2.0]] * 2


def test_ranks_see_the_env_path_and_cwd_of_now_not_of_the_agents_start(hosted, tmp_path):
    local_agent()  # warm before the controller's env and sys.path change
    (tmp_path / "host_test_mod.py").write_text("VALUE = 41\n")
    sys.path.append(str(tmp_path))
    os.environ["MNB_HOST_TEST"] = "per-fork"
    old_tmp = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path)
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        m = mnb.local_mesh(dp=1, name="envy")
        try:
            info = mnb.remote(_rank_info)(mesh=m).fetch(rank=0, timeout=60)
            m.exec("import host_test_mod\nv = host_test_mod.VALUE + 1")
            assert m.pull("v", rank=0) == 42
        finally:
            m.shutdown()
        two = mnb.remote(_rank_info)(mesh=hosted).fetch(timeout=60)
    finally:
        os.chdir(here)
        sys.path.remove(str(tmp_path))
        del os.environ["MNB_HOST_TEST"]
        if old_tmp is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old_tmp
    env = info["env"]
    assert env["MNB_HOST_TEST"] == "per-fork" and env["MONARCH_NB_KEY"] is None
    assert str(tmp_path) in info["path"] and str(tmp_path) in env["PYTHONPATH"].split(os.pathsep)
    assert info["cwd"] == str(tmp_path) and two[0]["cwd"] == here
    assert info["tmp"] == str(tmp_path)
    assert env["PYTHONUNBUFFERED"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["MALLOC_MMAP_THRESHOLD_"] == env["MALLOC_TRIM_THRESHOLD_"] == str(1 << 30)
    assert env["MPLBACKEND"] == "module://monarch_nb.worker.mpl_backend"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "1", "1")
    # OpenMP read the agent's OMP_NUM_THREADS when it loaded torch: each rank sets its own
    cpus = os.cpu_count() or 1
    for i, world in ((info, 1), (two[0], 2), (two[1], 2)):
        want = os.environ.get("OMP_NUM_THREADS") or str(max(1, cpus // world))
        assert i["env"]["OMP_NUM_THREADS"] == want and i["threads"] == int(want)
    assert [i["env"]["RANK"] for i in two] == ["0", "1"]


def _seeds():
    import random

    import torch as _torch

    return _torch.initial_seed(), _torch.rand(1).item(), random.random()


def test_every_rank_draws_seeds_of_its_own_as_a_fresh_process_does(hosted):
    first = mnb.remote(_seeds)(mesh=hosted).fetch(timeout=60)
    with mnb.local_mesh(dp=2, name="seeded") as m:
        again = mnb.remote(_seeds)(mesh=m).fetch(timeout=60)
    drawn = [x for ranks in (first, again) for rank in ranks for x in rank]
    assert len(set(drawn)) == len(drawn), (first, again)  # no seed or draw repeats
    assert torch.initial_seed() not in {s for s, _, _ in first + again}


def test_restart_keeps_the_agent_and_forks_new_ranks():
    with mnb.local_mesh(dp=2, name="renewed") as m:
        agent = local_agent()
        m.exec("kept = 1").fetch(timeout=60)
        before = rank_pids(m)
        m.restart()
        after = rank_pids(m)
        assert local_agent() is agent and agent.alive
        assert not set(before.values()) & set(after.values())
        assert pids_gone(before.values()) == []
        for pid in after.values():
            assert psutil.Process(pid).ppid() == agent.pid
        with pytest.raises(mnb.RemoteError, match="NameError"):
            m.pull("kept", rank=0)
        m.exec("y = 2")
        assert m.pull("y") == [2, 2]


def test_a_killed_rank_is_reported_with_its_rank_and_output():
    with mnb.local_mesh(dp=2, name="crashing") as m:
        m.exec("import os\nos.write(2, b'last words of this rank\\n')").fetch(timeout=60)
        busy = m.exec("import time\ntime.sleep(60)")
        os.kill(rank_pids(m)[1], signal.SIGKILL)
        with pytest.raises(WorkerCrashed) as ei:
            busy.fetch(timeout=30)  # the agent's report fails it long before this bound
        assert ei.value.rank == 1 and ei.value.exit_code == -signal.SIGKILL
        assert "killed by signal SIGKILL" in str(ei.value)
        assert "last words of this rank" in ei.value.stderr_tail
        assert m.status()["ranks"][1]["alive"] is False
        m.restart()
        assert m.pull("__name__") == ["__main__", "__main__"]


@pytest.mark.parametrize("end", ["SIGKILL", "exit"])
def test_the_controller_gone_takes_the_agent_and_its_ranks(end):
    script = (
        "import json, sys\n"
        "import monarch_nb as mnb\n"
        "from monarch_nb.launchers.host_agent import local_agent\n"
        "m = mnb.local_mesh(dp=2, name='doomed')\n"
        "m.exec('x = 1').fetch(timeout=60)\n"
        "print(json.dumps([local_agent().pid, *[i['pid'] for i in m.status()['ranks'].values()]]), "
        "flush=True)\n"
        "sys.stdin.read()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
        text=True,
    )
    try:
        line = p.stdout.readline()
        pids = json.loads(line)
        assert len(pids) == 3 and all(alive(x) for x in pids)
        assert all(psutil.Process(x).ppid() == pids[0] for x in pids[1:])
        if end == "exit":
            p.stdin.close()  # the script ends: its atexit shuts the mesh down
            assert p.wait(60) == 0
    finally:
        p.kill()
        p.wait(30)
    assert pids_gone(pids, timeout=10) == [], "the agent or a rank outlived its controller"


def test_bad_local_ranks_is_a_clear_error():
    for bad in ("0", "-3"):
        p = subprocess.run(
            [sys.executable, "-m", "monarch_nb.host", "--local-ranks", bad, "--stdio"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
        assert p.returncode == 2
        assert f"--local-ranks must be at least 1 (got {bad})" in p.stderr


def test_a_mesh_larger_than_the_agents_slots_is_refused_and_the_agent_serves_on(hosted):
    agent = HostAgent(local_ranks=2)
    try:
        with pytest.raises(RuntimeError) as ei:
            _mesh_on(agent, "toobig", 3)
        msg = str(ei.value)
        assert f"host agent (pid {agent.pid})" in msg and "rank 2" in msg
        assert "2 rank slot(s) (--local-ranks), all in use" in msg
        wait_for(lambda: not psutil.Process(agent.pid).children(), 15, "the started ranks gone")
        m = _mesh_on(agent, "fits", 2)
        try:
            m.exec("z = 3")
            assert m.pull("z") == [3, 3]
        finally:
            m.shutdown()
        assert hosted.pull("__name__", rank=0) == "__main__"  # the other mesh serves on
    finally:
        agent.stop()
    assert not agent.alive


def test_an_unknown_spawn_method_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MONARCH_NB_SPAWN", "fork-server")
    with pytest.raises(ValueError, match="MONARCH_NB_SPAWN='fork-server': one of agent, popen"):
        mnb.local_mesh(dp=1, name="unknown-spawn")
    assert "unknown-spawn" not in mnb.api.mesh.all_meshes()


def test_a_fork_that_fails_is_a_clear_error(hosted):
    agent = HostAgent(local_ranks=8)
    group = pids_cgroup(f"mnb_host_test_{os.getpid()}")
    try:
        (group / "pids.max").write_text("1")  # the agent itself: no fork succeeds
        (group / "cgroup.procs").write_text(str(agent.pid))
        with pytest.raises(RuntimeError) as ei:
            _mesh_on(agent, "nofork", 2)
        msg = str(ei.value)
        assert f"host agent (pid {agent.pid}) could not start rank 0 of 2" in msg
        assert "cannot fork rank 0" in msg and "Resource temporarily unavailable" in msg
        assert agent.alive
        assert hosted.pull("__name__", rank=1) == "__main__"
    finally:
        agent.stop()
        group.rmdir()


def test_host_messages_refuse_what_is_not_a_record():
    r = hm.LineReader()
    got = r.feed(b'{"t": "Kill", "slot": 1, "sig": 9}\nnot json\n{"t": "Exec"}\n{"t": "Ki')
    assert got[0] == hm.Kill(1, 9)
    assert isinstance(got[1], hm.HostMessageError) and "not JSON" in str(got[1])
    assert isinstance(got[2], hm.HostMessageError) and "unknown record type" in str(got[2])
    assert r.feed(b'll", "slot": 2}\n')[0].args[0].startswith("Kill: ")
    data = b"\xff\xfe raw"
    assert hm.output_bytes(hm.decode(hm.encode(hm.output(3, data)))) == data


def test_a_restart_whose_forks_fail_leaves_the_mesh_broken_with_the_reason():
    agent = HostAgent(local_ranks=8)
    m = _mesh_on(agent, "refork", 2)
    group = pids_cgroup(f"mnb_host_restart_{os.getpid()}")
    try:
        (group / "pids.max").write_text("max")
        (group / "cgroup.procs").write_text(str(agent.pid))
        (group / "pids.max").write_text("1")  # its old ranks stay where they were
        with pytest.raises(RuntimeError, match="cannot fork rank 0"):
            m.restart()
        with pytest.raises(mnb.RemoteError, match="the restart failed: RuntimeError"):
            mnb.remote(torch.ones)(2, mesh=m).fetch(timeout=30)
        (group / "pids.max").write_text("max")
        m.restart()
        assert mnb.remote(torch.ones)(2, mesh=m).fetch(timeout=60)[1].tolist() == [1.0, 1.0]
    finally:
        m.shutdown()
        agent.stop()
        group.rmdir()


def test_a_fork_of_the_controller_starts_an_agent_of_its_own(hosted):
    parent = local_agent()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked copy of the controller (multiprocessing's fork, say)
        code = 1
        try:
            os.close(r)
            mine = local_agent()
            os.write(w, f"{mine.pid} {psutil.Process(mine.pid).ppid()}\n".encode())
            mine.stop()
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, line
    child_agent, its_parent = map(int, line.split())
    assert child_agent != parent.pid and its_parent in (pid, psutil.Process(parent.pid).ppid())
    assert parent.alive and local_agent() is parent
    assert hosted.pull("__name__", rank=0) == "__main__"


# the last test: it kills the warm agent (the module's mesh with it)
def test_the_agent_killed_fails_its_ranks_clearly_and_a_restart_gets_a_new_one():
    m = mnb.local_mesh(dp=2, name="orphaned")
    try:
        agent = local_agent()
        ranks = list(rank_pids(m).values())
        busy = m.exec("import time\ntime.sleep(60)")
        os.kill(agent.pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashed) as ei:
            busy.fetch(timeout=30)
        text = str(ei.value) + ei.value.stderr_tail
        assert f"the host agent (pid {agent.pid}) was killed by signal SIGKILL" in text
        assert "its ranks died with it" in text
        assert pids_gone(ranks, timeout=10) == [], "a rank outlived its agent"
        m.restart()
        fresh = local_agent()
        assert fresh.pid != agent.pid and fresh.alive
        assert m.pull("__name__") == ["__main__", "__main__"]
    finally:
        m.shutdown()
