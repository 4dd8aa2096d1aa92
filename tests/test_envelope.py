"""The envelope (protocol v3) on real sockets: versions, ranks bound to sockets, sequence numbers,
and the connection file of connect_mesh.

Two joined workers (real processes) reach the controller through a relay, a real
man in the middle: each worker socket gets a DEALER of its own to the controller,
so it keeps an identity there, and the relay records every frame, can withhold
one, and can send captured or forged frames on any worker's connection.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future

import pytest
import zmq
from wait_helpers import wait_for

import monarch_nb as mnb
from monarch_nb.launchers.connection_file import write_connection_file
from monarch_nb.protocol import decode, encode, envelope
from monarch_nb.protocol import messages as m


class Relay:
    """Workers connect here; what they send goes on to ``upstream`` through a DEALER
    per worker socket, and the answers come back. Its sockets live on its thread."""

    def __init__(self, upstream: str):
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.upstream = upstream
        self.up: dict[bytes, zmq.Socket] = {}  # a worker socket's identity here -> its DEALER
        self.seen: list = []  # (identity, "up" or "down", frames)
        self.withheld: list = []
        self._withhold = None  # drop the first message going up for which this is true
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        owner: dict = {}
        while not self._stop:
            for sock, _ in poller.poll(10):
                if sock is self.front:
                    ident, *frames = self.front.recv_multipart()
                    up = self.up.get(ident)
                    if up is None:
                        up = self.up[ident] = self.ctx.socket(zmq.DEALER)
                        up.setsockopt(zmq.LINGER, 0)
                        up.connect(self.upstream)
                        owner[up] = ident
                        poller.register(up, zmq.POLLIN)
                    self.seen.append((ident, "up", frames))
                    if self._withhold is not None and self._withhold(frames):
                        self._withhold = None
                        self.withheld.append(frames)
                        continue
                    up.send_multipart(frames)
                else:
                    frames = sock.recv_multipart()
                    self.seen.append((owner[sock], "down", frames))
                    self.front.send_multipart([owner[sock], *frames])
            while not self._requests.empty():
                fn, fut = self._requests.get()
                fut.set_result(fn())
        for s in [self.front, *self.up.values()]:
            s.close(linger=0)
        self.ctx.term()

    def call(self, fn):
        """Run ``fn`` on the relay's thread (its sockets' only user)."""
        fut: Future = Future()
        self._requests.put((fn, fut))
        return fut.result(timeout=10)

    def withhold(self, pred) -> None:
        self.call(lambda: setattr(self, "_withhold", pred))

    def send_up(self, ident: bytes, frames: list) -> None:
        self.call(lambda: self.up[ident].send_multipart(frames))

    def send_down(self, ident: bytes, frames: list) -> None:
        self.call(lambda: self.front.send_multipart([ident, *frames]))

    def close(self) -> None:
        self._stop = True
        self.thread.join(10)


THIS = envelope.PROTOCOL_VERSION
OTHER = THIS + 1


def opened(frames, signer):
    """(header, messages) of an envelope."""
    header, parts = envelope.unseal(frames, signer)
    return header, [decode(p, signer) for p in parts]


def sealed(signer, inner: list, rank: int, sock: int, seq: int, version=envelope.PROTOCOL_VERSION):
    """An envelope of one message with a header of our choosing, signed with the mesh's
    secret (what a Sealer covers: the message's signature, or its pickle if it has none)."""
    header = envelope.HEADER.pack(version, rank, sock, seq, 1)
    sig, payload = inner[0], inner[1]
    entry = envelope.ENTRY.pack(len(sig), len(payload))
    return [signer.mac_of(header, entry, sig or payload), header, *inner]


def find(relay, signer, direction: str, pred):
    """The first recorded (identity, frames, header) going ``direction`` holding a
    message for which ``pred`` is true."""
    for ident, d, frames in list(relay.seen):
        if d != direction:
            continue
        header, msgs = opened(frames, signer)
        if any(pred(x) for x in msgs):
            return ident, frames, header
    return None


def printed(text: str, rank: int):
    return lambda x: type(x) is m.Output and x.rank == rank and text in x.text


@pytest.fixture(scope="module")
def relayed(tmp_path_factory):
    d = tmp_path_factory.mktemp("v2")
    conn = d / "mesh.json"
    result: list = []
    waiting = threading.Thread(
        target=lambda: result.append(
            mnb.connect_mesh(world=2, dp=2, connection_file=str(conn), timeout=120, name="v2")
        ),
        daemon=True,
    )
    waiting.start()
    wait_for(conn.exists, 30, f"{conn} to appear")
    info = json.loads(conn.read_text())
    relay = Relay(info["address"])
    (d / "relay.json").write_text(json.dumps({**info, "address": relay.address}))
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "monarch_nb.worker",
                "--connection-file",
                str(d / "relay.json"),
                "--rank",
                str(r),
                "--world",
                "2",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        waiting.join(120)
        assert result, "connect_mesh did not return"
        mesh = result[0]
        outputs: list = []
        mesh.output_handler = outputs.append
        yield mesh, relay, workers, outputs, conn
    finally:
        for mesh in result:
            mesh.shutdown()
        for p in workers:
            p.kill()
            p.wait(10)
        relay.close()


def rejections(mesh) -> dict:
    return mesh.status()["rejections"]


def dealer(ctrl, linger: int):
    """A DEALER socket of our own on the controller's ROUTER."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, linger)
    s.connect(ctrl.address)
    return s


def serves(mesh) -> None:
    assert mesh.exec("6 * 7").fetch(timeout=30) == [42, 42]


def test_a_worker_of_another_version_is_refused_naming_both(relayed, caplog):
    mesh, *_ = relayed
    ctrl = mesh._controller
    before = rejections(mesh)
    s = dealer(ctrl, linger=0)
    try:
        ready = encode(
            m.WorkerReady(0, 2, os.getpid(), socket.gethostname(), False, {}), ctrl.signer
        )
        s.send_multipart(sealed(ctrl.signer, ready, 0, 99, 1, version=OTHER))
        assert s.poll(10_000), "no answer from the controller"
        header, msgs = opened(s.recv_multipart(), ctrl.signer)
    finally:
        s.close()
    assert (header.version, header.rank) == (envelope.PROTOCOL_VERSION, envelope.CONTROLLER)
    assert msgs == [m.Refused(f"worker speaks protocol {OTHER}, this mesh {THIS}")]
    after = rejections(mesh)
    assert after["version"] == before["version"] + 1
    assert sum(after.values()) == mesh.status()["bad_messages"]
    assert f"worker speaks protocol {OTHER}, this mesh {THIS}" in caplog.text
    serves(mesh)


def test_a_replayed_frame_is_dropped_and_counted(relayed):
    mesh, relay, _, outputs, _ = relayed
    ctrl = mesh._controller
    mesh.exec("print('replay-probe')").fetch(timeout=30)
    wait_for(lambda: [x for x in outputs if printed("replay-probe", 0)(x)], 10, "the output")
    ident, frames, _ = find(relay, ctrl.signer, "up", printed("replay-probe", 0))
    before = rejections(mesh)["replay"]
    relay.send_up(ident, frames)  # on the worker socket's own connection
    fresh = zmq.Context.instance().socket(zmq.DEALER)  # and on a new one
    fresh.setsockopt(zmq.LINGER, 1000)
    fresh.connect(ctrl.address)
    fresh.send_multipart(frames)
    fresh.close()
    wait_for(lambda: rejections(mesh)["replay"] == before + 2, 10, "two replays counted")
    serves(mesh)
    assert len([x for x in outputs if printed("replay-probe", 0)(x)]) == 1

    # the controller's command, replayed to the worker, does not run again
    down = find(
        relay, ctrl.signer, "down", lambda x: type(x) is m.RunCode and "replay-probe" in x.source
    )
    assert down is not None
    worker_replays = mesh.status()["ranks"]
    relay.send_down(down[0], down[1])
    serves(mesh)
    wait_for(
        lambda: (
            sum(r["rejections"]["replay"] for r in mesh.status()["ranks"].values())
            == sum(r["rejections"]["replay"] for r in worker_replays.values()) + 1
        ),
        10,
        "the worker's count of replays (its health report)",
    )
    assert len([x for x in outputs if "replay-probe" in x.text]) == 2  # rank 0's and rank 1's


def test_a_message_claiming_another_rank_is_dropped_and_counted(relayed):
    mesh, relay, _, outputs, _ = relayed
    ctrl = mesh._controller
    mesh.exec("print('rank-probe')").fetch(timeout=30)
    wait_for(lambda: find(relay, ctrl.signer, "up", printed("rank-probe", 0)), 10, "the output")
    ident, _, header = find(relay, ctrl.signer, "up", printed("rank-probe", 0))  # a stream socket
    before = rejections(mesh)["rank"]
    forged = encode(m.Output(1, 0, None, "stdout", "forged-rank"), ctrl.signer)
    relay.send_up(ident, sealed(ctrl.signer, forged, 1, header.socket, header.seq + 1))
    wait_for(lambda: rejections(mesh)["rank"] == before + 1, 10, "the rank claim counted")

    # a socket of rank 0 carrying a message of rank 1
    s = dealer(ctrl, linger=1000)
    s.send_multipart(sealed(ctrl.signer, forged, 0, 1234, 1))
    s.close()
    wait_for(lambda: rejections(mesh)["rank"] == before + 2, 10, "the second claim counted")
    serves(mesh)  # rank 0's stream socket, whose identity was used, keeps its order
    assert not [x for x in outputs if "forged-rank" in x.text]


def test_a_gap_fails_the_requests_waiting_on_that_rank(relayed):
    """A message of rank 0 never arrives: the next one shows the gap, which is
    counted, and the request waiting on rank 0 fails instead of waiting."""
    mesh, relay, _, outputs, _ = relayed
    ctrl = mesh._controller
    before = rejections(mesh)["gap"]
    relay.withhold(
        lambda frames: any(printed("gap-probe", 0)(x) for x in opened(frames, ctrl.signer)[1])
    )
    mesh.exec("print('gap-probe')")
    # withheld before the next command is sent: its reply cannot share that envelope
    wait_for(lambda: len(relay.withheld) == 1, 30, "the envelope of rank 0's print")
    with pytest.raises(mnb.RemoteError, match=r"1 message\(s\) from rank 0 were lost"):
        mesh.exec("1").fetch(timeout=30)  # its reply comes after the gap
    assert len(relay.withheld) == 1
    assert rejections(mesh)["gap"] == before + 1
    assert [x.rank for x in outputs if "gap-probe" in x.text] == [1]
    serves(mesh)  # the socket goes on in order after the gap
    wait_for(lambda: mesh.status()["requests"] == 0, 10, "no request left behind")


def test_unsealed_frames_are_counted_by_kind(relayed):
    """Kinds the other tests do not reach: a bad envelope signature, a malformed frame set."""
    mesh, *_ = relayed
    ctrl = mesh._controller
    before = rejections(mesh)
    s = dealer(ctrl, linger=1000)
    frames = sealed(ctrl.signer, encode(m.Ping(), ctrl.signer), 0, 5, 1)
    s.send_multipart([b"\0" * 32, *frames[1:]])
    s.send_multipart([frames[0], frames[1] + b"\0", *frames[2:]])  # a header too long
    s.close()
    wait_for(lambda: rejections(mesh)["signature"] == before["signature"] + 1, 10, "signature")
    wait_for(lambda: rejections(mesh)["malformed"] == before["malformed"] + 1, 10, "malformed")
    serves(mesh)


def test_the_connection_file_is_private_and_removed_at_shutdown(relayed):
    mesh, _, workers, _, conn = relayed
    assert oct(os.stat(conn).st_mode & 0o777) == "0o600"
    assert mesh.connection_file == str(conn)
    mesh.shutdown()
    assert not conn.exists()
    assert [p.wait(30) for p in workers] == [0, 0]


def io_threads(name: str) -> list:
    return [t for t in threading.enumerate() if t.name == f"monarch-io-{name}"]


def test_a_symlink_or_a_file_at_the_connection_path_is_refused(tmp_path):
    target = tmp_path / "elsewhere.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(FileExistsError, match="symbolic link") as e:
        mnb.connect_mesh(world=1, connection_file=str(link), timeout=30, name="v2link")
    assert str(link) in str(e.value)
    assert link.is_symlink() and not target.exists()  # nothing written through it
    wait_for(lambda: not io_threads("v2link"), 10, "the controller's IO thread to end")

    taken = tmp_path / "taken.json"
    taken.write_text("mine")
    with pytest.raises(FileExistsError, match="exists already") as e:
        mnb.connect_mesh(world=1, connection_file=str(taken), timeout=30, name="v2taken")
    assert str(taken) in str(e.value) and taken.read_text() == "mine"
    wait_for(lambda: not io_threads("v2taken"), 10, "the controller's IO thread to end")


def test_a_connection_file_left_by_a_dead_controller_is_replaced(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = tmp_path / "left.json"
    path.write_text(
        json.dumps({"address": "tcp://x:1", "pid": gone.pid, "host": socket.gethostname()})
    )
    path.chmod(0o600)
    write_connection_file(str(path), "tcp://127.0.0.1:5", b"k" * 32, 1, "n", {"world": 1})
    info = json.loads(path.read_text())
    assert info["pid"] == os.getpid() and info["address"] == "tcp://127.0.0.1:5"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):  # its writer is alive now: not stale
        write_connection_file(str(path), "tcp://127.0.0.1:6", b"k" * 32, 1, "n", {"world": 1})


def test_a_worker_leaves_naming_both_versions_when_the_controller_speaks_another(tmp_path):
    from monarch_nb.protocol import Signer

    key = os.urandom(32)
    signer = Signer(key)
    (tmp_path / "key").write_text(key.hex())
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    w = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "monarch_nb.worker",
            "--connect",
            f"tcp://127.0.0.1:{port}",
            "--key-file",
            str(tmp_path / "key"),
            "--rank",
            "0",
            "--world",
            "1",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert router.poll(120_000), "the worker never said it was ready"
        ident, *frames = router.recv_multipart()
        header, msgs = opened(frames, signer)
        assert (header.version, header.rank, header.seq) == (THIS, 0, 1)
        assert type(msgs[0]) is m.WorkerReady
        router.send_multipart([ident, *sealed(signer, encode(m.Ping(), signer), -1, 7, 1, OTHER)])
        assert w.wait(60) == 2
        assert f"the controller speaks protocol {OTHER}, this worker {THIS}" in w.stderr.read()
    finally:
        w.kill()
        router.close()
