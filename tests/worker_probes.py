"""Remote functions that read a worker's own state, exactly and at once (status()
has it only as of the last health sample)."""

from __future__ import annotations


def env_size() -> int:
    """The number of values the worker holds for Refs, not counting this call's result.

    Deletes of dropped Refs travel after the commands already sent: call
    ``mesh.wait()`` first so that this one comes after them."""
    from monarch_nb.worker import current

    worker = current.worker
    return len(worker.env) - 1


def env_sizes(mesh) -> list[int]:
    """``env_size()`` on every rank of ``mesh``, after everything sent so far."""
    import monarch_nb as mnb

    mesh.wait()
    return mnb.remote(env_size)(mesh=mesh).fetch(timeout=60)


def rank_pids(mesh) -> dict[int, int]:
    """Rank -> the pid of its worker process, as ``mesh.status()`` reports it."""
    return {r: info["pid"] for r, info in mesh.status()["ranks"].items()}


def recordings() -> int:
    """The number of recordings (``mnb.compile``) the worker keeps."""
    from monarch_nb.worker import current

    worker = current.worker
    return len(worker.recordings)


def definitions() -> tuple[int, int]:
    """``(op templates, recordings)`` the worker holds (DefineOp, DefineRecording)."""
    from monarch_nb.worker import current

    worker = current.worker
    return len(worker.ops), len(worker.recordings)
