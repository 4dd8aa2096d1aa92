"""Unit tests of the wire: signing, framing, zero-copy tensors, functions by value."""

import pickle

import pytest
import torch

from monarch_nb.protocol import BadMessage, Signer, decode, encode, new_secret
from monarch_nb.protocol import messages as m
from monarch_nb.protocol.ndslice import NDSlice
from monarch_nb.protocol.wire import (
    FULL_COVER,
    function_ref,
    pack_args,
    resolve_function,
    unpack_args,
)


def test_roundtrip_and_signature():
    s = Signer(new_secret())
    msg = m.Status(1, 0, 5, (5, 5, 3))
    assert decode(encode(msg, s), s) == msg


def test_wrong_key_is_rejected_before_unpickling(tmp_path):
    marker = tmp_path / "executed"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    frames = encode(m.Output(0, 0, None, "stdout", "x"), Signer(new_secret()))
    frames[1] = pickle.dumps(Evil())
    with pytest.raises(BadMessage):
        decode(frames, Signer(new_secret()))
    assert not marker.exists()


@pytest.mark.parametrize("where", [0, 1, 2])
def test_any_tampered_frame_is_rejected(where):
    s = Signer(new_secret())
    t = torch.arange(1000, dtype=torch.float32)
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
    out = decode(encode(m.FetchResult(1, 0, t, None), s), s).value
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


def test_parameter_keeps_its_type():
    s = Signer(new_secret())
    p = torch.nn.Parameter(torch.ones(2))
    out = decode(encode(m.FetchResult(1, 0, p, None), s), s).value
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


def test_ndslice():
    s = NDSlice.contiguous((2, 3))
    assert s.ranks() == [0, 1, 2, 3, 4, 5]
    assert s.coordinates(4) == (1, 1)
    sub = NDSlice(1, (2,), (3,))
    assert sub.ranks() == [1, 4] and sub.coordinates(4) == (1,) and sub.coordinates(2) is None


def test_signer_repr_hides_secret():
    key = new_secret()
    assert key.hex() not in repr(Signer(key))
