"""The recording that watches the commands sent from this thread (mnb.compile)."""

from __future__ import annotations

import threading


class _RecordingTrace(threading.local):
    active = None  # the _Trace of the mnb.compile recording running on this thread


recording_trace = _RecordingTrace()
