"""Messages (one module of typed records) and the wire (framing, signing, pickling)."""

from . import messages
from .wire import BadMessage, Signer, decode, encode, new_secret

__all__ = ["messages", "BadMessage", "Signer", "decode", "encode", "new_secret"]
