"""Messages (typed records), the wire (signing, framing), pickling, and the
envelope of protocol v3 (version, rank, sequence number)."""

from . import envelope, messages
from .wire import BadMessage, Signer, decode, encode, new_secret

__all__ = ["envelope", "messages", "BadMessage", "Signer", "decode", "encode", "new_secret"]
