"""torch.profiler on a rank, from StartProfile to StopProfile: every thread's ops
(each stream's), and CUDA activity where there is a GPU."""

from __future__ import annotations

import json
import os
import tempfile
import time

from ..protocol.insight_messages import PROFILE_CLOCK_MARK

MARK = PROFILE_CLOCK_MARK  # an event whose wall-clock time aligns the trace
TOP_OPS = 20


class RankProfiler:
    """One profiling session of this process."""

    def __init__(self, cuda: bool):
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if cuda:
            activities.append(ProfilerActivity.CUDA)
        config = None
        try:
            from torch._C._profiler import _ExperimentalConfig

            config = _ExperimentalConfig(profile_all_threads=True)
        except (ImportError, TypeError):  # an older torch: the starting thread only
            config = None
        self._torch = torch
        self._prof = profile(activities=activities, experimental_config=config)
        self._prof.start()
        self.started = time.time()
        self._mark = self._clock_mark()

    def _clock_mark(self) -> float:
        """Wall-clock time (s) of the MARK event recorded now."""
        t0 = time.time()
        with self._torch.profiler.record_function(MARK):
            t1 = time.time()
        return (t0 + t1) / 2

    def stop(self) -> dict:
        """Stop; ``{"trace": Chrome trace (dict), "mark": wall clock of the MARK event,
        "wall": seconds profiled, "ops": the top ops by self time (CPU + device, us),
        "total_us": every op's self time}``."""
        prof = self._prof
        prof.stop()
        wall = time.time() - self.started
        fd, path = tempfile.mkstemp(suffix=".json", prefix="monarch_nb_trace_")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        finally:
            os.unlink(path)
        ops, total = [], 0.0
        for e in prof.key_averages():
            if e.key == MARK:
                continue
            cpu = float(e.self_cpu_time_total)
            device = float(getattr(e, "self_device_time_total", 0) or 0)
            total += cpu + device
            ops.append(
                {
                    "name": e.key,
                    "self_us": cpu + device,
                    "self_cpu_us": cpu,
                    "self_device_us": device,
                    "count": int(e.count),
                }
            )
        ops.sort(key=lambda o: -o["self_us"])
        top = ops[:TOP_OPS]
        return {"trace": trace, "mark": self._mark, "wall": wall, "ops": top, "total_us": total}
