"""The fan-out through host agents: a command goes once per host, and what the
ranks send comes back in one envelope per host, equal reports folded. Real
simulated hosts (their own processes) and a real controller; a rogue host is a
real socket in this process."""

from __future__ import annotations

import os

import pytest
import zmq
from wait_helpers import wait_for

import monarch_nb as mnb
from monarch_nb._version import __version__
from monarch_nb.controller.errors import RemoteError
from monarch_nb.host.fanout import _folded, fold
from monarch_nb.protocol import Signer, encode
from monarch_nb.protocol import messages as m
from monarch_nb.protocol.envelope import Sealer, host_peer
from monarch_nb.protocol.wire import send_frames

HOSTS, PER_HOST = 4, 16
WORLD = HOSTS * PER_HOST


def noop():
    return None


@pytest.fixture(scope="module")
def sim():
    mesh = mnb.local_mesh(host=HOSTS, gpu=PER_HOST, simulate=True, name="fanout")
    yield mesh
    mesh.shutdown()


def _host_sockets(ctrl) -> dict[bytes, int]:
    """Host socket identity -> how many envelopes it has sent so far."""
    peers = ctrl.peers
    out = {}
    for identity in ctrl.io.routes.hosts:
        _, sock = peers._identities[identity]
        out[identity] = peers._sockets[sock][1]
    return out


# ---------------------------------------------------------------- folding (pure)


def test_equal_reports_of_several_ranks_fold_into_one_group_each():
    msgs = [m.Status(r, 0, 9, (5, 5, 3)) for r in range(4)]
    msgs.append(m.Status(4, 0, 9, (4, 4, 2)))
    f = fold(msgs)
    assert f.kind == "Status"
    assert sorted(f.groups) == sorted(
        [((0, 1, 2, 3), (0, 9, (5, 5, 3))), ((4,), (0, 9, (4, 4, 2)))]
    )


def test_a_fold_goes_where_its_last_report_was_and_nothing_moves_before_it():
    fail = m.RemoteFunctionFailed(8, 1, 0, m.RemoteFailure("E", "x", ""))
    out = [
        m.Status(0, 0, 9, (1, 1, 1)),
        fail,  # rank 1's failure of command 8 came before its Status
        m.Status(1, 0, 9, (1, 1, 1)),
        m.FetchResult(10, 0, 3, None),
        m.Status(0, 0, 11, (2, 2, 2)),  # another RequestStatus: a fold of its own
    ]
    got = _folded(out)
    assert [type(x).__name__ for x in got] == [
        "RemoteFunctionFailed",
        "Folded",
        "FetchResult",
        "Status",
    ]
    assert got[1].groups == (((0, 1), (0, 9, (1, 1, 1))),)
    assert got[3] == out[4]  # alone: not wrapped


# ---------------------------------------------------------------- on the wire


def test_a_broadcast_goes_once_per_host_and_comes_back_folded(sim):
    ctrl = sim._controller
    identities = ctrl.workers.identities
    hosts = ctrl.io.routes.hosts
    assert len(hosts) == HOSTS
    assert set(identities.values()) == hosts  # every rank is reached through its host
    f = mnb.remote(noop)
    f(mesh=sim)
    sim.wait(timeout=60)
    sealer = ctrl.sealer
    sent = {h: sealer._seq[h] for h in hosts}
    got = _host_sockets(ctrl)
    for _ in range(5):
        f(mesh=sim)
        sim.wait(timeout=60)
    # per broadcast and host: at most the command and the status request down, the
    # folded status (and a tick's folded progress or health) up, never one per rank
    assert all(sealer._seq[h] - sent[h] <= 10 for h in hosts), (sent, sealer._seq)
    now = _host_sockets(ctrl)
    assert all(now[h] - got[h] <= 5 * 4 for h in hosts), (got, now)
    assert sim.status()["requests"] == 0


def test_replies_that_differ_per_rank_and_failures_come_back_per_rank(sim):
    assert sim.exec("rank * 10").fetch(timeout=60) == [r * 10 for r in range(WORLD)]
    with pytest.raises(RemoteError) as ei:
        sim.exec("1 / (rank - 21)").fetch(timeout=60)
    assert "ZeroDivisionError" in str(ei.value) and "21" in str(ei.value)
    # a failure is never overtaken by the folded Status of a later wait
    with pytest.raises(RemoteError, match="ZeroDivisionError"):
        sim.exec("1 / (rank - 5)")
        sim.wait(timeout=60)
    assert sim.exec("rank").fetch(rank=WORLD - 1, timeout=60) == WORLD - 1


def _rogue(ctrl, host: int, key: bytes, version: str = __version__):
    """A host socket in this process that asks to join as ``host``."""
    signer = Signer(key)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ctrl.address)
    join = encode(m.HostJoin(host, os.getpid(), "rogue", version), signer)
    send_frames(sock, Sealer(signer, host_peer(host)).seal(join))
    return sock


def _refusal(sock, signer) -> str:
    from monarch_nb.protocol import decode
    from monarch_nb.protocol.envelope import unseal

    if not sock.poll(30_000):
        raise AssertionError("no answer from the controller within 30 s")
    _, parts = unseal(sock.recv_multipart(), signer)
    msg = decode(parts[0], signer)
    assert type(msg) is m.Refused
    return msg.reason


def test_a_host_that_is_not_the_meshs_or_of_another_version_is_refused(sim):
    ctrl = sim._controller
    key = ctrl._secret
    sock = _rogue(ctrl, 1, key)  # host 1 of this mesh is another process
    try:
        assert "is not a host of this mesh" in _refusal(sock, Signer(key))
    finally:
        sock.close()
    sock = _rogue(ctrl, 0, key, version="0.0.1")
    try:
        reason = _refusal(sock, Signer(key))
        assert "0.0.1" in reason and __version__ in reason
    finally:
        sock.close()
    assert len(ctrl.io.routes.hosts) == HOSTS
    mnb.remote(noop)(mesh=sim)
    sim.wait(timeout=60)  # the mesh serves on


def test_a_host_with_another_key_is_never_answered(sim):
    ctrl = sim._controller
    before = sim.status()["rejections"]["signature"]
    sock = _rogue(ctrl, 2, b"k" * 32)
    try:
        wait_for(
            lambda: sim.status()["rejections"]["signature"] > before, 30, "the bad seal counted"
        )
        assert not sock.poll(200)
    finally:
        sock.close()
    assert sim.exec("rank").fetch(rank=0, timeout=60) == 0
