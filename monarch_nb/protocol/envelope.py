"""Protocol v3: the envelope around every ZeroMQ message, and the receiving
side's record of who may send what.

A ZeroMQ message is ``[env_sig, header, *inner]``:

* ``header`` (``HEADER``, 26 bytes, little-endian): the protocol version (u16,
  always the first two bytes, so that a peer of any version can read it), the
  sender's rank (i32, ``CONTROLLER`` = -1), the sending socket's id (u64,
  random per socket), the socket's sequence number (u64: 1, 2, ... per
  destination) and how many messages are inside (u32).
* ``inner``: one message ``[sig, pickle, *buffers]`` (count 1), or one frame
  ``batch`` holding ``count`` buffer-less messages, each as ``ENTRY`` (the
  length of its signature, 0 or 32, and of its pickle), the signature, the pickle
  (a signature of another length fails that message alone, in ``wire.decode``).
  One frame for a batch: ZeroMQ and pyzmq cost ~1 us a frame on each side.
* A message's own ``sig`` (``wire.encode``, on the thread that built it) covers
  a message with buffers, or a large pickle. A small buffer-less message comes
  unsigned (``sig`` empty): the envelope covers its pickle.
* ``env_sig``: HMAC-SHA256 of the header followed by each message's ``ENTRY``
  and then its signature, or its pickle when it has none. It is computed at
  send time by the thread that owns the socket (never over a large pickle or a
  buffer), and binds rank and sequence number to the contents.

``unseal`` hands on an unsigned message with ``None`` for its signature: covered
by the envelope it came in (``wire.decode`` and the relays read it so; no frame
off the wire is ever None).

The socket id is what makes a replay detectable on any connection: ZeroMQ
identities are assigned by the receiving ROUTER (a replayer gets a fresh one),
the socket id is signed.
"""

from __future__ import annotations

import hmac
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

from .wire import SIG_LEN, BadMessage, Signer, decode, small

PROTOCOL_VERSION = 5
CONTROLLER = -1  # the controller's rank in headers


def host_peer(host: int) -> int:
    """The rank a host agent's socket seals with: -2 for host 0, -3 for host 1..."""
    return -2 - host


HEADER = struct.Struct("<HiQQI")  # version, rank, socket id, sequence number, count
ENTRY = struct.Struct("<IQ")  # a message in an envelope: its signature's length, its pickle's
KINDS = ("signature", "version", "malformed", "rank", "replay", "gap")


class Header(NamedTuple):
    version: int
    rank: int
    socket: int
    seq: int
    count: int


class VersionMismatch(BadMessage):
    """The peer speaks another protocol version (``version``)."""

    def __init__(self, version: int):
        super().__init__(
            f"the sender speaks protocol {version}, this side {PROTOCOL_VERSION}", "version"
        )
        self.version = version


class Sealer:
    """Seals what one socket sends: this sender's rank, the socket's id, and a
    sequence number per destination (a ROUTER has many; a DEALER one, ``b""``).
    Used by the socket's owning thread only."""

    __slots__ = ("_signer", "rank", "socket", "_seq")

    def __init__(self, signer: Signer, rank: int, socket_id: int | None = None):
        self._signer = signer
        self.rank = rank
        self.socket = int.from_bytes(os.urandom(8), "little") if socket_id is None else socket_id
        self._seq: dict = {}

    def seal(self, inner: Sequence, count: int = 1, to: bytes = b"") -> list:
        """``[env_sig, header, *inner]``; ``inner`` holds one message, or ``count``
        [sig, pickle] pairs (packed into one batch frame). An empty or None ``sig``:
        the envelope covers that message's pickle."""
        seq = self._seq.get(to, 0) + 1
        self._seq[to] = seq
        header = HEADER.pack(PROTOCOL_VERSION, self.rank, self.socket, seq, count)
        if count != 1:
            batch, covered = _pack(inner)
            return [self._signer.mac_of(header, *covered), header, batch]
        if len(inner) == 2 and not inner[0]:  # unsigned: covered here
            payload = inner[1]
            mac = self._signer.mac_of(header, ENTRY.pack(0, len(payload)), payload)
            return [mac, header, b"", payload]
        if len(inner) < 2:  # no message (the receiver refuses it)
            return [self._signer.mac_of(header, *inner), header, *inner]
        entry = ENTRY.pack(len(inner[0]), len(inner[1]))
        return [self._signer.mac_of(header, entry, inner[0]), header, *inner]

    def retract(self, to: bytes = b"") -> None:
        """The message sealed last for ``to`` was not sent after all (a full
        socket): its sequence number is reused, or the receiver would see a gap."""
        self._seq[to] -= 1


def version_of(header) -> int:
    """The protocol version of a header frame (the wire before v2 had a pickle there: 1)."""
    if len(header) < 2:
        raise BadMessage("the header frame is too short")
    if len(header) != HEADER.size and header[:1] == b"\x80":
        return 1
    return int.from_bytes(header[:2], "little")


def unseal(frames: Sequence, signer: Signer) -> tuple[Header, list]:
    """Open an envelope: its header and the frame sets of the messages inside,
    each still to be decoded by ``wire.decode`` (a signature of None: covered by
    this envelope). Raises BadMessage of kind "malformed", "version"
    (VersionMismatch) or "signature"."""
    n = len(frames)
    if n < 2:
        raise BadMessage(f"expected an envelope of at least 3 frames, got {n}")
    header = small(frames[1])
    version = version_of(header)
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version)
    if len(header) != HEADER.size:
        raise BadMessage(f"a header of {len(header)} bytes, not {HEADER.size}")
    env_sig = small(frames[0])
    if len(env_sig) != SIG_LEN:
        raise BadMessage("the envelope signature has the wrong length")
    h = Header._make(HEADER.unpack(header))
    if h.count == 1:  # one message, of any shape: wire.decode checks it
        sig = small(frames[2]) if n > 2 else b""
        if n == 4 and not sig:  # unsigned: covered by this envelope
            payload = small(frames[3])
            parts = [[None, payload]]
            mac = signer.mac_of(header, ENTRY.pack(0, len(payload)), payload)
        elif n < 4:
            parts = [[sig]] if n == 3 else [[]]
            mac = signer.mac_of(header, sig)
        else:  # the pickle and buffers are the message's own signature's to cover
            parts = [list(frames[2:])]
            mac = signer.mac_of(header, ENTRY.pack(len(sig), len(frames[3])), sig)
    elif h.count > 1 and n == 3:
        parts, covered = _unpack(frames[2], h.count)
        mac = signer.mac_of(header, covered)
    else:
        raise BadMessage(f"an envelope of {n} frames cannot hold {h.count} message(s)")
    if not hmac.compare_digest(env_sig, mac):
        raise BadMessage("the envelope signature does not verify", "signature")
    return h, parts


def _pack(inner: Sequence) -> tuple:
    """The batch frame of ``[sig, pickle, ...]`` pairs, and the parts of it the
    envelope's signature covers (the batch itself when no message has a signature)."""
    if len(inner) % 2:
        raise ValueError("a batch is [sig, pickle] pairs")
    out: list = []
    covered: list = []
    for i in range(0, len(inner), 2):
        sig, payload = inner[i], inner[i + 1]
        if sig:
            entry = ENTRY.pack(len(sig), len(payload))
            out += (entry, sig, payload)
            covered += (entry, sig)
        else:
            entry = ENTRY.pack(0, len(payload))
            out += (entry, payload)
            covered += (entry, payload)
    batch = b"".join(out)
    return batch, (batch,) if len(covered) == len(out) else covered


def _unpack(frame, count: int) -> tuple:
    """The ``count`` messages of a batch frame (pickles as views of it), and what
    the envelope's signature covers of it; BadMessage when it does not parse."""
    view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    size, at, parts = len(view), 0, []
    covered: list | None = None  # while no message is signed: the batch itself
    for _ in range(count):
        if at + ENTRY.size > size:
            raise BadMessage("a batch shorter than its count")
        ls, lp = ENTRY.unpack_from(view, at)
        start = at + ENTRY.size
        end = start + ls + lp
        if end > size:
            raise BadMessage("a batch entry longer than the batch")
        if ls:
            if covered is None:
                covered = [view[:at]]
            sig = bytes(view[start : start + ls])
            covered += (view[at:start], sig)
            parts.append([sig, view[start + ls : end]])
        else:
            if covered is not None:
                covered.append(view[at:end])
            parts.append([None, view[start:end]])
        at = end
    if at != size:
        raise BadMessage("a batch longer than its count")
    return parts, view if covered is None else b"".join(covered)


def open_from_controller(frames: Sequence, signer: Signer, peers: PeerTable) -> tuple:
    """Unseal and admit an envelope the controller sent to one socket of a worker
    or host (``peers`` allows the controller): ``(missed, parts)``, how many of the
    controller's messages to this socket never arrived before it and the frame
    sets of the messages inside (``decode_each``). Raises BadMessage for the
    envelope as a whole: VersionMismatch for another protocol, kind "rank" for a
    sender other than the controller."""
    header, parts = unseal(frames, signer)
    missed = peers.admit(b"", header)
    if missed is None:
        raise BadMessage(f"a message of rank {header.rank}, not of the controller", "rank")
    return missed, parts


def decode_each(parts: list, signer: Signer):
    """Each message of an envelope's ``parts`` decoded, or the BadMessage it failed with."""
    for p in parts:
        try:
            yield decode(p, signer)
        except BadMessage as e:
            yield e


class PeerTable:
    """The receiving side's record of its peers' sockets: the rank each socket
    id and each ZeroMQ identity speaks for, the last sequence number of each
    socket, and the rejections counted by kind (``rejections``). Pure: no I/O.

    A socket binds to its rank on its first message when that rank has joined
    (``join``, after the rank's first socket was accepted); a socket of a rank
    that has not joined may only join. The table outlives restarts: the secret
    does too, so a frame of an earlier generation is still a replay."""

    def __init__(self, counts: dict | None = None):
        self.rejections = counts if counts is not None else {}
        for k in KINDS:
            self.rejections.setdefault(k, 0)
        self._sockets: dict[int, list] = {}  # socket id -> [rank, last seq, identity]
        self._identities: dict[bytes, tuple] = {}  # identity -> (rank, socket id)
        self._joined: set[int] = set()
        self._resuming = False

    def count(self, kind: str) -> int:
        """Count one rejection of ``kind``; returns the total of that kind."""
        self.rejections[kind] = self.rejections.get(kind, 0) + 1
        return self.rejections[kind]

    @property
    def total(self) -> int:
        return sum(self.rejections.values())

    def allow(self, rank: int) -> None:
        """Sockets of ``rank`` bind on their first message (a worker allows the controller)."""
        self._joined.add(rank)

    def join(self, identity: bytes, h: Header) -> None:
        """``identity``'s socket was accepted as rank ``h.rank``'s (its WorkerReady)."""
        self._joined.add(h.rank)
        self._sockets[h.socket] = [h.rank, h.seq, identity]
        self._identities[identity] = (h.rank, h.socket)

    def refuse(self, identity: bytes, h: Header) -> None:
        """``identity``'s socket asked to join and was refused: nothing more from it."""
        self._sockets[h.socket] = [None, h.seq, identity]
        self._identities[identity] = (None, h.socket)

    def new_generation(self) -> None:
        """Every rank joins again (known sockets stay known)."""
        self._joined.clear()
        self._resuming = False

    def resume(self, ranks) -> None:
        """A controller that attaches to running ``ranks``: their sockets are where
        they are in their sequences, so a socket's first message sets its start (no
        gap), whichever of the rank's sockets reconnects first."""
        self._joined.update(ranks)
        self._resuming = True

    def release(self, identity: bytes) -> None:
        """``identity``'s connection may carry a new socket (a worker's DEALER after its
        controller went and another attached); the old socket's messages stay replays."""
        self._identities.pop(identity, None)

    def admit(self, identity: bytes, h: Header) -> int | None:
        """Check the header of a message that came from ``identity``. Returns how
        many messages of its socket were skipped before it (0: in order; more: a
        gap, for the caller to count and act on), or None for a socket of a rank
        that has not joined (only a join may come from it). Raises BadMessage of
        kind "rank" (it claims another rank than its socket or identity) or
        "replay" (a sequence number seen already, or another socket's message on
        this connection), for the caller to count."""
        bound = self._identities.get(identity)
        if bound is not None:
            if bound[0] is None:
                raise BadMessage("a message from a socket that was refused", "rank")
            if bound[0] != h.rank:
                raise BadMessage(f"a message claiming rank {h.rank} from rank {bound[0]}", "rank")
            if bound[1] != h.socket:
                raise BadMessage("another socket's message on this connection", "replay")
        s = self._sockets.get(h.socket)
        if s is None:
            if h.rank not in self._joined:
                return None
            self._sockets[h.socket] = [h.rank, h.seq, identity]
            self._identities[identity] = (h.rank, h.socket)
            return 0 if self._resuming else h.seq - 1
        rank, last, known = s
        if rank is None:
            raise BadMessage("a message from a socket that was refused", "rank")
        if rank != h.rank:
            raise BadMessage(f"a message claiming rank {h.rank} from rank {rank}", "rank")
        if h.seq <= last:
            raise BadMessage(f"sequence number {h.seq} after {last}: a replay", "replay")
        s[1] = h.seq
        if known != identity:  # the socket reconnected: its new identity speaks for it
            s[2] = identity
            self._identities[identity] = (rank, h.socket)
        return h.seq - last - 1
