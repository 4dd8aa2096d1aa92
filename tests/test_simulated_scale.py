"""Simulated scale: light ranks (``monarch-nb-host --simulate N``, no torch) on
simulated hosts, each its own process, every rank with its own signed ZeroMQ
connection to a real controller. CI runs 256 ranks (8 hosts x 32); the benchmark
(benchmarks/scale.py) runs 1,024."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import zmq
from wait_helpers import alive, pids_gone, wait_for

import monarch_nb as mnb
from monarch_nb.controller.errors import RemoteError, WorkerCrashed
from monarch_nb.launchers.host_agent import HostAgent, sim_boot_path

ROOT = Path(__file__).resolve().parents[1]
HOSTS, PER_HOST = 8, 32
WORLD = HOSTS * PER_HOST


def noop():
    return None


def double(x):
    return 2 * x


@pytest.fixture(scope="module")
def sim():
    m = mnb.local_mesh(host=HOSTS, gpu=PER_HOST, simulate=True, name="sim256")
    yield m
    m.shutdown()


def _hosts(mesh) -> list[int]:
    return mesh._controller.workers.launcher.pids()


def _env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def test_256_light_ranks_broadcast_exec_fetch_and_status(sim):
    assert sim.backend == "simulated" and sim.size == WORLD
    mnb.remote(noop)(mesh=sim)
    sim.wait(timeout=60)
    sim.exec("x = rank * 3 + gpu").fetch(timeout=60)
    assert sim.exec("x").fetch(timeout=60) == [r * 3 + r % PER_HOST for r in range(WORLD)]
    ref = sim.exec("rank + 1")
    assert mnb.remote(double)(ref, mesh=sim).fetch(timeout=60) == [
        2 * (r + 1) for r in range(WORLD)
    ]
    status = wait_for(
        lambda: (s := sim.status())["ranks"][WORLD - 1]["rss"] is not None and s,
        30,
        "every light rank's first Health",
    )
    assert sorted(status["ranks"]) == list(range(WORLD))
    assert all(w["alive"] for w in status["ranks"].values())
    hosts = {r: w["host"] for r, w in status["ranks"].items()}
    assert {hosts[r] for r in range(WORLD)} == {f"sim-{i}" for i in range(HOSTS)}
    assert all(hosts[r] == f"sim-{r // PER_HOST}" for r in range(WORLD))
    # one process per simulated host, and none of them loaded torch
    pids = _hosts(sim)
    assert len(set(pids)) == HOSTS
    assert {w["pid"] for w in status["ranks"].values()} == set(pids)
    for pid in pids:
        maps = open(f"/proc/{pid}/maps").read()
        assert "libtorch" not in maps, f"simulated host {pid} loaded torch"


def test_a_light_rank_reports_failures_as_a_worker_does(sim):
    with pytest.raises(RemoteError) as ei:
        sim.exec("1 / (rank - 7)").fetch(timeout=60)
    assert "ZeroDivisionError" in str(ei.value) and "7" in str(ei.value)
    assert sim.exec("rank").fetch(rank=7, timeout=60) == 7  # the mesh serves on


def test_what_needs_torch_is_refused_naming_simulate_mode(sim):
    ref = sim.exec("rank")
    with pytest.raises(RemoteError) as ei:
        ref.reduce("gpu").fetch(rank=0, timeout=60)
    assert "simulated light rank" in str(ei.value) and "Reduce" in str(ei.value)
    assert sim.exec("rank").fetch(rank=WORLD - 1, timeout=60) == WORLD - 1
    import torch  # not at the top: the simulated hosts import this module (noop, double)

    with sim.activate():  # tensor ops: each fails where its value is read
        x = torch.ones(4) + 1
    with pytest.raises(RemoteError) as ei:
        mnb.inspect(x, timeout=60)
    assert "simulated light rank" in str(ei.value) and "RunOps" in str(ei.value)
    with pytest.raises(RemoteError, match="simulated light rank"):
        sim.wait(timeout=60)  # the failures on the other ranks, reported once
    for pid in _hosts(sim):  # the ops' templates (dtypes, devices) were never unpickled there
        assert "libtorch" not in open(f"/proc/{pid}/maps").read()
    assert sim.exec("rank").fetch(rank=0, timeout=60) == 0


def test_restart_keeps_the_simulated_hosts_and_starts_fresh_ranks(sim):
    sim.exec("marker = 1").fetch(timeout=60)
    before = _hosts(sim)
    # 256 ranks connect at once: a listen backlog of ZeroMQ's default (100) makes
    # the rest wait for TCP's resend of their SYN (1 s) at every start and restart
    assert sim._controller.io._router.getsockopt(zmq.BACKLOG) >= 1024
    sim.restart()
    assert _hosts(sim) == before
    assert sim.exec("'marker' in globals()").fetch(timeout=60) == [False] * WORLD
    mnb.remote(noop)(mesh=sim)
    sim.wait(timeout=60)


def test_a_mesh_beyond_the_slots_is_refused_and_the_other_meshes_serve_on(sim):
    with pytest.raises(ValueError, match=r"1025 ranks does not fit.*1024 simulated rank slots"):
        mnb.local_mesh(host=41, gpu=25, simulate=True, name="too-big")
    # two meshes claiming more slots than exist: the second is refused, naming the first
    with pytest.raises(ValueError, match=r"769 ranks does not fit.*256 held.*'sim256': 256"):
        mnb.local_mesh(world=769, simulate=32, name="too-many")
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="ranks per simulated host must be a positive int"):
            mnb.local_mesh(world=4, simulate=bad, name="bad-simulate")
    mnb.remote(noop)(mesh=sim)
    sim.wait(timeout=60)
    small = mnb.local_mesh(host=2, gpu=2, simulate=True, name="fits")  # the slots are free again
    assert small.exec("rank").fetch(timeout=60) == [0, 1, 2, 3]
    small.shutdown()


@pytest.mark.parametrize(
    "args", [["--simulate", "0"], ["--local-ranks", "0"], ["--simulate", "-2"]]
)
def test_bad_simulate_or_local_ranks_is_a_clear_error(args):
    p = subprocess.run(
        [sys.executable, sim_boot_path(), *args, "--stdio"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert p.returncode == 2
    assert f"{args[0]} must be at least 1 (got {args[1]})" in p.stderr


def test_a_simulated_host_refuses_spawns_beyond_its_slots():
    agent = HostAgent(simulate=2, host_name="tiny")
    try:
        ranks = [agent.spawn(r, 3, "tcp://127.0.0.1:9", b"k" * 32, {}) for r in range(3)]
        wait_for(lambda: all(r.spawned.is_set() for r in ranks), 30, "the agent's answers")
        assert ranks[0].spawn_error is None and ranks[1].spawn_error is None
        assert "simulated host tiny has 2 light rank slot(s)" in ranks[2].spawn_error
        assert "rank 2 does not fit" in ranks[2].spawn_error
        assert agent.alive
    finally:
        agent.stop()
    assert not alive(agent.pid)


def test_a_killed_light_rank_fails_pending_work_naming_host_and_rank():
    with mnb.local_mesh(host=2, gpu=4, simulate=True, name="sim-crash") as m:
        m.exec("x = 1").fetch(timeout=60)
        m._controller.workers.procs[5].kill(signal.SIGKILL)
        with pytest.raises(WorkerCrashed) as ei:
            m.exec("x").fetch(timeout=30)
        e = ei.value
        assert e.rank == 5 and e.exit_code == -signal.SIGKILL
        assert "simulated rank 5 on sim-1 was killed" in e.stderr_tail
        assert m.status()["ranks"][5]["alive"] is False
        # the call that involves rank 5 says restart; the other host serves on
        with pytest.raises(WorkerCrashed, match="needs a restart: its worker rank 5 died"):
            m.exec("x")
        other = m.slice(host=0)
        assert other.exec("x + rank").fetch(timeout=30) == [1, 2, 3, 4]
        mnb.remote(noop)(mesh=other)
        other.wait(timeout=30)
        with pytest.raises(WorkerCrashed, match="rank 5"):
            m.slice(host=1).exec("x").fetch(timeout=30)
        m.restart()
        assert m.exec("rank").fetch(rank=5, timeout=60) == 5


def test_a_killed_simulated_host_fails_all_its_ranks_and_a_restart_replaces_it():
    with mnb.local_mesh(host=2, gpu=4, simulate=True, name="sim-host-crash") as m:
        m.exec("x = 1").fetch(timeout=60)
        dead = _hosts(m)[1]
        os.kill(dead, signal.SIGKILL)
        with pytest.raises(WorkerCrashed) as ei:
            m.exec("x").fetch(timeout=30)
        assert ei.value.rank in (4, 5, 6, 7)
        assert f"simulated host sim-1 (pid {dead}) was killed" in ei.value.stderr_tail
        wait_for(
            lambda: not any(m.status()["ranks"][r]["alive"] for r in (4, 5, 6, 7)),
            10,
            "every rank of the killed host marked dead",
        )
        m.restart()
        assert _hosts(m)[1] != dead
        assert m.exec("rank").fetch(timeout=60) == list(range(8))


def test_shutdown_leaves_no_process():
    m = mnb.local_mesh(host=3, gpu=2, simulate=True, name="sim-end")
    pids = _hosts(m)
    assert len(pids) == 3 and all(alive(p) for p in pids)
    kids = {c.pid for c in psutil.Process().children(recursive=True)}
    assert set(pids) <= kids
    m.shutdown()
    assert pids_gone(pids) == []


def test_mesh_state_forgets_a_command_once_every_rank_finished_it_in_any_order():
    """The bookkeeping each Status updates stays linear at 1,024 ranks: the scan of
    the oldest command resumes where it stopped, and still never forgets early."""
    from monarch_nb.controller.state import MeshState

    n = 1024
    s = MeshState("bookkeeping", {"world": n}, "simulated")
    s.reset(range(n))
    for r in range(n):
        s.worker_ready(r, 1, "h")
    looks = [0]
    finished = s._finished

    def counted(rank, sid):
        looks[0] += 1
        return finished(rank, sid)

    s._finished = counted
    s.record_sent(1, 0, tuple(range(n)), "first")
    s.record_sent(2, 0, tuple(range(n)), "second")
    for r in range(1, n):  # every rank but rank 0 finishes both, in rank order
        s.progress(r, {0: (2, 2, 2)})
    assert [c[0] for c in s.sent[0]] == [1, 2]  # rank 0 has finished neither
    s.progress(0, {0: (1, 1, 1)})
    assert [c[0] for c in s.sent[0]] == [2]
    s.record_sent(3, 0, tuple(range(n)), "third")
    for r in range(n):  # in rank order: a scan from the start each time is quadratic
        s.progress(r, {0: (3, 3, 3)})
    assert not s.sent[0]
    assert looks[0] < 6 * n, f"{looks[0]} looks at ranks for {n} ranks"
    s.record_sent(4, 0, tuple(range(n)), "fourth")
    s.worker_exited(0, -9)  # a dead rank finishes nothing more: not waited for
    for r in range(1, n):
        s.progress(r, {0: (4, 4, 4)})
    assert not s.sent[0]
    assert s.snapshot()["ranks"][7]["streams"]["default"]["queued"] == 0


def test_the_controller_killed_takes_its_simulated_hosts():
    script = (
        "import json, sys\n"
        "import monarch_nb as mnb\n"
        "m = mnb.local_mesh(host=4, gpu=8, simulate=True, name='doomed')\n"
        "m.exec('x = 1').fetch(timeout=60)\n"
        "print(json.dumps(m._controller.workers.launcher.pids()), flush=True)\n"
        "sys.stdin.read()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        pids = json.loads(p.stdout.readline())
        assert len(pids) == 4 and all(alive(q) for q in pids)
        p.kill()
        p.wait(30)
        assert pids_gone(pids, timeout=5) == []
    finally:
        p.kill()
        p.wait(30)


def _limited(soft: int, hard: int, code: str) -> subprocess.CompletedProcess:
    import resource

    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
    )


def test_a_mesh_beyond_the_open_file_limit_is_a_clear_error_and_a_short_soft_one_is_raised():
    code = (
        "import resource, monarch_nb as mnb\n"
        "try:\n"
        "    mnb.local_mesh(world=300, simulate=30, name='wide')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    m = mnb.get_mesh('wide')\n"
        "    print('ranks', len(m.exec('rank').fetch(timeout=60)), "
        "'soft', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "    m.shutdown()\n"
    )
    hard = _limited(256, 256, code)
    assert hard.returncode == 0, hard.stderr[-2000:]
    assert "refused: a simulated mesh needs about 330 more open files" in hard.stdout
    assert "the limit is 256 (ulimit -n, hard)" in hard.stdout
    soft = _limited(256, 4096, code)
    assert soft.returncode == 0, soft.stderr[-2000:]
    ranks, n, _, limit = soft.stdout.split()
    assert int(n) == 300 and int(limit) > 300
