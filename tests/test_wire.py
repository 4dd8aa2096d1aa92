"""Unit tests of the wire: signing, framing, zero-copy tensors, functions by value, and
the envelope of protocol v3 (version, rank, sequence numbers, one frame and one HMAC for
a batch of small messages) with its PeerTable."""

import pickle

import pytest
import torch

from monarch_nb.protocol import BadMessage, Signer, decode, encode, envelope, new_secret, wire
from monarch_nb.protocol import messages as m
from monarch_nb.protocol.ndslice import NDSlice
from monarch_nb.protocol.pickling import IN_BAND
from monarch_nb.protocol.wire import (
    FULL_COVER,
    function_ref,
    pack_args,
    resolve_function,
    unpack_args,
)

pytestmark = pytest.mark.unit  # in-process: no worker, kernel or browser


def roundtrip(msg, s: Signer):
    """``msg`` encoded, sealed, unsealed and decoded: as a receiver gets it."""
    _, parts = envelope.unseal(envelope.Sealer(s, 0).seal(encode(msg, s)), s)
    return decode(parts[0], s)


def test_roundtrip_and_signature():
    s = Signer(new_secret())
    msg = m.Status(1, 0, 5, (5, 5, 3))
    assert roundtrip(msg, s) == msg
    frames = encode(msg, s)
    assert frames[0] == b""  # small and buffer-less: its envelope covers it
    with pytest.raises(BadMessage, match="wrong length"):  # and alone it is refused
        decode(frames, s)
    big = m.Output(0, 0, None, "stdout", "x" * (wire.COVER_MAX + 1))
    assert len(encode(big, s)[0]) == wire.SIG_LEN  # a large pickle is signed by its builder
    assert decode(encode(big, s), s) == big == roundtrip(big, s)


def test_wrong_key_is_rejected_before_unpickling(tmp_path):
    marker = tmp_path / "executed"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    s = Signer(new_secret())
    for msg in (m.Output(0, 0, None, "stdout", "x"), m.Output(0, 0, None, "stdout", "x" * 20_000)):
        sealed = envelope.Sealer(s, 0).seal(encode(msg, s))
        sealed[3] = pickle.dumps(Evil())  # the pickle, replaced on the way
        for signer in (s, Signer(new_secret())):
            with pytest.raises(BadMessage):
                _, parts = envelope.unseal(sealed, signer)
                decode(parts[0], signer)
        with pytest.raises(BadMessage):
            decode(sealed[2:], s)
    assert not marker.exists()


@pytest.mark.parametrize("where", [0, 1, 2])
def test_any_tampered_frame_is_rejected(where):
    s = Signer(new_secret())
    t = torch.arange(2000, dtype=torch.float32)  # over IN_BAND: its bytes are frame 2
    frames = [bytearray(f) for f in encode(m.FetchResult(1, 0, t, None), s)]
    frames[where][-1] ^= 1
    with pytest.raises(BadMessage):
        decode(frames, s)


def test_large_buffer_edges_and_length_are_covered():
    s = Signer(new_secret())
    t = torch.zeros(2 * FULL_COVER // 4, dtype=torch.float32)
    frames = [bytearray(f) for f in encode(m.FetchResult(1, 0, t, None), s)]
    assert len(frames) == 3  # the tensor is its own frame
    for i in (0, len(frames[2]) - 1):
        bad = list(frames)
        bad[2] = bytearray(frames[2])
        bad[2][i] ^= 1
        with pytest.raises(BadMessage):
            decode(bad, s)
    with pytest.raises(BadMessage):
        decode(frames[:2] + [frames[2][:-4]], s)


def test_nested_records_travel_as_plain_tuples_and_arrive_as_records():
    s = Signer(new_secret())
    fn = m.Function(b"payload", "f")
    msgs = [
        m.CallFunction(7, 8, fn, m.Args(b"a", (), (3,)), 0, None, "f"),
        m.CallFunction(7, 8, fn, None, 0, 1, "f"),
        m.RemoteFunctionFailed(1, 0, 0, m.RemoteFailure("E", "msg", "tb")),
    ]
    for msg in msgs:
        frames = encode(msg, s)
        assert b"monarch_nb.protocol.values" not in frames[1]  # no class to look up
        got = roundtrip(msg, s)
        assert got == msg
        for a, b in zip(got, msg):
            assert type(a) is type(b)
    # a field that should hold a record but holds something else is refused by name
    bad = pickle.dumps(
        (wire._CODE[m.CallFunction], 7, 8, ("too", "many", "parts"), None, 0, None, "f"), 5
    )
    with pytest.raises(BadMessage, match="CallFunction whose function is not a Function"):
        decode([s.digest(bad, []), bad], s)


def test_malformed_frames():
    s = Signer(new_secret())
    for frames in ([], [b"x"], [b"short", b"payload"], [b"\0" * 32, b"not a pickle"]):
        with pytest.raises(BadMessage):
            decode(frames, s)


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        torch.tensor([1.5, 2.5], dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.empty(0, 3),
        torch.tensor(7),
        torch.ones(3, requires_grad=True),
        torch.tensor([1 + 2j]).conj(),
    ],
)
def test_tensor_roundtrip(t):
    s = Signer(new_secret())
    out = roundtrip(m.FetchResult(1, 0, t, None), s).value
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out.detach(), t.detach().resolve_conj())
    assert out.requires_grad == t.requires_grad


def test_tensor_bytes_travel_out_of_band():
    s = Signer(new_secret())
    t = torch.ones(1 << 20)
    frames = encode(m.FetchResult(1, 0, t, None), s)
    assert len(frames[1]) < 1000 and memoryview(frames[2]).nbytes == t.numel() * 4
    out = decode(frames, s).value
    out += 1  # a received tensor is writable
    assert float(out[0]) == 2.0


def test_a_small_tensor_travels_inside_the_pickle_and_arrives_writable():
    s = Signer(new_secret())
    t = torch.arange(IN_BAND // 4, dtype=torch.float32)  # the largest that goes in band
    frames = encode(m.FetchResult(1, 0, t, None), s)
    assert len(frames) == 2  # one message of two frames: it batches with its neighbours
    out = roundtrip(m.FetchResult(1, 0, t, None), s).value
    out += 1
    assert torch.equal(out, t + 1)
    assert len(encode(m.FetchResult(1, 0, torch.arange(IN_BAND // 4 + 1.0), None), s)) == 3


def test_parameter_keeps_its_type():
    s = Signer(new_secret())
    p = torch.nn.Parameter(torch.ones(2))
    out = roundtrip(m.FetchResult(1, 0, p, None), s).value
    assert isinstance(out, torch.nn.Parameter)


def test_functions_by_reference_and_by_value():
    import os.path

    f = function_ref(os.path.join)
    assert b"cloudpickle" not in f.payload and resolve_function(f) is os.path.join
    k = 3
    g = function_ref(lambda x: x + k)
    assert resolve_function(g)(1) == 4


def test_args_with_refs_resolve_late():
    class R:
        def __init__(self, i):
            self.i = i

    from monarch_nb.protocol import wire

    wire.register_ref_type(R, lambda r: r.i)
    args, refs = pack_args((R(5), [R(6), {"k": R(5)}]), {"t": torch.ones(2)})
    assert args.refs == (5, 6) and len(refs) == 3
    a, kw = unpack_args(args, lambda i: i * 10)
    assert a == (50, [60, {"k": 50}]) and torch.equal(kw["t"], torch.ones(2))
    # plain scalars and Refs alone: the C pickler's fast path, read the same way
    args, refs = pack_args((R(5), 2.5, "s", None, True, b"b", R(7), R(5)), {"n": 3, "r": R(6)})
    assert args.refs == (5, 7, 6) and len(refs) == 4 and args.buffers == ()
    assert b"_RefToken" not in args.payload  # the worker needs no class of ours
    a, kw = unpack_args(args, lambda i: i * 10)
    assert a == (50, 2.5, "s", None, True, b"b", 70, 50) and kw == {"n": 3, "r": 60}


def test_ndslice():
    s = NDSlice.contiguous((2, 3))
    assert s.ranks() == [0, 1, 2, 3, 4, 5]
    assert s.coordinates(4) == (1, 1)
    sub = NDSlice(1, (2,), (3,))
    assert sub.ranks() == [1, 4] and sub.coordinates(4) == (1,) and sub.coordinates(2) is None


def test_signer_repr_hides_secret():
    key = new_secret()
    assert key.hex() not in repr(Signer(key))


# ------------------------------------------------------------------ protocol v3: the envelope


def _header(frames):
    return envelope.Header._make(envelope.HEADER.unpack(bytes(frames[1])))


def test_envelope_roundtrip_one_message_and_a_batch():
    s = Signer(new_secret())
    sealer = envelope.Sealer(s, 3)
    t = torch.arange(4.0)
    one = sealer.seal(encode(m.FetchResult(1, 3, t, None), s))
    h, parts = envelope.unseal(one, s)
    assert h == envelope.Header(envelope.PROTOCOL_VERSION, 3, sealer.socket, 1, 1)
    assert torch.equal(decode(parts[0], s).value, t)
    msgs = [m.Ping(), m.Refused("no"), m.DeleteRefs((1, 2))]
    batch = sealer.seal([f for x in msgs for f in encode(x, s)], len(msgs))
    assert len(batch) == 3  # a batch is one frame
    h, parts = envelope.unseal(batch, s)
    assert (h.seq, h.count) == (2, 3) and [decode(p, s) for p in parts] == msgs
    assert all(p[0] is None for p in parts)  # covered by the envelope
    version = envelope.PROTOCOL_VERSION.to_bytes(2, "little")
    assert bytes(one[1])[:2] == version  # the version leads the header
    # a batch with a message its builder signed (a large pickle) among unsigned ones
    msgs = [m.Ping(), m.Refused("x" * (wire.COVER_MAX + 1)), m.DeleteRefs((3,))]
    h, parts = envelope.unseal(sealer.seal([f for x in msgs for f in encode(x, s)], 3), s)
    assert [decode(p, s) for p in parts] == msgs
    assert [p[0] is None for p in parts] == [True, False, True]


def _signed_one():
    """A message with a buffer: signed by its builder, the envelope covers its signature."""
    return m.FetchResult(1, 0, torch.arange(2000.0), None)


@pytest.mark.parametrize("where", ["env_sig", "rank", "seq", "pickle", "inner_sig", "count"])
def test_envelope_binds_rank_sequence_and_contents(where):
    s = Signer(new_secret())
    msg = _signed_one() if where == "inner_sig" else m.Ping()
    frames = [bytearray(f) for f in envelope.Sealer(s, 0).seal(encode(msg, s))]
    h = _header(frames)
    if where == "env_sig":
        frames[0][0] ^= 1
    elif where == "inner_sig":
        frames[2][0] ^= 1
    elif where == "pickle":
        frames[3][-2] ^= 1
    else:
        change = {"rank": {"rank": 1}, "seq": {"seq": 7}, "count": {"count": 2}}[where]
        frames[1] = bytearray(envelope.HEADER.pack(*h._replace(**change)))
    with pytest.raises(BadMessage) as e:
        envelope.unseal(frames, s)
    assert e.value.kind == ("malformed" if where == "count" else "signature")


@pytest.mark.parametrize("at", range(3))
def test_every_message_of_a_batch_is_covered(at):
    s = Signer(new_secret())
    msgs = [m.Ping(), m.Refused("no"), m.DeleteRefs((1, 2))]
    frames = envelope.Sealer(s, 0).seal([f for x in msgs for f in encode(x, s)], 3)
    _, parts = envelope.unseal(frames, s)
    batch = bytearray(frames[2])
    start = sum(envelope.ENTRY.size + len(p[1]) for p in parts[:at]) + envelope.ENTRY.size
    batch[start + len(parts[at][1]) // 2] ^= 1  # a byte of message ``at``'s pickle
    with pytest.raises(BadMessage) as e:
        envelope.unseal([frames[0], frames[1], bytes(batch)], s)
    assert e.value.kind == "signature"


def test_envelope_of_another_version_names_it_before_anything_else():
    s = Signer(new_secret())
    frames = envelope.Sealer(s, 0).seal(encode(m.Ping(), s))
    other = envelope.PROTOCOL_VERSION + 1
    frames[1] = other.to_bytes(2, "little") + frames[1][2:]
    frames[0] = b"x"  # not even a signature: the version is read first
    with pytest.raises(envelope.VersionMismatch) as e:
        envelope.unseal(frames, s)
    assert (e.value.kind, e.value.version) == ("version", other)
    this = envelope.PROTOCOL_VERSION
    assert f"protocol {other}" in str(e.value) and f"this side {this}" in str(e.value)
    with pytest.raises(envelope.VersionMismatch) as e:  # the wire before v2: [sig, pickle]
        envelope.unseal(encode(m.Ping(), s), s)
    assert e.value.version == 1


def test_malformed_envelopes():
    s = Signer(new_secret())
    good = envelope.Sealer(s, 0).seal(encode(m.Ping(), s))
    signed = envelope.Sealer(s, 0).seal(encode(_signed_one(), s))
    batch = envelope.Sealer(s, 0).seal([*encode(m.Ping(), s), *encode(m.Ping(), s)], 2)
    for frames in (
        [],
        [b"x"],
        [good[0], b"\x02"],
        [good[0], good[1] + b"x", *good[2:]],
        [*batch, b"x"],  # a batch is one frame
        [*batch[:2], batch[2][:-1]],  # shorter than its count
        [*batch[:2], batch[2] + b"x"],  # longer
        [*batch[:2], batch[2][:3]],  # not even an entry
    ):
        with pytest.raises(BadMessage) as e:
            envelope.unseal(frames, s)
        assert e.value.kind == "malformed", frames
    with pytest.raises(BadMessage) as e:  # a buffer added to an unsigned message
        envelope.unseal([*good, b"buffer"], s)
    assert e.value.kind == "signature"
    # a message without its pickle is refused alone (its envelope still counts: no gap)
    _, parts = envelope.unseal(envelope.Sealer(s, 0).seal(good[2:3]), s)
    with pytest.raises(BadMessage, match="at least 2 frames"):
        decode(parts[0], s)
    _, parts = envelope.unseal(signed[:4], s)  # a signed message without its buffer opens...
    with pytest.raises(BadMessage) as e:
        decode(parts[0], s)  # ...and its own signature does not verify
    assert e.value.kind == "signature"
    # a signature of the wrong length fails its message alone, not the batch around it
    inner = [*encode(m.Ping(), s), b"short", b"pickle", *encode(m.Refused("no"), s)]
    _, parts = envelope.unseal(envelope.Sealer(s, 0).seal(inner, 3), s)
    got = list(envelope.decode_each(parts, s))
    assert got[0] == m.Ping() and got[2] == m.Refused("no")
    assert isinstance(got[1], BadMessage) and "wrong length" in str(got[1])
    _, parts = envelope.unseal(envelope.Sealer(s, 0).seal([b"short", b"pickle"]), s)
    with pytest.raises(BadMessage, match="wrong length"):
        decode(parts[0], s)
    with pytest.raises(ValueError, match="pairs"):  # a sealer refuses to build a bad batch
        envelope.Sealer(s, 0).seal([*encode(m.Ping(), s), b"odd"], 2)


def test_sealer_retract_reuses_the_sequence_number():
    s = Signer(new_secret())
    sealer = envelope.Sealer(s, 0)
    sealer.seal(encode(m.Ping(), s))
    sealer.retract()
    assert _header(sealer.seal(encode(m.Ping(), s))).seq == 1
    assert _header(sealer.seal(encode(m.Ping(), s), to=b"other")).seq == 1  # per destination


def _h(rank, socket, seq):
    return envelope.Header(envelope.PROTOCOL_VERSION, rank, socket, seq, 1)


def _rejected(table, identity, header):
    with pytest.raises(BadMessage) as e:
        table.admit(identity, header)
    return e.value.kind


def test_peer_table_binds_ranks_and_orders_each_socket():
    t = envelope.PeerTable()
    assert t.admit(b"w0", _h(0, 10, 1)) is None  # rank 0 has not joined: only a join may come
    t.join(b"w0", _h(0, 10, 1))
    assert t.admit(b"w0", _h(0, 10, 2)) == 0
    assert _rejected(t, b"w0", _h(0, 10, 2)) == "replay"
    assert _rejected(t, b"w0", _h(0, 10, 1)) == "replay"
    assert _rejected(t, b"w0", _h(1, 10, 3)) == "rank"  # the connection speaks for rank 0
    assert _rejected(t, b"w0", _h(0, 11, 1)) == "replay"  # another socket's message on it
    assert t.admit(b"w0", _h(0, 10, 5)) == 2  # a gap: two messages never came
    assert t.admit(b"s0", _h(0, 20, 1)) == 0  # a stream socket of a joined rank binds
    assert _rejected(t, b"s0", _h(1, 20, 2)) == "rank"
    assert _rejected(t, b"fresh", _h(0, 20, 1)) == "replay"  # replayed on a new connection
    assert t.admit(b"again", _h(0, 20, 2)) == 0  # the same socket, reconnected, goes on
    assert t.admit(b"s1", _h(1, 30, 1)) is None  # rank 1 has not joined
    t.refuse(b"dup", _h(0, 50, 1))  # a second rank 0, refused: nothing more from it
    assert _rejected(t, b"dup", _h(0, 50, 2)) == "rank"
    assert _rejected(t, b"dup2", _h(0, 50, 2)) == "rank"
    t.new_generation()
    assert t.admit(b"s2", _h(0, 40, 1)) is None  # after a restart every rank joins again
    assert _rejected(t, b"late", _h(0, 10, 5)) == "replay"  # old frames stay replays
    for kind in ("gap", "gap", "rank"):
        t.count(kind)
    assert t.rejections["gap"] == 2 and t.total == 3 and set(t.rejections) == set(envelope.KINDS)


def test_open_from_controller_admits_and_decode_each_names_what_fails():
    s = Signer(new_secret())
    peers = envelope.PeerTable()
    peers.allow(envelope.CONTROLLER)
    ctrl = envelope.Sealer(s, envelope.CONTROLLER)
    good, bad = encode(m.Ping(), s), encode(m.Refused("x" * (wire.COVER_MAX + 1)), s)
    bad = [bytes([bad[0][0] ^ 1]) + bytes(bad[0][1:]), bad[1]]  # sealed as it is
    ctrl.seal(good)  # never delivered: a gap of one
    missed, parts = envelope.open_from_controller(ctrl.seal([*good, *bad], 2), s, peers)
    assert missed == 1
    messages = list(envelope.decode_each(parts, s))
    assert messages[0] == m.Ping()
    assert isinstance(messages[1], BadMessage) and messages[1].kind == "signature"
    with pytest.raises(BadMessage) as e:  # a worker's envelope is not the controller's
        envelope.open_from_controller(envelope.Sealer(s, 0).seal(good), s, peers)
    assert e.value.kind == "rank"
    fresh = envelope.PeerTable()  # a table that does not allow the controller yet
    with pytest.raises(BadMessage, match="not of the controller") as e:
        envelope.open_from_controller(envelope.Sealer(s, envelope.CONTROLLER).seal(good), s, fresh)
    assert e.value.kind == "rank"


def test_tensors_torch_makes_without_plain_memory_travel():
    """Found by the OpInfo conformance run: a size-1 tensor broadcast by stride 0
    (``expand_as``) and autograd's ZeroTensor gradient could not be sent back."""
    import torch

    from monarch_nb.protocol.pickling import dumps, loads

    for t in (
        torch.tensor(3.0).expand(1, 1, 1),
        torch.ones(3, 1)[:, :1].expand(3, 1),
        torch._efficientzerotensor(2, 3),
    ):
        payload, buffers = dumps(t)
        back = loads(payload, buffers)
        assert torch.equal(back, t.clone() if not t._is_zerotensor() else torch.zeros(2, 3))


@pytest.mark.parametrize("value", [None, True, 7, 2.5, "text", b"bytes", 10**30])
def test_plain_values_pickle_as_the_full_pickler_pickles_them(value):
    import io

    from monarch_nb.protocol.pickling import _Pickler, dumps, loads

    f = io.BytesIO()
    _Pickler(f, [], []).dump(value)
    payload, buffers = dumps(value)
    assert (payload, buffers) == (f.getvalue(), []) and loads(payload) == value
