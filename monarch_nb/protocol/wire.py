"""The wire: signing and framing of one message (the envelope around each
ZeroMQ message is ``envelope.py``; pickling is ``pickling.py``).

A message travels as the frames ``[signature, pickle, *buffers]``:

* ``pickle`` is the message pickled with protocol 5 (``pickling.py``); tensors
  and other large buffers are out-of-band frames of their own.
* ``signature`` is HMAC-SHA256 with the mesh's secret over the pickle, the
  length of every buffer, and the content of every buffer up to
  ``FULL_COVER`` bytes; of larger buffers the first and last ``EDGE`` bytes are
  covered. The pickle, the only part that can make a receiver execute
  anything, is always covered whole. Full coverage of a large tensor would
  cost as much as sending it (SHA-256 runs at about 1 GB/s here, the same as
  loopback ZeroMQ); the setting ``sign_full`` (``MONARCH_NB_SIGN_FULL=1``) covers every byte.

It is computed by the thread that builds the message (the caller's), so big
payloads are never hashed by an IO thread. A message without buffers whose
pickle is at most ``COVER_MAX`` bytes goes unsigned (``signature`` empty): the
envelope that carries it covers its pickle (``envelope.py``), one HMAC for a
whole batch. A frame set whose signature does not verify is never unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import zmq
import zmq.backend

from ..config import process_settings
from . import messages, values
from .messages import FetchResult, RemoteFailure

# the pickling API, imported from here by most callers
from .pickling import (  # noqa: F401
    RefUseError,
    dumps,
    function_ref,
    is_by_value,
    load_group,
    loads,
    pack_args,
    register_ref_type,
    register_special_type,
    resolve_function,
    unpack_args,
)

SIG_LEN = 32
COVER_MAX = 16 << 10  # a buffer-less pickle up to this size is covered by its envelope
FULL_COVER = 1 << 20
EDGE = 64 << 10


class BadMessage(Exception):
    """A frame set that is malformed or fails authentication. ``kind`` names the
    rejection: "signature", "version", "malformed", "rank", "replay" or "gap"."""

    def __init__(self, message: str, kind: str = "malformed"):
        super().__init__(message)
        self.kind = kind


def new_secret() -> bytes:
    return os.urandom(32)


class Signer:
    """HMAC-SHA256 over a message's frames with one mesh's secret."""

    __slots__ = ("_key", "_inner", "_outer", "_full")

    def __init__(self, key: bytes, full: bool | None = None):
        """``full``: sign every byte of large buffers (the setting ``sign_full``; None:
        this process's). Every process of a mesh must agree: its controller hands
        its value to the ranks it starts."""
        if len(key) < 16:
            raise ValueError("the mesh secret must be at least 16 bytes")
        self._key = key
        self._full = process_settings()["sign_full"] if full is None else bool(full)
        # HMAC (RFC 2104) with the padded keys hashed once: each message then costs
        # two copies of a SHA-256 state (4x cheaper than hmac.digest, which sets up
        # OpenSSL's HMAC afresh for every call)
        block = key if len(key) <= 64 else hashlib.sha256(key).digest()
        block = block.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def __repr__(self) -> str:  # never show the secret
        return "Signer(<secret>)"

    def mac_of(self, *parts) -> bytes:
        """HMAC of ``parts`` one after another (bytes-like: no concatenation)."""
        h = self._inner.copy()
        for p in parts:
            h.update(p)
        outer = self._outer.copy()
        outer.update(h.digest())
        return outer.digest()

    mac = mac_of  # of a few bytes: an agent link's record

    def digest(self, payload, buffers: Sequence) -> bytes:
        h = self._inner.copy()
        h.update(payload)
        for b in buffers:
            mv = memoryview(b).cast("B")
            n = mv.nbytes
            h.update(n.to_bytes(8, "little"))
            if n <= FULL_COVER or self._full:
                h.update(mv)
            else:
                h.update(mv[:EDGE])
                h.update(mv[-EDGE:])
        outer = self._outer.copy()
        outer.update(h.digest())
        return outer.digest()

    def verify(self, signature, payload, buffers: Sequence) -> bool:
        return hmac.compare_digest(bytes(signature), self.digest(payload, buffers))


class _PackedFetch(NamedTuple):
    """A FetchResult on the wire: its value pickled apart (covered whole by the
    signature), so that a value the receiver cannot unpickle (a class it cannot
    import) still delivers the ident and rank, with the reason as the error."""

    ident: int
    rank: int
    error: Any
    value: bytes


# A message travels as the plain tuple (code, *fields), and so do the records of
# values.py in its fields (``_NESTED``): pickling a NamedTuple goes through copyreg and
# its __getnewargs__ in Python, and unpickling through its Python __new__.
_TYPES: tuple = tuple(
    sorted(
        (
            c
            for c in vars(messages).values()
            if isinstance(c, type) and issubclass(c, tuple) and c.__module__ == messages.__name__
        ),
        key=lambda c: c.__name__,
    )
) + (_PackedFetch,)
_CODE = {c: i for i, c in enumerate(_TYPES)}


_RECORDS = {n: c for n, c in vars(values).items() if isinstance(c, type) and issubclass(c, tuple)}


def _nested_fields(cls) -> tuple:
    """``(position, record class)`` of the fields of ``cls`` that hold a record of
    ``values.py`` (or None), read from its annotations: those travel as plain tuples too."""
    found = []
    for i, name in enumerate(cls._fields):
        hint = cls.__annotations__.get(name, "")
        hint = getattr(hint, "__forward_arg__", hint)  # NamedTuple wraps the strings
        hint = hint.removesuffix(" | None") if isinstance(hint, str) else ""
        if hint in _RECORDS:
            found.append((i + 1, _RECORDS[hint]))
    return tuple(found)


_NESTED = {c: n for c in _TYPES if (n := _nested_fields(c))}


def encode(msg, signer: Signer) -> list:
    """Frames ``[signature, pickle, *buffers]`` of a message; ``signature`` empty
    for a small buffer-less one (its envelope covers it).

    Records whose fields are plain data (everything but FetchResult, whose value
    is the user's) go through the C pickler alone: three times faster."""
    if type(msg) is FetchResult:
        value, buffers = dumps(msg.value)
        packed = (_CODE[_PackedFetch], msg.ident, msg.rank, msg.error, value)
        payload = pickle.dumps(packed, 5)
    else:
        buffers = []
        flat = (_CODE[type(msg)], *msg)
        nested = _NESTED.get(type(msg))
        if nested is not None:
            parts = list(flat)
            for i, _ in nested:
                if parts[i] is not None:
                    parts[i] = tuple(parts[i])
            flat = tuple(parts)
        payload = pickle.dumps(flat, 5, buffer_callback=buffers.append)
    if not buffers and len(payload) <= COVER_MAX:
        return [b"", payload]
    raws = [b.raw() for b in buffers]
    return [signer.digest(payload, raws), payload, *raws]


def encode_result(ident: int, rank: int, value, failure, signer: Signer) -> list:
    """A ``FetchResult``'s frames; a value that cannot be pickled goes as the failure
    that says so (``cannot send the value back: ...``), so the request still ends."""
    try:
        return encode(FetchResult(ident, rank, value, failure), signer)
    except Exception as e:
        why = RemoteFailure(type(e).__name__, f"cannot send the value back: {e}", "")
        return encode(FetchResult(ident, rank, None, why), signer)


def record_type(payload) -> type | None:
    """The message class of a record's pickle (``wire.encode``: the tuple ``(code,
    *fields)``, protocol 5), read from its first opcodes without unpickling; None
    when it does not start as a record does."""
    b = bytes(memoryview(payload)[:16])
    if len(b) < 4 or b[0] != 0x80:
        return None
    i = 2
    if b[i] == 0x95:  # FRAME and its 8-byte length
        i += 9
    if i < len(b) and b[i] == 0x28:  # MARK (a tuple of more than three items)
        i += 1
    if i + 1 >= len(b):
        return None
    op = b[i]
    if op == 0x4B:  # BININT1
        code = b[i + 1]
    elif op == 0x4D and i + 2 < len(b):  # BININT2
        code = b[i + 1] | b[i + 2] << 8
    else:
        return None
    return _TYPES[code] if code < len(_TYPES) else None


def small(f):
    """A frame's bytes (for small frames: copying beats a memoryview)."""
    return f.bytes if hasattr(f, "bytes") else f


def decode(frames: Sequence, signer: Signer):
    """Verify and unpickle frames received with ``copy=False`` (or as bytes); a
    signature of None: covered by the envelope they came in (``envelope.unseal``)."""
    if len(frames) < 2:
        raise BadMessage(f"expected at least 2 frames, got {len(frames)}")
    sig, payload = frames[0], small(frames[1])
    if sig is None:
        if len(frames) > 2:
            raise BadMessage("an unsigned message with buffers")
        bufs = ()
    else:
        sig = small(sig)
        bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames[2:]]
        if len(sig) != SIG_LEN:
            raise BadMessage("signature frame has the wrong length")
        if not signer.verify(sig, payload, bufs):
            raise BadMessage("signature does not verify", "signature")
    try:
        flat = pickle.loads(payload, buffers=bufs)
    except Exception as e:
        raise BadMessage(
            f"authenticated message failed to unpickle: {type(e).__name__}: {e}"
        ) from e
    code = flat[0] if type(flat) is tuple and flat else None
    if type(code) is not int or not 0 <= code < len(_TYPES):
        raise BadMessage(f"not a message record: {type(flat).__name__}")
    msg = build(_TYPES[code], flat)
    if type(msg) is _PackedFetch:
        return _unpack_fetch(msg, bufs)
    return msg


def build(cls, flat: tuple):
    """Record ``cls`` of its unpickled wire tuple ``(code, *fields)``; BadMessage when
    the fields do not fit it."""
    if len(flat) - 1 != len(cls._fields):
        raise BadMessage(f"a {cls.__name__} of {len(flat) - 1} fields, not {len(cls._fields)}")
    nested = _NESTED.get(cls)
    if nested is None:
        return tuple.__new__(cls, flat[1:])
    flat = list(flat)
    for i, rec in nested:
        v = flat[i]
        if v is not None:
            if type(v) is not tuple or len(v) != len(rec._fields):
                raise BadMessage(
                    f"a {cls.__name__} whose {cls._fields[i - 1]} is not a {rec.__name__}"
                )
            flat[i] = tuple.__new__(rec, v)
    return tuple.__new__(cls, flat[1:])


def _unpack_fetch(p: _PackedFetch, bufs: list) -> FetchResult:
    try:
        value = pickle.loads(p.value, buffers=bufs)
    except Exception as e:
        failure = RemoteFailure(
            type(e).__name__, f"the value arrived but cannot be unpickled here: {e}", ""
        )
        return FetchResult(p.ident, p.rank, None, failure)
    return FetchResult(p.ident, p.rank, value, p.error)


# pyzmq's Python layer (send_multipart, recv_multipart, getsockopt) turns every flag
# into an enum: twice the cost of the message itself on the hot path. The backend's
# methods take plain ints.
_RawSocket = zmq.backend.Socket
_raw_send, _raw_recv, _raw_get = _RawSocket.send, _RawSocket.recv, _RawSocket.get
_SNDMORE, _DONTWAIT = int(zmq.SNDMORE), int(zmq.DONTWAIT)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def send_frames(sock, frames: Sequence, nowait: bool = False) -> None:
    """Send a multipart message (copying; ``nowait``: zmq.Again when it cannot go now)."""
    last = len(frames) - 1
    flags = _DONTWAIT if nowait else 0
    for i, f in enumerate(frames):
        _raw_send(sock, f, (flags | _SNDMORE) if i < last else flags)


def recv_ready(sock):
    """The next message's frames if one is waiting, else None (zero-copy).

    Checks ZMQ_EVENTS instead of catching zmq.Again: pyzmq may reuse one Again
    instance, whose traceback would then keep the caller's frame, and the last
    (possibly 100 MB) message in its locals, alive until the next Again."""
    if not _raw_get(sock, _EVENTS) & _POLLIN:
        return None
    frame = _raw_recv(sock, 0, False)
    frames = [frame]
    while frame.more:
        frame = _raw_recv(sock, 0, False)
        frames.append(frame)
    return frames
