"""A host agent's link to its controller over ZeroMQ (``monarch-nb-host --connect``).

Each ZeroMQ message carries one host_messages record in the protocol v3
envelope: ``[env_sig, header, sig, line]``, ``sig`` the HMAC of the line under
the mesh key, the envelope sealed by ``envelope.Sealer``. No pickle: a line
that does not verify is never read, one that does is a plain record.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from . import host_messages as hm
from .envelope import Header, Sealer, unseal
from .wire import BadMessage, Signer, small

# the rank a relay's header names: no rank of the mesh, nor a host's (envelope.host_peer);
# the mesh's ROUTER hands such envelopes to the agents' channel
AGENT = -(1 << 30)


def is_agent_header(header: bytes) -> bool:
    """Whether an envelope's header frame names a relay's agent link."""
    return len(header) >= 6 and int.from_bytes(header[2:6], "little", signed=True) == AGENT


def seal(sealer: Sealer, signer: Signer, msg, to: bytes = b"") -> list:
    """The frames of ``msg`` (to ``to``, for a ROUTER)."""
    line = hm.encode(msg)
    return sealer.seal([signer.mac(line), line], 1, to)


def open_record(frames: Sequence, signer: Signer) -> tuple[Header, object]:
    """The header and record of ``frames``. Raises BadMessage (VersionMismatch for
    another protocol version) when they are not a record signed with the key."""
    h, parts = unseal(frames, signer)
    if len(parts) != 1 or len(parts[0]) != 2:
        raise BadMessage("an agent link message is one signed record")
    sig, line = parts[0][0], bytes(parts[0][1])
    if sig is not None and not hmac.compare_digest(small(sig), signer.mac(line)):
        raise BadMessage("the record's signature does not verify", "signature")
    try:
        return h, hm.decode(line)
    except hm.HostMessageError as e:
        raise BadMessage(str(e)) from None
