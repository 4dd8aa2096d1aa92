"""The recording that watches the commands sent while ``mnb.compile`` records.

It belongs to the thread that records, and is seen from every other thread
too while it records: torch's autograd runs the backward of CUDA tensors on a
device thread of its own, whose commands belong to the recording of the
thread that called ``backward()``.
"""

from __future__ import annotations

import threading


class RecordingError(RuntimeError):
    """Something a compiled function did cannot be recorded."""


class _RecordingTrace:
    def __init__(self):
        self._tls = threading.local()
        # the recording in progress on some thread: None in the common case, which hot
        # paths read before the ``active`` property (a thread-local look-up)
        self.anyone = None

    @property
    def active(self):
        """The _Trace of the recording in progress (this thread's, else any)."""
        anyone = self.anyone
        if anyone is None:  # nobody records: the common case, read on every command
            return None
        mine = getattr(self._tls, "trace", None)
        return mine if mine is not None else anyone

    @active.setter
    def active(self, trace) -> None:
        if trace is None:
            if self.anyone is getattr(self._tls, "trace", None):
                self.anyone = None
        else:
            self.anyone = trace
        self._tls.trace = trace


recording_trace = _RecordingTrace()
