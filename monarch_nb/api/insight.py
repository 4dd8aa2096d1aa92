"""Where the time and the memory go: ``mesh.timeline()``, ``mesh.memory()`` and
``mesh.profile(dir)``, a part of DeviceMesh."""

from __future__ import annotations

import contextlib
import json
import logging
import os

from ..controller.clocks import measure_offsets
from ..controller.profiles import merge_traces, summarize, summary_text
from ..controller.timeline import check_last
from ..protocol import messages as m

logger = logging.getLogger("monarch_nb.api.insight")


class MeshInsight:
    """DeviceMesh's timeline, memory and profiler (it sets ``_controller``, ``targets``)."""

    def timeline(
        self, last: int | None = None, since: float | None = None, measure: bool = True
    ) -> list[dict]:
        """Every command's start and end on this mesh's ranks, oldest first (the ``last``
        ones with ``last=N``): plain dicts of rank, stream, ident, kind ("cell", "op",
        "call", "collective", "fetch", "push", "exec"), name (the function, op or
        cell), start and end (seconds, the controller's wall clock) and straggler
        (it took over 1.5x the median of its peers' runs of the same command). The
        controller keeps the last ``timeline_size`` records (100,000 by default).
        ``since``: only the commands that ended then or later (``time.time()``'s clock).
        ``measure=False``: what the controller holds now, without the round trip to
        every rank that reads its clock and its latest records (a live view's redraw)."""
        last = check_last(last)
        if since is not None and not isinstance(since, (int, float)):
            raise TypeError(f"timeline(since=...) takes a time in seconds, got {since!r}")
        ctrl = self._controller
        timeline = ctrl.state.timeline
        if measure and ctrl.usable:
            # a round trip per rank: the clocks, and what finished since the last report
            rounds = 1 if all(r in timeline.offsets for r in self.targets) else 3
            try:
                measure_offsets(ctrl, self.targets, timeline.offsets, rounds)
            except Exception as e:  # a rank gone: what is recorded still stands
                logger.warning("timeline: the workers' clocks were not read (%s)", e)
        return timeline.records(last, dict(ctrl.state.stream_names), self.targets, since)

    @property
    def timeline_size(self) -> int:
        """How many command records the timeline keeps (the oldest go first)."""
        return self._controller.state.timeline.size

    @timeline_size.setter
    def timeline_size(self, n: int) -> None:
        self._controller.state.timeline.size = n

    def memory(self, snapshot: str | os.PathLike | None = None, timeout: float = 30.0) -> dict:
        """Each rank's memory now: rank -> {"rss": bytes, "cuda": None or per device
        {"allocated", "reserved", "peak"} bytes (torch's caching allocator)}. With
        ``snapshot=DIR`` (CUDA only), also write each rank's allocator snapshot
        (``torch.cuda.memory._snapshot()``, for pytorch.org/memory_viz) to
        ``DIR/rank{N}.pickle``, its path under "snapshot"."""
        ctrl = self._controller
        folder = None
        if snapshot is not None:
            if not ctrl.workers.all_cuda():
                raise RuntimeError(
                    f"memory snapshots need CUDA: the workers of mesh {self.name!r} have no GPU "
                    f"(mesh.memory() without snapshot= gives their RSS)"
                )
            folder = writable_dir(snapshot, "memory(snapshot=...)")
        ctrl.check_usable(self.targets)
        values = ctrl.request(
            m.ReadMemory(ctrl.next_ident(), False), self.targets, "memory", timeout=timeout
        ).result()
        out = dict(zip(self.targets, values))
        if folder is not None:
            snaps = ctrl.request(
                m.ReadMemory(ctrl.next_ident(), True), self.targets, "snapshot", timeout=timeout
            ).result()
            for rank, data in zip(self.targets, snaps):
                path = os.path.join(folder, f"rank{rank}.pickle")
                with open(path, "wb") as f:
                    f.write(data)
                out[rank]["snapshot"] = path
        return out

    @contextlib.contextmanager
    def profile(self, dir: str | os.PathLike, timeout: float = 120.0):
        """``with mesh.profile(dir) as prof:`` runs torch.profiler (CPU, and CUDA where
        present) on every rank for the block: it begins by waiting for the mesh (the
        work sent before it is not in the trace) and ends by waiting for it.
        Then ``prof.path`` is the merged Chrome trace (``dir/trace.json``: a process
        row per rank, the controller's clock), ``prof.summary`` the top ops by self
        time per rank, each rank's total and the slowest rank (plain data), also
        printed as text."""
        folder = writable_dir(dir, "profile(dir)")
        ctrl = self._controller
        ctrl.check_usable(self.targets)
        self.wait(timeout)
        offsets = measure_offsets(ctrl, self.targets, ctrl.state.timeline.offsets, 3)
        result = Profile(os.path.join(folder, "trace.json"))
        start = ctrl.request(
            m.StartProfile(ctrl.next_ident()), self.targets, "profile", timeout=timeout
        )
        try:
            start.result()
        except BaseException:
            self._stop_profile(timeout)  # the ranks that did start
            raise
        failed = True
        try:
            yield result
            self.wait(timeout)
            failed = False
        finally:  # a block that failed stops the profilers too, and keeps what ran
            reports = self._stop_profile(timeout)
            if reports:
                self._write_profile(result, reports, offsets, failed)

    @staticmethod
    def _write_profile(result, reports: dict, offsets: dict, failed: bool) -> None:
        """The merged trace and its summary; after a failure, what ran until then (a
        trace that cannot be written then is logged: the block's error stays the one
        shown)."""
        try:
            trace = merge_traces(reports, offsets)
            with open(result.path, "w") as f:
                json.dump(trace, f)
            result.summary = summarize(reports, result.path)
        except Exception:
            if not failed:
                raise
            logger.warning("profile: the trace of the failed block was not written", exc_info=True)
            return
        print(("the profile of what ran before the failure:\n" if failed else "") + result.text())

    def _stop_profile(self, timeout: float) -> dict:
        """Stop every rank's profiler: rank -> its report ({} when a rank had none)."""
        ctrl = self._controller
        req = ctrl.request(
            m.StopProfile(ctrl.next_ident()), self.targets, "profile", timeout=timeout
        )
        try:
            return dict(zip(self.targets, req.result()))
        except Exception as e:
            logger.warning("profile: not every rank stopped its profiler (%s)", e)
            return {}


class Profile:
    """What ``mesh.profile(dir)`` made: ``path`` (the merged Chrome trace) and
    ``summary`` (plain data), once its block is over."""

    def __init__(self, path: str):
        self.path = path
        self.summary: dict | None = None

    def text(self) -> str:
        """The summary in a few lines."""
        return "(the profile is not over)" if self.summary is None else summary_text(self.summary)

    def __repr__(self) -> str:
        return f"<Profile {self.path!r}{'' if self.summary else ' (running)'}>"


def writable_dir(path, what: str) -> str:
    """``path`` made if needed; a ValueError naming it when it cannot be written."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what} takes a directory path, got {type(path).__name__}")
    folder = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what}: cannot make directory {folder!r}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: directory {folder!r} is not writable")
    return folder
