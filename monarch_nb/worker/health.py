"""Samples of a worker's health: memory, CPU and GPU (NVML's view of the device, the
caching allocator's counters where this process uses CUDA)."""

from __future__ import annotations

import os

import psutil

from .memory import cuda_memory


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
