"""Turning a worker-side exception into the RemoteFailure record sent home."""

from __future__ import annotations

import os
import traceback

from ..protocol.messages import RemoteFailure

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def user_traceback(e: BaseException):
    """The traceback of ``e`` without the leading frames of monarch_nb's own machinery."""
    tb = e.__traceback__
    while tb is not None and _is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb if tb is not None else e.__traceback__


def describe(e: BaseException) -> RemoteFailure:
    tb = user_traceback(e)
    try:
        text = "".join(traceback.format_exception(type(e), e, tb))
    except Exception as fmt_error:  # a broken __str__ must not break error reporting
        text = f"{type(e).__name__} (traceback unavailable: {fmt_error!r})\n"
    try:
        message = str(e)
    except Exception:
        message = "<unprintable exception>"
    return RemoteFailure(type(e).__name__, message, text)
