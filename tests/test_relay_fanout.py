"""The fan-out through real host agents: each relay (``monarch-nb-host --connect``)
joins the mesh's ROUTER as its host, its forked ranks connect to the relay's own
ipc socket, every command goes once per host and what the ranks send comes back
in the host's envelopes.

Real relays as subprocesses on loopback, real forked ranks, real gloo, the
process groups' store reached through the relays (``MONARCH_NB_RENDEZVOUS=
controller``): 2 hosts x 2 ranks make a world of 4."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
import zmq
from test_remote_agents import Waiting, relay, tree, wait_file, where
from wait_helpers import pids_gone, wait_for

import monarch_nb as mnb
from monarch_nb._version import __version__
from monarch_nb.controller.errors import WorkerCrashed
from monarch_nb.protocol import Signer, decode, encode
from monarch_nb.protocol import messages as m
from monarch_nb.protocol.envelope import Sealer, host_peer, unseal
from monarch_nb.protocol.wire import send_frames


def noop():
    return None


def add(a, b):
    return a + b


def mark_then_sleep(path: str, seconds: float) -> None:
    import time

    open(f"{path}-{mnb.current_rank()}", "w").close()
    time.sleep(seconds)


def tcp_peers():
    """The TCP ports this rank's process is connected to."""
    import psutil

    return sorted({c.raddr.port for c in psutil.Process().net_connections("tcp") if c.raddr})


def listens(pid: int) -> list[str]:
    """The unix socket paths process ``pid`` is bound to."""
    return sorted(c.laddr for c in psutil.Process(pid).net_connections("unix") if c.laddr)


@pytest.fixture(scope="module")
def fan(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("MONARCH_NB_RENDEZVOUS", "MONARCH_NB_RELAY_FANOUT")}
    os.environ["MONARCH_NB_RENDEZVOUS"] = "controller"  # the store through the relays
    os.environ.pop("MONARCH_NB_RELAY_FANOUT", None)
    conn = tmp_path_factory.mktemp("fan") / "mesh.json"
    w = Waiting(world=4, hosts=2, gpus=2, connection_file=str(conn), timeout=120, name="fan")
    wait_file(conn)
    relays = [relay(conn, "--local-ranks", "2", "--node-rank", str(i)) for i in range(2)]
    try:
        mesh = w.mesh()
        yield mesh, relays, conn
    finally:
        if w.result:
            w.result[0].shutdown()
            for p in relays:
                try:
                    p.wait(30)  # Quit: it ends its ranks and removes its socket's directory
                except subprocess.TimeoutExpired:
                    pass
        for p in relays:
            p.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hosted(ctrl) -> bool:
    ids = ctrl.workers.identities
    hosts = ctrl.io.routes.hosts
    return len(ids) == 4 and set(ids.values()) == hosts and len(hosts) == 2


def test_every_rank_is_reached_through_its_host_and_runs_cells_collectives_and_fetches(fan):
    mesh, relays, _ = fan
    ctrl = mesh._controller
    assert hosted(ctrl)  # no rank has a socket of its own at the controller
    assert ctrl.rendezvous.kind == "controller"
    links = sorted((li.host, li.pid, sorted(li.ranks)) for li in ctrl.replies.hosts.links.values())
    assert links == [(0, relays[0].pid, [0, 1]), (1, relays[1].pid, [2, 3])]
    agents = [psutil.Process(p.pid).children()[0].pid for p in relays]
    seen = mnb.remote(where)(mesh=mesh).fetch(timeout=60)
    assert [s[:2] for s in seen] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert [s[3] for s in seen] == [agents[0], agents[0], agents[1], agents[1]]
    # no rank is connected to the mesh's ROUTER: each relay's ipc socket, in a 0700 dir
    assert all(ctrl.io.port not in ports for ports in mnb.remote(tcp_peers)(mesh=mesh).fetch())
    for p in relays:
        paths = sorted({a for a in listens(p.pid) if a.endswith("/ranks")})
        assert len(paths) == 1 and "mnb-relay-" in paths[0]
        assert stat.S_IMODE(os.stat(os.path.dirname(paths[0])).st_mode) == 0o700
    mesh.exec("import torch, os\nx = torch.full((2,), float(os.environ['RANK']))")
    assert mesh.pull("x", rank=3).tolist() == [3.0, 3.0]
    ones = mnb.remote(torch.ones)(2, mesh=mesh)
    assert [t.tolist() for t in ones.reduce(("hosts", "gpus"), "sum").fetch(timeout=60)] == [
        [4.0, 4.0]
    ] * 4
    big = mnb.remote(torch.full)((1 << 20,), 7.0, mesh=mesh)  # 4 MB per rank, up
    got = big.fetch(timeout=60)
    assert [t.shape[0] for t in got] == [1 << 20] * 4 and all(float(t[-1]) == 7.0 for t in got)
    down = mnb.remote(torch.sum)(torch.full((1 << 20,), 2.0), mesh=mesh)  # 4 MB down
    assert [float(v) for v in down.fetch(timeout=60)] == [2.0 * (1 << 20)] * 4
    assert hosted(ctrl)
    for p in relays:  # what it reads it reads without unpickling a user's value or torch's
        assert "libtorch" not in Path(f"/proc/{p.pid}/maps").read_text()


def test_tensor_engine_ops_reach_every_rank_through_the_relays(fan):
    mesh, _, _ = fan
    with mesh.activate():
        x = torch.ones(4)
        for _ in range(100):  # pipelined: packed into RunOps, fanned out per host
            x = x + 1
        total = (x * 2).sum().reduce(("hosts", "gpus"), "sum")
    assert mnb.inspect(x, hosts=1, gpus=1).tolist() == [101.0] * 4
    assert float(mnb.inspect(total, hosts=0, gpus=1)) == 4 * (101.0 * 2 * 4)
    assert hosted(mesh._controller)


def _up(ctrl) -> dict:
    """Host socket identity -> how many envelopes it has sent."""
    peers = ctrl.peers
    return {i: peers._sockets[peers._identities[i][1]][1] for i in ctrl.io.routes.hosts}


def test_a_broadcast_and_wait_costs_a_few_envelopes_per_host_not_per_rank(fan):
    mesh, _, _ = fan
    ctrl = mesh._controller
    f = mnb.remote(noop)
    f(mesh=mesh)
    mesh.wait(timeout=60)
    hosts = ctrl.io.routes.hosts
    down, up = {h: ctrl.sealer._seq[h] for h in hosts}, _up(ctrl)
    n = 20
    for _ in range(n):
        f(mesh=mesh)
        mesh.wait(timeout=60)
    # down: the call and the status request, each once per host; up: one folded Status
    # per host and wait (plus a tick's progress and health), where 2 ranks unfolded
    # would send at least 2
    sent = {h: ctrl.sealer._seq[h] - down[h] for h in hosts}
    got = {h: v - up[h] for h, v in _up(ctrl).items()}
    assert all(v <= 2 * n for v in sent.values()), sent
    assert all(v <= n + 12 for v in got.values()), got
    assert mesh.status()["requests"] == 0


def test_restart_forks_again_through_the_same_relays_and_hosts(fan):
    mesh, relays, _ = fan
    ctrl = mesh._controller
    before = tree(relays[0]) + tree(relays[1])
    ranks = list(ctrl.worker_pids().values())
    links = set(ctrl.io.routes.hosts)
    mesh.restart()
    assert sorted(ctrl.worker_pids()) == [0, 1, 2, 3]
    assert not set(ctrl.worker_pids().values()) & set(ranks)
    assert all(p.poll() is None for p in relays)
    assert [psutil.Process(p.pid).children()[0].pid in before for p in relays] == [True, True]
    assert pids_gone(ranks, timeout=10) == []
    assert hosted(ctrl) and ctrl.io.routes.hosts == links  # the same host sockets
    ones = mnb.remote(torch.ones)(1, mesh=mesh)
    assert ones.reduce(("hosts", "gpus"), "sum").fetch(rank=2, timeout=60).tolist() == [4.0]


def test_with_the_fan_out_off_each_rank_connects_itself_and_back(fan, monkeypatch):
    mesh, _, _ = fan
    ctrl = mesh._controller
    monkeypatch.setenv("MONARCH_NB_RELAY_FANOUT", "0")
    mesh.restart()
    ids = ctrl.workers.identities
    assert len(set(ids.values())) == 4 and not set(ids.values()) & ctrl.io.routes.hosts
    assert mnb.remote(mnb.current_rank)(mesh=mesh).fetch(timeout=60) == [0, 1, 2, 3]
    monkeypatch.setenv("MONARCH_NB_RELAY_FANOUT", "1")
    mesh.restart()
    assert hosted(ctrl)
    assert mnb.remote(mnb.current_rank)(mesh=mesh).fetch(timeout=60) == [0, 1, 2, 3]


def test_a_bad_fan_out_switch_is_a_clear_error(monkeypatch):
    from monarch_nb.launchers.remote_hosts import fanout

    monkeypatch.setenv("MONARCH_NB_RELAY_FANOUT", "yes")
    with pytest.raises(ValueError, match="MONARCH_NB_RELAY_FANOUT='yes': 0 or 1"):
        fanout()


def _rogue(ctrl, host: int, key: bytes, pid: int):
    signer = Signer(key)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ctrl.address)
    join = encode(m.HostJoin(host, pid, "rogue", __version__), signer)
    send_frames(sock, Sealer(signer, host_peer(host)).seal(join))
    return sock


def test_a_host_with_a_wrong_key_or_not_the_relay_of_its_slot_is_refused(fan):
    mesh, relays, _ = fan
    ctrl = mesh._controller
    before = mesh.status()["rejections"]["signature"]
    sock = _rogue(ctrl, 1, b"k" * 32, relays[1].pid)  # the right pid, a wrong key
    try:
        wait_for(lambda: mesh.status()["rejections"]["signature"] > before, 30, "the bad seal")
        assert not sock.poll(200)  # never answered
    finally:
        sock.close()
    key = ctrl._secret
    sock = _rogue(ctrl, 1, key, os.getpid())  # the mesh's key, not slot 1's relay
    try:
        assert sock.poll(30_000), "no answer from the controller"
        _, parts = unseal(sock.recv_multipart(), Signer(key))
        msg = decode(parts[0], Signer(key))
        assert type(msg) is m.Refused and "is not a host of this mesh" in msg.reason
    finally:
        sock.close()
    assert hosted(ctrl)
    assert mesh.pull("__name__") == ["__main__"] * 4


def test_an_interrupt_stops_every_stream_of_every_hosted_rank(fan, tmp_path):
    mesh, _, _ = fan
    side = mesh.stream("side")  # a second reply socket per rank, behind the relay
    loop_mark, sleep_mark = tmp_path / "loop", tmp_path / "sleep"
    looping = mesh.exec(f"open(f'{loop_mark}-{{rank}}', 'w').close()\nwhile True: pass")
    sleeping = mnb.remote(mark_then_sleep)(str(sleep_mark), 1000, mesh=mesh, stream=side)
    marks = [f"{m}-{r}" for m in (loop_mark, sleep_mark) for r in range(4)]
    wait_for(lambda: all(os.path.exists(p) for p in marks), 30, "both commands to start")
    mesh.interrupt()
    for ref in (looping, sleeping):
        with pytest.raises(mnb.RemoteError, match="KeyboardInterrupt") as ei:
            ref.fetch(timeout=30)
        assert set(ei.value.failures) == {0, 1, 2, 3}
    assert mesh.exec("1 + 1").fetch(timeout=30) == [2] * 4
    assert mnb.remote(add)(1, 1, mesh=mesh, stream=side).fetch(timeout=30) == [2] * 4
    mesh.wait(timeout=30)


def test_a_gap_on_a_ranks_socket_at_its_relay_fails_what_waits_on_that_rank(fan):
    mesh, relays, _ = fan
    ctrl = mesh._controller
    before = ctrl.state.rejections["gap"]
    pending = mnb.remote(mark_then_sleep)("/dev/null", 3.0, mesh=mesh).fetch_async(timeout=60)
    path = next(a for a in listens(relays[1].pid) if a.endswith("/ranks"))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"ipc://{path}")
    sealer = Sealer(ctrl.signer, 2)  # a new socket of rank 2, whose first message never came
    sealer.seal(encode(m.Ping(), ctrl.signer))
    send_frames(sock, sealer.seal(encode(m.Ping(), ctrl.signer)))
    sock.close()
    with pytest.raises(mnb.RemoteError, match=r"1 message\(s\) from rank 2 were lost"):
        pending.result(timeout=60)
    assert ctrl.state.rejections["gap"] == before + 1
    mesh.wait(timeout=60)
    assert [s[0] for s in mnb.remote(where)(mesh=mesh).fetch(timeout=60)] == [0, 1, 2, 3]


def flood(started: str, go: str, progress: str, mb: int) -> None:
    """Remote: once ``go`` exists, print ``mb`` lines of 1 MB, counting them in a file."""
    import os
    import sys
    import time

    rank = mnb.current_rank()
    open(f"{started}-{rank}", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    line = "x" * (1 << 20) + "\n"
    for i in range(mb):
        sys.stdout.write(line)
        with open(f"{progress}-{rank}", "w") as f:
            f.write(str(i + 1))


def test_a_flood_waits_in_the_ranks_while_the_controller_reads_nothing(fan, tmp_path):
    """The relay stops reading its ranks while its socket up is full, so their sends
    block (as with sockets of their own at the controller) and its memory stays bounded."""
    mesh, relays, _ = fan
    ctrl = mesh._controller
    mb = 300
    got = dict.fromkeys(range(4), 0)
    saved = ctrl.on_output
    ctrl.on_output = lambda msg: got.__setitem__(msg.rank, got[msg.rank] + len(msg.text))
    started, go, progress = tmp_path / "started", tmp_path / "go", tmp_path / "progress"
    procs = [psutil.Process(p.pid) for p in relays]
    try:
        run = mnb.remote(flood)(str(started), str(go), str(progress), mb, mesh=mesh)
        wait_for(lambda: all(os.path.exists(f"{started}-{r}") for r in range(4)), 60, "start")
        base = [p.memory_info().rss for p in procs]
        seen = {"values": None, "since": 0.0}

        def stalled() -> bool:  # every rank's count unchanged for a second, short of mb
            values = []
            for r in range(4):
                try:
                    values.append(int(Path(f"{progress}-{r}").read_text() or 0))
                except (FileNotFoundError, ValueError):
                    values.append(0)
            now = time.monotonic()
            if values != seen["values"]:
                seen["values"], seen["since"] = values, now
            return now - seen["since"] >= 1.0 and max(values) < mb

        assert ctrl.io._lease.acquire(timeout=10)  # the controller reads nothing now
        try:
            go.touch()
            wait_for(stalled, 8, "the ranks to block")
            grown = [p.memory_info().rss - b for p, b in zip(procs, base)]
        finally:
            ctrl.io._lease.release()
        run.fetch(timeout=180)
        mesh.wait(timeout=60)
    finally:
        ctrl.on_output = saved
    assert max(seen["values"]) < mb and min(seen["values"]) > 0, seen
    assert max(grown) < 160 << 20, grown  # the ranks' 600 MB per relay waited in the ranks
    assert all(n == mb * ((1 << 20) + 1) for n in got.values()), got  # and nothing was lost


def test_a_killed_rank_fails_pending_work_naming_host_and_rank(fan):
    mesh, relays, _ = fan
    ctrl = mesh._controller
    mesh.exec("import os\nos.write(2, b'last words of rank 3\\n')").fetch(timeout=60)
    busy = mesh.exec("import time\ntime.sleep(60)")
    os.kill(ctrl.worker_pids()[3], signal.SIGKILL)
    with pytest.raises(WorkerCrashed) as ei:
        busy.fetch(timeout=30)
    e = ei.value
    assert e.rank == 3 and e.exit_code == -signal.SIGKILL
    assert "last words of rank 3" in e.stderr_tail
    assert f"rank 3 ran on host {os.uname().nodename} (relay pid {relays[1].pid})" in e.stderr_tail
    mesh.restart()
    assert hosted(ctrl) and mesh.pull("__name__") == ["__main__"] * 4


def test_a_killed_relay_fails_its_ranks_naming_its_host_and_a_new_one_takes_the_slot(fan):
    mesh, relays, conn = fan
    ctrl = mesh._controller
    ranks = [pid for r, pid in ctrl.worker_pids().items() if r >= 2]
    left = {os.path.dirname(a) for a in listens(relays[1].pid) if a.endswith("/ranks")}
    busy = mesh.exec("import time\ntime.sleep(60)")
    os.kill(relays[1].pid, signal.SIGKILL)  # its socket's directory stays: the next sweeps it
    with pytest.raises(WorkerCrashed) as ei:
        busy.fetch(timeout=30)
    text = ei.value.stderr_tail
    assert ei.value.rank in (2, 3)
    assert f"host {os.uname().nodename} (relay pid {relays[1].pid})" in text
    assert "its connection closed (the relay process is gone)" in text
    assert pids_gone(ranks, timeout=10) == []
    relays[1].wait(10)
    # its socket's directory stays until a relay starts on this host and sweeps it: the
    # next one here, or one another test file starts meanwhile (seen under -n 2)
    assert left
    relays[1] = relay(conn, "--local-ranks", "2", "--node-rank", "1")
    agents = ctrl.workers.launcher.agents
    wait_for(lambda: len(agents.hosts()) == 2, 120, "the new relay")
    mesh.restart()
    assert not any(os.path.exists(d) for d in left)  # the new relay removed it, binding its own
    assert hosted(ctrl)
    links = {li.host: li.pid for li in ctrl.replies.hosts.links.values()}
    assert links == {0: relays[0].pid, 1: relays[1].pid}
    assert [s[:2] for s in mnb.remote(where)(mesh=mesh).fetch(timeout=60)][2] == (2, 0)


def test_sweep_removes_the_directories_of_relays_that_are_gone(tmp_path):
    import socket
    import time

    from monarch_nb.host.relay_ranks import PREFIX, YOUNG_S, sweep_stale

    def made(name: str) -> Path:
        d = tmp_path / (PREFIX + name)
        d.mkdir(mode=0o700)
        return d

    live, dead, young, old = made("live"), made("dead"), made("young"), made("old")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(live / "ranks"))
    listening.listen()
    closed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    closed.bind(str(dead / "ranks"))  # its process gone: the file stays, nobody listens
    closed.close()
    past = time.time() - YOUNG_S - 5
    os.utime(old, (past, past))  # made long ago and never bound
    (tmp_path / "unrelated").mkdir()
    try:
        gone = sweep_stale(str(tmp_path))
    finally:
        listening.close()
    assert sorted(gone) == sorted([str(dead), str(old)])
    assert live.is_dir() and young.is_dir() and (tmp_path / "unrelated").is_dir()
    assert not dead.exists() and not old.exists()
