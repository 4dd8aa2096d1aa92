"""DAP messages of the adapter: responses, errors, and its blocking work off the
control thread's event loop (on the pool debugpy leaves running)."""

from __future__ import annotations

import asyncio

from . import dap_debugpy


class DapError(Exception):
    """Answered as a DAP error response (success: false) with this message."""


def response(request: dict, body=None, error: str | None = None) -> dict:
    rep = {
        "seq": request.get("seq", 0),
        "type": "response",
        "request_seq": request.get("seq", 0),
        "command": request.get("command"),
        "success": error is None,
    }
    if error is None:
        rep["body"] = body if body is not None else {}
    else:
        rep["message"] = error
        rep["body"] = {"error": {"id": 1, "format": error, "showUser": True}}
    return rep


def to_int(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


async def off_loop(fn, *args):
    """Run blocking ``fn`` off the control thread's event loop when there is one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(dap_debugpy.pool, fn, *args)


__all__ = ["DapError", "to_int", "off_loop", "response"]
