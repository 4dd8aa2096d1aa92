"""The wire under random and mutated frames (hypothesis).

* The decoders (``envelope.unseal``, ``wire.decode``) raise nothing but
  BadMessage on any frames, and never unpickle a frame set whose signature does
  not verify: a mutated copy of a signed message whose pickle would run code is
  rejected and runs nothing.
* A live worker and a live controller fed random and mutated frames keep
  serving; every dropped message is counted, exactly, and visible in
  ``mesh.status()`` (``ranks[r]["bad_messages"]`` and ``bad_messages``).
  Authenticated messages of no known kind are dropped and counted the same way.
* Sockets bind to loopback by default; the mesh secret appears in no log, repr,
  status, command line or environment.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
from collections import Counter
from concurrent.futures import Future

import psutil
import pytest
import torch
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from reliability_helpers import wait_for

import monarch_nb as mnb
from monarch_nb.controller.io_items import Send
from monarch_nb.protocol import BadMessage, Signer, decode, encode, envelope, new_secret
from monarch_nb.protocol import messages as m

MARKER_DIR = os.environ.get("TMPDIR", "/tmp")
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

frame = st.binary(max_size=96)
frames_st = st.lists(frame, min_size=1, max_size=7)
# signature-sized frames and v2 headers are what the decoders branch on: make them likely
v2_header = st.tuples(
    st.integers(-1, 3), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 4)
).map(lambda h: envelope.HEADER.pack(envelope.PROTOCOL_VERSION, *h))
shaped_frames = st.one_of(
    frames_st,
    st.tuples(st.binary(min_size=32, max_size=32), frame).map(list),
    st.tuples(st.binary(min_size=32, max_size=32), v2_header, st.lists(frame, max_size=6)).map(
        lambda t: [t[0], t[1], *t[2]]
    ),
)
plain_data = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
    max_leaves=12,
)


def mark(path: str) -> None:
    """What a forged pickle would run: create ``path``."""
    with open(path, "w") as f:
        f.write("executed")


class Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (mark, (self.path,))


def signed_evil(signer: Signer, path: str) -> list[bytes]:
    """A correctly signed message whose unpickling runs ``mark(path)``, with a tensor frame."""
    payload = pickle.dumps((Evil(path), "x"), 5)
    tensor = torch.arange(64, dtype=torch.int32).numpy().tobytes()
    return [signer.digest(payload, [tensor]), payload, tensor]


def mutations(frames: list[bytes]):
    """Mutated copies of ``frames``: flipped bits, truncated, extended, dropped,
    added, swapped or duplicated frames."""
    n = len(frames)
    flip = st.tuples(st.integers(0, n - 1), st.integers(0, 10**6), st.integers(0, 7)).map(
        lambda a: _flip(frames, *a)
    )
    cut = st.tuples(st.integers(0, n - 1), st.integers(0, 10**6)).map(lambda a: _cut(frames, *a))
    grow = st.tuples(st.integers(0, n - 1), st.binary(min_size=1, max_size=8)).map(
        lambda a: _grow(frames, *a)
    )
    drop = st.integers(0, n - 1).map(lambda i: frames[:i] + frames[i + 1 :])
    add = st.tuples(st.integers(0, n), frame).map(
        lambda a: frames[: a[0]] + [a[1]] + frames[a[0] :]
    )
    swap = st.permutations(range(n)).map(lambda p: [frames[i] for i in p])
    return st.one_of(flip, cut, grow, drop, add, swap)


def _flip(frames, i, pos, bit):
    f = bytearray(frames[i])
    if not f:
        return frames[:i] + [b"\x00"] + frames[i + 1 :]
    f[pos % len(f)] ^= 1 << bit
    return frames[:i] + [bytes(f)] + frames[i + 1 :]


def _cut(frames, i, k):
    f = frames[i]
    return frames[:i] + [f[: k % (len(f) + 1)]] + frames[i + 1 :]


def _grow(frames, i, extra):
    return frames[:i] + [frames[i] + extra] + frames[i + 1 :]


# ------------------------------------------------------------------ decoders


@pytest.mark.unit
@FUZZ
@given(shaped_frames)
def test_decoders_raise_only_bad_message_on_random_frames(frames):
    s = Signer(new_secret())
    with pytest.raises(BadMessage) as e:
        envelope.unseal(frames, s)
    assert e.value.kind in envelope.KINDS
    with pytest.raises(BadMessage):
        decode(frames, s)


@pytest.mark.unit
@FUZZ
@given(data=st.data())
def test_mutated_signed_frames_are_rejected_before_unpickling(data, tmp_path_factory):
    s = Signer(b"k" * 32)
    marker = str(tmp_path_factory.getbasetemp() / "executed-by-a-mutation")
    frames = signed_evil(s, marker)
    bad = data.draw(mutations(frames))
    assume(bad != frames)
    with pytest.raises(BadMessage):
        decode(bad, s)
    assert not os.path.exists(marker)


@pytest.mark.unit
def test_the_unmutated_frames_would_run_code(tmp_path):
    """The control for the test above: decoding the intact frames does run ``mark``."""
    s = Signer(b"k" * 32)
    marker = str(tmp_path / "executed")
    with pytest.raises(BadMessage, match="not a message record"):  # it ran, then was refused
        decode(signed_evil(s, marker), s)
    assert os.path.exists(marker)


# ------------------------------------------------------------------ a live mesh


@pytest.fixture(scope="module")
def fz():
    mesh = mnb.local_mesh(dp=2, name="fuzz")
    yield mesh
    mesh.shutdown()


def send_to_worker(mesh, rank: int, frames: list[bytes]) -> None:
    """Through the controller's own socket, as one ZeroMQ message (not batched)."""
    done: Future = Future()
    mesh._controller.io.submit(Send([rank], [bytes(f) for f in frames], done))
    done.result(timeout=10)


def worker_bad(mesh) -> dict:
    return {r: mesh.status()["ranks"][r]["bad_messages"] for r in mesh.ranks}


def serves(mesh) -> None:
    assert mnb.remote(int.__add__)(20, 22, mesh=mesh).fetch(timeout=30) == [42, 42]
    assert all(r["alive"] for r in mesh.status()["ranks"].values())


def test_workers_drop_and_count_random_and_mutated_frames(fz, tmp_path):
    ctrl = fz._controller
    marker = str(tmp_path / "executed-on-a-worker")
    # a signed command that would create the marker if a worker ran it
    # (signed by itself, as a large message is: the controller's envelope vouches only for
    # what its caller hands it unsigned)
    payload = bytes(
        encode(
            m.RunCode(
                ctrl.next_ident(), ctrl.next_id(), f"open({marker!r}, 'w')", "<x>", 0, 0, "x"
            ),
            ctrl.signer,
        )[1]
    )
    evil = [ctrl.signer.digest(payload, []), payload]
    before = wait_for(lambda: (b := worker_bad(fz)) and None not in b.values() and b, 10, "health")
    expected: Counter = Counter()

    @FUZZ
    @given(st.integers(0, 1), st.one_of(shaped_frames, mutations(evil)))
    def feed(rank, frames):
        assume(frames != evil)
        # an empty signature asks the controller's envelope to cover the pickle: a message
        # the controller vouches for, not a forgery (those are the wire's, mutated after
        # sealing: the controller's test below and test_wire.py)
        assume(not (len(frames) == 2 and not frames[0]))
        send_to_worker(fz, rank, frames)  # sealed by the controller as one message
        expected[rank] += 1

    @FUZZ
    @given(st.integers(0, 1), plain_data)
    def feed_authenticated(rank, value):
        # correctly signed, but of no kind a worker handles: dropped, counted
        payload = pickle.dumps(value, 5)
        send_to_worker(fz, rank, [ctrl.signer.digest(payload, []), payload])
        expected[rank] += 1

    feed()
    feed_authenticated()
    want = {r: before[r] + expected[r] for r in (0, 1)}
    wait_for(lambda: worker_bad(fz) == want, 20, f"worker drop counts {want}")
    assert sum(expected.values()) > 100
    serves(fz)
    assert not os.path.exists(marker)


def test_controller_drops_and_counts_random_and_mutated_frames(fz, tmp_path):
    ctrl = fz._controller
    marker = str(tmp_path / "executed-on-the-controller")
    # sealed as by sockets of rank 0, one socket (and connection) each: a mutation that
    # still opens can only be that socket's first message or a replay of it, so every
    # frame set is dropped exactly once and none opens a gap
    sealers = {k: envelope.Sealer(ctrl.signer, 0) for k in ("evil", "genuine", "plain")}
    sources = {
        "evil": sealers["evil"].seal(signed_evil(ctrl.signer, marker)),
        "genuine": sealers["genuine"].seal(encode(m.Progress(0, {0: (1, 1, 1)}), ctrl.signer)),
    }
    before = fz.status()["bad_messages"]
    sent = [0]
    ctx = zmq.Context.instance()
    socks = {k: ctx.socket(zmq.DEALER) for k in ("random", "evil", "genuine", "plain", "outside")}
    for sock in socks.values():
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(ctrl.address)
    try:

        @FUZZ
        @given(
            st.one_of(
                shaped_frames.map(lambda f: ("random", f)),
                mutations(sources["evil"]).map(lambda f: ("evil", f)),
                mutations(sources["genuine"]).map(lambda f: ("genuine", f)),
            )
        )
        def feed(item):
            source, frames = item
            assume(frames != sources.get(source))
            socks[source].send_multipart(frames)
            sent[0] += 1

        @FUZZ
        @given(plain_data)
        def feed_authenticated(value):
            payload = pickle.dumps(value, 5)
            inner = [ctrl.signer.digest(payload, []), payload]
            socks["plain"].send_multipart(sealers["plain"].seal(inner))
            sent[0] += 1

        feed()
        feed_authenticated()
        # a genuine message of a rank outside the mesh: authenticated, still dropped
        outside = envelope.Sealer(ctrl.signer, 7)
        progress = encode(m.Progress(7, {0: (1, 1, 1)}), ctrl.signer)
        socks["outside"].send_multipart(outside.seal(progress))
        sent[0] += 1
        want = before + sent[0]
        wait_for(lambda: fz.status()["bad_messages"] == want, 20, f"{want} drops counted")
    finally:
        for sock in socks.values():
            sock.close()
    assert not os.path.exists(marker)
    serves(fz)


# ------------------------------------------------------------------ exposure


def test_sockets_bind_to_loopback_by_default(fz):
    mnb.remote(torch.ones)(2, mesh=fz).reduce("dp").fetch(timeout=60)  # gloo is up
    ctrl = fz._controller
    assert ctrl.bind_address.startswith("tcp://127.0.0.1:")
    procs = [psutil.Process(os.getpid())] + [psutil.Process(p) for p in ctrl.worker_pids().values()]
    listening = {
        (proc.pid, c.laddr.ip)
        for proc in procs
        for c in proc.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert any(pid == os.getpid() for pid, _ in listening)  # the controller's socket
    assert {pid for pid, _ in listening} >= set(ctrl.worker_pids().values())  # gloo's
    assert {ip for _, ip in listening} <= {"127.0.0.1", "::1"}, listening
    # gloo is told so, whatever the host name resolves to: in the environment the rank's
    # C code reads (a forked rank's /proc/PID/environ shows what its forebear was started with)
    assert mnb.remote(_gloo_interface)(mesh=fz).fetch(timeout=60) == [("lo", "lo")] * 2


def _gloo_interface() -> tuple:
    """GLOO_SOCKET_IFNAME as Python and as libc's getenv (gloo's) see it on a rank."""
    import ctypes

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    raw = getenv(b"GLOO_SOCKET_IFNAME")
    return os.environ.get("GLOO_SOCKET_IFNAME"), raw.decode() if raw else None


def test_the_secret_appears_in_no_log_repr_or_status(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("MONARCH_NB_LOG", "DEBUG")  # the workers log everything to stderr
    caplog.set_level(logging.DEBUG)
    with mnb.local_mesh(dp=1, name="secretive") as mesh:
        ctrl = mesh._controller
        key = ctrl._secret
        forms = [key.hex(), key.hex().upper(), base64.b64encode(key).decode(), repr(key)]
        # things that log: failures, dropped messages, an internal error
        with pytest.raises(mnb.RemoteError):
            mesh.exec("1/0").fetch(timeout=30)
        send_to_worker(mesh, 0, [b"\0" * 32, b"junk"])
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(ctrl.address)
        sock.send_multipart([b"\1" * 32, b"junk"])
        sock.close(linger=1000)
        wait_for(lambda: mesh.status()["bad_messages"] >= 1, 10, "the drop")
        wait_for(lambda: mesh.status()["ranks"][0]["bad_messages"] == 1, 10, "the drop")
        ctrl.send(m.BorrowFirstUse(12345), None)
        with pytest.raises(mnb.RemoteError, match="is broken"):
            mnb.remote(torch.ones)(1, mesh=mesh).fetch(timeout=30)
        tail = ctrl.workers.procs[0].tail_text  # the worker's log of that failure, to its last line
        wait_for(lambda: "KeyError: 12345" in tail(), 10, "the worker's log", show=tail)
        worker = psutil.Process(ctrl.worker_pids()[0])
        texts = {
            "logs": caplog.text,
            "worker stderr": ctrl.workers.procs[0].tail_text(),
            "reprs": repr(ctrl) + repr(ctrl.signer) + repr(mesh) + repr(ctrl.state),
            "status": json.dumps(mesh.status(), default=str),
            "worker command line": " ".join(worker.cmdline()),
            "worker environment": json.dumps(worker.environ()),
            "our environment": json.dumps(dict(os.environ)),
        }
        assert "DEBUG" in texts["worker stderr"] or "WARNING" in texts["worker stderr"]
        assert "dropped" in caplog.text
    for where, text in texts.items():
        for form in forms:
            assert form not in text, f"the secret appears in the {where}"
