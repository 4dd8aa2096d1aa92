"""The agent fork server's wire: a controller asks it to fork a host agent.

The fork server (``host/forkserver.py``) has imported what a host agent imports
(torch, the worker) and listens on a Unix socket (SOCK_SEQPACKET: one message a
datagram) that is 0600 in a 0700 directory of its user; a caller of another user
is refused by its credentials too. A request is one JSON message carrying the
agent's arguments, environment and working directory, with three file
descriptors beside it (SCM_RIGHTS): the agent's stdin, stdout and stderr. The
server answers ``{"pid": P, "server": S}`` at once (or ``{"error": why}``) and,
on the same connection, ``{"exit": code}`` when that agent ends (Popen's
convention: a negative code is the signal that ended it).
"""

from __future__ import annotations

import json

REQUEST_FDS = 3  # the agent's stdin, stdout, stderr
MAX_MESSAGE = 1 << 20  # a request's bytes at most (an environment is a few KiB)


class ForkRequestError(ValueError):
    """A request the fork server cannot take: the message names what is wrong."""


def encode_request(argv: list[str], env: dict, cwd: str) -> bytes:
    """The request to fork an agent run as ``monarch-nb-host ARGV`` in ``env`` and ``cwd``."""
    return json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode()


def decode_request(data: bytes) -> tuple[list[str], dict, str]:
    """``(argv, env, cwd)`` of a request; ForkRequestError naming what is wrong."""
    try:
        msg = json.loads(data)
    except ValueError as e:
        raise ForkRequestError(f"a fork request is JSON: {e}") from None
    if not isinstance(msg, dict) or set(msg) != {"argv", "env", "cwd"}:
        raise ForkRequestError("a fork request is an object of argv, env and cwd")
    argv, env, cwd = msg["argv"], msg["env"], msg["cwd"]
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise ForkRequestError("a fork request's argv is a list of strings")
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise ForkRequestError("a fork request's env maps names to strings")
    if not isinstance(cwd, str) or not cwd:
        raise ForkRequestError("a fork request's cwd is a directory")
    return argv, env, cwd


def encode_reply(**fields) -> bytes:
    return json.dumps(fields).encode()


def decode_reply(data: bytes) -> dict:
    """A reply: ``pid`` and ``server``, ``error``, or ``exit``; ForkRequestError else."""
    try:
        msg = json.loads(data)
    except ValueError as e:
        raise ForkRequestError(f"the fork server's reply is not JSON: {e}") from None
    if not isinstance(msg, dict) or not ({"pid", "error", "exit"} & set(msg)):
        raise ForkRequestError(f"the fork server's reply names no pid, error or exit: {msg!r}")
    return msg
