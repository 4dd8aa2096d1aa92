"""A rank's memory: its RSS and, on a GPU, the CUDA caching allocator's counters."""

from __future__ import annotations

import os
import pickle
import sys

import psutil


def cuda_memory() -> dict | None:
    """Per device index: allocated, reserved and peak allocated bytes (torch's caching
    allocator); None where CUDA was never initialised in this process."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    out = {}
    for d in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(d)
        out[d] = {
            "allocated": int(stats.get("allocated_bytes.all.current", 0)),
            "reserved": int(stats.get("reserved_bytes.all.current", 0)),
            "peak": int(stats.get("allocated_bytes.all.peak", 0)),
        }
    return out


def read_memory() -> dict:
    """``{"rss": bytes, "cuda": cuda_memory()}`` of this process, now."""
    return {"rss": psutil.Process(os.getpid()).memory_info().rss, "cuda": cuda_memory()}


def cuda_snapshot() -> bytes:
    """torch's CUDA memory snapshot of this process, pickled as
    ``torch.cuda.memory._dump_snapshot`` writes it (for pytorch.org/memory_viz)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("a memory snapshot needs CUDA: this rank has no GPU")
    return pickle.dumps(torch.cuda.memory._snapshot())
