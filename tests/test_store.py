"""The process-group store reached through the signed controller channel
(worker/store.py, controller/store_server.py), and no open door: a port scan
from another network namespace finds nothing of a joined mesh but its ROUTER."""

from __future__ import annotations

import datetime
import json
import os
import sys

import psutil
import pytest
import torch
from connect_helpers import Waiting, wait_file, worker
from netns_helpers import bridged, ip
from wait_helpers import wait_for

import monarch_nb as mnb
from monarch_nb.controller.store_server import StoreServer
from monarch_nb.protocol import messages as m


@pytest.fixture(scope="module")
def store_mesh():
    """A dp=2 local mesh whose workers meet through the controller's store."""
    old = os.environ.get("MONARCH_NB_RENDEZVOUS")
    os.environ["MONARCH_NB_RENDEZVOUS"] = "controller"
    try:
        mesh = mnb.local_mesh(dp=2, name="store")
    finally:
        if old is None:
            del os.environ["MONARCH_NB_RENDEZVOUS"]
        else:
            os.environ["MONARCH_NB_RENDEZVOUS"] = old
    yield mesh
    mesh.shutdown()


def _store():
    from monarch_nb.worker.store import current_store

    return current_store()


def all_reduced():
    import torch.distributed as dist

    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.tolist(), type(_store()).__name__, _store().generation


def test_the_process_group_starts_on_the_controller_store(store_mesh):
    assert store_mesh._controller.rendezvous.kind == "controller"
    got = mnb.remote(all_reduced)(mesh=store_mesh).fetch(timeout=60)
    gen = store_mesh.generation
    assert got == [([3.0, 3.0], "ControllerStore", gen)] * 2
    reduced = mnb.remote(ones_by_rank)(mesh=store_mesh).reduce("dp").fetch(timeout=60)
    assert [t.tolist() for t in reduced] == [[3.0, 3.0]] * 2  # a new_group's, made through it


def ones_by_rank():
    return torch.ones(2) * (mnb.current_rank() + 1)


def store_ops():
    s, r = _store(), mnb.current_rank()
    other = 1 - r
    out = {"added": s.add("t/counter", 1)}
    s.set(f"t/from{r}", f"hello from {r}".encode())
    s.wait([f"t/from{other}"])  # parked in the controller until the other rank sets it
    out["got"] = s.get(f"t/from{other}")
    out["check"] = (s.check([f"t/from{other}"]), s.check(["t/nobody"]))
    s.wait(["t/counter"], datetime.timedelta(seconds=30))
    # only one rank's compare_set finds the key missing and claims it
    out["claim"] = s.compare_set("t/owner", b"", f"rank{r}".encode())
    s.multi_set([f"t/m{r}a", f"t/m{r}b"], [b"a", b"b"])
    out["multi"] = s.multi_get([f"t/m{other}a", f"t/m{other}b"])
    s.set(f"t/done{r}", b"1")
    s.wait([f"t/done{other}"])
    out["counter"] = int(s.get("t/counter"))
    out["swap"] = s.compare_set("t/owner", b"no such value", b"x")
    return out


def test_store_operations_from_worker_functions(store_mesh):
    a, b = mnb.remote(store_ops)(mesh=store_mesh).fetch(timeout=60)
    assert sorted([a["added"], b["added"]]) == [1, 2]
    assert a["got"] == b"hello from 1" and b["got"] == b"hello from 0"
    assert a["check"] == b["check"] == (True, False)
    assert a["claim"] == b["claim"] in (b"rank0", b"rank1")  # the first one won, for both
    assert a["multi"] == b["multi"] == [b"a", b"b"]
    assert a["counter"] == b["counter"] == 2
    assert a["swap"] == b["swap"] == a["claim"]  # a wrong expected value changes nothing
    keys = store_mesh._controller.rendezvous.store.keys
    assert keys["t/counter"] == b"2" and keys["t/from0"] == b"hello from 0"


def parked_get():
    """A get of the key the other rank sets, made on a side stream's thread."""
    return _store().get(f"c/late{1 - mnb.current_rank()}")


def set_mine():
    r = mnb.current_rank()
    _store().set(f"c/late{r}", f"from {r}".encode())


def test_concurrent_callers_on_one_worker_do_not_wait_for_each_other(store_mesh):
    """A get parked in the controller for one thread of a worker (a side stream's)
    does not hold up another thread's set on the same store (the default stream's).
    No timing: the sets are sent once both gets are seen parked in the controller,
    and each step is bounded (a set held up by the parked get fails the fetch)."""
    server = store_mesh._controller.rendezvous.store
    keys = [["c/late0"], ["c/late1"]]

    def parked():  # the keys our two gets wait for, as the controller holds them
        return sorted(p[3] for p in list(server._parked) if p[3] in keys)

    side = store_mesh.stream("store-waiter")
    waiting = mnb.remote(parked_get)(mesh=store_mesh, stream=side)
    wait_for(lambda: parked() == keys, 30, "both ranks' gets parked in the controller", show=parked)
    mnb.remote(set_mine)(mesh=store_mesh).fetch(timeout=30)
    assert waiting.fetch(timeout=30) == [b"from 1", b"from 0"]
    assert parked() == []


def bounded_get():
    from monarch_nb.worker.store import StoreTimeout

    s = _store()
    old = s.timeout
    s.set_timeout(datetime.timedelta(seconds=0.5))
    try:
        s.get("t/never-set")
    except StoreTimeout as e:
        return str(e)
    finally:
        s.set_timeout(old)
    return "no timeout"


def test_a_bounded_get_times_out_with_a_clear_error(store_mesh):
    texts = mnb.remote(bounded_get)(mesh=store_mesh).fetch(timeout=60)
    for r, text in enumerate(texts):
        assert "store get timed out after 0.5 s" in text and "t/never-set" in text, text
        assert f"rank {r}" in text
    # the mesh, its store and its process groups keep working
    got = mnb.remote(all_reduced)(mesh=store_mesh).fetch(timeout=60)
    assert [g[0] for g in got] == [[3.0, 3.0]] * 2


def bad_requests():
    from monarch_nb.worker.store import ControllerStoreError

    s, out = _store(), []
    s.set("t/text", b"not a number")
    for op, args in [("frobnicate", ()), ("add", ("t/text", 1)), ("set", (3, b"x"))]:
        try:
            s._call(op, args)
        except ControllerStoreError as e:
            out.append(str(e))
    return out


def test_a_bad_request_gets_a_clear_error_and_the_store_keeps_serving(store_mesh):
    texts = mnb.remote(bad_requests)(mesh=store_mesh).fetch(timeout=60)[0]
    assert texts[0] == "store frobnicate: unknown store operation 'frobnicate'"
    assert "key 't/text' does not hold a number" in texts[1]
    assert "a key must be a str, got int" in texts[2]
    assert mnb.remote(all_reduced)(mesh=store_mesh).fetch(timeout=60)[0][0] == [3.0, 3.0]


def ask_a_dead_generation():
    """A store of the previous generation, on this worker's channel: no answer."""
    from monarch_nb.worker.store import ControllerStore, StoreTimeout

    live = _store()
    dead = ControllerStore(live._link, live.generation - 1, datetime.timedelta(seconds=0.3))
    try:
        dead.set("t/from-the-dead", b"x")
    except StoreTimeout as e:
        return str(e), live.check(["t/from-the-dead"])
    return "answered", None


def test_a_restart_serves_a_fresh_generation(store_mesh):
    mnb.remote(lambda: _store().set("t/before", b"1"))(mesh=store_mesh).fetch(timeout=60)
    gen = store_mesh.generation
    store_mesh.restart()
    assert store_mesh.generation == gen + 1
    check = mnb.remote(lambda: (_store().generation, _store().check(["t/before"])))
    assert check(mesh=store_mesh).fetch(timeout=60) == [(gen + 1, False)] * 2
    got = mnb.remote(all_reduced)(mesh=store_mesh).fetch(timeout=60)
    assert got == [([3.0, 3.0], "ControllerStore", gen + 1)] * 2
    text, landed = mnb.remote(ask_a_dead_generation)(mesh=store_mesh).fetch(timeout=60)[0]
    assert "store set timed out after 0.3 s: the controller did not answer" in text
    assert landed is False


def test_an_unknown_rendezvous_kind_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MONARCH_NB_RENDEZVOUS", "tcp")
    with pytest.raises(ValueError, match=r"MONARCH_NB_RENDEZVOUS='tcp': one of auto, file, controller"):
        mnb.local_mesh(dp=1, name="bad-rendezvous")
    assert "bad-rendezvous" not in mnb.api.mesh.all_meshes()


def test_the_sweep_removes_only_directories_nobody_holds(tmp_path):
    """A shared directory (a file rendezvous's, a code folder) is stale once nobody
    holds its lock and it is older than a minute (an earlier version's, without the
    held file: two days)."""
    import fcntl
    import subprocess
    import time

    from monarch_nb.protocol.held_dirs import HELD, sweep

    def made(name, age_s, held_file=True):
        d = tmp_path / ("mnb-store-" + name)
        d.mkdir()
        if held_file:
            (d / HELD).touch()
        (d / "gen0").write_bytes(b"x")
        t = time.time() - age_s
        os.utime(d, (t, t))
        return str(d)

    stale, young = made("stale", 120), made("young", 5)
    old_version, older_version = made("v1", 86400, False), made("v0", 3 * 86400, False)
    held = made("held", 120)
    holder = subprocess.Popen(  # another process holds it, as a live rank does
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()",
         os.path.join(held, HELD)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        assert sorted(sweep("mnb-store-", str(tmp_path))) == sorted([stale, older_version])
        assert all(os.path.isdir(d) for d in (young, old_version, held))
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert sweep("mnb-store-", str(tmp_path)) == [held]  # its holder is gone
    fd = os.open(os.path.join(young, HELD), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # our own shared lock keeps it too, however old
    os.utime(young, (time.time() - 120,) * 2)
    assert sweep("mnb-store-", str(tmp_path)) == []
    os.close(fd)


def test_the_server_drops_other_generations_and_answers_parked_gets():
    server = StoreServer()
    server.begin(3)
    old = m.StoreRequest(0, 2, 1, "set", ("k", b"v"), 5.0)
    assert server.handle(old, b"w0") == [] and server.keys == {}
    assert server.handle(m.StoreRequest(0, 3, 2, "get", ("k",), 5.0), b"w0") == []
    assert server.parked == 1
    sent = server.handle(m.StoreRequest(1, 3, 7, "set", ("k", b"v"), 5.0), b"w1")
    assert sent == [
        (b"w1", m.StoreReply(3, 7, None, None)),
        (b"w0", m.StoreReply(3, 2, b"v", None)),
    ]
    assert server.parked == 0
    server.begin(4)
    assert server.keys == {}


# ------------------------------------------------------------------ no open door


SCAN = r"""
import errno, json, resource, select, socket, sys
host = sys.argv[1]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
open_ports, batch = [], 1000
for start in range(1, 65536, batch):
    socks = {}
    for port in range(start, min(start + batch, 65536)):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        if s.connect_ex((host, port)) in (0, errno.EINPROGRESS):
            socks[s] = port
        else:
            s.close()
    pending = dict(socks)
    while pending:
        _, ready, _ = select.select([], list(pending), [], 2.0)
        if not ready:
            break  # no answer at all: filtered, not open
        for s in ready:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                open_ports.append(pending[s])
            del pending[s]
    for s in socks:
        s.close()
print(json.dumps(open_ports))
"""


def _listening(pids) -> set:
    """(address, port) of the TCP sockets the processes ``pids`` listen on."""
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    }


def test_a_port_scan_from_another_namespace_finds_only_the_router(tmp_path):
    with bridged(1, "10.219.5") as net:
        _scan_from(net, tmp_path)


def _scan_from(net, tmp_path):
    host, ns = net.controller, net.spaces[0]
    workers, waiting = [], None
    try:
        conn = tmp_path / "mesh.json"
        waiting = Waiting(world=2, dp=2, connection_file=str(conn), timeout=120, interface=host)
        wait_file(conn)
        env = {"GLOO_SOCKET_IFNAME": "lo"}
        workers = [
            worker(conn, "--rank", str(r), "--world", "2", env=env, stderr=None) for r in range(2)
        ]
        mesh = waiting.mesh()
        assert mesh._controller.rendezvous.kind == "controller"
        # the default process group and a new_group are up (a reduce over dp)
        x = mnb.remote(ones_by_rank)(mesh=mesh).reduce("dp").fetch(timeout=60)
        assert [t.tolist() for t in x] == [[3.0, 3.0]] * 2
        router = mesh._controller.io.port
        # host agents join through the same ROUTER
        agents = int(mesh._controller.workers.launcher.agents.address.rsplit(":", 1)[1])
        assert agents == router
        pids = {os.getpid(), *(w.pid for w in workers)}
        mine = _listening(pids)
        assert (host, router) in mine, mine
        scan = ip("netns", "exec", ns, sys.executable, "-c", SCAN, host)
        found = set(json.loads(scan.stdout))
        assert router in found, "the scan does not see the controller's ROUTER"
        reachable = {p for addr, p in mine if p in found}
        assert reachable == {router}, f"open to the namespace besides the ROUTER: {mine}"
        mesh.shutdown()
        for w in workers:
            assert w.wait(30) == 0
    finally:
        if waiting is not None and waiting.result:
            waiting.result[0].shutdown()
        for w in workers:
            w.kill()
