"""The worker process: receiver, streams, cells, debugger, collectives."""

from .current import current_coords, current_rank, current_size

__all__ = ["current_coords", "current_rank", "current_size"]
