"""Host agents on other hosts: ``monarch-nb-host --connect`` (a relay whose child is
the forking agent) joins a ``connect_mesh`` over the signed agent channel.

Real relays started as subprocesses on loopback, real forked ranks, real gloo:
2 hosts x 2 ranks make a world of 4. A zombie counts as gone (wait_helpers.alive)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
from cgroup_helpers import pids_cgroup
from connect_helpers import Waiting, wait_file
from netns_helpers import bridged
from wait_helpers import alive, pids_gone, wait_for
from worker_probes import rank_pids

import monarch_nb as mnb
from monarch_nb.controller.errors import WorkerCrashed
from monarch_nb.protocol.envelope import PROTOCOL_VERSION as THIS

ROOT = Path(__file__).resolve().parents[1]
# a remote host imports from its own environment: this test module too (where())
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p
    ),
    "GLOO_SOCKET_IFNAME": "lo",
}


def relay(conn, *args, heartbeat: float = 10.0, prefix=(), key_file=None, env=None):
    """``monarch-nb-host --connection-file conn ARGS`` (its stderr kept); with
    ``key_file``: ``--connect ADDR --key-file K``, ADDR the file's agent channel."""
    cmd = [*prefix] or [sys.executable, "-m", "monarch_nb.host"]
    if key_file is None:
        cmd += ["--connection-file", str(conn)]
    else:
        info = json.loads(Path(conn).read_text())
        Path(key_file).write_text(info["key"])
        cmd += ["--connect", info["agents"], "--key-file", str(key_file)]
    cmd += ["--heartbeat-timeout", str(heartbeat), *args]
    return subprocess.Popen(cmd, env={**ENV, **(env or {})}, stderr=subprocess.PIPE, text=True)


def tree(p) -> list[int]:
    """A relay and everything under it: its agent and the agent's ranks."""
    try:
        proc = psutil.Process(p.pid)
        return [proc.pid] + [c.pid for c in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def where():
    import os
    import socket

    return (
        int(os.environ["RANK"]),
        int(os.environ["LOCAL_RANK"]),
        socket.gethostname(),
        os.getppid(),
    )


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """A world of 4 on two relays of 2 local ranks each (node ranks 0 and 1): one
    joins with --connection-file, one with --connect ADDR --key-file K."""
    conn = tmp_path_factory.mktemp("remote") / "mesh.json"
    w = Waiting(world=4, hosts=2, gpus=2, connection_file=str(conn), timeout=120, name="remote")
    wait_file(conn)
    relays = [
        relay(conn, "--local-ranks", "2", "--node-rank", "0"),
        relay(conn, "--local-ranks", "2", "--node-rank", "1", key_file=conn.with_name("key")),
    ]
    try:
        mesh = w.mesh()
        yield mesh, relays, conn
    finally:
        if w.result:
            w.result[0].shutdown()
        for p in relays:
            p.kill()


def test_the_connection_file_names_the_agents_address_the_meshs_router(hosts):
    mesh, relays, conn = hosts
    info = json.loads(conn.read_text())
    # host agents join through the mesh's own ROUTER: one port for workers and agents
    assert info["agents"].startswith("tcp://127.0.0.1:") and info["agents"] == info["address"]
    text = mesh._controller.workers.launcher.lines(info["address"], 4)  # what connect_mesh printed
    assert f"srun --ntasks-per-node 1 monarch-nb-host --connection-file {conn}" in text
    assert f"monarch-nb-host --connect {info['agents']} --key-file K" in text
    assert "torchrun --nnodes NODES --nproc-per-node 1 -m monarch_nb.host" in text
    assert "mnb.k8s_manifest" in text and f"--from-file=connection.json={conn}" in text
    assert "-m monarch_nb.worker --connection-file" in text


def test_agents_fork_their_blocks_which_run_a_cell_an_all_reduce_and_a_fetch(hosts):
    mesh, relays, _ = hosts
    agents = [psutil.Process(p.pid).children()[0].pid for p in relays]
    seen = mnb.remote(where)(mesh=mesh).fetch(timeout=60)
    assert [s[:2] for s in seen] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert [s[3] for s in seen] == [agents[0], agents[0], agents[1], agents[1]]
    mesh.exec("import torch, os\nx = torch.full((2,), float(os.environ['RANK']))")
    assert mesh.pull("x", rank=3).tolist() == [3.0, 3.0]
    ones = mnb.remote(torch.ones)(2, mesh=mesh)
    assert [t.tolist() for t in ones.reduce(("hosts", "gpus"), "sum").fetch(timeout=60)] == [
        [4.0, 4.0]
    ] * 4


def test_tab_and_shift_tab_reach_a_rank_behind_a_relay(hosts):
    mesh, _, _ = hosts
    mesh.exec("def behind_the_relay(a):\n    'Help from a remote host.'")
    assert mesh.complete("behind_the_re", rank=3, timeout=30)["matches"] == ["behind_the_relay"]
    info = mesh.inspect_code("behind_the_relay", rank=2, timeout=30)
    assert "Help from a remote host." in info["data"]["text/plain"]


def test_restart_forks_again_through_the_same_agents(hosts):
    mesh, relays, _ = hosts
    before = tree(relays[0]) + tree(relays[1])
    ranks = list(rank_pids(mesh).values())
    mesh.restart()
    after = rank_pids(mesh)
    assert sorted(after) == [0, 1, 2, 3] and not set(after.values()) & set(ranks)
    assert all(p.poll() is None for p in relays)
    agents = [psutil.Process(p.pid).children()[0].pid for p in relays]
    assert all(a in before for a in agents)  # the same relays and agents
    assert pids_gone(ranks, timeout=10) == []
    assert mnb.remote(where)(mesh=mesh).fetch(timeout=60)[2][:2] == (2, 0)


def test_a_rank_killed_under_a_remote_agent_fails_pending_work_naming_host_and_rank(hosts):
    mesh, relays, _ = hosts
    mesh.exec("import os\nos.write(2, b'last words of rank 2\\n')").fetch(timeout=60)
    busy = mesh.exec("import time\ntime.sleep(60)")
    os.kill(rank_pids(mesh)[2], signal.SIGKILL)
    with pytest.raises(WorkerCrashed) as ei:
        busy.fetch(timeout=30)  # the agent's report fails it long before this bound
    e = ei.value
    assert e.rank == 2 and e.exit_code == -signal.SIGKILL
    assert "last words of rank 2" in e.stderr_tail
    assert f"rank 2 ran on host {os.uname().nodename} (relay pid {relays[1].pid})" in e.stderr_tail
    mesh.restart()  # the same agents fork the world again
    assert mesh.pull("__name__") == ["__main__"] * 4


@pytest.mark.parametrize("victim", ["agent", "relay"])
def test_a_remote_agent_killed_fails_all_its_ranks_naming_its_host(hosts, victim):
    mesh, relays, conn = hosts
    i = 0 if victim == "agent" else 1
    agent = psutil.Process(relays[i].pid).children()[0].pid
    ranks = [pid for r, pid in rank_pids(mesh).items() if r // 2 == i]
    busy = mesh.exec("import time\ntime.sleep(60)")
    os.kill(agent if victim == "agent" else relays[i].pid, signal.SIGKILL)
    with pytest.raises(WorkerCrashed) as ei:
        busy.fetch(timeout=30)
    text = ei.value.stderr_tail
    assert ei.value.rank in (2 * i, 2 * i + 1)
    assert f"host {os.uname().nodename} (relay pid {relays[i].pid})" in text
    if victim == "agent":
        assert "its host agent was killed by signal SIGKILL" in text
    else:
        assert "its connection closed (the relay process is gone)" in text
    assert "its ranks died with it" in text
    assert relays[i].wait(30) != 0  # a relay whose agent died leaves
    assert pids_gone(ranks + [agent], timeout=10) == []
    relays[i] = relay(conn, "--local-ranks", "2", "--node-rank", str(i))  # a new host
    wait_for(
        lambda: len(mesh._controller.workers.launcher.agents.hosts()) == 2, 120, "the new host"
    )
    mesh.restart()
    assert [s[:2] for s in mnb.remote(where)(mesh=mesh).fetch(timeout=60)][2 * i] == (2 * i, 0)


def test_bad_agents_are_refused_with_the_cause_and_the_mesh_serves_on(hosts, tmp_path):
    mesh, relays, conn = hosts
    zero = relay(conn, "--local-ranks", "0")
    assert zero.wait(60) == 2 and "--local-ranks must be at least 1" in zero.stderr.read()
    same = relay(conn, "--local-ranks", "2", "--node-rank", "1")
    assert same.wait(60) == 2
    assert "two host agents claim host slot 1" in same.stderr.read()
    beyond = relay(conn, "--local-ranks", "1", "--node-rank", "5")
    assert beyond.wait(60) == 2
    assert "ranks 5-5, beyond the mesh's world of 4" in beyond.stderr.read()
    big = relay(conn, "--local-ranks", "8")
    assert big.wait(60) == 2
    assert "it offers 8 ranks, more than the 0 free of the mesh's world of 4" in big.stderr.read()
    wrong = dict(json.loads(conn.read_text()), key=os.urandom(32).hex())
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    bad_key = relay(tmp_path / "wrong.json", "--local-ranks", "1", heartbeat=2)
    assert bad_key.wait(60) == 3  # never answered: it leaves once its heartbeat timeout passes
    assert "wrong key" in bad_key.stderr.read()
    other = relay(
        conn,
        "--local-ranks",
        "1",
        prefix=[
            sys.executable,
            "-c",
            f"import sys, monarch_nb.protocol.envelope as e; e.PROTOCOL_VERSION = {THIS + 1}; "
            "from monarch_nb.host.__main__ import main; main(sys.argv[1:])",
        ],
    )
    assert other.wait(60) == 2
    assert f"the controller speaks protocol {THIS}, this host agent {THIS + 1}" in other.stderr.read()
    refusals = mesh._controller.workers.launcher.agents.refusals
    assert any(f"a host agent speaks protocol {THIS + 1}, this mesh {THIS}" in r for r in refusals)
    assert mesh.pull("__name__") == ["__main__"] * 4


def test_an_agent_and_a_per_rank_worker_make_one_mesh_and_shutdown_ends_them(tmp_path):
    conn = tmp_path / "mesh.json"
    w = Waiting(world=3, connection_file=str(conn), timeout=120, name="mixed")
    wait_file(conn)
    host = relay(conn, "--local-ranks", "2")
    worker = subprocess.Popen(
        [sys.executable, "-m", "monarch_nb.worker", "--connection-file", str(conn)]
        + ["--rank", "2", "--world", "3"],
        env=ENV,
    )
    try:
        mesh = w.mesh()
        pids = tree(host)
        assert len(pids) == 4  # relay, agent, 2 ranks
        assert mnb.remote(mnb.current_rank)(mesh=mesh).fetch(timeout=60) == [0, 1, 2]
        ones = mnb.remote(torch.ones)(1, mesh=mesh)
        assert ones.reduce("world", "sum").fetch(rank=2, timeout=60).tolist() == [3.0]
        mesh.shutdown()
        assert host.wait(30) == 0 and worker.wait(30) == 0
        assert pids_gone(pids, timeout=10) == []
    finally:
        host.kill()
        worker.kill()


@pytest.mark.parametrize("end", ["SIGKILL", "SIGSTOP"])
def test_the_controller_gone_takes_every_relay_agent_and_rank(tmp_path, end):
    """SIGKILL closes its connections (the relays see them close); SIGSTOP leaves them
    open but silent (the relays' short heartbeat timeout, here 6 s)."""
    conn = tmp_path / "mesh.json"
    script = tmp_path / "ctl.py"
    script.write_text(
        textwrap.dedent(f"""
        import time, monarch_nb as mnb
        mesh = mnb.connect_mesh(world=2, connection_file={str(conn)!r}, timeout=120)
        assert mnb.remote(lambda: 1)(mesh=mesh).fetch() == [1, 1]
        print("ready", flush=True)
        time.sleep(600)
    """)
    )
    ctl = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=ENV
    )
    relays = []
    # SIGKILL: the closed connection ends them. SIGSTOP: the relays' timeout, 6 s as a
    # starting controller (importing torch) can hold its GIL for seconds on a loaded machine
    heartbeat = 6 if end == "SIGSTOP" else 60
    try:
        wait_file(conn)
        relays = [relay(conn, "--local-ranks", "1", heartbeat=heartbeat) for _ in range(2)]
        assert any(line.strip() == "ready" for line in iter(ctl.stdout.readline, ""))
        pids = tree(relays[0]) + tree(relays[1])
        assert len(pids) == 6 and all(alive(p) for p in pids)
        os.kill(ctl.pid, getattr(signal, end))
        assert pids_gone(pids, timeout=30) == [], "a relay, agent or rank outlived its controller"
        assert [p.wait(5) for p in relays] == [3, 3]
        why = "closed and it has not answered" if end == "SIGKILL" else "for 6 s"
        assert all(why in p.stderr.read() for p in relays)
    finally:
        ctl.kill()
        for p in relays:
            p.kill()


def test_an_agent_whose_forks_fail_fails_the_start_naming_host_and_cause(tmp_path):
    conn = tmp_path / "mesh.json"
    w = Waiting(world=1, connection_file=str(conn), timeout=120, name="nofork")
    wait_file(conn)
    p = relay(conn, "--local-ranks", "1")
    mesh = w.mesh()
    group = pids_cgroup(f"mnb_remote_test_{os.getpid()}")
    try:
        for pid in tree(p)[:2]:  # the relay and its agent; the rank stays where it is
            (group / "cgroup.procs").write_text(str(pid))
        # their own tasks only (the relay's I/O threads): no fork succeeds
        (group / "pids.max").write_text((group / "pids.current").read_text().strip())
        with pytest.raises(WorkerCrashed) as ei:
            mesh.restart()
        text = ei.value.stderr_tail
        assert f"host {os.uname().nodename} (relay pid {p.pid}) could not start rank 0" in text
        assert "cannot fork rank 0" in text and "Resource temporarily unavailable" in text
        assert p.poll() is None  # the agent serves on
        (group / "pids.max").write_text("max")
        mesh.restart()
        assert mesh.pull("__name__") == ["__main__"]
    finally:
        mesh.shutdown()
        p.kill()
        p.wait()
        wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), 30, "an empty cgroup")
        group.rmdir()


def test_spawns_over_the_network_carry_no_secret_and_every_record_is_signed(tmp_path):
    """A relay made by hand (a real DEALER speaking the agent link) sees what crosses
    the network: signed records, the rank's variables, never the mesh key."""
    import zmq

    from monarch_nb.protocol import agent_link
    from monarch_nb.protocol import host_messages as hm
    from monarch_nb.protocol.envelope import ENTRY, Sealer
    from monarch_nb.protocol.wire import Signer

    conn = tmp_path / "mesh.json"
    w = Waiting(world=2, connection_file=str(conn), timeout=60, name="handmade")
    wait_file(conn)
    info = json.loads(conn.read_text())
    key = bytes.fromhex(info["key"])
    signer = Signer(key)
    sealer = Sealer(signer, agent_link.AGENT)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(info["agents"])

    def send(msg):
        sock.send_multipart(agent_link.seal(sealer, signer, msg))

    def recv(kind):
        while True:
            assert sock.poll(30_000), f"no {kind.__name__} from the controller"
            frames = sock.recv_multipart()
            assert hmac_ok(frames, signer)
            _, msg = agent_link.open_record(frames, signer)
            if isinstance(msg, kind):
                return msg

    def hmac_ok(frames, signer):
        entry = ENTRY.pack(len(frames[2]), len(frames[3]))  # the record's own signature
        return (
            frames[0] == signer.mac_of(frames[1], entry, frames[2])
            and frames[2] == signer.mac(frames[3])
        )

    try:
        send(hm.Hello("handmade", os.getpid(), mnb.__version__, 2, None))
        assert recv(hm.Welcome) == hm.Welcome(0, 2, 2)
        send(hm.AgentReady(os.getpid(), "handmade", mnb.__version__, 2))
        spawns = [recv(hm.Spawn), recv(hm.Spawn)]
        assert [(s.rank, s.local_rank, s.world) for s in spawns] == [(0, 0, 2), (1, 1, 2)]
        assert all(s.key_hex == "" and s.sys_path == [] and s.cwd == "" for s in spawns)
        assert spawns[1].env == {
            "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"
        }  # fmt: skip
        assert spawns[0].address == info["address"]
        send(hm.AgentGone(-signal.SIGKILL))
        with pytest.raises(WorkerCrashed) as ei:
            w.mesh()
        assert "host handmade" in ei.value.stderr_tail
        assert "its host agent was killed by signal SIGKILL" in ei.value.stderr_tail
    finally:
        sock.close(0)
        ctx.term()


def _eth0_addr():
    import subprocess

    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True
    ).stdout
    return out.split()[3].split("/")[0]


def test_two_hosts_in_network_namespaces_join_through_their_agents(tmp_path):
    """Each "host" a network namespace of its own: the agent channel, the ranks'
    connections and gloo cross the bridge (the controller binds on its address)."""
    with bridged(2, "10.213.9") as net:
        nss, hosts = net.spaces, net.hosts
        conn = tmp_path / "mesh.json"
        w = Waiting(
            world=2, connection_file=str(conn), timeout=120, name="nshosts", interface="10.213.9.1"
        )
        wait_file(conn)
        assert json.loads(conn.read_text())["agents"].startswith("tcp://10.213.9.1:")
        relays = [
            relay(
                conn,
                "--local-ranks",
                "1",
                "--node-rank",
                str(i),
                prefix=["ip", "netns", "exec", ns, sys.executable, "-m", "monarch_nb.host"],
                env={"GLOO_SOCKET_IFNAME": "eth0"},
            )
            for i, ns in enumerate(nss)
        ]
        try:
            mesh = w.mesh()
            assert mnb.remote(_eth0_addr)(mesh=mesh).fetch(timeout=60) == hosts
            ones = mnb.remote(torch.ones)(2, mesh=mesh)
            assert ones.reduce("world", "sum").fetch(rank=1, timeout=60).tolist() == [2.0, 2.0]
            mesh.shutdown()
            assert [p.wait(30) for p in relays] == [0, 0]
        finally:
            for p in relays:
                p.kill()
