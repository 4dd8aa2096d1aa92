"""What messages carry besides plain data: functions and arguments pickled apart,
and how a failure is told. Field types of the records in ``messages.py``."""

from __future__ import annotations

from typing import NamedTuple


class Function(NamedTuple):
    """A function to call on workers: its pickle (by reference when importable,
    by value via cloudpickle when defined in ``__main__`` or a notebook)."""

    payload: bytes
    name: str


class Args(NamedTuple):
    """Positional and keyword arguments pickled apart from the message, so that the
    worker unpickles them on the stream thread when the Refs inside are ready.

    ``refs`` lists the ref ids the pickle mentions; ``buffers`` are its
    out-of-band buffers (tensor bytes), which travel as frames of their own.
    """

    payload: bytes
    buffers: tuple
    refs: tuple


class RemoteFailure(NamedTuple):
    """An exception on a worker: type name, ``str()``, traceback; ``exc_module`` and
    ``exc_qualname`` locate the type (empty for the worker's own reports)."""

    exc_type: str
    message: str
    traceback: str
    exc_module: str = ""
    exc_qualname: str = ""


class DependentOn(NamedTuple):
    ident: int
