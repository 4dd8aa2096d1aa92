"""Helpers of the tensor engine's tests: one program run locally and on a mesh."""

from __future__ import annotations

import torch

import monarch_nb as mnb
from benchmarks.lm import one_thread


def as_locally(mesh, run, rank: int = 1) -> tuple:
    """``run()`` locally, then under ``mesh.activate()`` (one thread each, as a rank
    has): every tensor it returns must equal local torch's bit for bit on rank
    ``rank`` of ``dp`` (a local one, as it is). Returns ``(ours, local)``."""
    with one_thread():
        local = run()
    with one_thread(), mesh.activate():
        ours = run()
    assert len(ours) == len(local)
    for i, (a, b) in enumerate(zip(ours, local)):
        assert torch.equal(mnb.inspect(a.detach(), dp=rank), b.detach()), f"item {i}"
    return ours, local
