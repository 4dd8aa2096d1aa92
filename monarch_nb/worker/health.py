"""Samples of a worker's health: memory, CPU and GPU (NVML's view of the device, the
caching allocator's counters where this process uses CUDA), and its stalled commands."""

from __future__ import annotations

import logging
import os
import sys
import time

import psutil

from ..config import process_settings
from ..protocol import messages as m
from .failure import format_user_stack
from .memory import cuda_memory

logger = logging.getLogger("monarch_nb.worker")


class HealthSampler:
    def __init__(self, cuda: bool):
        self._proc = psutil.Process(os.getpid())
        self._proc.cpu_percent(None)
        self._nvml = None
        self._cuda = cuda
        if cuda:
            try:
                import pynvml

                pynvml.nvmlInit()
                index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
            except Exception:
                self._nvml = None

    def sample(self) -> tuple[int, float, dict | None]:
        rss = self._proc.memory_info().rss
        cpu = self._proc.cpu_percent(None)
        gpu = None
        if self._nvml is not None:
            nv, handle = self._nvml
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
                util = nv.nvmlDeviceGetUtilizationRates(handle)
                gpu = {"mem": int(mem.used), "mem_total": int(mem.total), "util": float(util.gpu)}
            except Exception:
                gpu = None
        if self._cuda:
            allocator = cuda_memory()  # None until this process has used CUDA
            if allocator:
                gpu = {**(gpu or {}), **allocator[min(allocator)]}  # its first device's
        return rss, cpu, gpu


def check_stalls(streams: dict, rank: int, send) -> None:
    """Once a command of one of ``streams`` runs longer than the setting
    ``stall_seconds``: log where its stream is and tell the controller with ``send``
    (the dashboard shows it); then, every ``stall_seconds`` while it runs, tell it
    again if it is elsewhere now (it was in a slow import, say)."""
    now, stall = time.time(), process_settings()["stall_seconds"]
    for s in list(streams.values()):
        running = s.running
        if running is None or now - running[2] < stall:
            continue
        last = s.stall_logged
        first = last is None or last[0] != running[0]
        if not first and now - last[2] < stall:
            continue
        frame = sys._current_frames().get(s.thread_id or -1)
        where = format_user_stack(frame) or "(in the worker's own code)"
        s.stall_logged = (running[0], where, now)
        if not first and last[1] == where:
            continue
        if first:
            logger.warning(
                "possible stall: stream %r has run command %d (%s) for %.0f s; it is at:\n%s",
                s.name,
                running[0],
                running[1],
                now - running[2],
                where,
            )
        send(m.Stalled(rank, s.id, running[0], running[1], now - running[2], where))
