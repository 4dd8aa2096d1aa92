"""Where worker code learns who it runs as: rank, size and mesh coordinates."""

from __future__ import annotations

_state: dict = {}
namespace: dict = {}  # the worker's persistent namespace (set by the worker)
worker = None  # the Worker serving this process (set by it): its state, for probes and tests


def _set(rank: int, size: int, coords: dict) -> None:
    _state.update(rank=rank, size=size, coords=dict(coords))


def _get(key: str):
    if key not in _state:
        raise RuntimeError(
            f"current_{key}() only works inside worker code (a remote function or a %%monarch cell)"
        )
    return _state[key]


def current_rank() -> int:
    """This worker's global rank."""
    return _get("rank")


def current_size() -> int:
    """The number of ranks in the mesh."""
    return _get("size")


def current_coords() -> dict:
    """This rank's coordinate on each named dim of the mesh, e.g. ``{"dp": 1}``."""
    return dict(_get("coords"))


def in_worker() -> bool:
    return "rank" in _state
