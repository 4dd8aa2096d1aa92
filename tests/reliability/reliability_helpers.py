"""Shared helpers of the reliability tests (real meshes, real processes; no mocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import psutil
from wait_helpers import alive, pids_gone, running, wait_for, wait_running  # noqa: F401 - their name


class PeakRss:
    """Samples the RSS of some processes on a thread; ``peak[pid]`` is the highest seen."""

    def __init__(self, pids, period: float = 0.01):
        self.procs = {p: psutil.Process(p) for p in pids}
        self.base = {p: proc.memory_info().rss for p, proc in self.procs.items()}
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for p, proc in self.procs.items():
                try:
                    self.peak[p] = max(self.peak[p], proc.memory_info().rss)
                except psutil.Error:
                    pass
            self._stop.wait(self._period)

    def growth(self, pid: int) -> int:
        return self.peak[pid] - self.base[pid]

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Collect:
    """A mesh's output handler that keeps the text per rank (the notebook layer
    installs its own handler the same way)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.text: dict[int, list[str]] = {}
        self.nbytes = 0
        self.keep = True

    def __call__(self, msg) -> None:
        self.nbytes += len(msg.text)
        if self.keep:
            self.text.setdefault(msg.rank, []).append(msg.text)

    def of(self, rank: int) -> str:
        return "".join(self.text.get(rank, ()))

    def __enter__(self) -> Collect:
        self._old = self.mesh.output_handler
        self.mesh.output_handler = self
        return self

    def __exit__(self, *exc) -> None:
        self.mesh.output_handler = self._old


def env_sizes(mesh) -> list:
    return [mesh.status()["ranks"][r]["env_size"] for r in mesh.ranks]


MY_PID = os.getpid()


def run_trials(script: str, trials: int, env: dict) -> list[dict]:
    """Run the trials script ``script`` (of this folder; ``python SCRIPT FIRST COUNT``,
    a JSON line per trial) in two runners side by side, half the trials each; every
    trial's record, checked to be all there."""
    path = os.path.join(os.path.dirname(__file__), script)
    half = trials // 2
    runners = [
        subprocess.Popen(
            [sys.executable, path, str(first), str(n)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=os.path.dirname(__file__),
        )
        for first, n in ((0, half), (half, trials - half))
    ]
    results = []
    try:
        for p in runners:
            out, _ = p.communicate(timeout=900)
            assert p.returncode == 0, out
            results.extend(json.loads(line) for line in out.splitlines())
    finally:
        for p in runners:
            p.kill()
    assert sorted(t["trial"] for t in results) == list(range(trials))
    return results
