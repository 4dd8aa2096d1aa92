"""The worker's handlers of the timeline, memory and profiler requests (a part of
Worker, which dispatches each message to the handler of its name). Each is
answered at once by the socket's lease holder, whatever the streams run."""

from __future__ import annotations

import time

from ..protocol import messages as m
from .failure import describe
from .memory import cuda_snapshot, read_memory
from .timings import take_timings


class InsightHandlers:
    """Handlers of ReadClock, ReadMemory, StartProfile and StopProfile."""

    _profiler = None

    def _answer(self, ident: int, compute) -> None:
        try:
            value, error = compute(), None
        except Exception as e:  # the request fails with why; the worker goes on
            value, error = None, describe(e)
        self._send(m.FetchResult(ident, self.rank, value, error))

    def ReadClock(self, msg: m.ReadClock) -> None:
        # the commands finished so far go first: a timeline read after this is complete
        timings = take_timings(self.rank, list(self.streams.values()))
        if timings is not None:
            self._send(timings)
        self._send(m.FetchResult(msg.ident, self.rank, time.time(), None))

    def ReadMemory(self, msg: m.ReadMemory) -> None:
        self._answer(msg.ident, cuda_snapshot if msg.snapshot else read_memory)

    def StartProfile(self, msg: m.StartProfile) -> None:
        def start():
            from .profiler import RankProfiler  # imports torch.profiler: only when asked

            if self._profiler is not None:
                raise RuntimeError("a profile is running on this rank already")
            self._profiler = RankProfiler(self.cuda)

        self._answer(msg.ident, start)

    def StopProfile(self, msg: m.StopProfile) -> None:
        def stop():
            profiler, self._profiler = self._profiler, None
            if profiler is None:
                raise RuntimeError("no profile runs on this rank")
            return profiler.stop()

        self._answer(msg.ident, stop)
