"""Turning a worker-side exception into the RemoteFailure record sent home."""

from __future__ import annotations

import os
import sys
import traceback

from ..protocol.messages import RemoteFailure

_WORKER_DIR = os.path.dirname(os.path.abspath(__file__))
_PROTOCOL_DIR = os.path.join(os.path.dirname(_WORKER_DIR), "protocol")
_HOST_DIR = os.path.join(os.path.dirname(_WORKER_DIR), "host")  # the agent that forked a rank
_MACHINERY = tuple(d + os.sep for d in (_WORKER_DIR, _PROTOCOL_DIR, _HOST_DIR))


def is_machinery(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_MACHINERY)


def format_user_traceback(e: BaseException) -> str:
    """``e`` formatted without the frames of the worker's own machinery (which
    runs the user's code and delivers interrupts), nor, for a bad magic (IPython's
    UsageError), IPython's own frames: the cell's line and the message, as IPython
    says it."""
    te = traceback.TracebackException(type(e), e, e.__traceback__)
    hidden = _MACHINERY
    if type(e).__name__ == "UsageError" and type(e).__module__ == "IPython.core.error":
        hidden += (os.path.dirname(sys.modules["IPython"].__file__) + os.sep,)
    for t in _chain(te):
        t.stack = traceback.StackSummary.from_list(
            [f for f in t.stack if not os.path.abspath(f.filename).startswith(hidden)]
        )
    return "".join(te.format())


def format_user_stack(frame) -> str:
    """Where ``frame``'s thread is, without the worker's own frames ("" when it only
    runs the worker's machinery: an idle stream)."""
    if frame is None:
        return ""
    frames = [
        f
        for f in traceback.extract_stack(frame)
        if not (is_machinery(f.filename) or f.filename.startswith("<frozen runpy>"))
    ]
    return "".join(traceback.format_list(frames))


def _chain(te):
    seen = set()
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        yield te
        te = te.__cause__ or (None if te.__suppress_context__ else te.__context__)


def describe(e: BaseException) -> RemoteFailure:
    """``e`` as sent home: its type (name, module, qualname, so that the controller
    can raise that type too), message and user traceback."""
    try:
        text = format_user_traceback(e)
    except Exception as fmt_error:  # a broken __str__ must not break error reporting
        text = f"{type(e).__name__} (traceback unavailable: {fmt_error!r})\n"
    try:
        message = str(e)
    except Exception:
        message = "<unprintable exception>"
    summary = oom_summary(e)
    if summary:
        text += summary
    t = type(e)
    module, qualname = getattr(t, "__module__", None), getattr(t, "__qualname__", None)
    if type(module) is not str or type(qualname) is not str:
        module = qualname = ""  # a type that lies about its names: report the name only
    return RemoteFailure(t.__name__, message, text, module, qualname)


def oom_summary(e: BaseException) -> str:
    """For a CUDA out-of-memory error: this rank's memory, the caching allocator's
    summary of the device it ran on (``torch.cuda.memory_summary``), to put under
    its traceback; "" for any other error, or when the summary cannot be made."""
    torch = sys.modules.get("torch")
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    if oom is None or not isinstance(e, oom):
        return ""
    try:
        device = torch.cuda.current_device()
        summary = torch.cuda.memory_summary(device, abbreviated=True)
    except Exception as why:  # a broken context must not break the report
        return f"\n(no memory summary of this rank's GPU: {why})\n"
    return f"\nthis rank's GPU {device} when it ran out of memory:\n{summary}"
